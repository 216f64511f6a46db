"""megatron_sp_ext: sequence-parallel attention extensions for Megatron-core and DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="megatron_sp_ext",
    version="0.1.0",
    description="Head-chunked (HCMS), ring, TASP and topology-aware sequence-parallel attention "
    "for Megatron-core and DeepSpeed",
    packages=find_packages(include=["megatron_sp_ext", "megatron_sp_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.5"],
    extras_require={
        "megatron": ["megatron-core>=0.16"],
        "deepspeed": ["deepspeed>=0.19"],
        "train": ["einops", "matplotlib", "safetensors", "tqdm", "tensorboard"],
        "test": ["pytest", "einops"],
        "dev": ["pytest", "einops", "megatron-core>=0.16", "deepspeed>=0.19"],
    },
)

"""Wan transformer presets (diffusers' WanTransformer3DModel keywords) with the task each is trained for, building one
from a preset (random init) or a local diffusers directory (a transformer, or a pipeline: transformer/ or, for Wan
2.2 A14B's low-noise expert, transformer_2/), its FLOP count, and writing it back in diffusers' layout.

Presets (diffusers' configs of the released checkpoints; the video DiT's presets in training/video_dit/config.py have
wan-1.3b's and wan-14b's widths):
    wan-1.3b, wan-14b:  Wan 2.1 T2V (30 / 40 blocks, 12 / 40 heads x 128, FFN 8960 / 13824, 16 latent channels)
    wan2.1-i2v-14b:     Wan 2.1 I2V: wan-14b with 36 input channels (16 noisy + 4 mask + 16 condition) and the CLIP
                        image branch (image_dim 1280, added k/v projections)
    wan2.2-ti2v-5b:     Wan 2.2 TI2V: 30 blocks, 24 heads x 128, FFN 14336, 48 latent channels (Wan 2.2's VAE)
    wan2.2-a14b:        one expert of Wan 2.2 T2V A14B (wan-14b's config; boundary_ratio 0.875)
    wan2.2-i2v-a14b:    one expert of Wan 2.2 I2V A14B (36 input channels, no image branch; boundary_ratio 0.9)
    tiny, tiny-i2v, tiny-ti2v, tiny-a14b: 2 blocks, 4 heads x 16, FFN 128, text 32 wide, 4 latent channels (CPU tests)
Text embeddings are umT5's: [512, 4096] per prompt ([8, 32] for the tiny presets; tiny-i2v keeps 512 tokens:
diffusers' I2V attention takes the context's last 512 tokens as the text, the ones before as the image's).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_sp_ext.errors import SPConfigError

from training.video_dit.config import DiTConfig

_COMMON = dict(patch_size=(1, 2, 2), cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
               image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None)
_TINY = dict(_COMMON, num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
             freq_dim=32, ffn_dim=128, num_layers=2)
_14B = dict(_COMMON, num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
            freq_dim=256, ffn_dim=13824, num_layers=40)
WAN_PRESETS = {
    "tiny": _TINY,
    "tiny-i2v": dict(_TINY, in_channels=12, image_dim=24, added_kv_proj_dim=64),
    "tiny-ti2v": _TINY,
    "tiny-a14b": _TINY,
    "wan-1.3b": dict(_COMMON, num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                     text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30),
    "wan-14b": _14B,
    "wan2.1-i2v-14b": dict(_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "wan2.2-ti2v-5b": dict(_COMMON, num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
                           text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30),
    "wan2.2-a14b": _14B,
    "wan2.2-i2v-a14b": dict(_14B, in_channels=36),
}
# (task, the pipeline's boundary_ratio: None for one transformer) of each preset (training/wan_diffusers/task.py)
PRESET_TASKS = {"tiny": ("t2v", None), "tiny-i2v": ("i2v", None), "tiny-ti2v": ("ti2v", None),
                "tiny-a14b": ("t2v", 0.875), "wan-1.3b": ("t2v", None), "wan-14b": ("t2v", None),
                "wan2.1-i2v-14b": ("i2v", None), "wan2.2-ti2v-5b": ("ti2v", None), "wan2.2-a14b": ("t2v", 0.875),
                "wan2.2-i2v-a14b": ("i2v", 0.9)}
TEXT_LEN = {"tiny": 8, "tiny-ti2v": 8, "tiny-a14b": 8}   # tokens per prompt; 512 (umT5) for every other model
IMAGE_TOKENS = {"tiny-i2v": 5}   # CLIP image embeddings per sample of the synthetic source; 257 otherwise
GRIDS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}   # Wan's latent F x H x W (81 frames; 832x480 / 1280x720)
ENTRY = "diffusers-wan"   # the entry point's name in checkpoints' run.json


def preset_kwargs(name: str, num_layers: Optional[int] = None) -> dict:
    """WanTransformer3DModel keywords of preset ``name`` (--model), with --num-layers' override."""
    if name not in WAN_PRESETS:
        raise SPConfigError(f"--model={name!r} is invalid: choose one of {', '.join(WAN_PRESETS)}")
    kw = dict(WAN_PRESETS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise SPConfigError(f"--num-layers={num_layers}: must be >= 1")
        kw["num_layers"] = num_layers
    return kw


def dit_config(config, text_len: int) -> DiTConfig:
    """The video DiT's config of the same widths (``config``: a WanTransformer3DModel config or keywords): what the
    data path (the latent's channels: out_channels, which I2V's in_channels exceed by its mask and condition; patch,
    text width/length) and the MFU count (DiTConfig.flops_per_token) read. The count fits
    Wan's block: self-attention q/k/v/o (4 d^2), cross-attention q/o on video tokens (2 d^2; its k/v run on the text),
    a two-matrix FFN (2 d f), attention scores and values over the video and the text tokens."""
    c = dict(config)
    heads, hd = c["num_attention_heads"], c["attention_head_dim"]
    return DiTConfig(dim=heads * hd, heads=heads, ffn=c["ffn_dim"], layers=c["num_layers"],
                     in_channels=c["out_channels"], patch=tuple(c["patch_size"]), text_dim=c["text_dim"],
                     text_len=text_len, freq_dim=c["freq_dim"], eps=c["eps"])


def random_model(kwargs: dict, seed: int, device: torch.device) -> torch.nn.Module:
    """A WanTransformer3DModel of ``kwargs`` with diffusers' own initialisation drawn from ``seed`` (the same
    weights on every rank), built on ``device`` (fp32)."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    torch.manual_seed(seed)
    with torch.device(device):
        return WanTransformer3DModel(**kwargs).float()


def pretrained_dir(path: str, sub: str = "transformer") -> tuple[str, Optional[str]]:
    """(directory, subfolder) of ``--init PATH``: a transformer saved with save_pretrained (config.json beside its
    safetensors), or a Wan pipeline directory holding it under ``sub`` (transformer/, or transformer_2/ for Wan 2.2
    A14B's low-noise expert). SPConfigError naming --init otherwise."""
    if not os.path.isdir(path):
        raise SPConfigError(f"--init={path!r}: no such directory (give 'random' with --model, or a local directory "
                            f"in diffusers' layout: config.json + diffusion_pytorch_model*.safetensors)")
    for where in (None, sub):
        cfg = os.path.join(path, where or "", "config.json")
        if os.path.isfile(cfg):
            try:
                with open(cfg) as f:
                    name = json.load(f).get("_class_name")
            except (OSError, ValueError) as e:
                raise SPConfigError(f"--init={path!r}: {cfg} is unreadable ({e})") from None
            if name != "WanTransformer3DModel":
                raise SPConfigError(f"--init={path!r}: {cfg} describes a {name!r}, this entry trains "
                                    f"WanTransformer3DModel")
            return path, where
    raise SPConfigError(f"--init={path!r}: no config.json there or under {sub}/ (not a diffusers model "
                        f"directory; write one with WanTransformer3DModel.save_pretrained)")


def pipeline_config(path: str) -> dict:
    """A Wan pipeline directory's model_index.json ({} for a bare transformer directory): _class_name,
    boundary_ratio (two experts), expand_timesteps (Wan 2.2 TI2V), transformer_2."""
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        return {}
    try:
        with open(index) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SPConfigError(f"--init={path!r}: {index} is unreadable ({e})") from None
    return doc if isinstance(doc, dict) else {}


def load_model(path: str, device: torch.device, sub: str = "transformer") -> torch.nn.Module:
    """WanTransformer3DModel.from_pretrained(``path``) in fp32 on ``device``, from safetensors only (no pickle);
    ``sub``: the pipeline's subfolder (transformer or transformer_2) when ``path`` is a pipeline directory.
    diffusers 0.42 loads this model (it has _keep_in_fp32_modules) only with accelerate installed; without it the
    same files are read here: config.json -> from_config, the safetensors (one file or an index of shards) ->
    load_state_dict(strict)."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    root, sub = pretrained_dir(path, sub)
    try:
        if has_accelerate():
            # no torch_dtype: the weights are read into the fp32 parameters whatever dtype the files hold
            model = WanTransformer3DModel.from_pretrained(root, subfolder=sub, use_safetensors=True)
        else:
            model = _read_pretrained(WanTransformer3DModel, os.path.join(root, sub or ""))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        lines = str(e).strip().splitlines()
        raise SPConfigError(f"--init={path!r}: diffusers could not load it ({lines[0][:300] if lines else e})") \
            from None
    return model.float().to(device)


def has_accelerate() -> bool:
    import importlib.util  # noqa: PLC0415
    return importlib.util.find_spec("accelerate") is not None


WEIGHTS = "diffusion_pytorch_model.safetensors"
EXTRA = "megatron_sp_ext_extra.safetensors"   # tensors a stock WanTransformer3DModel lacks (sparse gates)


def _read_pretrained(cls, folder: str) -> torch.nn.Module:
    """What from_pretrained reads, without accelerate: config.json and the safetensors weights of ``folder``."""
    from safetensors.torch import load_file  # noqa: PLC0415
    model = cls.from_config(cls.load_config(folder))
    index = os.path.join(folder, WEIGHTS + ".index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise OSError(f"no {WEIGHTS} (or its .index.json) in {folder}: only safetensors weights are read")
    state: dict = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    missing, _ = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing:   # unexpected keys (a sparse plan's gates) are left out, as from_pretrained does
        raise OSError(f"{folder}: {len(missing)} weights of the model are not in its safetensors (first: {missing[0]})")
    return model


def gate_names(folder: str) -> set:
    """Names of the sparse plan's gate tensors (``.sparse_gate.``) in ``folder``'s safetensors files (headers only):
    what BlockSparsePlan.load_gates copies."""
    from safetensors import safe_open  # noqa: PLC0415
    names: set = set()
    for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="pt") as st:
                names |= {k for k in st.keys() if ".sparse_gate." in k}
    return names


def identity(config, preset: str, sparse_gates: bool) -> dict:
    """run.json keys a checkpoint must match on resume (training/video_dit/checkpoint.read_run)."""
    c = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(config).items() if not k.startswith("_")}
    return {"entry": ENTRY, "model": {"preset": preset, "layers": c["num_layers"], **c}, "sparse_gates": sparse_gates}


def save_pretrained(model: torch.nn.Module, out_dir: str, rank: int) -> Optional[list]:
    """Write the trained weights in diffusers' layout (``out_dir``: config.json + safetensors) that
    WanTransformer3DModel.from_pretrained reads back. Collective: FSDP2 shards are gathered (full state dict, on the
    CPU of rank 0). Parameters a stock WanTransformer3DModel lacks (the sparse plan's gates) go to
    ``megatron_sp_ext_extra.safetensors`` beside them (BlockSparsePlan.load_gates reads them there). Returns (rank 0)
    the names of those extra tensors."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return written_on_rank0(rank, lambda: _write_pretrained(WanTransformer3DModel, dict(model.config), full, out_dir),
                            f"--save-pretrained {out_dir}: could not write the model")


def written_on_rank0(rank: int, write: Callable[[], object], failure: str) -> object:
    """``write()`` on rank 0 (None elsewhere), its failure raised on EVERY rank as one SPConfigError (``failure``: what
    the message starts with; an SPConfigError of ``write`` as it is). Collective where a process group of more than
    one rank is up: the outcome is shared as text, so no rank waits on a barrier rank 0 never reaches."""
    out, error = None, None
    if rank == 0:
        try:
            out = write()
        except Exception as e:   # noqa: BLE001 - shared as text with every rank below
            error = e if isinstance(e, SPConfigError) else SPConfigError(f"{failure} ({type(e).__name__}: {e})")
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcome = [str(error) if error is not None else None]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise (error if error is not None else SPConfigError(outcome[0]))
    elif error is not None:
        raise error
    return out


def _write_pretrained(stock_cls, config: dict, full: dict, out_dir: str) -> list:
    """Rank 0's part of save_pretrained: ``full`` (name -> CPU tensor) into ``out_dir``; returns the extra names."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        stock = stock_cls(**config)
    keys = set(stock.state_dict())
    missing = sorted(keys - set(full))
    if missing:
        raise SPConfigError(f"--save-pretrained {out_dir}: the trained model lacks {missing[:4]} (not a "
                            f"WanTransformer3DModel)")
    stock.load_state_dict({k: v.float() for k, v in full.items() if k in keys}, strict=True, assign=True)
    stock.save_pretrained(out_dir, safe_serialization=True)
    extra = sorted(set(full) - keys)
    if extra:   # beside the model's files; listed in the index when diffusers sharded them
        from safetensors.torch import save_file  # noqa: PLC0415
        save_file({k: full[k].contiguous() for k in extra}, os.path.join(out_dir, EXTRA))
        index = os.path.join(out_dir, WEIGHTS + ".index.json")
        if os.path.isfile(index):
            with open(index) as f:
                doc = json.load(f)
            doc["weight_map"].update({k: EXTRA for k in extra})
            with open(index, "w") as f:
                json.dump(doc, f, indent=2)
    return extra

"""The Inductor options of the project's compiled regions (training/video_dit/fused.py's elementwise regions,
megatron_sp_ext.diffusers.fused's compiled Wan blocks): one place for the workaround below."""
from __future__ import annotations

from typing import Optional


def compile_options(backend: Optional[str]) -> Optional[dict]:
    """Inductor options: Triton's mix-order reduction off where torch has it (2.10+). Its split reduction of the
    [B, 1, d] AdaLN modulation gradients over B*S rows returns them as [d] in fp32 at B=1 on torch 2.11 (the final
    reduce drops keepdim: "CompiledFunctionBackward returned an invalid gradient at index 1 - got [1536] but expected
    shape compatible with [1, 1, 1536]", wan-1.3b, 8190 tokens; bf16 was spared by the cast after the reduction), and
    through 2.13 it can leave chunked modulation slices' gradients unwritten (pytorch/pytorch#193061). None for other
    backends (they take no Inductor options)."""
    if backend != "inductor":
        return None
    from torch._inductor import config  # noqa: PLC0415
    return {"triton.mix_order_reduction": False} if hasattr(config.triton, "mix_order_reduction") else None

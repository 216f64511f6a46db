"""Model presets: tiny (CPU), Wan2.1-1.3B and Wan2.1-14B dimensions (layer count overridable)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DiTConfig:
    """dim: model width; heads: attention heads; ffn: FFN width; layers: blocks;
    in_channels: latent channels C; patch: (pt, ph, pw); text_dim / text_len: text embeddings;
    freq_dim: sinusoidal timestep embedding width; eps: norm epsilon; modulation: how the timestep reaches the
    blocks' AdaLN (``MODULATIONS``)."""

    dim: int
    heads: int
    ffn: int
    layers: int
    in_channels: int = 16
    patch: tuple = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    modulation: str = "wan"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch
        return self.in_channels * pt * ph * pw

    def flops_per_token(self, seqlen: int, text_len: int) -> float:
        """Forward+backward FLOPs per token (6 * matmul params + attention terms)."""
        d, f, L = self.dim, self.ffn, self.layers
        dense = 2 * (4 * d * d + 2 * d * d + 2 * d * f) * L
        attn = 2 * 2 * seqlen * d * L + 2 * 2 * text_len * d * L
        return 3 * (dense + attn)


# --modulation: how the timestep embedding t_emb [B, d] becomes each block's six AdaLN rows (shift, scale, gate of the
# attention and of the FFN) and the head's shift / scale
MODULATIONS = {
    # Wan 2.1's: one time projection Linear(d, 6d) after SiLU shared by every block, plus each block's own learned
    # table [6d]; the head adds its table [2d] to t_emb itself (wan-14b: 14.3B parameters at 40 blocks)
    "wan": "one shared time projection plus a learned table per block (Wan 2.1)",
    # DiT / PixArt-style: a Linear(d, 6d) per block after SiLU, the head's Linear(d, 2d); this project's model before
    # 2026-11-29 (wan-14b: 20.5B parameters at 40 blocks, the per-block Linears 6.3B of them)
    "linear": "a Linear(d, 6d) per block (DiT-style; this project's model before 2026-11-29)",
}

PRESETS = {
    "tiny": DiTConfig(dim=64, heads=8, ffn=128, layers=2, in_channels=4, text_dim=32, text_len=8, freq_dim=32),
    "wan-1.3b": DiTConfig(dim=1536, heads=12, ffn=8960, layers=30, in_channels=16, text_dim=4096, text_len=512),
    "wan-14b": DiTConfig(dim=5120, heads=40, ffn=13824, layers=40, in_channels=16, text_dim=4096, text_len=512),
}


def preset(name: str, layers: Optional[int] = None, modulation: Optional[str] = None) -> DiTConfig:
    """A preset by name, with an optional layer-count override (for benchmarking) and --modulation
    (``MODULATIONS``; None: the preset's, "wan")."""
    if name not in PRESETS:
        raise ValueError(f"--model={name!r} is invalid: choose one of {', '.join(PRESETS)}")
    if modulation is not None and modulation not in MODULATIONS:
        raise ValueError(f"--modulation={modulation!r} is invalid: choose one of {', '.join(MODULATIONS)}")
    cfg = PRESETS[name]
    cfg = dataclasses.replace(cfg, layers=layers) if layers else cfg
    return dataclasses.replace(cfg, modulation=modulation) if modulation else cfg

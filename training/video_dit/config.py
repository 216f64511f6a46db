"""Model presets: tiny (CPU), Wan2.1-1.3B and Wan2.1-14B dimensions (layer count overridable)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DiTConfig:
    """dim: model width; heads: attention heads; ffn: FFN width; layers: blocks;
    in_channels: latent channels C; patch: (pt, ph, pw); text_dim / text_len: text embeddings;
    freq_dim: sinusoidal timestep embedding width; eps: norm epsilon."""

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

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch
        return self.in_channels * pt * ph * pw

    def params(self) -> int:
        """Approximate parameter count (for MFU)."""
        d, f = self.dim, self.ffn
        per_block = 4 * d * d + 2 * d * d + 2 * self.text_dim * d * 0 + 2 * d * f + 6 * d * d + 2 * d * d
        return self.layers * per_block + self.patch_volume * d * 2 + self.text_dim * d

    def flops_per_token(self, seqlen: int, text_len: int) -> float:
        """Forward+backward FLOPs per token (6 * matmul params + attention terms)."""
        d, f, L = self.dim, self.ffn, self.layers
        dense = 2 * (4 * d * d + 2 * d * d + 2 * d * f) * L
        attn = 2 * 2 * seqlen * d * L + 2 * 2 * text_len * d * L
        return 3 * (dense + attn)


PRESETS = {
    "tiny": DiTConfig(dim=64, heads=8, ffn=128, layers=2, in_channels=4, text_dim=32, text_len=8, freq_dim=32),
    "wan-1.3b": DiTConfig(dim=1536, heads=12, ffn=8960, layers=30, in_channels=16, text_dim=4096, text_len=512),
    "wan-14b": DiTConfig(dim=5120, heads=40, ffn=13824, layers=40, in_channels=16, text_dim=4096, text_len=512),
}


def preset(name: str, layers: Optional[int] = None) -> DiTConfig:
    """A preset by name, with an optional layer-count override (for benchmarking)."""
    if name not in PRESETS:
        raise ValueError(f"--model={name!r} is invalid: choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    return dataclasses.replace(cfg, layers=layers) if layers else cfg

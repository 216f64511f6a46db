"""3D rotary position embedding over (frame, row, column), split across the head dimension.

head_dim D is split Wan-style into D - 4*(D//6) dims for time and 2*(D//6) each for height and
width; each axis rotates its pairs by its own coordinate. Each rank rotates its own tokens by
their GLOBAL positions, so the result is independent of the sequence placement. Packed steps (several
clips in one sequence): each token is rotated by its position in its OWN clip's grid (``rope_angles_packed``).

Devices: the angles are computed on the device of ``token_ids``. The entry points keep token ids on the host, but a
wrapper may move the model's inputs (FSDP2's root moves every tensor argument to its CUDA device), so nothing here
assumes the host.
"""
from __future__ import annotations

import torch


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _freqs(n: int, device: torch.device, theta: float = 10000.0) -> torch.Tensor:
    """[n/2] float64 inverse frequencies on ``device``."""
    return 1.0 / (theta ** (torch.arange(0, n, 2, dtype=torch.float64, device=device) / n))


def rope_angles(token_ids: torch.Tensor, grid: tuple[int, int, int], head_dim: int) -> torch.Tensor:
    """Rotation angles [S, head_dim/2] (float64, on token_ids' device) for global token indices [S] into a
    (T, H, W) token grid."""
    t_n, h_n, w_n = grid
    tid = token_ids.to(torch.int64)
    f = tid // (h_n * w_n)
    y = (tid // w_n) % h_n
    x = tid % w_n
    dt, dh, dw = axis_dims(head_dim)
    parts = [pos.double()[:, None] * _freqs(n, tid.device)[None, :] for pos, n in ((f, dt), (y, dh), (x, dw))]
    return torch.cat(parts, dim=1)


def rope_angles_packed(token_ids: torch.Tensor, local_lens, grids, head_dim: int) -> torch.Tensor:
    """Packed samples: token_ids [S_local] are positions within each token's own sample, the local tokens
    grouped by sample (``local_lens``); sample i is rotated on its own grid ``grids[i]``. -> [S_local, D/2]."""
    parts, a = [], 0
    for n, grid in zip(local_lens, grids):
        parts.append(rope_angles(token_ids[a:a + n], tuple(grid), head_dim))
        a += n
    return torch.cat(parts, dim=0)


def apply_rope(x_bshd: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of [B, S, H, D] by angles [S, D/2]."""
    cos = angles.cos().to(x_bshd.dtype)[None, :, None, :]
    sin = angles.sin().to(x_bshd.dtype)[None, :, None, :]
    x1, x2 = x_bshd[..., 0::2], x_bshd[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


class RopeCache:
    """The angle table of the last (token ids, grid, device) seen, kept on ``device``: a training run with a fixed
    shape computes and copies it once instead of every forward. Token ids on the host (what the entry points pass)
    are compared on the host, without a device sync; token ids already on a device (a wrapper moved the model's
    inputs, as FSDP2's root does) are not cached: their table is computed there (a few small kernels), since
    comparing them with the cached ids would cost a device sync per forward."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.ids = None
        self.angles = None

    def _lookup(self, key: tuple, token_ids: torch.Tensor, device, compute) -> torch.Tensor:
        if token_ids.device.type != "cpu":
            return compute().to(device)
        if self.key != key or not torch.equal(self.ids, token_ids):
            self.key, self.ids = key, token_ids.clone()
            self.angles = compute().to(device)
        return self.angles

    def get(self, token_ids: torch.Tensor, grid: tuple, head_dim: int, device) -> torch.Tensor:
        """``rope_angles(token_ids, grid, head_dim)`` on ``device``, [S, head_dim/2] float64."""
        key = (tuple(grid), head_dim, str(device), token_ids.shape[0])
        return self._lookup(key, token_ids, device, lambda: rope_angles(token_ids, grid, head_dim))

    def get_packed(self, token_ids: torch.Tensor, local_lens, grids, head_dim: int, device) -> torch.Tensor:
        """``rope_angles_packed``, cached like ``get`` (a packed step's table changes with its samples' sizes)."""
        key = ("packed", tuple(local_lens), tuple(map(tuple, grids)), head_dim, str(device), token_ids.shape[0])
        return self._lookup(key, token_ids, device,
                            lambda: rope_angles_packed(token_ids, local_lens, grids, head_dim))

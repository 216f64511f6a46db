"""The video DiT the tests build: AdaLN-zero starts every block as the identity, so the modulations get small random
weights (every block, and the timestep, then count in the loss and its gradients)."""
from __future__ import annotations

import torch

from training.video_dit import VideoDiT


def modulated_dit(cfg, *, seed: int = 5, device="cpu") -> VideoDiT:
    """``VideoDiT(cfg)`` built on ``device`` under ``torch.manual_seed(seed)``, modulation weights ~ N(0, 0.05)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = VideoDiT(cfg)
    with torch.no_grad():
        for _, p in model.modulation_parameters():
            p.normal_(0.0, 0.05)
    return model

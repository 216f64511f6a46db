"""A Wan-style video diffusion transformer trained with flow matching under sequence parallelism."""
from .config import PRESETS, DiTConfig, preset
from .model import VideoDiT

__all__ = ["PRESETS", "DiTConfig", "preset", "VideoDiT"]

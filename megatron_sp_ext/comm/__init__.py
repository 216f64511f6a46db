"""Exchanges (flat all-to-all, point-to-point batches: ``p2p``) and stream helpers."""
from .exchange import all_to_all_flat
from .streams import StreamPool, default_pool

__all__ = ["all_to_all_flat", "StreamPool", "default_pool"]

"""Local attention backends, (out, lse) kernels per call and LSE merging."""
from .backends import LocalAttention, available_backends, get_backend, wrap_callable
from .lse import merge, merge_into

__all__ = ["LocalAttention", "available_backends", "get_backend", "wrap_callable", "merge", "merge_into"]

"""Peak live tensor bytes of a region on CPU, counted at the dispatcher (a stand-in for CUDA's peak
memory statistic, which CPU tensors lack).

Every tensor an op returns is counted by its storage until the last tensor object holding that storage
is gone, so views and in-place results cost nothing extra. Memory that existed before the region (and
views of it) is not counted. A tensor handed to a collective (c10d op) is passed as an alias: the
communication library's own hold on it (gloo's worker thread drops its finished work some time after ``wait()``
returns, at a moment set by the scheduler) would otherwise decide when the tensor stops counting, and a count taken
right after the region would change from run to run on a loaded machine. The count is what the program holds. On 4 x H200 the fwd+bwd peaks of Ulysses, HCMS and DeepSpeed measured with CUDA's
allocator stood in the same ratios as this count (1.5x / 1.1x / 1x before the backward freed early).
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak`` (bytes) and ``m.live`` (bytes still alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":  # the library holds the alias's TensorImpl, never the tracked tensor object
            args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or (key in inputs and key not in self.refs):
                continue  # a view of (or in-place on) memory that existed before the region
            if key not in self.refs:
                self.refs[key], self.size[key] = 0, storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

"""What a local attention kernel is: the calls it offers, what it can do, and why it cannot run a given call.

Every kernel module of this package defines one ``Kernel`` subclass. Shapes (this side of every kernel): q
[B, H, Sq, D], k/v [B, Hkv, Sk, D] (bhsd, any strides with stride(-1) == 1; GQA: H % Hkv == 0), out [B, H, Sq, D] in
q's dtype, lse fp32 (fp64 for fp64 math) [B, H, Sq]. ``causal`` is top-left aligned (Sq == Sk). ``tiles``: a
``attention.tiles.TileSlice`` (a block mask's view for the call's rows), ANDed with causal.

Calls a kernel may offer (``Capabilities``):
  plain    ``attention(q, k, v, causal, scale)``: differentiable
  dropout  ``dropout_attention(q, k, v, causal, scale, dropout_p)``: differentiable, one dropout mask per call
  lse      ``forward(...) -> (out, lse)`` and ``backward(do, q, k, v, out, lse, ...)`` from the rows' FINAL out/lse
           (what ring steps and head-chunked blocks need)
  varlen   ``varlen_forward`` / ``varlen_backward``: packed samples in one call (``varlen`` = the method's name)
  tiles    block sparsity: ``forward`` / ``backward`` / ``attention`` with ``tiles=``; "any" (any tile size and
           placement), "kernel_blocks" (the kernel's own blocks: whether it runs a given slice, tiles that cut
           its blocks included, is its ``why_not_here``), "none"
GQA: every kernel takes k/v with fewer heads (expanded inside the kernels that need it; read as they are by FA4,
flex, flash_attn and TE); no choice depends on it, so it is no capability.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

NEEDS = ("plain", "lse", "varlen", "tiles", "dropout")


def package_device_problem(installed: bool, package: str, install_hint: str, device: torch.device,
                           arch_majors: tuple) -> Optional[str]:
    """The reason a CUDA-only kernel package cannot run on ``device`` (not installed, not a CUDA tensor, an
    architecture outside ``arch_majors``), in a user's words; None when those three hold."""
    if not installed:
        return f"the package {package!r} is not installed ({install_hint})"
    if device.type != "cuda":
        return f"it runs on NVIDIA GPUs only (tensors are on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in arch_majors:
        return f"it runs on Hopper (sm_90) and Blackwell (sm_100) GPUs, not sm_{major}{minor}"
    return None


# GQA by expansion (the kernels that do not read k/v with fewer heads as they are)
def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """k, v [B, Hkv, S, D] repeated to ``heads`` heads (GQA), and the repeat factor."""
    rep = heads // k.shape[1]
    if rep == 1:
        return k, v, 1
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), rep


def fold_kv_grad(g: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient [B, Hkv * rep, S, D] of ``expand_kv``'s output summed back to [B, Hkv, S, D]."""
    if rep == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // rep, rep, s, d).sum(dim=2)


@dataclass(frozen=True)
class Capabilities:
    """What a kernel can do (see module docstring). dtypes per device type; archs: CUDA compute-capability majors
    (None: any); dense: calls without a block mask too (False: a block-sparse-only kernel, never a backend nor a
    dense log-sum-exp kernel); deterministic: whose backward gives the same bits on every rerun under torch's
    deterministic switch ("none"; "dense": its dense and varlen calls; "all": its block-sparse calls too). Every field
    is read by the registry (tests/test_registry.py scans)."""

    plain: bool = True
    lse: bool = False
    varlen: Optional[str] = None
    tiles: str = "none"
    dropout: bool = False
    dtypes: dict = field(default_factory=dict)
    archs: Optional[tuple] = None
    dense: bool = True
    deterministic: str = "none"


@dataclass(frozen=True)
class KernelCall:
    """What a call needs: where it runs, its dtype and head dim, which calls (``needs`` of NEEDS), and for block
    sparsity the call's tile slice (None: no mask)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: Optional[int] = None
    needs: frozenset = frozenset({"plain"})
    tiles: object = None

    @staticmethod
    def of(q: torch.Tensor, *needs: str, tiles=None) -> "KernelCall":
        """The call of query tensor ``q`` needing ``needs`` (default: plain)."""
        return KernelCall(q.device, q.dtype, q.shape[-1], frozenset(needs or ("plain",)), tiles)


class Kernel:
    """One local attention kernel (subclasses fill ``name``, ``setting``, ``label``, ``caps`` and the calls)."""

    name = "base"          # the registry's key
    setting = "base"       # the name a user gives (backend / block kernel setting)
    label = "base"         # in a user's words (logs, the DiT's kernel line)
    package: Optional[str] = None   # the pip package it needs, if any
    caps = Capabilities()
    in_torch_sdpa = False  # one of the kernels torch's SDPA dispatch picks among ("auto"'s plain calls go there)
    offered = True         # a setting a user may give (False: reached through the chooser only, kernels/sdpa.py)

    def installed(self) -> bool:
        """Whether the kernel's code is importable here (not imported)."""
        return True

    def schema_ok(self) -> bool:
        """Whether the installed code has the calls (and argument names) this library makes."""
        return self.installed()

    def varlen_schema_ok(self) -> bool:
        """Whether the installed code has the varlen calls this library makes."""
        return self.caps.varlen is not None and self.schema_ok()

    def why_not(self, call: KernelCall) -> Optional[str]:
        """None if this kernel runs ``call`` here, else the reason in a user's words."""
        if not self.installed():
            return f"the package {self.package!r} is not installed"
        caps = self.caps
        for need, ok in (("plain", caps.plain), ("lse", caps.lse), ("varlen", caps.varlen is not None),
                         ("tiles", caps.tiles != "none"), ("dropout", caps.dropout)):
            if need in call.needs and not ok:
                return _LACKS[need]
        reason = self.device_reason(call)
        return reason if reason is not None else self.why_not_here(call)

    def device_reason(self, call: KernelCall) -> Optional[str]:
        """Why the call's device, dtype or architecture does not suit the kernel (None: they do)."""
        caps = self.caps
        dev = torch.device(call.device)
        allowed = caps.dtypes.get(dev.type)
        if allowed is None:
            return f"it does not run on {dev.type}"
        if call.dtype not in allowed:
            return f"it does not take {call.dtype} on {dev.type} (takes {', '.join(str(d) for d in allowed)})"
        if caps.archs is not None and dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            if major not in caps.archs:
                return f"it runs on compute capability {'/'.join(f'{a}.x' for a in caps.archs)}, not {major}.{minor}"
        return None

    def why_not_here(self, call: KernelCall) -> Optional[str]:
        """The kernel's own further conditions (head dims, tile alignment, a probe); None when it runs."""
        return None

    def prepare(self, tiles, sq: int, sk: int, causal: bool) -> None:
        """Build (and cache in the slice) what block-sparse calls of ``tiles`` over ``sq`` x ``sk`` rows need; the
        first call would otherwise do it (benchmarks time it apart)."""

    # -- calls (a kernel implements those its capabilities declare)
    def attention(self, q, k, v, causal: bool, scale: float, tiles=None) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: no plain call")

    def forward(self, q, k, v, scale: float, causal: bool, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{self.name}: no forward with log-sum-exp")

    def backward(self, do, q, k, v, out, lse, scale: float, causal: bool, tiles=None):
        raise NotImplementedError(f"{self.name}: no backward from out/lse")

    def dropout_attention(self, q, k, v, causal: bool, scale: Optional[float], dropout_p: float) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: no call with attention dropout")

    def varlen_forward(self, q, k, v, cu: tuple, scale: float, causal: bool):
        raise NotImplementedError(f"{self.name}: no varlen call")

    def varlen_backward(self, do, q, k, v, out, lse, cu: tuple, scale: float, causal: bool):
        raise NotImplementedError(f"{self.name}: no varlen call")


_LACKS = {"plain": "it has no plain differentiable call",
          "lse": "it has no forward with log-sum-exp and backward from a given out/lse",
          "varlen": "it has no packed-samples (varlen) call",
          "tiles": "it has no block sparsity",
          "dropout": "it has no attention dropout"}


class LseFunction(torch.autograd.Function):
    """A differentiable call on a kernel's forward-with-lse and backward-from-lse (so a plain call and a one-block
    ring step compute the same bits)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: Kernel, causal: bool, scale: float, tiles):
        out, lse = kernel.forward(q, k, v, scale, causal, tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale, tiles)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale, tiles = ctx.args
        dq, dk, dv = kernel.backward(do, q, k, v, out, lse, scale, causal, tiles)
        return dq, dk, dv, None, None, None, None

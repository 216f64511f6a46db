"""Attention of packed variable-length samples on one device: forward with log-sum-exp, backward, and a
differentiable call, by one of several methods that compute the same per-sample attention.

q [1, H, S, D], k/v [1, Hkv, S, D] (bhsd, any strides with stride(-1) == 1; GQA: H % Hkv == 0), ``cu`` the
cumulative sample lengths (tuple of ints, cu[0] = 0, cu[-1] = S, empty samples allowed). Every sample
attends only to itself (a block-diagonal mask; causal = top-left within the sample). out [1, H, S, D] in
q's dtype, lse fp32 [1, H, S]. Methods (``METHODS``):
  "per_sample"    one backend call per sample, in sample order (what the Ulysses varlen path always did)
  "grouped"       samples of one length in one batched backend call (B = their count): a run of adjacent
                  samples is a strided view of q/k/v, scattered ones are stacked copies; a length held by
                  one sample is called as in "per_sample"
  "flash_varlen"  one call of torch's FlashAttention-2 varlen kernel (aten._flash_attention_forward /
                  _flash_attention_backward with cum_seq_q/k; what torch.nn.attention.varlen.varlen_attn
                  calls); [S, H, D] views, no copies of q/k/v
  "fa4_varlen"    one call of FlashAttention-4's varlen kernel (``fa4.varlen_forward`` / ``varlen_backward``, cu_seqlens;
                  GQA without expanding k/v); offered where the backend's kernel is "fa4"
The kernel methods run on CUDA in fp16/bf16 only, for ``AutoBackend``s whose kernel choice allows it ("auto"/"sdpa"
and "torch_flash"; the fixed "cudnn" backend runs only per_sample and grouped), and only after
a probe against math on this (device, dtype) passed (schema check first: a torch without the op never offers
it). There is no cuDNN ragged-kernel method: aten._cudnn_attention_forward / _backward with cum_seq_q/k
measured wrong on torch 2.11 / cuDNN 9.19 (1 x H200, 2026-11-24) and an illegal memory access followed, and
torch 2.13's own varlen_attn also leaves its cuDNN route off.
``method_for``: "auto" = "per_sample" off CUDA (the CPU fallback is the per-sample math); on CUDA the fastest
method that runs here, measured once on the call's own tensors and cached under everything that decides
which methods run and what they compute (device, dtype, heads, kv heads, head dim, sample lengths, causal,
scale, backend and its kernel, whether a backward is timed). A candidate whose trial raises is dropped (every
method computes the same attention, so one kernel failing on these shapes is no reason to fail the call; torch
2.11's cuDNN backward raised ``mha_graph.execute(...).is_good()`` in a trial on an H100): one warning per key
naming the method, the backend and the error's first line, kept in ``VarlenChooser.dropped``; the fastest of the
rest is chosen, and if every candidate raises, the first candidate's error is raised. Group-wide (``across`` a
``CallGroup``: the ranks that make the call together, e.g. a Ulysses group, each on its own share of heads): every member times its
own call and decides from each candidate's time maxed over the group (one all-reduce per new key, as the other
"auto" policies do: ``sp.calibration``), so every member runs the same method; a candidate that cannot run or
raised on any member is dropped on all; the key then holds the group's ranks and, in place of this rank's head
counts, ``CallGroup.heads`` (what names the call's heads the same on every member), so all members find or miss
a decision together. Without a group the decision is this rank's own (calls no other rank makes). A named method is never
tried nor dropped: it runs, and raises, as named; one that cannot run here raises SPConfigError naming the
setting. The methods differ only by the rounding of their kernels; every method's backward takes any method's
(out, lse), since each is exact given the final out/lse of the rows.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..errors import SPConfigError
from ..trials import isolated_trial
from . import kernels
from .backends import AutoBackend, LocalAttention

log = logging.getLogger("megatron_sp_ext")

KERNEL_METHODS = tuple(reversed(kernels.varlen_methods()))   # one call of a kernel's varlen path
METHODS = ("per_sample", "grouped") + KERNEL_METHODS
SETTINGS = ("auto",) + METHODS

# ----------------------------------------------------------------------------------------------- samples

def sample_slices(cu: tuple[int, ...]) -> list[tuple[slice, slice, slice]]:
    """The bhsd index of each non-empty sample of ``cu``."""
    return [(slice(None), slice(None), slice(a, b)) for a, b in zip(cu, cu[1:]) if b > a]


def length_groups(cu: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """(length, [start of each sample of that length]) of the non-empty samples, lengths in order of first
    appearance."""
    groups: dict[int, list[int]] = {}
    for a, b in zip(cu, cu[1:]):
        if b > a:
            groups.setdefault(b - a, []).append(a)
    return list(groups.items())


def _batched(x: torch.Tensor, length: int, starts: list[int]) -> torch.Tensor:
    """x [1, H, S, ...] -> [n, H, length, ...]: the samples at ``starts``; a strided view when they are
    adjacent, else a stacked copy."""
    n, a = len(starts), starts[0]
    if starts == list(range(a, a + n * length, length)):
        return x[0, :, a:a + n * length].unflatten(1, (n, length)).transpose(0, 1)
    return torch.stack([x[0, :, s:s + length] for s in starts])


def _in_sample_order(cu: tuple[int, ...], groups: list[tuple[int, list[int]]], parts: list) -> list:
    """Per-sample pieces [1, H, L, ...] in sample order, from ``parts[g]`` = group g's [n, H, L, ...] (or
    the [1, H, L, ...] result of a one-sample group)."""
    where = {}
    for (length, starts), part in zip(groups, parts):
        for j, s in enumerate(starts):
            where[s] = part[j:j + 1]
    return [where[a] for a, b in zip(cu, cu[1:]) if b > a]


def _one(x: torch.Tensor, length: int, starts: list[int]) -> torch.Tensor:
    """A group's input: the sample's own slice when it is alone (as "per_sample" calls it), else batched."""
    if len(starts) == 1:
        return x[:, :, starts[0]:starts[0] + length]
    return _batched(x, length, starts)


def _cat_seq(parts: list) -> torch.Tensor:
    """The per-sample outputs [1, H, L_i, D] side by side along S, in the kernel's own memory order: parts that are
    views of [1, L_i, H, D] memory (FA4, cuDNN, flash) give a view of one [1, S, H, D] tensor, so a backward's slice
    of a sample is exactly the layout its kernel wrote (a plain cat made a head-major [1, H, S, D] out that FA4's
    backward, reading its own [B, S, H, D] order, never received from any other path); others a plain cat."""
    if len(parts) > 1 and all(p.transpose(1, 2).is_contiguous() for p in parts):
        return torch.cat([p.transpose(1, 2) for p in parts], dim=1).transpose(1, 2)
    return torch.cat(parts, dim=2)


def _nonempty(cu: tuple[int, ...]) -> tuple[int, ...]:
    out = [cu[0]]
    for c in cu[1:]:
        if c > out[-1]:
            out.append(c)
    return tuple(out)


# -------------------------------------------------------------------------------------- the three methods

def forward_lse(method: str, be: LocalAttention, q, k, v, cu: tuple[int, ...], *, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, H, S, D], lse fp32 [1, H, S]) of the packed samples by ``method`` (a resolved one)."""
    if method == "per_sample":
        parts = [be.forward_lse(q[i], k[i], v[i], causal=causal, softmax_scale=scale) for i in sample_slices(cu)]
        return _cat_seq([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=2)
    if method == "grouped":
        groups = length_groups(cu)
        parts = [be.forward_lse(_one(q, n, st), _one(k, n, st), _one(v, n, st), causal=causal, softmax_scale=scale)
                 for n, st in groups]
        outs = _in_sample_order(cu, groups, [o for o, _ in parts])
        lses = _in_sample_order(cu, groups, [lse for _, lse in parts])
        return _cat_seq(outs), torch.cat(lses, dim=2)
    kern = kernels.of_varlen_method(method)
    if kern is None:
        raise ValueError(f"unknown varlen method {method!r}")
    return kern.varlen_forward(q, k, v, _nonempty(cu), scale, causal)


def backward_lse(method: str, be: LocalAttention, do, q, k, v, out, lse, cu: tuple[int, ...], *, causal: bool,
                 scale: float) -> list[torch.Tensor]:
    """[dq, dk, dv] of ``forward_lse`` given the final out / lse (any method's)."""
    if method == "per_sample":
        parts = [be.backward_lse(do[i], q[i], k[i], v[i], out[i], lse[i], causal=causal, softmax_scale=scale)
                 for i in sample_slices(cu)]
        return [torch.cat([p[j] for p in parts], dim=2) for j in range(3)]
    if method == "grouped":
        groups = length_groups(cu)
        parts = [be.backward_lse(*(_one(t, n, st) for t in (do, q, k, v, out, lse)), causal=causal,
                                 softmax_scale=scale) for n, st in groups]
        return [torch.cat(_in_sample_order(cu, groups, [p[j] for p in parts]), dim=2) for j in range(3)]
    kern = kernels.of_varlen_method(method)
    if kern is None:
        raise ValueError(f"unknown varlen method {method!r}")
    return kern.varlen_backward(do, q, k, v, out, lse, _nonempty(cu), scale, causal)


def attention(method: str, be: LocalAttention, q, k, v, cu: tuple[int, ...], *, causal: bool,
              scale: float) -> torch.Tensor:
    """Differentiable out [1, H, S, D] of the packed samples by ``method`` (a resolved one): "per_sample" and
    "grouped" call ``be`` (its own autograd), "flash_varlen" runs under an autograd Function."""
    if method == "per_sample":
        return torch.cat([be(q[i], k[i], v[i], causal=causal, softmax_scale=scale) for i in sample_slices(cu)],
                         dim=2)
    if method == "grouped":
        groups = length_groups(cu)
        parts = [be(_one(q, n, st), _one(k, n, st), _one(v, n, st), causal=causal, softmax_scale=scale)
                 for n, st in groups]
        return torch.cat(_in_sample_order(cu, groups, parts), dim=2)
    if method in KERNEL_METHODS:
        return _KernelFn.apply(q, k, v, method, be, cu, causal, scale)
    raise ValueError(f"unknown varlen method {method!r}")


class _KernelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, method, be, cu, causal, scale):
        out, lse = forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (method, be, cu, causal, scale)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        method, be, cu, causal, scale = ctx.args
        dq, dk, dv = backward_lse(method, be, do, q, k, v, out, lse, cu, causal=causal, scale=scale)
        return dq, dk, dv, None, None, None, None, None


# ------------------------------------------------------------------------------------------ availability

def schema_ok(method: str) -> bool:
    """Whether this build has ``method``'s calls with the arguments this library passes."""
    if method in ("per_sample", "grouped"):
        return True
    kern = kernels.of_varlen_method(method)
    return kern is not None and kern.varlen_schema_ok()


_PROBED: dict = {}


def kernel_available(method: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the varlen kernel ``method`` runs here: its kernel's conditions (device, dtype, schema) and a probe
    against math (packed samples of several lengths, GQA, causal and not, forward and backward; cached)."""
    device = torch.device(device)
    kern = kernels.of_varlen_method(method)
    if kern is None or kern.why_not(kernels.KernelCall(device, dtype, None, frozenset({"varlen"}))) is not None:
        return False
    key = (method, str(device), dtype)
    if key not in _PROBED:
        failures = getattr(kern, "probe_failures", (RuntimeError, NotImplementedError, TypeError, ValueError))
        try:   # a kernel this build lacks (FA4, its own package, may fail by assertions or its DSL's errors)
            ok = probe(method, device, dtype)
        except failures as e:  # noqa: BLE001 - see above
            log.info("megatron_sp_ext: varlen kernel %s unavailable on %s/%s: %s", method, device, dtype, e)
            ok = False
        if not ok:
            log.info("megatron_sp_ext: varlen kernel %s is not offered on %s/%s (probe)", method, device, dtype)
        _PROBED[key] = ok
    return _PROBED[key]


def probe(method: str, device, dtype, tol: float = 3e-2) -> bool:
    """``method`` on a tiny packed case (lengths 40, 24, 0, 17: none a multiple of a tile; 4 q heads on 2 kv
    heads) against per-sample math, causal and not, on contiguous bhsd q/k/v and on bhsd views of [S, H, D]
    memory: out, lse, dq, dk, dv within ``tol`` (relative to max)."""
    g = torch.Generator().manual_seed(0)
    cu, s = (0, 40, 64, 64, 81), 81
    math_be = LocalAttention()
    close = lambda a, b: bool((a.float() - b.float()).abs().max() <= tol * (1 + b.float().abs().max()))  # noqa: E731
    for causal, thd_memory in ((False, False), (True, False), (False, True), (True, True)):
        if thd_memory:
            q, k, v, do = (torch.randn(1, s, n, 64, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
                           for n in (4, 2, 2, 4))
        else:
            q, k, v, do = (torch.randn(1, n, s, 64, generator=g).to(device=device, dtype=dtype) for n in (4, 2, 2, 4))
        o, lse = forward_lse(method, math_be, q, k, v, cu, causal=causal, scale=0.125)
        grads = backward_lse(method, math_be, do, q, k, v, o, lse, cu, causal=causal, scale=0.125)
        f32 = [t.float() for t in (do, q, k, v)]
        o_m, lse_m = forward_lse("per_sample", math_be, *f32[1:], cu, causal=causal, scale=0.125)
        grads_m = backward_lse("per_sample", math_be, f32[0], *f32[1:], o_m, lse_m, cu, causal=causal, scale=0.125)
        if not (close(o, o_m) and close(lse, lse_m) and all(close(a, b) for a, b in zip(grads, grads_m))):
            return False
    return True


def _backend_kernel(be: LocalAttention, q: torch.Tensor) -> Optional[str]:
    """The lse kernel an "auto"-family backend (``AutoBackend``, fixed kernels too) runs for q (None for others)."""
    return be.kernel_for(q) if isinstance(be, AutoBackend) else None


def methods_here(be: LocalAttention, q: torch.Tensor, cu: Optional[tuple[int, ...]] = None) -> list[str]:
    """The methods that run for ``be`` on q's (device, dtype), "per_sample" first, then the varlen methods of the
    kernels the backend may run (every "auto" kernel's for "auto"/"sdpa"; a fixed kernel's own), where they run
    here. Not the varlen kernels when a sample of ``cu`` has one token (the fixed-length kernels' 1 x 1 calls were
    wrong or crashed on an H100, see lse_kernels; the per-sample methods run those calls on the math kernel). The
    kernels are the one choice's candidates (``kernels.candidates`` of a varlen call for the backend's kernel
    setting; "auto": from the kernel it chose for the calls on)."""
    out = ["per_sample", "grouped"]
    one_token = cu is not None and any(b - a == 1 for a, b in zip(cu, cu[1:]))
    if one_token or not isinstance(be, AutoBackend):
        return out
    chosen = _backend_kernel(be, q)   # a fixed kernel that cannot run here raises naming its setting
    call = kernels.KernelCall(q.device, q.dtype, q.shape[-1], frozenset({"varlen"}))
    allowed = {kernels.get(n).caps.varlen for n in kernels.candidates(call, be.kernel_setting, after=chosen)}
    offered = [m for m in KERNEL_METHODS if m in allowed]
    return out + [m for m in offered if kernel_available(m, q.device, q.dtype)]


# ------------------------------------------------------------------------------------------------ choice

def cuda_timer(method: str, fn: Callable[[], None], reps: int = 3) -> float:
    """Best of ``reps`` timings of ``fn`` (``method``'s call; ms, CUDA events) after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e))
    return best


class CallGroup(NamedTuple):
    """Who decides an "auto" method together (module docstring): ``group``, the ranks that make the call together
    (None or one rank: this rank alone); ``heads``, what names the call's heads the same on every member (None: this
    rank's head counts)."""

    group: Optional[dist.ProcessGroup] = None
    heads: Hashable = None


ALONE = CallGroup()


class VarlenChooser:
    """Resolves a ``varlen_kernel`` setting to a method; "auto" measures once per key (see module docstring), in
    ``trials.isolated_trial`` (activation checkpointing's saved-tensor hooks never see the trials).
    ``timer(method, fn) -> ms`` and ``measure_off_cuda`` exist for tests; ``decisions`` is the cache (LRU, key ->
    method); ``dropped`` holds, for the cached keys where some candidate's trial raised, {method: "ErrorType: the
    error's first line"} (evicted with its decision)."""

    def __init__(self, timer: Callable[[str, Callable[[], None]], float] = cuda_timer, capacity: int = 1024,
                 measure_off_cuda: bool = False) -> None:
        self.timer, self.capacity, self.measure_off_cuda = timer, capacity, measure_off_cuda
        self.decisions: OrderedDict = OrderedDict()
        self.dropped: dict = {}

    @staticmethod
    def key(be: LocalAttention, q, k, cu: tuple[int, ...], causal: bool, scale: float, need_grad: bool,
            explicit: bool, across: CallGroup = ALONE) -> tuple:
        """Everything that decides which methods run and what they compute; for a group-wide decision (``across``
        a group of more than one rank), also the group's ranks, and ``across.heads`` (when given) in place of this
        rank's head counts, so the key is the same on every member."""
        lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
        ranks = _group_ranks(across.group)
        h, hkv = (q.shape[1], k.shape[1]) if not ranks or across.heads is None else ("group", across.heads)
        key = (str(q.device), q.dtype, h, hkv, q.shape[3], lengths, bool(causal), float(scale),
               be.name, getattr(be, "kernel", None), _backend_kernel(be, q), bool(need_grad), bool(explicit))
        return key + (ranks,) if ranks else key

    def method_for(self, setting: str, be: LocalAttention, q, k, v, cu: tuple[int, ...], *, causal: bool, scale: float,
                   need_grad: bool, explicit: bool = True, across: CallGroup = ALONE) -> str:
        """The method for this call (explicit: the call runs ``forward_lse`` / ``backward_lse``; else
        ``attention`` under autograd; "auto" times that, dropping a candidate whose trial raises; ``across`` a
        group: decided group-wide, see the module docstring). Raises SPConfigError naming ``varlen_kernel`` for an
        unknown setting or a method that cannot run here, and, for "auto", the first candidate's error when every
        candidate's trial raised (on any member of the group)."""
        group = across.group
        if setting not in SETTINGS:
            raise SPConfigError(f"varlen_kernel={setting!r} is invalid: choose one of {', '.join(SETTINGS)}")
        here = methods_here(be, q, cu)
        if setting != "auto":
            if setting not in here:
                raise SPConfigError(
                    f"varlen_kernel={setting!r} does not run here (backend {be.name!r}, {q.device}, {q.dtype}"
                    f"{', a one-token sample or padding segment' if setting in KERNEL_METHODS else ''}): use 'auto' "
                    f"or one of {', '.join(here)}")
            return setting
        if q.device.type != "cuda" and not self.measure_off_cuda:
            return "per_sample"
        key = self.key(be, q, k, cu, causal, scale, need_grad, explicit, across)
        if key in self.decisions:
            self.decisions.move_to_end(key)
            return self.decisions[key]
        times: dict = {}
        errors: dict = {}
        with isolated_trial():  # a checkpointed forward's saved-tensor hooks never see the trials
            for m in here:
                try:
                    times[m] = self.timer(m, self._run(m, be, q, k, v, cu, causal, scale, need_grad, explicit))
                except Exception as e:  # noqa: BLE001 - any failure of one candidate's trial drops that candidate
                    errors[m] = e
        dropped = {m: first_line(e) for m, e in errors.items()}
        if _group_ranks(group):   # group-wide: each candidate's time maxed over the group, then the argmin
            times = _group_max_times(times, here, group, q.device)
            dropped.update({m: "on another rank of the group (or it is not offered there)"
                            for m in here if m not in times and m not in dropped})
        for m, line in dropped.items():
            log.warning("megatron_sp_ext: varlen_kernel='auto' dropped %s (backend %r, kernel %s, %d samples): its "
                        "trial raised %s", m, be.name, key[10], len(key[5]), line)
        if not times:  # nothing ran: the first candidate's own error (the others are in the warnings above)
            if not errors:   # this rank ran them all; other members of the group did not
                raise RuntimeError("megatron_sp_ext: varlen_kernel='auto': every candidate's trial raised on another "
                                   f"rank of the group ({', '.join(here)})")
            raise errors[here[0]] if here[0] in errors else next(iter(errors.values()))
        best = min(times, key=lambda m: (times[m], here.index(m)))
        log.info("megatron_sp_ext: varlen_kernel='auto' chose %s for %d samples (ms: %s%s)", best,
                 len(key[5]), {m: round(t, 3) for m, t in times.items()},
                 f"; dropped: {sorted(dropped)}" if dropped else "")
        self.decisions[key] = best
        if dropped:
            self.dropped[key] = dropped
        while len(self.decisions) > self.capacity:
            self.dropped.pop(self.decisions.popitem(last=False)[0], None)
        return best

    @staticmethod
    def _run(method, be, q, k, v, cu, causal, scale, need_grad, explicit) -> Callable[[], None]:
        def fn() -> None:
            if not explicit:
                with torch.enable_grad():
                    qkv = [t.detach().requires_grad_(need_grad) for t in (q, k, v)]
                    out = attention(method, be, *qkv, cu, causal=causal, scale=scale)
                    if need_grad:
                        torch.autograd.grad(out, qkv, out.detach())
                return
            with torch.no_grad():
                out, lse = forward_lse(method, be, q, k, v, cu, causal=causal, scale=scale)
                if need_grad:
                    backward_lse(method, be, out, q, k, v, out, lse, cu, causal=causal, scale=scale)
        return fn


def _group_ranks(group) -> tuple:
    """The global ranks of ``group`` when a decision is to be group-wide (more than one rank, torch.distributed up),
    else () (the same tuple on every member; what ``sp.calibration.group_key`` names a group by)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ()
    return tuple(dist.get_process_group_ranks(group))


def _group_max_times(times: dict, here: list, group, device: torch.device) -> dict:
    """Each method's ms maxed over ``group`` (one all-reduce of a float64 row over METHODS; a method missing on a
    rank, not offered there or its trial raised, is +inf there): the methods that ran on every member."""
    row = torch.tensor([times.get(m, float("inf")) if m in here else float("inf") for m in METHODS],
                       dtype=torch.float64, device=device)
    dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)
    return {m: t for m, t in zip(METHODS, row.tolist()) if m in here and t != float("inf")}


def first_line(e: BaseException) -> str:
    """``"ErrorType: <first line of the message>"`` (a cuDNN error's message runs to many lines)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


_DEFAULT = VarlenChooser()


def default_chooser() -> VarlenChooser:
    """The process-wide chooser (its cache is shared by every call that does not pass its own)."""
    return _DEFAULT


def method_for(setting: str, be: LocalAttention, q, k, v, cu: tuple[int, ...], *, causal: bool, scale: float,
               need_grad: bool, explicit: bool = True, chooser: Optional[VarlenChooser] = None,
               across: CallGroup = ALONE) -> str:
    """``(chooser or default_chooser()).method_for(...)``."""
    return (chooser or _DEFAULT).method_for(setting, be, q, k, v, cu, causal=causal, scale=scale, need_grad=need_grad,
                                            explicit=explicit, across=across)

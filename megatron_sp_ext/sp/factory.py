"""The one map from a mode (``SPConfig.mode``) to its sequence-parallel attention algorithm.

Every entry point (Megatron's ``SPDotProductAttention``, DeepSpeed's ``SPDistributedAttention``, the video
DiT's ``make_core``) calls ``make_attention`` and runs the ``SPAttention`` it returns; no other module maps
a mode name to an algorithm.

    attn = make_attention(cfg, group, num_heads=H, num_kv_heads=Hkv, layout="sbhd", placement="zigzag",
                          backend=cfg.backend, resources=SPResources())
    problem = attn.problem(causal=True)          # once per step: what every layer's call computes
    out = attn(q, k, v, problem)                 # or attn(q, k, v, causal=True): one problem per call

Modes: ulysses (one chunk), hcms (``cfg.head_chunks``, "auto" via the HCMS policy), ring and tasp (ring
variants over ``group``), usp and tas (``hybrid_attention`` on a mesh), torus (``torus_attention`` on a
mesh), auto (``resolve_auto_mode`` statically: hcms when every rank gets a head, else a usp mesh, else
ring; when it is hcms, on CUDA the model's ``ModePolicy`` calibrates Ulysses/HCMS against the ring per
shape). Attention dropout (``dropout_p``) runs inside the Ulysses family only (``config.DROPOUT_MODES``);
with dropout, or with a caller's own local attention, "auto" stays on Ulysses/HCMS. What each mode needs and
supports is declared in the mode registry (modes.py); this module maps a mode's ``family`` to its algorithm.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..attention.backends import LocalAttention, get_backend
from .. import modes
from ..comm.capability import check_p2p, needs_p2p, p2p_unavailable_reason
from ..comm.streams import StreamPool
from ..comm.transport import TransportPool
from ..config import DEFAULT_PLACEMENT, DROPOUT_MODES, LAYOUTS, SEQ_PLACEMENTS, SPConfig, resolve_auto_mode
from ..errors import SPConfigError
from ..topology.mesh import SPMesh, build_sp_mesh
from .problem import AttentionProblem, problem_from_keywords
from .layers.policy import FormPolicy
from .calibration import ModePolicy
from .ring import hybrid_attention, ring_attention, torus_attention
from .ulysses import HCMSPolicy, PackedUlysses, ulysses_attention
from .speed_plan.auto import AutoRanker, shape_of   # issue 84

RING_MODES = modes.names(family="ring")         # the ring variants auto may pick per shape
log = logging.getLogger("megatron_sp_ext")


class SPResources:
    """What every attention of one model shares: comm streams, HCMS chunk policy, mode policy (auto), the
    attention-layer form policy (``--sp-async-qkv auto``), transports, meshes (one per group/heads/arrangement) and
    the speed plan's ranker (``speed_plan``: auto's candidates ranked on groups across machines; None: off).
    ``sp_config``: the model's settings, if known."""

    def __init__(self, sp_config: Optional[SPConfig] = None, *, streams: Optional[StreamPool] = None,
                 policy: Optional[HCMSPolicy] = None, mode_policy: Optional[ModePolicy] = None,
                 transports: Optional[TransportPool] = None, form_policy: Optional[FormPolicy] = None) -> None:
        self.sp_config = sp_config
        self.streams = streams or StreamPool()
        self.policy = policy or HCMSPolicy()
        self.mode_policy = mode_policy or ModePolicy()
        self.transports = transports or TransportPool()
        self.form_policy = form_policy or FormPolicy()
        self.speed_plan = AutoRanker()   # issue 84: auto's ranking on groups across machines (None: off)
        self.meshes: dict = {}
        self.said: set[tuple] = set()   # the model's log lines said once (auto's fixed mode per reason), not per layer

    def mesh(self, group: dist.ProcessGroup, num_heads: int, cfg: SPConfig,
             arrangement: Optional[str] = None) -> SPMesh:
        """The (cached) mesh of ``group`` for ``num_heads`` heads; ``arrangement`` (usp/tas) overrides the setting
        ``cfg.arrangement``."""
        arrangement = arrangement or cfg.arrangement
        key = (id(group), num_heads, arrangement, cfg.ulysses_size, cfg.nodes)
        if key not in self.meshes:
            self.meshes[key] = build_sp_mesh(
                group, num_heads=num_heads, arrangement=arrangement, ulysses_size=cfg.ulysses_size, nodes=cfg.nodes,
                names={s: cfg.name(s) for s in ("arrangement", "ulysses_size", "nodes")})
        return self.meshes[key]


# (q, k, problem) -> "hcms", "ring" or "tasp": overrides auto's calibration (adapters, tests)
Chooser = Callable[[torch.Tensor, torch.Tensor, "AttentionProblem"], str]


class SPAttention:
    """One sequence-parallel attention: ``attn(q, k, v, *, causal, softmax_scale, kv_valid_len=None,
    dropout_p=0.0, local_attention=None)`` on this rank's shards ([B, S_loc, H, D] for layout "bshd",
    [S_loc, B, H, D] for "sbhd", in ``placement``), returning the output in q's layout and shape.

    Attributes: ``mode`` (what runs; "auto" resolved statically), ``auto`` (auto may pick the ring per shape),
    ``backend`` (local kernel; settable), ``mesh`` (usp/tas/torus), ``packed`` (a ``PackedUlysses`` for models
    that write q|k|v into the exchange layout, or None), ``takes_local_attention`` (a caller's own local
    attention can run inside: Ulysses/HCMS), ``chooser`` (None: auto's own calibration), ``training`` (the
    owning module's training flag, set by the adapters before each call: auto's calibration then keys and times
    fwd+bwd by it, so a no_grad forward under activation recompute decides like its recompute; None: grad mode).
    """

    def __init__(self, cfg: SPConfig, group: Optional[dist.ProcessGroup], *, num_heads: int,
                 num_kv_heads: Optional[int], layout: str, placement: str, backend: "str | LocalAttention",
                 resources: SPResources, mesh: Optional[SPMesh] = None) -> None:
        if layout not in LAYOUTS:
            raise SPConfigError(f"layout={layout!r} is invalid: choose one of {', '.join(LAYOUTS)}")
        if placement not in SEQ_PLACEMENTS:
            raise SPConfigError(f"placement={placement!r} is invalid: choose one of {', '.join(SEQ_PLACEMENTS)}")
        self.cfg, self.group, self.layout, self.placement, self.res = cfg, group, layout, placement, resources
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads or num_heads
        self.world = dist.get_world_size(group) if group is not None else 1
        cfg.check_dropout(self.world, num_heads)
        auto = modes.get(cfg.mode).auto
        self.mode = resolve_auto_mode(num_heads, self.world) if auto else cfg.mode
        self.spec = modes.get(self.mode)   # what the mode that runs needs and supports
        self.auto = auto and self.spec.family == "ulysses" and cfg.dropout_p == 0.0
        self.auto_asked = auto   # "auto" was the setting (what runs is ``mode``; ``auto``: it may switch per shape)
        if self.spec.heads_per_rank and self.world > 1 and num_heads < self.world:
            raise SPConfigError(f"{cfg.name('mode')}={cfg.mode} needs at least one attention head per rank: "
                                f"{num_heads} heads < {cfg.name('sp_size')} {self.world}; use "
                                f"{modes.listing(modes.names(heads_per_rank=False))}")
        self.chunks = self.spec.chunks(cfg.head_chunks)
        self.backend = get_backend(backend, cfg.name("backend"))
        self.takes_local_attention = self.spec.local_attention
        self.chooser: Optional[Chooser] = None
        self.training: Optional[bool] = None  # the owning module's flag: auto times fwd+bwd by it (None: grad mode)
        self.mesh = mesh
        if self.mesh is None and self.spec.mesh and self.world > 1:
            self.mesh = resources.mesh(group, num_heads, cfg, self.mode if self.spec.arrangement else None)
        self.packed = packed_entry(cfg, group, resources, backend=self.backend) if self.world > 1 else None

    def _say_fixed_mode(self, reason: str) -> None:
        """Log (once per model and reason) that auto ran its baseline for calls with ``reason``: auto calibrates the
        mode on calls without packed samples, dropout or a caller's local attention (block masks included), so
        benchmark rows (tools/benchlib.AutoDecisions) name what ran."""
        key = ("fixed mode", self.mode, self.chunks, reason)
        if key not in self.res.said and log.isEnabledFor(logging.INFO):   # said when someone listens
            self.res.said.add(key)
            log.info("megatron_sp_ext: auto mode -> %s (head chunks %s) for calls with %s: auto picks the mode per "
                     "shape on calls without packed samples, dropout or a caller's local attention", self.mode,
                     self.chunks, reason)

    def mode_for(self, q: torch.Tensor, k: torch.Tensor, problem: AttentionProblem) -> str:
        """auto: "hcms" (Ulysses/HCMS, the baseline), "ring", or "tasp" (groups of more than 2 ranks) for this
        shape (``chooser`` or the ModePolicy's calibration, once per key, see sp.calibration; off CUDA: the
        baseline). The three compute the same attention (tests/test_auto_mode.py). With a block mask the
        candidates are timed with that mask, a fresh copy per call (the ring skips the steps and transfers it leaves
        empty, Ulysses moves every token), once per mask shape and tile size: later masks of the same shape (a top-k
        mask changes every step) reuse the choice, which changes speed only, never the result. Called after the
        problem was agreed across ranks (so every rank keys the calibration alike)."""
        if self.chooser is not None:
            return self.chooser(q, k, problem)
        masked = problem.block_mask is not None

        def fresh() -> AttentionProblem:   # each timed call on its own copy of the mask: the per-mask setup (the
            # ring's skip tables, cached per problem) is counted, as a new top-k mask pays it every step
            return problem if not masked else problem.with_mask(problem.block_mask.clone(), agreed=True)
        candidates = {self.mode: lambda a, b, c: self._ulysses(a, b, c, fresh(), None)}
        for variant in RING_MODES:   # TASP's n-1 rings differ from the ring only beyond 2 ranks
            if (self.world > 2 or not modes.get(variant).multi_ring) and (not masked or
                                                                           modes.get(variant).block_mask):
                candidates[variant] = lambda a, b, c, var=variant: self._ring(a, b, c, var, fresh())
        if p2p_unavailable_reason(self.group, q.device) is not None:   # never tried: it would break the group
            candidates = {m: f for m, f in candidates.items() if not needs_p2p(m, self.world)}
        if len(candidates) == 1:
            self._say_fixed_mode("no point-to-point path in this group (the ring modes need one)")
            return next(iter(candidates))
        # -- issue 84 (speed plan): on a group across machines the plan ranks the candidates, only those it cannot
        # separate are timed, the pick and its predicted / measured time logged once (speed_plan/auto.py)
        report = lambda pick, policy=None: pick  # noqa: E731
        tiles = None if not masked else {"block_mask": problem.block_mask, "block_size": problem.tile}
        if self.res.speed_plan is not None and q.device.type in self.res.mode_policy.timed_devices:
            candidates, report = self.res.speed_plan.narrow(candidates, shape_of(
                tuple(q.shape), tuple(k.shape), self.layout, self.world, problem.causal, self.chunks, tiles, q.device),
                self.res.speed_plan.cluster(self.group, self.cfg.nodes), problem.block_mask)
            if len(candidates) == 1:
                return report(next(iter(candidates)))
        # -- end issue 84
        mask_key = () if not masked else ("block_mask", tuple(problem.block_mask.shape), problem.tile)
        return report(self.res.mode_policy.fastest_for(q, k, self.group, candidates, extra_key=(
            problem.causal, problem.kv_valid_len, self.layout, self.placement, self.cfg.transport, self.chunks,
            getattr(self.backend, "name", type(self.backend).__name__), *mask_key), fwd_bwd=self.training),
            self.res.mode_policy)

    def _ulysses(self, q, k, v, problem: AttentionProblem, local_attention):
        backend = local_attention if local_attention is not None else self.backend
        if self.world == 1:   # the one-rank path: no exchange, so no stream, transport or chunk policy
            return ulysses_attention(q, k, v, None, problem, backend=backend)
        return ulysses_attention(
            q, k, v, self.group, problem, head_chunks=self.chunks, backend=backend,
            comm_stream=self.res.streams.comm_stream(q.device), policy=self.res.policy,
            transport=self.res.transports.get(self.cfg.transport, self.group, q.device, self.cfg.name("transport")))

    def _ring(self, q, k, v, variant: str, problem: AttentionProblem):
        return ring_attention(q, k, v, self.group, problem, variant=variant, backend=self.backend)

    def problem(self, **keywords) -> AttentionProblem:
        """An ``AttentionProblem`` for this attention's calls: its layout and placement, the rest from
        ``keywords`` (causal, softmax_scale, kv_valid_len, cu_seqlens, block_mask, tile, dropout_p, ranks_agree)."""
        return AttentionProblem(**{"layout": self.layout, "placement": self.placement, **keywords})

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Optional[AttentionProblem] = None,
                 *, local_attention: Optional[LocalAttention] = None, **keywords) -> torch.Tensor:
        """q: [B, S_loc, H, D] / [S_loc, B, H, D]; k, v: Hkv heads. problem: the ``AttentionProblem`` (``problem()``
        builds one with this attention's layout and placement; build it once per step and pass it to every layer),
        or its settings as keywords (causal, softmax_scale, kv_valid_len, dropout_p, cu_seqlens, block_mask,
        block_size / tile: one problem per call). local_attention: a caller's local attention for Ulysses/HCMS (bhsd
        in and out). cu_seqlens: packed variable-length samples (every mode; auto stays on Ulysses/HCMS).
        block_mask: block-sparse attention in every mode (auto times its candidates with the mask, once per mask
        shape: ``mode_for``); not with cu_seqlens, dropout_p or local_attention. The problem is agreed across the
        ranks first (its first call: one all_gather every rank reaches), before any calibration or exchange."""
        what = f"{self.cfg.name('mode')}={self.cfg.mode}"
        if problem is None:
            keywords = {"layout": self.layout, "placement": self.placement, **keywords}
        problem, _ = problem_from_keywords(what, problem, keywords)
        if (problem.layout, problem.placement) != (self.layout, self.placement):
            raise SPConfigError(f"{what}: the AttentionProblem has layout={problem.layout!r}, placement="
                                f"{problem.placement!r}; this attention was made for layout={self.layout!r}, "
                                f"placement={self.placement!r} (build it with attention.problem(...))")
        dropout_p = problem.dropout_p
        try:   # every local refusal of this call, raised on every rank through the agreement below
            self._refuse(problem, local_attention)
            error = None
        except SPConfigError as e:
            error = e
        if self.world > 1:
            problem.agree(self.group, q, k, v, what=what, error=error)
        elif error is not None:
            raise error
        mode = self.mode
        if self.auto and self.world > 1 and dropout_p == 0.0 and local_attention is None and problem.cu_seqlens is None:
            picked = self.mode_for(q, k, problem)
            mode = picked if picked in RING_MODES else self.mode
        elif self.auto_asked:
            self._say_fixed_mode(
                "packed samples" if problem.cu_seqlens is not None
                else "attention dropout" if dropout_p > 0.0 or self.cfg.dropout_p > 0.0
                else "a caller's local attention" if local_attention is not None
                else f"{self.num_heads} heads over {self.world} ranks (resolved once, not per shape)")
        if self.world > 1 and needs_p2p(mode, self.world):
            check_p2p(f"{self.cfg.name('mode')}={mode!r}" + (" (auto)" if modes.get(self.cfg.mode).auto else ""),
                      self.group, q.device, f"{self.cfg.name('mode')} {modes.listing(modes.names(p2p=False, auto=False))}")
        family = modes.get(mode).family   # the one map from a mode to its algorithm
        if family == "ulysses" or self.world == 1:   # one rank: every mode is the one-rank path of Ulysses
            return self._ulysses(q, k, v, problem, local_attention)
        if family == "ring":
            return self._ring(q, k, v, mode, problem)
        if family == "torus":
            return torus_attention(q, k, v, self.mesh, problem, ring_variant=self.cfg.ring_variant,
                                   backend=self.backend)
        if family == "hybrid":
            return hybrid_attention(q, k, v, self.mesh, problem, head_chunks=self.cfg.head_chunks,
                                    ring_variant=self.cfg.ring_variant, backend=self.backend)
        raise SPConfigError(f"{self.cfg.name('mode')}={mode!r} is invalid")  # pragma: no cover - SPConfig checked

    def _refuse(self, problem: AttentionProblem, local_attention: Optional[LocalAttention]) -> None:
        """What this attention cannot run of ``problem`` (SPConfigError naming the setting)."""
        if problem.block_mask is not None and local_attention is not None:
            raise SPConfigError("block_mask runs megatron_sp_ext's block-sparse kernels, not a caller's local "
                                "attention: give one of them")
        if problem.cu_seqlens is not None and local_attention is not None:
            raise SPConfigError("packed variable-length samples (cu_seqlens) run megatron_sp_ext's kernels per "
                                "sample, not a caller's local attention")
        for arg, given, flag in (("cu_seqlens", problem.cu_seqlens is not None, "packed"),
                                 ("block_mask", problem.block_mask is not None, "block_mask")):
            if given and not getattr(self.spec, flag):   # what the mode registry declares the mode takes
                raise SPConfigError(f"{arg} is not supported by {self.cfg.name('mode')}={self.mode!r}: use "
                                    f"{modes.listing(modes.names(**{flag: True}))}")
        if problem.dropout_p > 0.0 and not self.spec.dropout:
            raise SPConfigError(f"dropout_p={problem.dropout_p} is not supported by {self.cfg.name('mode')}="
                                f"{self.mode!r} (log-sum-exp merged partial results): use dropout_p=0 or "
                                f"{' / '.join(DROPOUT_MODES)}")
        if local_attention is not None and not self.takes_local_attention:
            raise SPConfigError(f"{self.cfg.name('mode')}={self.mode!r} runs megatron_sp_ext's log-sum-exp kernels "
                                f"({self.cfg.name('backend')}), not a caller's local attention: use "
                                f"{modes.listing(modes.names(local_attention=True))}")


def packed_entry(cfg: SPConfig, group: dist.ProcessGroup, resources: SPResources,
                 backend: "str | LocalAttention | None" = None) -> Optional[PackedUlysses]:
    """The packed Ulysses / HCMS entry of ``cfg.mode`` (for models that write q|k|v into the exchange layout),
    or None where the mode is not plainly Ulysses/HCMS (ring and mesh modes, "auto", which may pick the ring)
    or attention dropout is set (the packed path runs the explicit kernels, which carry no dropout mask)."""
    spec = modes.get(cfg.mode)
    if spec.family != "ulysses" or cfg.dropout_p > 0.0:
        return None
    return PackedUlysses(group, spec.chunks(cfg.head_chunks),
                         backend=backend if backend is not None else cfg.backend, transport=cfg.transport,
                         policy=resources.policy)


def make_attention(cfg: SPConfig, group: Optional[dist.ProcessGroup], *, num_heads: int,
                   num_kv_heads: Optional[int] = None, layout: str = "bshd", placement: str = DEFAULT_PLACEMENT,
                   backend: "str | LocalAttention | None" = None, resources: Optional[SPResources] = None,
                   mesh: Optional[SPMesh] = None) -> SPAttention:
    """The attention of ``cfg.mode`` over ``group`` for ``num_heads`` query heads (``num_kv_heads`` key/value
    heads), on shards in ``layout`` ("bshd" [B, S_loc, H, D] or "sbhd") and sequence ``placement``
    ("contiguous", "zigzag", "tasp_zigzag"). backend: local kernel (default ``cfg.backend``); resources: what
    the model's attentions share (a fresh ``SPResources`` if None); mesh: a prebuilt mesh for usp/tas/torus.
    Raises SPConfigError naming the user's setting (``cfg.source``)."""
    return SPAttention(cfg, group, num_heads=num_heads, num_kv_heads=num_kv_heads, layout=layout,
                       placement=placement, backend=backend if backend is not None else cfg.backend,
                       resources=resources or SPResources(cfg), mesh=mesh)

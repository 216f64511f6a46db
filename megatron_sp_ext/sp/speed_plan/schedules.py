"""Each mode's schedule as a timeline (``timeline``), read from the objects the mode itself builds and runs:

  Ulysses / HCMS   ``sp.heads.head_layout``: each rank's heads per chunk, hence every all-to-all's bytes per peer and
                   every chunk's kernel; the chunks overlap as ``sp.ulysses.engine`` issues them (all input exchanges
                   first on the side stream, each chunk's output exchange as soon as its attention is done; the
                   backward mirrors it); one chunk runs on the caller's stream (no overlap).
  ring / TASP      ``sp.ring.ring.build_ring_plan``: each step's kernel calls (``RingPlan.items``), each step's K|V
                   transfers (``RingPlan.transfer``, TASP's from ``topology.hamiltonian`` routing tables), the
                   backward's dK|dV partials home (``sp.ring.rotation.home_ops``) and its last-step head chunks
                   (``rotation.head_chunks``); double buffering: a step's transfer runs beside its kernels.
  USP / TAS        ``topology.mesh.mesh_grid``: which ranks form each Ulysses row and ring column on the machines;
                   the Ulysses part as above over a row, each chunk's attention the ring over a column
                   (``sp.ring.hybrid.mesh_runs`` / ``sorted_rows``: the runs its plan is built on).
  Torus            ``sp.ring.torus.torus_schedule``: every stage's pair (a ring over the ring column) and what travels
                   meanwhile, forward and backward.
Bytes and calls come from those objects; the time of a call from the kernel-rate table (``rates``), of an exchange
from the cluster's links (``cluster``), of the copies around exchanges from the device's copy rate. The timeline
simulates one rank, the busiest: each exchange takes its slowest rank's time, each ring step the slowest rank's
calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ... import modes
from ...errors import SPConfigError
from .. import heads as sp_heads
from ..placement import balanced_placement, pieces
from ..ring import hybrid, ring, rotation, torus
from ...topology import mesh as mesh_mod
from ...topology.detect import Topology
from .cluster import Cluster
from .rates import Call, KernelRates
from .timeline import COMPUTE, Result, Timeline

MAX_TASP_RANKS = 64   # topology.hamiltonian's rainbow-path search: seconds up to 64 ranks, no end in sight at 128


def ulysses_mode(chunked: bool) -> str:
    """The registry's Ulysses-family mode with a fixed single chunk (``chunked`` False) or the chunk setting."""
    return next(n for n in modes.names(heads_per_rank=True, auto=False)
                if (modes.get(n).head_chunks is None) == chunked)


@dataclass(frozen=True)
class Problem:
    """One attention call: ``tokens`` (the full sequence), ``heads`` (query) and ``kv_heads`` (None: heads),
    ``head_dim``, ``causal``, ``density`` (share of tile pairs a block mask selects; 1.0 dense) at ``tile`` tokens per
    tile, ``batch``, ``dtype_bytes`` (2: bf16)."""

    tokens: int
    heads: int
    head_dim: int = 128
    causal: bool = False
    density: float = 1.0
    tile: int = 128
    batch: int = 1
    kv_heads: Optional[int] = None
    dtype_bytes: int = 2

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads


@dataclass(frozen=True)
class Setting:
    """A mode as it runs: ``mode`` (a registry name), ``chunks`` (HCMS head chunks; meshes' Ulysses part too),
    ``variant`` (the ring inside mesh and torus modes: ring or tasp), ``arrangement`` (usp / tas: the mesh of mesh and
    torus modes), ``ulysses_size`` (their P_u; 0: gcd(P, H))."""

    mode: str
    chunks: int = 1
    variant: str = ""
    arrangement: str = ""
    ulysses_size: int = 0

    def label(self) -> str:
        spec = modes.get(self.mode)
        out = self.mode
        if self.chunks > 1:
            out += f" C={self.chunks}"
        if spec.mesh:
            if not spec.arrangement:
                out += f" on {self.arrangement}"
            if self.ulysses_size:
                out += f" Pu={self.ulysses_size}"
            if self.variant and modes.get(self.variant).multi_ring:
                out += f" ({self.variant})"
        return out


class Builder:
    """Adds a mode's tasks to a timeline for one problem on one cluster (see module docstring)."""

    def __init__(self, problem: Problem, cluster: Cluster, rates: KernelRates) -> None:
        self.pb, self.cl, self.rates = problem, cluster, rates
        self.row = problem.batch * problem.head_dim * problem.dtype_bytes   # bytes of one token of one head

    # ---- parts
    def kernel(self, tl: Timeline, deps, call: Call, backward: bool) -> int:
        fwd, bwd = self.rates.call_ms(self.cl.device, self.cl.kernel, call, self.pb.head_dim)
        return tl.add(COMPUTE, bwd * self.cl.kernel_scale[1] if backward else fwd * self.cl.kernel_scale[0], deps)

    def copy(self, tl: Timeline, nbytes: float, deps=(), stream: str = COMPUTE) -> int:
        """A copy of ``nbytes`` (read and written: the copy rate counts both)."""
        return self.memory(tl, 2 * nbytes, deps, stream)

    def memory(self, tl: Timeline, moved: float, deps=(), stream: str = COMPUTE) -> int:
        """An elementwise pass that moves ``moved`` bytes through memory (at the copy rate)."""
        return tl.add(stream, moved / (self.cl.copy_tbps * 1e9), deps, kind="copy", hidden=0.0)

    def exchange(self, tl: Timeline, stream: str, sent: dict, deps=(), received: Optional[dict] = None) -> int:
        ms, hidden = self.cl.exchange_ms(sent, received)
        return tl.add(stream, ms, deps, kind="exchange", hidden=hidden)

    def call(self, sq: int, sk: int, heads: int, causal: bool = False) -> Call:
        return Call(sq, sk, heads, causal, self.pb.density, self.pb.tile, self.pb.batch)

    # ---- Ulysses / HCMS over ``ranks`` (cluster ranks, Ulysses index = position)
    def ulysses(self, tl: Timeline, ranks: tuple, chunks: int, backward: bool, s_loc: int,
                attend: Callable) -> None:
        """The Ulysses exchanges of one call over ``ranks`` (``s_loc`` tokens per rank), each chunk's attention
        added by ``attend(tl, deps, q_heads, kv_heads, backward) -> last compute task``."""
        pb, n = self.pb, len(ranks)
        hl = sp_heads.head_layout(pb.heads, pb.hkv, n, chunks)
        side = "ulysses" if hl.chunks > 1 else COMPUTE   # one chunk: the caller's stream (engine / function)
        busy = max(range(n), key=lambda i: hl.q_counts[i])
        gathered = s_loc * n * self.row

        def width(kind, p, c):
            q, kv = hl.q_chunks[p][c][1], hl.kv_chunks[p][c][1]
            return {"qkv": q + 2 * kv, "q": q, "kv": kv}[kind]

        def a2a(kind: str, c: int, to_heads: bool) -> dict:
            """seq -> head (``to_heads``: the receiver's heads travel) or head -> seq (the sender's)."""
            return {ranks[i]: {ranks[p]: s_loc * self.row * width(kind, p if to_heads else i, c)
                               for p in range(n) if p != i} for i in range(n)}

        own = [(hl.q_chunks[busy][c][1], hl.kv_chunks[busy][c][1]) for c in range(hl.chunks)]
        if not backward:
            packs = [self.copy(tl, gathered * (q + 2 * kv), stream=side) for q, kv in own]
            ins = [self.exchange(tl, side, a2a("qkv", c, True), [packs[c]]) for c in range(hl.chunks)]
            for c, (q, kv) in enumerate(own):
                tk = self.copy(tl, gathered * (q + 2 * kv), [ins[c]])   # received q|k|v -> the kernel's layout
                done = attend(tl, [tk], q, kv, False)
                out = self.exchange(tl, side, a2a("q", c, False), [done])
                self.copy(tl, gathered * q, [out], stream=side)          # outputs -> the local layout
        else:
            packs = [self.copy(tl, gathered * q, stream=side) for q, _ in own]
            ins = [self.exchange(tl, side, a2a("q", c, True), [packs[c]]) for c in range(hl.chunks)]
            for c, (q, kv) in enumerate(own):
                done = attend(tl, [ins[c]], q, kv, True)
                for kind, w in (("q", q), ("kv", kv), ("kv", kv)):     # dq, dk, dv: one exchange each
                    x = self.exchange(tl, side, a2a(kind, c, False), [done])
                    self.copy(tl, gathered * w, [x], stream=side)
        tl.add(COMPUTE, 0.0, [tl.last(side)])   # the caller's stream waits for the side stream

    def flat_attend(self, tokens: int) -> Callable:
        def attend(tl, deps, q_heads, kv_heads, backward):
            return self.kernel(tl, deps, self.call(tokens, tokens, q_heads, self.pb.causal), backward)
        return attend

    # ---- ring / TASP over ``ranks`` (cluster ranks, ring index = position)
    def ring_plans(self, ranks: tuple, variant: str, q_runs_of, kv_runs, s_loc: int, balanced: bool) -> list:
        n = len(ranks)
        if modes.get(variant).multi_ring and n > MAX_TASP_RANKS:
            raise SPConfigError(f"{variant} over {n} ranks: its routing tables (topology/hamiltonian.py) are not "
                                f"built beyond {MAX_TASP_RANKS} ranks in reasonable time")
        which = range(n) if (self.pb.causal or n == 1) else (0,)   # non-causal: every rank's steps are one full call
        return [ring.build_ring_plan(None, j, n, ring.RingSpec.of(
                    variant=variant, s_loc=s_loc, q_runs=q_runs_of[j], kv_runs=kv_runs, causal=self.pb.causal,
                    scale=1.0, backend=None, balanced_slots=balanced), None)
                for j in which]

    def ring_attend(self, tl: Timeline, deps, ranks: tuple, plans: list, heads: int, kv_heads: int,
                    backward: bool, stream: str = "ring") -> int:
        """One ring (or TASP) call over ``ranks`` with ``heads`` / ``kv_heads``, as ``ring.forward_compute_order``
        / ``rotation.backward_steps`` run it; returns the last compute task."""
        pb, n, plan = self.pb, len(ranks), plans[0]
        kv_row = 2 * kv_heads * self.row       # one K|V buffer row
        q_tokens = sum(ln for _, ln in plan.q_runs)
        acc = q_tokens * heads * pb.batch * pb.head_dim   # elements of the fp32 accumulators
        kv_tokens = plan.slot_off[-1] + plan.slot_len[-1]

        def step_calls(step: int) -> list:
            worst = []
            for p in plans:
                calls = [self.call(_rows(it.q_rows, q_tokens), _rows(it.kv_rows, kv_tokens), heads, it.causal)
                         for it in p.items(step, "cpu")]
                t = sum(self.rates.call_ms(self.cl.device, self.cl.kernel, c, pb.head_dim)[backward] for c in calls)
                t *= self.cl.kernel_scale[backward]
                worst.append((t, calls))
            return max(worst, key=lambda w: w[0])[1]

        def sent(ops_of, step: int) -> dict:
            out: dict = {}
            for j in range(n):
                for kind, peer, _, rows in ops_of(step, j):
                    if kind == "send":
                        row = out.setdefault(ranks[j], {})
                        row[ranks[peer]] = row.get(ranks[peer], 0) + rows * kv_row
            return out
        hop_key = (lambda s: s) if plan.mode == "ab" else (lambda s: 0)   # "plain": every step's layout is the same
        hops: dict = {}

        def kv_hop(step, deps_):
            key = hop_key(step)
            if key not in hops:
                hops[key] = self.cl.exchange_ms(sent(lambda s, r: plan.transfer(s, r), step))
            return tl.add(stream, hops[key][0], deps_, kind="exchange", hidden=hops[key][1])
        kv_elems = kv_tokens * kv_row / pb.dtype_bytes
        self.copy(tl, kv_tokens * kv_row, deps)      # this rank's k, v into the step-0 buffer
        hop = None
        if not backward:
            for step in range(n):
                nxt = kv_hop(step, [tl.last(COMPUTE), hop]) if step < n - 1 else None
                for i, c in enumerate(step_calls(step)):
                    self.kernel(tl, [hop], c, False)
                    if step or i:
                        self.memory(tl, acc * 12)   # log-sum-exp merge into the fp32 accumulator
                hop = nxt
            return self.memory(tl, acc * 6)         # acc -> the output dtype
        pending, chunk_count = [], 1
        for step in range(n):
            last = step == n - 1
            nxt = kv_hop(step, [tl.last(COMPUTE), hop]) if not last else None
            calls = step_calls(step)
            if last:
                chunk_count = len(rotation.head_chunks(rotation.DkvSchedule(), kv_heads, int(kv_tokens * kv_row)))
            done = len(pending)
            parts = chunk_count if last and step else 1
            for _ in range(parts):
                for c in calls:
                    self.kernel(tl, [hop], Call(c.sq, c.sk, max(1, c.heads // parts), c.causal, c.density, c.tile,
                                                c.batch), True)
                    self.memory(tl, acc * 10 / parts)       # dq += the call's dq (fp32)
                if step:
                    home = sent(lambda s, r: rotation.home_ops(plan, s, r), step)
                    home = {r: {p: v / parts for p, v in row.items()} for r, row in home.items()}
                    pending.append(self.exchange(tl, stream, home, [tl.last(COMPUTE)]))
                else:
                    self.memory(tl, kv_elems * 10)          # this rank's dK|dV into its fp32 accumulator
            for h in pending[:done]:                         # earlier steps' partials, added after this step
                self.memory(tl, kv_elems * 10, [h])
            del pending[:done]
            hop = nxt
        for h in pending:
            self.memory(tl, kv_elems * 10, [h])
        return self.memory(tl, (acc + kv_elems) * 6)        # dq, dk, dv -> their dtype


def _rows(rows, full: int) -> int:
    """Rows a call reads: a slice (None ends: all ``full``) or an index tensor."""
    if isinstance(rows, slice):
        return (full if rows.stop is None else rows.stop) - (rows.start or 0)
    return int(rows.numel())


def grid_mesh(cluster: Cluster, num_heads: int, arrangement: str, ulysses_size: int) -> tuple:
    """(arrangement, P_u, P_r, grid) of the mesh a mesh mode builds over the whole cluster."""
    n = cluster.gpus
    topo = Topology(cluster.machines, cluster.per_machine, tuple(r // cluster.per_machine for r in range(n)))
    return mesh_mod.mesh_grid(topo, num_heads, arrangement or "auto", ulysses_size or None)


def _placement(variant: str, causal: bool) -> str:
    return balanced_placement(variant, causal)


def simulate(problem: Problem, cluster: Cluster, setting: Setting, rates: KernelRates, backward: bool) -> Result:
    """The forward (``backward`` False) or backward of ``setting`` as one simulated timeline."""
    b = Builder(problem, cluster, rates)
    tl = Timeline()
    spec = modes.get(setting.mode)
    family = {"ulysses": _ulysses_mode, "ring": _ring_mode, "hybrid": _mesh_mode, "torus": _torus_mode}.get(spec.family)
    if family is None:
        raise SPConfigError(f"mode {setting.mode!r} has no schedule to time (resolve 'auto' first: speed_plan.rank_modes)")
    family(b, tl, setting, backward)
    return tl.run()


def _ulysses_mode(b: Builder, tl: Timeline, st: Setting, backward: bool) -> None:
    n, pb = b.cl.gpus, b.pb
    chunks = modes.get(st.mode).chunks(st.chunks)
    b.ulysses(tl, tuple(range(n)), chunks, backward, pb.tokens // n, b.flat_attend(pb.tokens))


def _ring_mode(b: Builder, tl: Timeline, st: Setting, backward: bool) -> None:
    n, pb = b.cl.gpus, b.pb
    placement = _placement(st.mode, pb.causal)
    runs = tuple(pieces(placement, r, n, pb.tokens) for r in range(n))
    plans = b.ring_plans(tuple(range(n)), st.mode, runs, runs, pb.tokens // n, placement == "tasp_zigzag")
    b.ring_attend(tl, [], tuple(range(n)), plans, pb.heads, pb.hkv, backward)


def _mesh(b: Builder, st: Setting) -> tuple:
    arrangement = st.arrangement or (st.mode if modes.get(st.mode).arrangement else "")
    arr, p_u, p_r, grid = grid_mesh(b.cl, b.pb.heads, arrangement, st.ulysses_size)
    topo = Topology(b.cl.machines, b.cl.per_machine, tuple(r // b.cl.per_machine for r in range(b.cl.gpus)))
    return mesh_mod.SPMesh(None, grid[0][0], b.cl.gpus, arr, p_u, p_r, topo, grid, 0, 0, None, None)


def _mesh_mode(b: Builder, tl: Timeline, st: Setting, backward: bool) -> None:
    pb, mesh = b.pb, _mesh(b, st)
    variant = st.variant or modes.names(ring_variant=True)[0]
    placement = _placement(modes.names(ring_variant=True, multi_ring=False)[0], pb.causal)
    runs = hybrid.mesh_runs(mesh, placement, pb.tokens)
    if mesh.ulysses_size > 1 and pb.causal:   # the Ulysses exchange sorts each row's pieces (hybrid_attention)
        runs = tuple(merged for _, merged in hybrid.sorted_rows(mesh.grid, mesh.world, placement, pb.tokens))
    column = tuple(row[0] for row in mesh.grid)
    plans = b.ring_plans(column, variant, runs, runs, pb.tokens // mesh.ring_size, False)

    def attend(tl_, deps, q_heads, kv_heads, backward_):
        return b.ring_attend(tl_, deps, column, plans, q_heads, kv_heads, backward_)
    if mesh.ulysses_size == 1:
        attend(tl, [], pb.heads, pb.hkv, backward)
        return
    b.ulysses(tl, mesh.grid[0], st.chunks, backward, pb.tokens // mesh.world, attend)


def _torus_mode(b: Builder, tl: Timeline, st: Setting, backward: bool) -> None:
    pb, mesh = b.pb, _mesh(b, st)
    variant = st.variant or modes.names(ring_variant=True)[0]
    placement = _placement(modes.names(ring_variant=True, multi_ring=False)[0], pb.causal)
    T, s_loc = mesh.ulysses_size, pb.tokens // mesh.world
    hl = sp_heads.head_layout(pb.heads, pb.hkv, T, 1)
    column = tuple(row[0] for row in mesh.grid)
    cache: dict = {}

    def pair(q_ls: tuple, kv_ls: tuple) -> list:
        if (q_ls, kv_ls) not in cache:
            of = lambda ls: tuple(tuple(r for l in ls for r in hybrid.rank_runs(placement, mesh.grid[j][l], mesh.world,  # noqa: E731
                                                                            pb.tokens)) for j in range(mesh.ring_size))
            cache[q_ls, kv_ls] = b.ring_plans(column, variant, of(q_ls), of(kv_ls), len(kv_ls) * s_loc, False)
        return cache[q_ls, kv_ls]

    def width(kind: str, sender: int, receiver: int) -> int:
        """Heads of one transfer: the receiver's head group for what goes to heads (q, kv, do), else the sender's."""
        owner = receiver if kind in ("q", "kv", "do") else sender
        return 2 * hl.kv_counts[owner] if kind in ("kv", "dkv") else hl.q_counts[owner]

    def moves(index: int, fwd: bool) -> dict:
        sent: dict = {}
        for t in range(T):
            stage = (torus.torus_schedule(T, t).forward if fwd else torus.torus_schedule(T, t).backward)[index]
            for dst in stage.dst:
                for j in range(mesh.ring_size):
                    sent.setdefault(mesh.grid[j][t], {})[mesh.grid[j][dst]] = \
                        s_loc * b.row * width(stage.moves, t, dst)
        return sent
    stages = torus.torus_schedule(T, 0)
    pending, wait, q_heads, kv_heads = [], None, hl.q_counts[0], hl.kv_counts[0]
    for i, stage in enumerate(stages.backward if backward else stages.forward):
        x = None
        if stage.moves and not stage.after:
            x = b.exchange(tl, "ulysses", moves(i, not backward), [tl.last(COMPUTE), wait])
        if stage.q_owners:
            b.ring_attend(tl, [wait], column, pair(stage.q_owners, stage.kv_owners), q_heads, kv_heads, backward)
        if stage.moves and stage.after:
            pending.append(b.exchange(tl, "ulysses", moves(i, not backward), [tl.last(COMPUTE)]))
        wait = x
    tl.add(COMPUTE, 0.0, [wait] + pending)
    b.copy(tl, s_loc * b.row * pb.heads * (1 if not backward else 3))   # outputs / gradients into the local layout


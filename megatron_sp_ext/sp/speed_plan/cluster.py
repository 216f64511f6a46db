"""The cluster a speed plan runs on: machines x GPUs, the two classes of link each GPU sees, and what one exchange
costs on them.

``Link``: one class of link as one GPU sees it: ``gbps`` GB/s leaving (and entering) the GPU over that class, all
its peers together (an NVSwitch port, a NIC per GPU); ``latency_ms`` per exchange; ``hidden``: the share of an
exchange's time that a kernel running beside it hides (the rest adds to the step: NCCL's kernels wait for SMs beside
attention on NVLink; on slow links the link, not the SMs, is the limit).

``Probe``: a measured exchange of one peer pattern (``intra`` peers in the rank's machine, ``inter`` across), as
``tools/gpu_ranks.probe_links`` records it in every benchmark JSON (``meta.links_probe``; ``Cluster.from_probe``).

An exchange's time (``Cluster.exchange_ms``): per rank, where a probe of that rank's peer pattern exists, the
probe's time at the largest per-peer byte count (linear between its rows, beyond its largest row at that row's rate,
below its smallest row that row's time; beyond its largest row along its last segment, or where that segment
was latency-bound at the largest row's average rate: ``UNRESOLVED``); else per class, latency + max(sent, received) / bandwidth, both classes at
once (different hardware), the slower. The exchange takes its slowest rank's time; its ``hidden`` share is that of
the class that bounds it.

Every preset number (``PRESETS``) names its source; nothing is fitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from ...errors import SPConfigError


@dataclass(frozen=True)
class Link:
    """One class of link as one GPU sees it (module docstring)."""

    gbps: float
    latency_ms: float = 0.0
    hidden: float = 1.0
    name: str = ""

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / (self.gbps * 1e6) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Probe:
    """A measured exchange: ``intra`` / ``inter`` peers per rank; ``rows`` ((bytes per peer, ms), ...) sorted."""

    intra: int
    inter: int
    rows: tuple
    source: str = ""

    def ms(self, per_peer: float) -> float:
        """The probe's time at ``per_peer`` bytes (module docstring)."""
        rows = self.rows
        if per_peer <= rows[0][0]:
            return rows[0][1]
        for (b0, t0), (b1, t1) in zip(rows, rows[1:]):
            if per_peer <= b1:
                return t0 + (per_peer - b0) / (b1 - b0) * (t1 - t0)
        (b0, t0), (b1, t1) = rows[-2] if len(rows) > 1 else (0.0, 0.0), rows[-1]
        average = b1 / t1
        marginal = (b1 - b0) / (t1 - t0) if t1 > t0 else float("inf")
        rate = marginal if marginal <= UNRESOLVED * average else average
        return t1 + (per_peer - b1) / rate


# beyond a probe's largest row its last segment goes on (latency paid once), unless that segment is this many times
# faster than the largest row's average rate: then both rows were latency-bound (the probe did not resolve the
# bandwidth) and the largest row's average rate is used, latency included
UNRESOLVED = 3.0
# Measured link classes (what each number is and where it was measured).
PRESETS = {
    # NCCL all-to-all between two H200s over NVLink (NV18), 32 MB per rank: 139.9 GB/s per GPU (the intra-machine probe
    # of results/2026-11-28_h200x4_2010/call5/i68_emu22/emu22.json). hidden 0.44: an NCCL exchange beside flash
    # attention hides 35% / 53% of itself (P=4, 16K / 32K; results/README.md, 2026-11-22 "Exchange beside attention")
    "nvlink": Link(139.9, 0.0, 0.44, "NVLink (NCCL, 32 MB probe)"),
    # NCCL over NVLink at attention-sized messages: ~240 GB/s received per GPU (4 x H200, q|k|v of 32K, H 40;
    # results/README.md 2026-11-22 "copy_engine ... vs NCCL's ~240 GB/s"): the NVSwitch machines of --table
    "nvlink_large": Link(240.0, 0.0, 0.44, "NVLink (NCCL, attention-sized messages)"),
    # NCCL_P2P_DISABLE=1 (exchanges through host memory): ~25-30 GB/s per GPU measured on 4 x H200 (docs/links.md,
    # results/README.md 2026-11-22/23); hidden 1.0: there the exchange hides ~100% beside attention (same sources)
    "host": Link(27.5, 0.0, 1.0, "host memory (NCCL_P2P_DISABLE=1)"),
    # the emulation's host-staged transport between machines (copy engines through pinned host memory): 10.4 GB/s per
    # GPU, one peer, 32 MB (emu22.json's inter-machine probe); hidden 0.54: copy-engine pulls beside flash attention
    # hide 43% / 65% of themselves (results/README.md 2026-11-22, copy_engine)
    "host_staged": Link(10.4, 0.0, 0.54, "host-staged (emulated machines)"),
}
# a NIC per GPU (--table): line rate x NIC_EFFICIENCY (an ASSUMPTION: NCCL's all-to-all over InfiniBand / RoCE
# reaches ~80% of line rate; not measured here), NIC_LATENCY_MS per exchange (an ASSUMPTION), hidden 1.0 as the
# other slow link measured (host memory)
NIC_EFFICIENCY = 0.8
NIC_LATENCY_MS = 0.02
# the Ulysses layouts' copies, TB/s counted read + write (1 x H200, tools/bench_word_copies.py, results/2026-11-29_h200
# README): value copies 1.6 (the code before 2026-11-29), 8-byte word copies 3.1 (layout.copy_bits, since)
COPY_TBPS = {"values": 1.6, "words": 3.1}


def nic(gbit: float) -> Link:
    """A NIC per GPU of ``gbit`` Gb/s line rate (``NIC_EFFICIENCY``, ``NIC_LATENCY_MS``)."""
    return Link(gbit / 8 * NIC_EFFICIENCY, NIC_LATENCY_MS, 1.0, f"{gbit:g} Gb/s NIC per GPU")


@dataclass(frozen=True)
class Cluster:
    """``machines`` x ``per_machine`` GPUs (group rank r on machine r // per_machine); ``intra`` / ``inter``
    links; ``device`` / ``kernel``: the kernel-rate table's rows; ``copy_tbps``: the layouts' copies; ``probes``:
    measured exchanges by peer pattern (they win over the class model where a pattern matches)."""

    machines: int
    per_machine: int
    intra: Link
    inter: Link
    device: str = "H200"
    kernel: str = "fa4"
    copy_tbps: float = COPY_TBPS["words"]
    probes: tuple = ()
    name: str = ""
    kernel_scale: tuple = (1.0, 1.0)   # this machine's (forward, backward) kernel time over the table's
    _by_pattern: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.machines < 1 or self.per_machine < 1:
            raise SPConfigError(f"cluster {self.machines} x {self.per_machine}: machines and GPUs per machine must be "
                                f">= 1")
        for p in self.probes:
            self._by_pattern[(p.intra, p.inter)] = p

    @property
    def gpus(self) -> int:
        return self.machines * self.per_machine

    def same_machine(self, a: int, b: int) -> bool:
        return a // self.per_machine == b // self.per_machine

    def with_(self, **kw) -> "Cluster":
        return replace(self, **kw)

    def rank_ms(self, rank: int, sent: Mapping[int, float], received: Mapping[int, float]) -> tuple:
        """(ms, hidden) of one rank's part of an exchange: bytes to / from each peer (group ranks)."""
        key = tuple(sorted((self.same_machine(rank, p), sent.get(p, 0), received.get(p, 0))
                           for p in set(sent) | set(received)))
        if key not in self._by_pattern:
            self._by_pattern[key] = self._pattern_ms(key)
        return self._by_pattern[key]

    def _pattern_ms(self, peers: tuple) -> tuple:
        """(ms, hidden) of a rank whose peers are ``peers``: (same machine, bytes sent, bytes received) each."""
        if not peers:
            return 0.0, 1.0
        n_intra = sum(1 for same, _, _ in peers if same)
        probe = self._by_pattern.get((n_intra, len(peers) - n_intra))
        if probe is not None:
            worst = max(max(s, r) for _, s, r in peers)
            return probe.ms(worst), (self.inter if n_intra < len(peers) else self.intra).hidden
        out = []
        for link, same in ((self.intra, True), (self.inter, False)):
            members = [(s, r) for m, s, r in peers if m == same]
            if members:
                out.append((link.ms(max(sum(s for s, _ in members), sum(r for _, r in members))), link.hidden))
        return max(out)

    def exchange_ms(self, sent: Mapping[int, Mapping[int, float]],
                    received: Optional[Mapping[int, Mapping[int, float]]] = None) -> tuple:
        """(ms, hidden) of an exchange: ``sent[r][p]`` bytes rank r sends to p (``received`` default: the
        transpose); the slowest rank's."""
        if received is None:
            received = {}
            for r, row in sent.items():
                for p, n in row.items():
                    received.setdefault(p, {})[r] = n
        ranks = set(sent) | set(received)
        return max((self.rank_ms(r, sent.get(r, {}), received.get(r, {})) for r in ranks), default=(0.0, 1.0))

    @classmethod
    def from_probe(cls, probe: dict, regime: str, world: int, **kw) -> "Cluster":
        """The cluster of a benchmark row from its links probe (``meta.links_probe[str(world)]`` of a result JSON) and
        regime ("nvlink", "host", "emu<M>"): one machine over NVLink; host links as ``world`` machines of one GPU
        (every peer through host memory); emulated machines of M. The probe's rows become ``Probe`` patterns; the
        class links keep the presets' hidden shares, their bandwidth from the probe's pair rows where it has them."""
        per = _per_machine(regime, world)
        probes, intra, inter = [], PRESETS["nvlink"], PRESETS["host" if regime == "host" else "host_staged"]
        rows = probe.get("world_rows") or []
        if rows:
            n_intra = per - 1
            probes.append(Probe(n_intra, world - 1 - n_intra, _rows(rows, world), "world"))
        for key, base in (("intra_machine", "intra"), ("inter_machine", "inter")):
            part = probe.get(key)
            if not part or not part.get("rows"):
                continue
            ranks = int(part.get("ranks", 2))
            pattern = (ranks - 1, 0) if base == "intra" else (0, ranks - 1)
            probes.append(Probe(*pattern, _rows(part["rows"], ranks), key))
            gbps = max(r["GBps_per_gpu"] for r in part["rows"])
            if base == "intra":
                intra = replace(intra, gbps=gbps, name=f"{intra.name}, probe")
            else:
                inter = replace(inter, gbps=gbps, name=f"{inter.name}, probe")
        return cls(world // per, per, intra, inter, probes=tuple(probes), **kw)


def _per_machine(regime: str, world: int) -> int:
    if regime == "nvlink":
        return world
    if regime == "host":
        return 1
    if regime.startswith("emu") and regime[3:].isdigit():
        return int(regime[3:])
    raise SPConfigError(f"links regime {regime!r} is invalid: nvlink, host or emu<M>")


def _rows(rows: list, ranks: int) -> tuple:
    """Probe rows (bytes per rank's buffer, ms) as (bytes per peer, ms), sorted."""
    return tuple(sorted((r["bytes"] / ranks, r["ms"]) for r in rows))

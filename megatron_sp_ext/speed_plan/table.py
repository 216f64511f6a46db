"""``--table``: the best mode for Wan-class problems on clusters of 8-GPU machines, beside USP, flat Ulysses and the
ring, written into docs/choosing_a_mode.md (between its ``speed-plan table`` markers) with a plot, and the TAS vs
USP inter-machine volume at 4 x 8 counted from the schedules (``volume_rows``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .. import modes
from ..errors import SPConfigError
from ..topology.volume import tas_volume, usp_volume
from ..sp.speed_plan.cluster import COPY_TBPS, NIC_EFFICIENCY, PRESETS, Cluster, nic
from ..sp.speed_plan.plan import Prediction, predict, predict_all
from ..sp.speed_plan.rates import KernelRates, package_rates
from ..sp.speed_plan.schedules import Problem, Setting, grid_mesh, ulysses_mode

MODELS = (("wan-14b", 40), ("wan-1.3b", 12))
TOKENS = (75_600, 300_000, 1_000_000)
DENSITIES = (1.0, 0.1)
MACHINES = (1, 2, 4, 8, 16, 32)
PER_MACHINE = 8
DEVICES = ("H200", "H100")
NICS = (400, 200)
BEGIN, END = "<!-- speed-plan table: begin (python -m megatron_sp_ext.speed_plan --table) -->", \
    "<!-- speed-plan table: end -->"


@dataclass(frozen=True)
class Cell:
    model: str
    heads: int
    tokens: int
    density: float
    machines: int
    device: str
    nic_gbit: int
    best: Prediction
    usp: Optional[Prediction]
    ulysses: Optional[Prediction]
    ring: Optional[Prediction]
    refused: tuple


def cluster_of(machines: int, device: str, nic_gbit: int) -> Cluster:
    """``machines`` x 8 GPUs: NVLink inside (``PRESETS["nvlink_large"]``), a NIC per GPU across."""
    return Cluster(machines, PER_MACHINE, PRESETS["nvlink_large"], nic(nic_gbit), device=device,
                   copy_tbps=COPY_TBPS["words"], name=f"{machines}x{PER_MACHINE} {device} {nic_gbit} Gb/s")


def _named(preds: list, setting: Setting) -> Optional[Prediction]:
    return next((p for p in preds if p.setting == setting), None)


def cell(model: str, heads: int, tokens: int, density: float, cluster: Cluster, rates: KernelRates,
         nic_gbit: int = 0) -> Cell:
    pb = Problem(tokens, heads, density=density, tile=128)
    preds, refused = predict_all(pb, cluster, rates=rates)
    best = min(preds, key=lambda p: p.fwd_bwd_ms)
    usp_name = modes.names(arrangement=True, ulysses_across=False)[0]
    ring_name = modes.names(ring_variant=True, multi_ring=False)[0]
    usp = None
    if cluster.gpus > 1:
        try:
            _, p_u, _, _ = grid_mesh(cluster, heads, usp_name, 0)
            usp = _named(preds, Setting(usp_name, 1, ring_name, "", p_u)) or predict(
                pb, cluster, Setting(usp_name, 1, ring_name, "", p_u), rates)
        except SPConfigError:   # no usp mesh for these heads and GPUs: the column says so
            usp = None
    return Cell(model, heads, tokens, density, cluster.machines, cluster.device, nic_gbit, best, usp,
                _named(preds, Setting(ulysses_mode(False))), _named(preds, Setting(ring_name)), tuple(refused))


def cells(rates: Optional[KernelRates] = None, devices=DEVICES, nics=NICS, machines=MACHINES) -> list:
    rates = rates or package_rates()
    out = []
    for device in devices:
        for gbit in nics:
            for n in machines:
                if n == 1 and gbit != nics[0]:
                    continue   # one machine: no NIC
                cl = cluster_of(n, device, gbit)
                for model, heads in MODELS:
                    for tokens in TOKENS:
                        for density in DENSITIES:
                            out.append(cell(model, heads, tokens, density, cl, rates, gbit))
    return out


def _ratio(c: Cell, ref: Optional[Prediction]) -> str:
    return "-" if ref is None else f"{ref.fwd_bwd_ms / c.best.fwd_bwd_ms:.2f}x"


def _ms(ms: float) -> str:
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def markdown(rows: list, device: str = "H200", gbit: int = 400) -> str:
    """The docs table: one line per (model, tokens, density, machines) on ``device`` with ``gbit`` NICs."""
    out = ["| model | tokens | mask | GPUs | best mode (fwd+bwd ms) | its exchange: time / hidden | vs USP | vs "
           "flat Ulysses | vs ring |", "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        if c.device != device or (c.machines > 1 and c.nic_gbit != gbit):
            continue
        b = c.best.both
        out.append(f"| {c.model} | {c.tokens:,} | {'dense' if c.density >= 1 else f'{1 - c.density:.0%} sparse'} | "
                   f"{c.machines}x{PER_MACHINE} | {c.best.setting.label()} ({_ms(c.best.fwd_bwd_ms)}) | "
                   f"{_ms(b.exchange_ms)} / {_ms(b.hidden_ms)} | {_ratio(c, c.usp)} | {_ratio(c, c.ulysses)} | "
                   f"{_ratio(c, c.ring)} |")
    return "\n".join(out)


def volume_rows(tokens: int = 131_072, heads: int = 40, head_dim: int = 128, machines: int = 4,
                per: int = PER_MACHINE) -> list:
    """(arrangement, P_u, MiB per GPU between machines per forward counted from the schedules, the same from
    topology/volume.py's equations) for USP and TAS at ``machines`` x ``per``: the Ulysses all-to-all of q, k, v, o
    over each grid row (``mesh_grid``) and the ring's K|V hops over each column (``RingPlan.transfer``), bytes whose
    two ends sit on different machines, averaged over the GPUs."""
    from ..sp.speed_plan.schedules import Builder   # noqa: PLC0415 - the schedule reader, for its byte counts
    cl = Cluster(machines, per, PRESETS["nvlink_large"], nic(400))
    pb = Problem(tokens, heads, head_dim)
    out = []
    b = Builder(pb, cl, package_rates())
    for name in modes.names(arrangement=True):
        for p_u in (u for u in range(2, cl.gpus) if cl.gpus % u == 0 and heads % u == 0 and u >= machines):
            arr, p_u, p_r, grid = grid_mesh(cl, heads, name, p_u)
            cross = _cross_bytes(b, cl, grid, p_u, p_r)
            n, m = machines, per
            eq = (usp_volume if not modes.get(arr).ulysses_across else tas_volume)(n, m, p_u, p_r, 1, tokens, heads,
                                                                                   head_dim)
            out.append((arr, p_u, cross / 2 ** 20, eq * pb.dtype_bytes / 2 ** 20))
    return out


def _cross_bytes(b, cl: Cluster, grid: tuple, p_u: int, p_r: int) -> float:
    """Bytes per GPU crossing machines in one forward of a p_u x p_r mesh (read from the schedules)."""
    from ..sp.heads import head_layout   # noqa: PLC0415
    from ..sp.ring.hybrid import mesh_runs   # noqa: PLC0415
    from ..sp.ring.ring import RingSpec, build_ring_plan   # noqa: PLC0415
    from ..topology.detect import Topology   # noqa: PLC0415
    from ..topology.mesh import SPMesh   # noqa: PLC0415
    pb, total = b.pb, 0.0
    s_loc = pb.tokens // cl.gpus
    hl = head_layout(pb.heads, pb.hkv, p_u, 1)
    for row in grid:   # Ulysses: q, k, v in (receiver's heads), o out (sender's heads)
        for i, a in enumerate(row):
            for p, c in enumerate(row):
                if i != p and not cl.same_machine(a, c):
                    total += s_loc * b.row * (3 * hl.q_counts[p] + hl.q_counts[i])
    topo = Topology(cl.machines, cl.per_machine, tuple(r // cl.per_machine for r in range(cl.gpus)))
    mesh = SPMesh(None, 0, cl.gpus, "", p_u, p_r, topo, grid, 0, 0, None, None)
    runs = mesh_runs(mesh, "contiguous", pb.tokens)
    kv_row = 2 * (pb.heads // p_u) * b.row
    for u in range(p_u):   # the ring's K|V hops, P_r - 1 steps
        column = tuple(r[u] for r in grid)
        plan = build_ring_plan(None, 0, p_r, RingSpec.of(variant=modes.names(ring_variant=True)[0],
                                                         s_loc=pb.tokens // p_r, q_runs=runs[0], kv_runs=runs,
                                                         causal=False, scale=1.0, backend=None), None)
        for step in range(p_r - 1):
            for j in range(p_r):
                for kind, peer, _, rows in plan.transfer(step, j):
                    if kind == "send" and not cl.same_machine(column[j], column[peer]):
                        total += rows * kv_row
    return total / cl.gpus


def plot(rows: list, path: str, device: str = "H200", gbit: int = 400) -> str:
    """The best mode's fwd+bwd time relative to USP (and to the ring) by cluster size, one line per model and
    sequence, dense and 90% sparse side by side (matplotlib, PNG at ``path``)."""
    import matplotlib   # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # noqa: PLC0415
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, density in zip(axes, DENSITIES):
        for model, _ in MODELS:
            for tokens in TOKENS:
                pts = [(c.machines * PER_MACHINE, c.usp.fwd_bwd_ms / c.best.fwd_bwd_ms) for c in rows
                       if c.model == model and c.tokens == tokens and c.density == density and c.device == device
                       and (c.machines == 1 or c.nic_gbit == gbit) and c.usp is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{model}, {tokens:,} tokens")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("GPUs (8 per machine)")
        ax.set_title(f"{'dense' if density >= 1 else '90% block-sparse'}, {device}, {gbit} Gb/s NIC per GPU")
    axes[0].set_ylabel("USP time / best mode's time (fwd+bwd)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Speed plan: the best mode against USP (python -m megatron_sp_ext.speed_plan --table)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_doc(doc: str, section: str) -> None:
    """Put ``section`` between the markers of ``doc`` (appended with them where the file has none)."""
    with open(doc) as f:
        text = f.read()
    new = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + new + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    with open(doc, "w") as f:
        f.write(text)



def _mask(density: float) -> str:
    return "dense" if density >= 1 else f"{1 - density:.0%} sparse"


def grid(rows: list, device: str, gbit: int) -> str:
    """The best mode per (model, tokens, mask) and cluster size on ``device`` with ``gbit`` NICs, and its speed-up
    over the default USP mesh."""
    sizes = sorted({c.machines for c in rows})
    out = ["| model | tokens | mask | " + " | ".join(f"{n}x{PER_MACHINE}" for n in sizes) + " |",
           "|---|---|---|" + "---|" * len(sizes)]
    keys = sorted({(c.model, c.tokens, c.density) for c in rows}, key=lambda k: (k[0] != MODELS[0][0], k[1], -k[2]))
    for model, tokens, density in keys:
        line = []
        for n in sizes:
            c = next((c for c in rows if (c.model, c.tokens, c.density, c.machines, c.device) ==
                      (model, tokens, density, n, device) and (n == 1 or c.nic_gbit == gbit)), None)
            line.append("-" if c is None else f"{c.best.setting.label()} {_ratio(c, c.usp)}")
        out.append(f"| {model} | {tokens:,} | {_mask(density)} | " + " | ".join(line) + " |")
    return "\n".join(out)


def run_table(doc: str, plot_path: str, rates: Optional[KernelRates] = None, devices=DEVICES, nics=NICS,
              max_machines: int = MACHINES[-1]) -> list:
    """Compute the cells, write the tables and the volume check into ``doc`` and the plot to ``plot_path``."""
    rates = rates or package_rates()
    machines = tuple(n for n in MACHINES if n <= max_machines)
    rows = cells(rates, devices, nics, machines)
    parts = [f"Generated by `python -m megatron_sp_ext.speed_plan --table` (forward+backward of one attention layer, "
             f"B=1, head dim 128, non-causal, 90% sparse = 128-token tiles; NVLink {PRESETS['nvlink_large'].gbps:g} "
             f"GB/s per GPU inside a machine, a NIC per GPU at {NIC_EFFICIENCY:.0%} of its line rate across).",
             "", f"### {devices[0]}, {nics[0]} Gb/s NIC per GPU", "", markdown(rows, devices[0], nics[0])]
    for device in devices:
        for gbit in nics:
            parts += ["", f"Best mode and its speed-up over USP ({device}, {gbit} Gb/s):", "", grid(rows, device, gbit)]
    parts += ["", "### TAS vs USP: bytes between machines at 4 x 8, counted from the schedules", "",
              "| arrangement | P_u | MiB per GPU per forward (schedules) | topology/volume.py's equation |",
              "|---|---|---|---|"]
    parts += [f"| {a} | {u} | {mib:,.0f} | {eq:,.0f} |" for a, u, mib, eq in volume_rows()]
    parts += ["", f"![speed plan]({os.path.relpath(plot_path, os.path.dirname(os.path.abspath(doc)))})"]
    write_doc(doc, "\n".join(parts))
    plot(rows, plot_path, devices[0], nics[0])
    return rows

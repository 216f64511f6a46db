"""``--validate``: every measured attention row committed under a results folder, predicted from its own links probe,
one line per (row, mode), then ``N rows, median |error| X%, max Y%``; failing (exit 1) where the median passes
``MEDIAN_BOUND`` or one mode's worst row ``WORST_BOUND``.

Rows read (never used to fit: the plan fits nothing): ``tools/bench_cp.py`` JSONs (``bench_cp_*.json``, also inside
the ``.tgz`` archives of a day's folder) and ``tools/bench_attention.py`` JSONs (a ``results`` list of rows with
``modes``); each entry of a row's ``modes`` that names one of our modes (``modes``' registry, ``hcms<C>``, the
meshes) is one validated row; where the same job timed Transformer Engine's p2p ring, its times stand beside
(not validated: where ours and the plan part, they say which is nearer what a ring can do). Left out, each with its
reason in the output: Transformer Engine's entries (not our schedules), ``auto`` entries whose choice the JSON does not record, entries without times.

What each row is predicted from: its cluster (its regime, ``links``: nvlink / host / emu<M>; its GPUs), its own links
probe (``meta.links_probe``) where the JSON has one, else the committed probe of the same regime that ``FALLBACK``
names (bench_cp JSONs carry none), else the regime's preset link; the kernel-rate table of the package (its device,
FA4: every row ran with FA4 installed); the copy rate of the code the row ran (value copies before 2026-11-29, words
since). With ``clock="floor"`` each job's clock is taken from its own one-GPU FA4 floor (the kernel table scaled by
the floor's measured / predicted time; an option, not the default).
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, replace
from typing import Optional

from .. import modes
from ..sp.speed_plan.cluster import COPY_TBPS, PRESETS, Cluster
from ..sp.speed_plan.plan import predict
from ..sp.speed_plan.rates import Call, KernelRates, package_rates
from ..sp.speed_plan.schedules import Problem, Setting, ulysses_mode

MEDIAN_BOUND, WORST_BOUND = 0.10, 0.25
SINCE = "2026-11-24"         # rows before it ran torch SDPA's kernels and an older exchange (FA4 came 11-24/25)
WORDS_SINCE = "2026-11-29"
MIN_TOKENS = 16384   # layout.copy_bits (8-byte word copies) shipped late on 2026-11-28, after every row before
# committed probes of a regime, for rows whose JSON has none: (regime, P) -> (file, key path into meta.links_probe)
FALLBACK = {
    ("nvlink", 2): ("2026-11-28_h200x4_2010/call5/i68_emu22/emu22.json", ("4", "intra_machine")),
    ("nvlink", 4): ("2026-11-28_h200x4_1800/call4/tpcp/block_tp2_wan14b_32760.json", ("4",)),
}


@dataclass(frozen=True)
class Row:
    """One measured (row, mode): where, on what, and the settings the mode ran with (forward / forward+backward)."""

    source: str
    device: str
    date: str
    regime: str
    world: int
    problem: Problem
    name: str
    settings: tuple   # (forward's Setting, forward+backward's Setting), None where not ours
    times: tuple      # measured (forward ms or NaN, forward+backward ms)
    probe: Optional[dict]
    floor_fa4: Optional[dict]
    skip: str = ""
    te_p2p: Optional[tuple] = None   # Transformer Engine's p2p ring timed in the same job: (forward, fwd+bwd) ms


def _device(meta: dict, path: str) -> str:
    name = meta.get("device") or ""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", name) or re.search(r"_(h\d00)", path)
    return m.group(1).upper() if m else "H200"


def _settings(name: str, entry: dict, world: int, heads: int) -> tuple:
    """(fwd setting, fwd+bwd setting, why not) of one bench entry."""
    m = re.fullmatch(r"([a-z_]+?)(\d+)?", name)
    base, chunks = (m.group(1), int(m.group(2))) if m and m.group(2) else (name, None)
    mesh = entry.get("mesh", {})
    if base == "mesh_auto":   # placement "auto": the arrangement of the volume model
        st = Setting(modes.names(arrangement=True)[0], 1, "", "", mesh.get("ulysses_size", 0))
        return st, st, ""
    spec = modes.find(base.split("-")[0])
    if spec is None:
        return None, None, f"{name}: not a mode of ours"
    variant = base.split("-")[1] if "-" in base else ""
    if spec.auto or (spec.head_chunks is None and chunks is None and not spec.mesh and not spec.ring_variant):
        return _decided(name, entry)
    if spec.mesh:
        arrangement = "" if spec.arrangement else modes.names(arrangement=True, ulysses_across=True)[0]
        st = Setting(spec.name, 1, variant, arrangement, mesh.get("ulysses_size", 0))
        return st, st, ""
    st = Setting(spec.name, chunks or 1)
    return st, st, ""


def _decided(name: str, entry: dict) -> tuple:
    """What an auto / head_chunks=auto entry ran: its logged decisions (forward first, then forward+backward)."""
    lines = entry.get("auto_decisions") or []
    if not lines:
        return None, None, f"{name}: what it ran is not recorded"
    picks = []   # per timed direction: (mode, chunks)
    chunks = 1
    for line in lines:
        c = re.search(r"head_chunks=auto -> (\d+)", line)
        if c:
            chunks = int(c.group(1))
            if not any("auto mode ->" in x for x in lines):
                picks.append((ulysses_mode(True), chunks))
        mm = re.search(r"auto mode -> (\w+)", line)
        if mm:
            picks.append((mm.group(1), chunks))
    if len(picks) < 2:
        return None, None, f"{name}: {len(picks)} decision(s) logged, 2 needed (forward, forward+backward)"

    def setting(mode: str, c: int) -> Setting:
        spec = modes.get(mode)
        return Setting(mode, c if spec.heads_per_rank else 1)
    return setting(*picks[0]), setting(*picks[-1]), ""


def _sparse_rows_of(doc: dict, source: str) -> list:
    """``tools/bench_sp_block_sparse.py`` rows: Ulysses and the ring, dense and under a block mask (fwd+bwd only)."""
    meta, out = doc.get("meta") or {}, []
    names = {"ulysses": ulysses_mode(False), "ring": modes.names(ring_variant=True, multi_ring=False)[0]}
    for r in doc.get("rows") or []:
        kind = str(r.get("row", "")).split("_")[-1]
        if kind not in names or "fwd_bwd_ms" not in r:
            continue
        density = 1.0 - float(r.get("sparsity") or 0.0)
        pb = Problem(int(r["s"]), int(r["h"]), int(r.get("d", 128)), bool(meta.get("causal")), round(density, 4),
                     int(r.get("block_size") or 128))
        st = Setting(names[kind])
        out.append(Row(source, _device(meta, source), str(meta.get("date", ""))[:10], meta.get("link") or "nvlink",
                       int(r["p"]), pb, f"{r['row']}{'/' + r['mask'] if r.get('mask') else ''}", (st, st),
                       (float("nan"), float(r["fwd_bwd_ms"])), None, None))
    return out


def _rows_of(doc: dict, source: str) -> list:
    meta = doc.get("meta") or {}
    if "bench_sp_block_sparse" in str(meta.get("command", "")):
        return _sparse_rows_of(doc, source)
    out = []
    for r in doc.get("rows") or doc.get("results") or []:
        if not isinstance(r, dict) or "modes" not in r or "P" not in r:
            continue
        causal = bool(r.get("causal", meta.get("causal", False)))
        regime = r.get("links") or meta.get("links") or ("host" if str(meta.get("NCCL_P2P_DISABLE")) == "1"
                                                          else "nvlink")
        world, heads = int(r["P"]), int(r["H"])
        pb = Problem(int(r["L"]), heads, int(r.get("D", 128)), causal)
        probe = (meta.get("links_probe") or {}).get(str(world))
        te = r["modes"].get("te_p2p") if isinstance(r["modes"].get("te_p2p"), dict) else None
        te_p2p = (float(te.get("fwd_ms", "nan")), float(te.get("fwd_bwd_ms", "nan"))) if te else None
        for name, e in r["modes"].items():
            fwd_s, fb_s, why = _settings(name, e, world, heads)
            if "fwd_bwd_ms" not in e or e.get("fwd_bwd_ms") != e.get("fwd_bwd_ms"):   # missing or NaN
                why = why or f"{name}: no time"
            out.append(Row(source, _device(meta, source), str(meta.get("date", ""))[:10] or _date(source), regime,
                           world, pb, name, (fwd_s, fb_s), (float(e.get("fwd_ms", "nan")),
                                                            float(e.get("fwd_bwd_ms", "nan"))), probe,
                           r.get("floor_fa4"), why, te_p2p))
    return out


def _date(path: str) -> str:
    m = re.search(r"(\d{4}-\d{2}-\d{2})", path)
    return m.group(1) if m else ""


def _wanted(name: str, command: str) -> bool:
    return name.startswith(("bench_cp_", "bench_sp_block_sparse")) or "bench_attention" in command


def measured_rows(results: str) -> list:
    """Every (row, mode) under ``results`` (module docstring); a JSON that also sits in a ``.tgz`` is read once."""
    out, seen = [], set()

    def add(doc: dict, source: str) -> None:
        key = json.dumps(doc.get("rows") or doc.get("results"), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.extend(_rows_of(doc, source))
    for path in sorted(glob.glob(os.path.join(results, "**", "*.json"), recursive=True)):
        if _wanted(os.path.basename(path), _command(path)):
            with open(path) as f:
                add(json.load(f), os.path.relpath(path, results))
    for path in sorted(glob.glob(os.path.join(results, "**", "*.tgz"), recursive=True)):
        with tarfile.open(path) as tar:   # read as data: json members only, never extracted
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".json") and _wanted(os.path.basename(member.name), ""):
                    add(json.load(io.TextIOWrapper(tar.extractfile(member))),
                        f"{os.path.relpath(path, results)}:{member.name}")
    return out


def _command(path: str) -> str:
    try:
        with open(path) as f:
            head = f.read(4096)
    except OSError:
        return ""
    m = re.search(r'"command":\s*"([^"]*)"', head)
    return m.group(1) if m else ""


def cluster_for(row: Row, results: str, rates: KernelRates, clock: str = "table") -> tuple:
    """(cluster, where its links came from) of a row."""
    copy = COPY_TBPS["words" if row.date >= WORDS_SINCE else "values"]
    probe, where = row.probe, "its own probe"
    if probe is None and (row.regime, row.world) in FALLBACK:
        path, keys = FALLBACK[row.regime, row.world]
        with open(os.path.join(results, path)) as f:
            probe = json.load(f)["meta"]["links_probe"]
        for k in keys:
            probe = probe[k]
        if "rows" in probe:   # a pair probe inside a larger one: the world of its own ranks
            probe = {"world_rows": probe["rows"]}
        where = f"no probe in the row: {path}"
    elif probe is None:
        where = f"no probe: preset {row.regime}"
    if probe is not None:
        cl = Cluster.from_probe(probe, row.regime, row.world, device=row.device, copy_tbps=copy)
    else:
        link = PRESETS[row.regime]
        per = 1 if row.regime == "host" else row.world
        cl = Cluster(row.world // per, per, link, link, device=row.device, copy_tbps=copy)
    if clock == "floor" and row.floor_fa4 and "fwd" in row.floor_fa4:
        fl = row.floor_fa4
        call = Call(row.problem.tokens, row.problem.tokens, int(fl["heads_per_rank"]), row.problem.causal)
        fwd, bwd = rates.call_ms(row.device, cl.kernel, call)
        cl = replace(cl, kernel_scale=(fl["fwd"] / fwd, (fl["fwd_bwd"] - fl["fwd"]) / bwd))
        where += f"; clock: its FA4 floor (x{fl['fwd'] / fwd:.3f} / x{(fl['fwd_bwd'] - fl['fwd']) / bwd:.3f})"
    return cl, where


@dataclass
class Summary:
    """What ``validate`` found: ``lines`` (one per row, skipped rows with their reason, then the summaries), the
    forward+backward and forward errors per mode, ``ok`` (both within the bounds)."""

    lines: list
    fwd_bwd: dict
    fwd: dict

    @staticmethod
    def stats(errors: dict) -> tuple:
        """(rows, median |error|, max |error|, {mode: worst}) of {mode: [|error|, ...]}."""
        flat = sorted(e for es in errors.values() for e in es)
        if not flat:
            return 0, float("nan"), float("nan"), {}
        return len(flat), flat[len(flat) // 2], flat[-1], {m: max(es) for m, es in errors.items()}

    def passes(self, errors: dict) -> bool:
        n, med, _, worst = self.stats(errors)
        return n > 0 and med <= MEDIAN_BOUND and all(w <= WORST_BOUND for w in worst.values())

    @property
    def ok(self) -> bool:
        return self.passes(self.fwd_bwd) and self.passes(self.fwd)


def _summary_line(what: str, errors: dict) -> str:
    n, med, top, worst = Summary.stats(errors)
    over = ", ".join(f"{m} {w:.1%}" for m, w in sorted(worst.items(), key=lambda mw: -mw[1]) if w > WORST_BOUND)
    return f"{what}{n} rows, median |error| {med:.1%}, max {top:.1%}" + (f" (over {WORST_BOUND:.0%}: {over})"
                                                                         if over else "")


def validate(results: str, rates: Optional[KernelRates] = None, clock: str = "table") -> Summary:
    """Every row under ``results`` predicted (module docstring). The last line is the forward+backward summary
    (``N rows, median |error| X%, max Y%``), the one before it the forward's (rows that have a forward time)."""
    rates = rates or package_rates()
    lines, err_fb, err_f = [], {}, {}
    done: set = set()
    skipped: dict = {}   # (file, reason) -> entries
    for row in measured_rows(results):
        where = (f"{row.source} P={row.world} L={row.problem.tokens} {'causal' if row.problem.causal else 'full'}"
                 f"{'' if row.problem.density >= 1 else f' density {row.problem.density:g}'} {row.regime}")
        fwd_st, fb_st = row.settings
        fwd_ms, fb_ms = row.times
        why = row.skip or ("" if fwd_st is not None else "no mode of ours")
        if not why and row.world < 2:
            why = "one rank: no exchange to predict"
        if not why and row.date < SINCE:
            why = f"measured {row.date}, before {SINCE}: torch SDPA's kernels and an older exchange, not today's schedules"
        if not why and row.problem.tokens < MIN_TOKENS:
            why = (f"{row.problem.tokens} tokens < {MIN_TOKENS}: host-bound (the host issues one Ulysses fwd+bwd in "
                   f"~2.9 ms, 2026-11-21 profile); the plan predicts device time")
        key = (row.device, row.date, row.world, row.problem, row.name, fb_ms)
        if not why and key in done:
            why = "the same measurement again (an earlier copy of this job's JSON)"
        done.add(key)
        if why:
            key = (row.source, why.split(": ", 1)[-1] if why.startswith(f"{row.name}: ") else why)
            skipped.setdefault(key, []).append(row.name)
            continue
        cl, links = cluster_for(row, results, rates, clock)
        fb = predict(row.problem, cl, fb_st, rates).fwd_bwd_ms
        e_fb = fb / fb_ms - 1
        err_fb.setdefault(fb_st.mode, []).append(abs(e_fb))
        text = f"fwd+bwd {fb_ms:8.2f} ms predicted {fb:8.2f} ({e_fb:+6.1%})"
        if fwd_ms == fwd_ms:   # not NaN: the row has a forward time
            fwd = predict(row.problem, cl, fwd_st, rates).fwd_ms
            e_f = fwd / fwd_ms - 1
            err_f.setdefault(fwd_st.mode, []).append(abs(e_f))
            text = f"fwd {fwd_ms:7.2f} ms predicted {fwd:7.2f} ({e_f:+6.1%}); " + text
        if row.te_p2p is not None:   # beside, not validated: where ours and the plan part, is TE's ring nearer?
            text += f"; TE p2p in the same job: fwd {row.te_p2p[0]:.2f}, fwd+bwd {row.te_p2p[1]:.2f} ms"
        lines.append(f"{row.name:<14} {where}: {text} [{fb_st.label()}; links: {links}]")
    for (source, why), names in skipped.items():
        lines.append(f"skipped {len(names)} of {source} ({', '.join(sorted(set(names)))}): {why}")
    lines.append(_summary_line("forward: ", err_f))
    lines.append(_summary_line("", err_fb))
    return Summary(lines, err_fb, err_f)

"""Markdown tables for the README from the raw benchmark JSON under tools/results/.

    python tools/results_tables.py tools/results/2026-11-21_h200x4
"""
from __future__ import annotations

import json
import os
import statistics
import sys


def _load(d, tag):
    p = os.path.join(d, f"{tag}.json")
    return json.load(open(p)) if os.path.exists(p) else None


def hcms_table(d, tag):
    data = _load(d, tag)
    if not data:
        return ""
    out = ["| P | H | L | rho | DeepSpeed | our Ulysses | best HCMS (C) | auto (C) | Ulysses vs DS | best HCMS vs Ulysses | auto vs Ulysses |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        m = r["modes"]
        u, ds, a = m["ulysses"], m.get("deepspeed"), m.get("auto")
        hc = {k: v for k, v in m.items() if k.startswith("hcms")}
        best = min(hc, key=lambda k: hc[k]["fwd_bwd_ms"])
        choice = (a or {}).get("auto_choice", {}).get("train", {}).get("chunks", "?")
        cell = lambda e: f"{e['fwd_ms']:.2f} / {e['fwd_bwd_ms']:.2f}"  # noqa: E731
        ratio = lambda x, y: f"{y['fwd_ms'] / x['fwd_ms']:.2f}x / {y['fwd_bwd_ms'] / x['fwd_bwd_ms']:.2f}x"  # noqa: E731
        out.append(f"| {r['P']} | {r['H']} | {r['L'] // 1024}K | {r.get('rho', 0):.2f} | {cell(ds) if ds else '-'} | "
                   f"{cell(u)} | {cell(hc[best])} ({best[4:]}) | {cell(a) if a else '-'} ({choice}) | "
                   f"{ratio(u, ds) if ds else '-'} | {ratio(hc[best], u)} | {ratio(a, u) if a else '-'} |")
    return "\n".join(out)


def modes_table(d, tag, modes):
    data = _load(d, tag)
    if not data:
        return ""
    out = ["| P | H | L | causal | " + " | ".join(modes) + " |", "|---|---|---|---|" + "---|" * len(modes)]
    for r in data["results"]:
        u = r["modes"]["ulysses"]
        cells = []
        for mo in modes:
            e = r["modes"].get(mo)
            cells.append("-" if e is None else f"{e['fwd_ms']:.2f} / {e['fwd_bwd_ms']:.2f} "
                         f"({u['fwd_bwd_ms'] / e['fwd_bwd_ms']:.2f}x)")
        out.append(f"| {r['P']} | {r['H']} | {r['L'] // 1024}K | {data['meta']['causal']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def dit_table(d):
    out = ["| mode | step time (s, median of steps 3-9) | tokens/s | MFU | peak GiB | loss steps 0-3 |",
           "|---|---|---|---|---|---|"]
    for mode in ("ulysses", "hcms", "usp"):
        p = os.path.join(d, f"dit_{mode}", "metrics.jsonl")
        if not os.path.exists(p):
            continue
        rows = [json.loads(x) for x in open(p)]
        st = statistics.median(r["step_time_s"] for r in rows[3:])
        tps = statistics.median(r["tokens_per_s"] for r in rows[3:])
        mfu = statistics.median(r.get("mfu", 0) for r in rows[3:])
        mem = max(r.get("peak_mem_gib", 0) for r in rows)
        losses = ", ".join(f"{r['loss']:.4f}" for r in rows[:4])
        label = {"hcms": "hcms (--hcms-head-chunks auto)", "usp": "usp 2x2 (--sp-nodes 2)"}.get(mode, mode)
        out.append(f"| {label} | {st:.3f} | {tps:,.0f} | {mfu:.1%} | {mem:.1f} | {losses} |")
    return "\n".join(out)


def main() -> None:
    d = sys.argv[1]
    print("### HCMS, P=4 (interleaved timing)\n")
    print(hcms_table(d, "hcms_p4_interleaved"))
    print("\n### HCMS, P=2 (sequential timing, +-5% drift between modes)\n")
    print(hcms_table(d, "hcms_p2"))
    for tag in ("ring_p4", "ring_causal_p4", "ring_p2"):
        print(f"\n### {tag}\n")
        print(modes_table(d, tag, ["ulysses", "ring", "tasp"]))
    print("\n### mesh 2x2\n")
    print(modes_table(d, "mesh_2x2", ["ulysses", "usp", "tas", "torus", "usp-tasp"]))
    print("\n### DiT\n")
    print(dit_table(d))


if __name__ == "__main__":
    main()

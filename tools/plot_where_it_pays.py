"""The README's plot: forward+backward time of each mode relative to our plain Ulysses, per sequence length,
from committed raw results (default: the interleaved P=4 grid on 4 x H200, NVSwitch, 2026-11-21).

    python tools/plot_where_it_pays.py results/2026-11-21_h200x4/hcms_p4_interleaved.json \
        --out docs/where_it_pays.png
"""
from __future__ import annotations

import argparse
import json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default="results/2026-11-21_h200x4/hcms_p4_interleaved.json")
    ap.add_argument("--out", default="docs/where_it_pays.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(args.results) as f:
        data = json.load(f)
    meta, rows = data["meta"], data["results"]
    heads = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 3.4), sharey=True, squeeze=False)
    for ax, h in zip(axes[0], heads):
        sel = sorted((r for r in rows if r["H"] == h), key=lambda r: r["L"])
        ls = [r["L"] // 1024 for r in sel]
        best = [max(v["speedup_fwd_bwd_vs_ulysses"] for k, v in r["modes"].items() if k.startswith("hcms"))
                for r in sel]
        series = {"DeepSpeed DistributedAttention": [r["modes"]["deepspeed"]["speedup_fwd_bwd_vs_ulysses"] for r in sel],
                  "HCMS, best chunk count": best,
                  "HCMS auto": [r["modes"]["auto"]["speedup_fwd_bwd_vs_ulysses"] for r in sel]}
        for (name, ys), m in zip(series.items(), "osD"):
            ax.plot(ls, ys, marker=m, label=name)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ls, [f"{x}K" for x in ls])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(f"P={sel[0]['P']}, H={h}, D={meta.get('D', 128)}", fontsize=9)
    axes[0][0].set_ylabel("fwd+bwd speed vs our Ulysses (x)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta['device']} x4 (NVSwitch), {meta['date']}, torch {meta['torch']}, {meta['dtype']}, "
                 f"non-causal", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Renders a `fedshard-sim --sweep` CSV to a PNG.

Three panels, each the predicted data-processing speed-up over fsdp (tokens/s per GPU ratio,
the same bandwidth for both):
  1. against K, one line per algorithm and inter-group bandwidth, at its reference groups;
  2. against the number of groups, one line per algorithm, at one K and bandwidth;
  3. against the inter-group bandwidth, one line per algorithm and K, at its reference groups.
Reference values default to the paper's setting when the sweep has it (K 8, 400 Gb/s,
fl_fsdp with 128 groups, fl_hsdp with 16), else to the middle (K, bandwidth) or the largest
(groups) value in the file.

usage: plot_sweep.py sweep.csv out.png [--k K] [--gbps X] [--groups G] [--paper 8.04]
"""
import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"plot_sweep.py: {path} has no rows")
    for r in rows:
        for key in ("groups", "replicas", "shards", "K"):
            r[key] = int(r[key])
        for key in ("inter_group_gbps", "speedup_vs_fsdp", "tokens_per_s_per_gpu", "step_s"):
            r[key] = float(r[key])
    return rows


def pick(rows, key, wanted, preferred):
    values = sorted({r[key] for r in rows})
    if wanted is not None:
        if wanted not in values:
            sys.exit(f"plot_sweep.py: {key} = {wanted} is not in the sweep (it has {values})")
        return wanted
    return preferred if preferred in values else values[len(values) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--k", type=int)
    ap.add_argument("--gbps", type=float)
    ap.add_argument("--groups", type=int)
    ap.add_argument("--paper", type=float, default=8.04, help="reference line (0: none)")
    args = ap.parse_args()

    rows = load(args.csv)
    k = pick(rows, "K", args.k, 8)
    bw = pick(rows, "inter_group_gbps", args.gbps, 400.0)
    paper_groups = {"fl_fsdp": 128, "fl_hsdp": 16}
    ref_groups = {}
    for algo in sorted({r["algo"] for r in rows}):
        mine = [r for r in rows if r["algo"] == algo]
        preferred = paper_groups.get(algo, max(r["groups"] for r in mine))
        ref_groups[algo] = pick(mine, "groups", args.groups, preferred)
    styles = {algo: ("-", "--", ":", "-.")[i % 4] for i, algo in enumerate(sorted(ref_groups))}
    title = f"{rows[0]['model']} on {rows[0]['gpus']} GPUs of {rows[0]['cluster']}"
    at_ref = [r for r in rows if r["groups"] == ref_groups[r["algo"]]]

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))

    lines = defaultdict(list)
    for r in at_ref:
        lines[(r["algo"], r["inter_group_gbps"])].append((r["K"], r["speedup_vs_fsdp"]))
    for (algo, b), pts in sorted(lines.items()):
        pts.sort()
        axes[0].plot(*zip(*pts), styles[algo], marker="o", label=f"{algo} ({ref_groups[algo]} groups), {b:g} Gb/s")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("K (inner steps per sync)")
    axes[0].set_title("vs K")
    axes[0].legend(fontsize=6, ncol=2)

    lines = defaultdict(list)
    for r in rows:
        if r["inter_group_gbps"] == bw and r["K"] == k:
            lines[r["algo"]].append((r["groups"], r["speedup_vs_fsdp"]))
    for algo, pts in sorted(lines.items()):
        pts.sort()
        axes[1].plot(*zip(*pts), styles[algo], marker="o", label=algo)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("federation groups")
    axes[1].set_title(f"vs groups, K = {k}, {bw:g} Gb/s")
    axes[1].legend(fontsize=8)

    lines = defaultdict(list)
    for r in at_ref:
        lines[(r["algo"], r["K"])].append((r["inter_group_gbps"], r["speedup_vs_fsdp"]))
    for (algo, kk), pts in sorted(lines.items()):
        pts.sort()
        axes[2].plot(*zip(*pts), styles[algo], marker="o", label=f"{algo} ({ref_groups[algo]} groups), K = {kk}")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("inter-group bandwidth (Gb/s)")
    axes[2].set_title("vs bandwidth")
    axes[2].legend(fontsize=6, ncol=2)

    for ax in axes:
        ax.set_ylabel("predicted speed-up over fsdp")
        ax.axhline(1.0, color="grey", lw=0.8)
        if args.paper > 0:
            ax.axhline(args.paper, color="red", ls="--", lw=0.8, label=None)
        ax.grid(True, which="both", alpha=0.3)
    if args.paper > 0:
        axes[0].text(axes[0].get_xlim()[0], args.paper, f" paper: up to {args.paper:g}x",
                     color="red", va="bottom", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"plot_sweep.py: wrote {args.png}")


if __name__ == "__main__":
    main()

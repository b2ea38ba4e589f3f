#!/usr/bin/env python3
"""Render fedshard-demo's curves.csv as two PNGs: eval perplexity against training time and
against tokens processed, one line per algorithm.

usage: python3 examples/plot_curves.py [demo-out/curves.csv] [output-dir]
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else "demo-out/curves.csv"
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(path) or "."
    curves: dict[str, list[tuple[float, float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            curves.setdefault(row["algorithm"], []).append(
                (float(row["seconds"]), float(row["tokens"]), float(row["eval_ppl"])))
    if not curves:
        print(f"plot_curves: no rows in {path}", file=sys.stderr)
        return 1
    for x_index, x_label, name in ((0, "training time (s)", "ppl_vs_time.png"),
                                   (1, "tokens processed", "ppl_vs_tokens.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for algorithm, points in curves.items():
            ax.plot([p[x_index] for p in points], [p[2] for p in points], marker="o",
                    markersize=3, label=algorithm)
        ax.set_xlabel(x_label)
        ax.set_ylabel("eval perplexity")
        ax.set_yscale("log")
        ax.set_title("fedshard-demo: 8 ranks on 2 sites, emulated slow link")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        target = os.path.join(out, name)
        fig.savefig(target, dpi=120)
        plt.close(fig)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

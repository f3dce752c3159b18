"""Held-out curves of heads runs, read from their metrics.jsonl: at every evaluation the step, the
training minutes so far, tokens/s, the loss, top-1 agreement at draft position 1 and the τ it
implies for a chain of 4 and for the tree the run selects by (heads.tree_budget); a markdown table
per run and, with --png, one plot of τ against training minutes.

    .venv/bin/python tools/heads_curves.py runs/ttt1/heads/eagle runs/ttt2/heads/eagle --png curves.png

A folder may be a finished run or one still training (its metrics.jsonl grows as it goes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def evaluations(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: not a heads run folder")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("heldout_tau_tree") is not None]


def table(label: str, rows: list[dict]) -> str:
    lines = [f"**{label}**", "", "| step | minutes | tokens/s | loss | top-1 (pos. 1) | τ chain of 4 | τ tree |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r.get('train_s', 0) / 60:.1f} | {r.get('tokens_per_s', 0):,.0f} | "
                     f"{r['loss']:.3f} | {r['heldout_top1']:.3f} | {r['heldout_tau_chain']:.2f} | "
                     f"{r['heldout_tau_tree']:.2f} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        minutes = [r.get("train_s", 0) / 60 for r in rows]
        line, = ax.plot(minutes, [r["heldout_tau_tree"] for r in rows], marker="o", label=f"{label} (tree)")
        ax.plot(minutes, [r["heldout_tau_chain"] for r in rows], linestyle="--", color=line.get_color(),
                label=f"{label} (chain of 4)")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out τ (implied)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="heads run folders (runs/<run>/heads/<kind>)")
    parser.add_argument("--labels", nargs="*", help="one label per folder (default: the run's name)")
    parser.add_argument("--png", type=Path, help="also plot τ against training minutes into this file")
    args = parser.parse_args()
    labels = args.labels or [f"{folder.parent.parent.name}/{folder.name}" for folder in args.folders]
    if len(labels) != len(args.folders):
        raise SystemExit("error: give one --labels entry per folder")
    curves = {label: evaluations(folder) for label, folder in zip(labels, args.folders)}
    print("\n\n".join(table(label, rows) for label, rows in curves.items()))
    if args.png:
        plot(curves, args.png)
        print(f"\n-> {args.png}")


if __name__ == "__main__":
    main()

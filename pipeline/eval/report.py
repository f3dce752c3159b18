"""report.json, report.md and the plots of the eval stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.files import atomic_write_text, rename


def write_report(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write report.json, report.md and the PNG plots; return the plots by name."""
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "report.md", markdown(report))
    return plots(report, out)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    methods = report["methods"]
    lines = [
        f"# Eval: {report['target']['name']} on {report['dataset']}",
        "",
        f"{report['num_prompts']} conversations ({report['num_turns']} turns), max_new_tokens="
        f"{report['max_new_tokens']}, temperature={report['temperature']}, batch size {report['batch_size']}, "
        f"{report['dtype']} on {report['device']}. Target fingerprint `{report['target']['fingerprint'][:16]}`.",
        *([f"Chains of draft models, eagle and early_exit end at a token drafted with probability below "
           f"{report['confidence_threshold']} (k is the longest chain)."] if report.get("confidence_threshold") else []),
        *([f"Linear layers in int8 (dynamic activations) for {', '.join(report['int8_drafts'])}; other drafts in "
           f"{report['dtype']}."] if report.get("int8_drafts") else []),
        *(["Every forward of our decoder replayed from a captured CUDA graph."] if report.get("cuda_graphs") else []),
        f"Lossless: greedy outputs equal plain decoding's, a difference excused only where plain's top-2 "
        f"logits are within {report.get('tie_epsilon', 1e-4):g} (a tie that rounding decides).",
        "",
        f"Baselines: our plain decoding {report['baselines']['plain']['tokens_per_s']:.2f} tokens/s, "
        f"HF `generate` {report['baselines']['hf_generate']['tokens_per_s']:.2f} tokens/s "
        f"(ours {report['baselines']['plain']['tokens_per_s'] / report['baselines']['hf_generate']['tokens_per_s']:.2f}x).",
        "",
        "| method | drafter | k | τ | α by position | tokens/s | vs plain | vs HF generate | predicted | lossless |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for name, m in methods.items():
        alphas = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) or "–"
        lines.append(
            f"| {name} | {m['drafter']} | {_fmt(m['num_draft_tokens'])} | {_fmt(m['tau'])} | {alphas} | "
            f"{m['tokens_per_s']:.2f} | {m['speedup_vs_plain']:.2f}x | {m['speedup_vs_hf']:.2f}x | "
            f"{_fmt(m.get('predicted_speedup'))}{'x' if m.get('predicted_speedup') else ''} | {_fmt(m['lossless'])} |"
        )
    if report.get("hf_methods"):
        lines += ["", "Transformers' own speculative decoding with the same drafts and k:", "",
                  "| method | k | tokens/s | vs our plain | ours (same drafter) |", "|---|---:|---:|---:|---:|"]
        for name, m in report["hf_methods"].items():
            lines.append(f"| {name} | {m['num_draft_tokens']} | {m['tokens_per_s']:.2f} | {m['speedup_vs_plain']:.2f}x | "
                         f"{methods[m['ours']]['tokens_per_s']:.2f} ({m['ours']}) |")
    categories = sorted({c for m in methods.values() for c in m["per_category"]})
    if len(categories) > 1:
        lines += ["", "Speedup over plain decoding by category:", "",
                  "| method | " + " | ".join(categories) + " |", "|---|" + "---:|" * len(categories)]
        for name, m in methods.items():
            cells = [_fmt(m["per_category"].get(c, {}).get("speedup_vs_plain")) for c in categories]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, sweep in report.get("sweeps", {}).items():
        lines += ["", f"num_draft_tokens sweep for {name} (the first {report['sweep_prompts']} conversations):", "",
                  "| k | τ | proposal rate | tokens/s | vs plain | predicted |", "|---:|---:|---:|---:|---:|---:|"]
        for row in sweep:
            lines.append(f"| {row['num_draft_tokens']} | {_fmt(row['tau'])} | {row['proposal_rate']:.2f} | "
                         f"{row['tokens_per_s']:.2f} | {row['speedup_vs_plain']:.2f}x | "
                         f"{_fmt(row['predicted_speedup'])}{'x' if row['predicted_speedup'] else ''} |")
    by_size = report.get("by_batch_size") or {}
    if by_size:
        sizes = sorted(by_size, key=int)
        names = list(by_size[sizes[0]])
        lines += ["", "Tokens/s (speedup over plain at the same batch size) by batch size:", "",
                  "| method | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for name in names:
            cells = [f"{by_size[b][name]['tokens_per_s']:.1f} ({by_size[b][name]['speedup_vs_plain']:.2f}x)"
                     for b in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    costs = report["costs"]
    lines += ["", "Costs (median forward time, relative to one target forward of one token, "
                  f"{costs['target_forward_s'] * 1000:.1f} ms):",
              "", "- verify k+1 tokens: " + ", ".join(f"k={k}: {v:.2f}" for k, v in costs["verify_cost_by_k"].items())]
    for name, c in costs["draft_cost_ratio"].items():
        lines.append(f"- {name}: one draft token costs {c:.3f} target tokens")
    return "\n".join(lines) + "\n"


def plots(report: dict[str, Any], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{report['target']['name']} on {report['dataset']}"
    made = {}
    spec = {n: m for n, m in report["methods"].items() if m["acceptance_by_position"]}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, m in spec.items():
        alphas = m["acceptance_by_position"]
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=f"{name} (k={m['num_draft_tokens']}, τ={m['tau']:.2f})")
    ax.set_xticks(range(1, 1 + max((len(m["acceptance_by_position"]) for m in spec.values()), default=1)))
    ax.set(xlabel="draft position i", ylabel="acceptance rate α_i", ylim=(0, 1.05),
           title=f"Acceptance by draft position: {title}")
    ax.grid(alpha=0.3)
    if spec:
        ax.legend()
    made["acceptance_by_position"] = _save(fig, out / "acceptance_by_position.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, sweep in report.get("sweeps", {}).items():
        ks = [r["num_draft_tokens"] for r in sweep]
        line, = ax.plot(ks, [r["speedup_vs_plain"] for r in sweep], marker="o", label=f"{name} measured")
        if all(r["predicted_speedup"] is not None for r in sweep):  # trees have no chain model
            ax.plot(ks, [r["predicted_speedup"] for r in sweep], linestyle="--", color=line.get_color(),
                    label=f"{name} predicted")
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xticks(sorted({r["num_draft_tokens"] for sweep in report.get("sweeps", {}).values() for r in sweep}))
    ax.set(xlabel="num_draft_tokens (k; a tree's size)", ylabel="speedup over plain decoding",
           title=f"Speedup vs k: {title}")
    ax.grid(alpha=0.3)
    if report.get("sweeps"):
        ax.legend()
    made["speedup_vs_k"] = _save(fig, out / "speedup_vs_k.png")

    categories = sorted({c for m in report["methods"].values() for c in m["per_category"]})
    names = [n for n in report["methods"] if n != "plain"]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(categories) + 2), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = [report["methods"][name]["per_category"].get(c, {}).get("speedup_vs_plain") or 0 for c in categories]
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=name)
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    ax.set(ylabel="speedup over plain decoding", title=f"Speedup by category: {title}")
    if names:
        ax.legend()
    made["per_category"] = _save(fig, out / "per_category.png")

    by_size = report.get("by_batch_size") or {}
    if by_size:
        sizes = sorted(by_size, key=int)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in [n for n in by_size[sizes[0]] if n != "plain"]:
            ax.plot([int(b) for b in sizes], [by_size[b][name]["speedup_vs_plain"] for b in sizes], marker="o",
                    label=name)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(b) for b in sizes], sizes)
        ax.set(xlabel="batch size", ylabel="speedup over plain decoding (same batch size)",
               title=f"Speedup vs batch size: {title}")
        ax.grid(alpha=0.3)
        ax.legend()
        made["speedup_vs_batch_size"] = _save(fig, out / "speedup_vs_batch_size.png")
    return made


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    rename(tmp, path)
    return path

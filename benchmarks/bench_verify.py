"""What one target forward costs by the number of tokens it verifies, for each step of our
CPU decode layout, in one process (interleaved repetitions, medians).

    python benchmarks/bench_verify.py [--context 300] [--reps 40]

A speculative step verifies k+1 tokens (a chain) or a token tree of any size in one target
forward after the cached context; the speedup is τ over that forward's cost v (in plain
decoding steps) plus the drafter's. Rows: the embedded target as transformers loads it;
with the small-batch product (W @ x.T).T alone (decode/layout.py); with oneDNN's reordered
weights from 3 rows; and with SDPA's own grouped-query attention (decode/attention.py), which
together are what `stage=eval` uses (eval.decode_layout=true). The draft column is one
decoding step of a draft of the CPU recipe's shape (2 layers, an 8192-token LM head) under
the same layout.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import pipeline.decode.layout as layout
from pipeline.decode.attention import gqa_attention
from pipeline.decode.kv import SlotCache
from pipeline.distill.draft import new_draft, restrict_vocabulary
from pipeline.models import load_target

WIDTHS = (1, 2, 3, 5, 9, 17)


def recipe_draft(target: torch.nn.Module, layered_like: torch.nn.Module) -> torch.nn.Module:
    """The CPU recipe's draft shape (conf/draft/new.yaml): 2 layers, 8192-token vocabulary."""
    draft = new_draft(target, num_layers=2, init_layers=[0, -1]).eval()
    restrict_vocabulary(draft, torch.arange(8192))
    if layout.is_decode_layout(layered_like):
        layout.decode_layout(draft)
    if layered_like.config._attn_implementation != draft.config._attn_implementation:
        gqa_attention(draft)
    return draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()

    target = load_target("smollm2_135m", device="cpu")
    loaded = target.model
    loaded.eval()
    small = copy.deepcopy(loaded)
    layout.decode_layout(small)
    onednn = copy.deepcopy(small)
    full = copy.deepcopy(small)
    gqa_attention(full)
    configs = [  # name, target, ONEDNN_MIN_ROWS
        ("nn.Linear, sdpa (as loaded)", loaded, layout.ONEDNN_MIN_ROWS),
        ("(W @ x.T).T", small, layout.MAX_ROWS + 1),
        ("+ oneDNN from 3 rows", onednn, layout.ONEDNN_MIN_ROWS),
        ("+ grouped-query SDPA (eval)", full, layout.ONEDNN_MIN_ROWS),
    ]
    drafts = {name: recipe_draft(loaded, model) for name, model, _ in configs}
    prompt = torch.randint(0, 8000, (1, args.context))
    default_min_rows = layout.ONEDNN_MIN_ROWS

    def cache(model):
        kv = SlotCache(model, 1, torch.device("cpu"))
        with torch.inference_mode():
            kv.forward(prompt, logits_to_keep=1)
        return kv

    def step(kv, width: int, keep: int) -> float:
        tokens = torch.full((1, width), 5)
        with torch.inference_mode():
            t0 = time.perf_counter()
            kv.forward(tokens, logits_to_keep=keep)
            seconds = time.perf_counter() - t0
            kv.keep_last(torch.zeros((1, width), dtype=torch.bool))  # back to the context
        return seconds

    caches = {name: (cache(model), cache(drafts[name])) for name, model, _ in configs}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps + 2):  # the first two warm up
        for name, _, min_rows in configs:
            layout.ONEDNN_MIN_ROWS = min_rows
            target_kv, draft_kv = caches[name]
            for width in WIDTHS:
                times.setdefault((name, f"t{width}"), []).append(step(target_kv, width, 0))
            times.setdefault((name, "draft"), []).append(step(draft_kv, 1, 1))
    layout.ONEDNN_MIN_ROWS = default_min_rows

    def median(name, col):
        values = sorted(times[(name, col)][2:])
        return values[len(values) // 2]

    base = median(configs[0][0], "t1")
    print(f"\nembedded target, context {args.context}, {torch.get_num_threads()} threads, medians of {args.reps}; "
          f"v = forward time / the same layout's 1-token forward")
    head = " | ".join(f"v({w} tok)" for w in WIDTHS)
    print(f"| layout | 1-token ms | vs as loaded | {head} | 2-layer draft step |")
    print("|---|---:|---:|" + "---:|" * len(WIDTHS) + "---:|")
    for name, _, _ in configs:
        one = median(name, "t1")
        vs = " | ".join(f"{median(name, f't{w}') / one:.2f}" for w in WIDTHS)
        print(f"| {name} | {one * 1e3:.1f} | {base / one:.2f}x | {vs} | {median(name, 'draft') / one:.3f} |")


if __name__ == "__main__":
    main()

"""What one target forward costs by the number of tokens it verifies, for each step of our
CPU decode layout, in one process (interleaved repetitions, medians).

    python benchmarks/bench_verify.py [--context 300] [--reps 40]

A speculative step verifies k+1 tokens (a chain) or a token tree of any size in one target
forward after the cached context; the speedup is τ over that forward's cost v (in plain
decoding steps) plus the drafter's. Rows: the embedded target as transformers loads it;
its linear layers all through (W @ x.T).T, then all through oneDNN's reordered weights
(kernels/linear.py); and through the product measured fastest per shape and row count on
this machine (the decode layout), which is what `stage=eval` uses (eval.decode_layout=true).
Every forward is our decoder's (static KV cache, grouped-query attention reading the shared
heads as they are). The products the decode layout chose follow the table. The draft column is one
decoding step of a draft of the CPU recipe's shape (2 layers, an 8192-token LM head) under
the same layout, in fp32 and with its linear layers in int8 (layout.int8_linears, what
`stage=eval` does to draft models on CPU by default, eval.draft_int8=true).
"""

from __future__ import annotations

import argparse
import copy

import torch

import pipeline.kernels.linear as layout
from pipeline.decode import StaticModel
from pipeline.decode.prepare import restrict_vocabulary
from pipeline.distill.draft import new_draft
from pipeline.eval.measure import forward_step, median_seconds
from pipeline.models import load_target

WIDTHS = (1, 2, 3, 5, 9, 17)


def recipe_draft(target: torch.nn.Module, *, small_batch: bool, int8: bool = False) -> torch.nn.Module:
    """The CPU recipe's draft shape (conf/draft/new.yaml): 2 layers, 8192-token vocabulary."""
    draft = new_draft(target, num_layers=2, init_layers=[0, -1]).eval()
    restrict_vocabulary(draft, torch.arange(8192))
    if int8:
        layout.int8_linears(draft)
    if small_batch:
        layout.decode_layout(draft)
    return draft


def with_product(product, step):
    """`step` with every small-batch linear call through `product` (None: the measured one)."""
    def run() -> None:
        layout.FORCE = product
        step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()

    target = load_target("smollm2_135m", device="cpu")
    loaded = target.model.eval()
    small = copy.deepcopy(loaded)
    layout.decode_layout(small)
    configs = [  # name, target, the draft's small-batch product, product
        ("nn.Linear (as loaded)", loaded, False, None),
        ("all (W @ x.T).T", small, True, "columns"),
        ("all oneDNN", copy.deepcopy(small), True, "onednn"),
        ("measured per shape and rows (eval)", copy.deepcopy(small), True, None),
    ]
    steps = {}
    for name, model, small_batch, product in configs:
        static = StaticModel(model)
        for width in WIDTHS:
            steps[name, width] = with_product(product, forward_step(static, width, args.context))
        for int8 in (False, True):
            draft = StaticModel(recipe_draft(loaded, small_batch=small_batch, int8=int8))
            steps[name, "draft", int8] = with_product(product, forward_step(draft, 1, args.context, logits_to_keep=1))
    seconds = median_seconds(steps, loaded, reps=args.reps)  # round-robin: drift touches all alike
    layout.FORCE = None

    base = seconds[configs[0][0], 1]
    print(f"\nembedded target, context {args.context}, {torch.get_num_threads()} threads, medians of {args.reps}; "
          f"v = forward time / the same layout's 1-token forward")
    head = " | ".join(f"v({w} tok)" for w in WIDTHS)
    print(f"| layout | 1-token ms | vs as loaded | {head} | 2-layer draft step | int8 draft step |")
    print("|---|---:|---:|" + "---:|" * len(WIDTHS) + "---:|---:|")
    for name, *_ in configs:
        one = seconds[name, 1]
        vs = " | ".join(f"{seconds[name, w] / one:.2f}" for w in WIDTHS)
        print(f"| {name} | {one * 1e3:.1f} | {base / one:.2f}x | {vs} | {seconds[name, 'draft', False] / one:.3f} "
              f"| {seconds[name, 'draft', True] / one:.3f} |")
    print(f"\nThe decode layout's products by rows ({', '.join(map(str, layout.ROW_BUCKETS))}):")
    for (out_features, in_features, dtype, _), chosen in sorted(layout._CHOICES.items(), key=str):
        print(f"- {out_features}x{in_features} {str(dtype).replace('torch.', '')}: {' '.join(chosen)}")


if __name__ == "__main__":
    main()

"""Our decoder's speed by drafter kind on this machine, and against another commit's decoder.

    python benchmarks/bench_decode.py [--conversations 4] [--max-new-tokens 64] [--heads-run RUN] [--draft DIR]
    python benchmarks/bench_decode.py --compare REF [--rounds 3] [...]

One process decodes MT-bench conversations (both turns, greedy, fp32 on CPU, the CPU decode
layout and int8 drafts as `stage=eval` sets them) with plain decoding, prompt lookup, a draft
model (the target's first 4 layers), Medusa, EAGLE and early-exit chains, and Medusa and EAGLE
trees, the methods taking turns on every conversation (eval's rotation), and prints tokens/s,
τ and the speedup over plain decoding. The heads are built from a fixed seed (random weights,
so they are rarely accepted) unless --heads-run names a run whose trained heads to load
(runs/<RUN>/heads/<kind>, each kind where there is one); --draft loads a trained draft model
(a save_pretrained folder, e.g. runs/demo/distill/checkpoint) instead of the first layers.

--compare REF checks a refactor: it puts REF's pipeline/ in a git worktree and runs this
script alternately with REF's and this checkout's package (the order flips each round), then
prints, per method, the median tokens/s of each side over the rounds and their ratio, the
median of the rounds' own ratios (each round's two runs are adjacent in time, so this one
cancels the machine's slow drift), and whether both sides emitted the same tokens. The script
uses only what both sides offer (pipeline.eval.measure's make_decode and measure).

Each process measures which small-batch product (pipeline/kernels/linear.py) is fastest for
each weight shape, and timing noise can make two processes choose differently; the table
counts the shapes whose choice differs from the first round's. --product linear (or columns,
onednn) pins one product on both sides, so rounds compare the decoders alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K = 3  # draft tokens per chain (early exit: 2)
BUDGET = 8  # tree nodes
METHODS = [("plain", None), ("ngram", K), ("draft_model", K), ("medusa", K), ("eagle", K), ("early_exit", 2),
           ("medusa_tree", BUDGET), ("eagle_tree", BUDGET)]
HEADS = {"medusa": dict(num_heads=3, num_layers=1), "eagle": dict(feature_layers=[2, 15, 27], ttt_steps=1),
         "early_exit": dict(exit_layer=8, adapter_rank=64)}


def random_heads(kind: str, target):
    import torch

    from pipeline.heads.models import build_heads

    heads = build_heads(kind, target, torch.arange(target.config.vocab_size), HEADS[kind])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return heads.eval()


def measure_here(args) -> dict:
    """{method: tokens/s, τ, tokens, seconds} with the pipeline package this process imports."""
    import torch

    from pipeline.data.chat import eos_token_ids, first_prompt_ids
    from pipeline.data.sources import load_conversations
    from pipeline.decode.prepare import prepare_for_decoding
    from pipeline.distill.draft import first_layers_draft, load_draft
    from pipeline.eval.measure import Method, Settings, make_decode, measure
    from pipeline.heads.models import load_heads
    from pipeline.kernels import linear
    from pipeline.kinds import DraftOptions
    from pipeline.models import load_target

    if args.product:
        linear.FORCE = args.product
    torch.manual_seed(0)
    target = load_target("smollm2_135m", device="cpu")
    model, tok = target.model.eval(), target.tokenizer
    convs = load_conversations("mtbench", limit=args.conversations).conversations
    draft = load_draft(Path(args.draft), target) if args.draft else first_layers_draft(model, 4)
    drafts = {"draft_model": draft.eval()}
    heads = {}
    for kind in (k for k in HEADS if any(name.startswith(k) for name, _ in METHODS)):
        trained = REPO / "runs" / (args.heads_run or "") / "heads" / kind
        heads[kind] = load_heads(trained, model) if args.heads_run and trained.is_dir() else random_heads(kind, model)
    int8 = tuple(name for name in ("draft_model", "medusa") if name in drafts or name in heads)
    prepare_for_decoding(model, drafts, layout=True, compare_hf=False, heads=heads, int8=int8)
    settings = Settings(model=model, tokenizer=tok, eos_ids=set(eos_token_ids(target.generation_config, tok)),
                        max_new_tokens=args.max_new_tokens, drafting=DraftOptions(tree_depth=4, tree_topk=4))
    modules = {**drafts, **heads}
    methods = {name: Method(make_decode(name, settings, k, modules.get(name.removesuffix("_tree"))), name, k)
               for name, k in METHODS}
    short = dataclasses.replace(settings, max_new_tokens=4)  # a warm-up of every method: allocations, thread pools
    for name, k in METHODS:
        make_decode(name, short, k, modules.get(name.removesuffix("_tree")))([first_prompt_ids(tok, convs[0])])
    results = measure(methods, convs, settings)
    out = {name: dict(tokens_per_s=m.total.tokens_per_s, tau=m.total.tau, tokens=m.total.tokens,
                      seconds=m.total.seconds, outputs=m.outputs) for name, m in results.items()}
    out["products"] = {" ".join(map(str, key)): list(value) for key, value in linear._CHOICES.items()}
    return out


def run_side(root: Path, args) -> dict:
    """This script in a child process whose `pipeline` package is root's."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--json-out", out.name, "--conversations", str(args.conversations),
                   "--max-new-tokens", str(args.max_new_tokens)]
        command += ["--heads-run", args.heads_run] if args.heads_run else []
        command += ["--draft", args.draft] if args.draft else []
        command += ["--methods", args.methods] if args.methods else []
        command += ["--product", args.product] if args.product else []
        env = dict(os.environ, PYTHONPATH=str(root))
        subprocess.run(command, env=env, check=True, cwd=REPO)
        return json.loads(Path(out.name).read_text())


def compare(args) -> None:
    sha = subprocess.run(["git", "rev-parse", args.compare], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    base = Path(tempfile.gettempdir()) / f"specdraft-bench-{sha[:12]}"
    if not (base / "pipeline").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(base), sha], cwd=REPO, check=True,
                       capture_output=True)
    sides = {f"{args.compare} ({sha[:7]})": base, "this checkout": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run_side(sides[name], args))
    before, after = runs.values()
    print(f"\n{args.conversations} MT-bench conversations (both turns), {args.max_new_tokens} new tokens, greedy, "
          f"fp32, {args.rounds} rounds alternating (medians); chains k={K} (early exit 2), trees {BUDGET} nodes")
    print("| method | τ before | τ after | same tokens | tokens/s before | tokens/s after | after / before "
          "| paired (median) | per round (min–max) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, _ in METHODS:
        b = statistics.median(r[name]["tokens_per_s"] for r in before)
        a = statistics.median(r[name]["tokens_per_s"] for r in after)
        rounds = [y[name]["tokens_per_s"] / x[name]["tokens_per_s"] for x, y in zip(before, after)]
        tau = lambda rs: f"{rs[0][name]['tau']:.2f}" if rs[0][name]["tau"] else "–"
        same = "yes" if before[0][name]["outputs"] == after[0][name]["outputs"] else "**no**"
        print(f"| {name} | {tau(before)} | {tau(after)} | {same} | {b:.2f} | {a:.2f} | {a / b:.3f}x "
              f"| {statistics.median(rounds):.3f}x | {min(rounds):.3f}–{max(rounds):.3f} |")
    first = before[0]["products"]
    changed = [sum(r["products"].get(key) != choice for key, choice in first.items()) for r in before + after]
    print(f"\nlinear products: {args.product or 'measured per process'}; weight shapes whose choice differs from "
          f"the first round's, per run: {changed} of {len(first)}")
    speed = lambda rs, n: statistics.median(r[n]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rs)
    print("\nspeedup over plain decoding in the same run (median): "
          + ", ".join(f"{n} {speed(before, n):.2f}x -> {speed(after, n):.2f}x" for n, _ in METHODS[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heads-run", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--compare", default=None, help="a git ref whose decoder to measure against, interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=None, help="comma-separated: measure only these (plain always)")
    parser.add_argument("--product", choices=("linear", "columns", "onednn"), default=None,
                        help="pin the CPU small-batch product on both sides (default: each process measures)")
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.methods:
        keep = {"plain", *args.methods.split(",")}
        METHODS[:] = [m for m in METHODS if m[0] in keep]
    if args.compare:
        compare(args)
        return
    from pipeline.__main__ import quiet_library_progress_bars

    quiet_library_progress_bars()
    results = measure_here(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results))
        return
    plain = results["plain"]["tokens_per_s"]
    print(f"\n{args.conversations} MT-bench conversations (both turns), {args.max_new_tokens} new tokens, greedy, fp32")
    print("| method | k / nodes | τ | tokens/s | vs plain |")
    print("|---|---:|---:|---:|---:|")
    for name, k in METHODS:
        r = results[name]
        tau = f"{r['tau']:.2f}" if r["tau"] else "–"
        print(f"| {name} | {k or '–'} | {tau} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / plain:.2f}x |")


if __name__ == "__main__":
    main()

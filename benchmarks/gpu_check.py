"""`make gpu-check`: on a CUDA machine, our decoder's CUDA tests and its numbers, in one run.

    python3 benchmarks/gpu_check.py --out DIR [--mtbench FILE] [--sharegpt FILE] [--budget-s 540]

Writes DIR/gpu_check.json and DIR/gpu_check.md (and prints the table):

1. tests: the kernel tests and our decoder's CUDA tests (pytest, on this GPU);
2. decode: the embedded target in bf16, MT-bench (one conversation per category, both
   turns), greedy, 128 new tokens, batch 1: our plain decoding and prompt lookup with CUDA
   graphs, our plain decoding without them (eager launches), transformers' eager `generate`
   and its `generate` with a static cache (compiled, the fastest a transformers user gets);
   tokens/s, τ, and whether each output equals plain decoding's (differences only at bf16
   near-ties);
3. verify: a verification of w tokens against a 1-token step (graph replays, medians of
   interleaved timings), w = 1 .. 64;
4. batch: the generate stage's decoding of ShareGPT first turns at batch 256 (256 new
   tokens, 512 prompts, continuous batching), with and without CUDA graphs.

Each part records its error instead of stopping the run; parts left when the budget runs
out are marked skipped. Run it with the machine's own python (`make gpu-check PY=python3`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CUDA_TESTS = ["tests/kernels", "tests/decode/test_fast_cuda.py", "tests/decode/test_fast.py"]
WIDTHS = [1, 2, 4, 8, 16, 32, 64]


def part(results: dict, name: str, deadline: float, fn) -> None:
    """Run one part into results[name]: its numbers, or its error, or skipped past the deadline."""
    if time.monotonic() > deadline:
        results[name] = {"skipped": "out of time"}
        return
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except Exception:  # a part that fails is reported; the others still run
        results[name] = {"error": traceback.format_exc(limit=8)}
    results[name]["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"gpu-check: {name} done in {results[name]['wall_s']} s", flush=True)


def run_tests(timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "tail": lines[-30:]}


def conversations(source: str, path, per_category=None, limit=None):
    from pipeline.data.sources import load_conversations

    return load_conversations(source, path, per_category=per_category, limit=limit).conversations


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_part(target, mtbench, max_new_tokens: int, graphs: bool) -> dict:
    import copy

    import torch

    from pipeline.data.chat import eos_token_ids
    from pipeline.eval.measure import Method, Settings, greedy_divergences, make_decode, measure

    model, tok = target.model, target.tokenizer
    hf = copy.deepcopy(model)  # transformers' methods on the model exactly as transformers loads it
    eos = set(eos_token_ids(model.generation_config, tok))
    fast = Settings(model=model, tokenizer=tok, eos_ids=eos, max_new_tokens=max_new_tokens, graphs=graphs, hf_model=hf)
    eager = Settings(model=model, tokenizer=tok, eos_ids=eos, max_new_tokens=max_new_tokens, hf_model=hf)

    def hf_static(prompts):
        from pipeline.decode.types import DecodeResult

        out = []
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=sorted(eos), pad_token_id=tok.pad_token_id,
                                 cache_implementation="static")[0, len(p):].tolist()
            out.append(new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))])
        return DecodeResult(out, [len(o) for o in out])

    t0 = time.perf_counter()
    hf_static([[tok.eos_token_id] * 8])  # compiles (its time is reported, not counted in tokens/s)
    compile_s = time.perf_counter() - t0
    methods = {"plain (graphs)": Method(make_decode("plain", fast), "plain"),
               "ngram k=4 (graphs)": Method(make_decode("ngram", fast, 4), "ngram", 4),
               "ngram k=2 (graphs)": Method(make_decode("ngram", fast, 2), "ngram", 2),
               "plain (no graphs, eager)": Method(make_decode("plain", eager), "plain"),
               "hf_generate (eager)": Method(make_decode("hf_generate", eager), "hf_generate"),
               "hf_generate (static cache, compiled)": Method(hf_static, "hf_static")}
    for m in methods.values():  # warm-up: graph captures and allocations
        m.decode([[tok.eos_token_id] * 8])
    results = measure(methods, mtbench, fast)
    plain = results["plain (graphs)"]
    rows = {}
    for name, m in results.items():
        found = greedy_divergences(model, plain, m) if name != "plain (graphs)" else []
        rows[name] = dict(tokens_per_s=m.total.tokens_per_s, tau=m.total.tau, tokens=m.total.tokens,
                          divergences=len(found), near_tie_divergences=sum(d.tie for d in found))
    return {"methods": rows, "hf_static_compile_s": compile_s, "turns": sum(len(c.user_turns) for c in mtbench),
            "max_new_tokens": max_new_tokens}


def verify_part(target, graphs: bool, widths: list[int]) -> dict:
    from pipeline.decode.static_kv import StaticModel
    from pipeline.eval.measure import forward_step, median_seconds

    fast = StaticModel(target.model, graphs=graphs)
    seconds = median_seconds({w: forward_step(fast, w) for w in widths}, target.model, reps=30)
    return {"ms": {w: 1000 * s for w, s in seconds.items()}, "vs_one": {w: s / seconds[1] for w, s in seconds.items()}}


def batch_part(target, sharegpt, batch: int, max_new_tokens: int, graphs: bool) -> dict:
    """The generate stage's decoding: 2 x batch ShareGPT first turns through `batch` rows
    (continuous batching), with CUDA graphs (`graphs`) and without."""
    from pipeline.data.chat import eos_token_ids, first_prompt_ids
    from pipeline.decode import StaticModel, continuous_decode

    tok = target.tokenizer
    eos = set(eos_token_ids(target.generation_config, tok))
    prompts = [first_prompt_ids(tok, c)[-512:] for c in sharegpt[: 2 * batch]]
    fast, eager = StaticModel(target.model, graphs=graphs), StaticModel(target.model)
    continuous_decode(fast, prompts[:batch], batch_size=batch, max_new_tokens=4, eos_ids=eos)  # capture
    runs = {"continuous batching (graphs)": lambda: continuous_decode(
                fast, prompts, batch_size=batch, max_new_tokens=max_new_tokens, eos_ids=eos),
            "continuous batching (no graphs)": lambda: continuous_decode(
                eager, prompts, batch_size=batch, max_new_tokens=max_new_tokens, eos_ids=eos)}
    out, answers = {}, {}
    for name, run in runs.items():
        sync()
        t0 = time.perf_counter()
        result = run()
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, result.tokens))
        out[name] = dict(prompts=len(result.tokens), tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)
        answers[name] = result.tokens[:batch]
    same = sum(a == b for a, b in zip(*answers.values()))
    return {"batch": batch, "max_new_tokens": max_new_tokens, "rows": out, "identical_answers": same}


def markdown(results: dict) -> str:
    lines = [f"# gpu-check: {results['device']}", "", f"torch {results['torch']}, transformers "
             f"{results['transformers']}, triton {results['triton']}", ""]
    tests = results.get("tests", {})
    lines += [f"Tests ({' '.join(CUDA_TESTS)}): {tests.get('summary') or tests.get('error') or tests.get('skipped')}", ""]
    dec = results.get("decode", {})
    if "methods" in dec:
        lines += [f"MT-bench, {dec['turns']} turns, greedy, {dec['max_new_tokens']} new tokens, batch 1, {results['dtype']} "
                  f"(HF static-cache compile: {dec['hf_static_compile_s']:.0f} s, not counted):", "",
                  "| method | tokens/s | vs plain (graphs) | τ | differs from plain (near-ties) |", "|---|---:|---:|---:|---|"]
        base = dec["methods"]["plain (graphs)"]["tokens_per_s"]
        for name, m in dec["methods"].items():
            tau = f"{m['tau']:.2f}" if m["tau"] else "–"
            lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['tokens_per_s'] / base:.2f}x | {tau} | "
                         f"{m['divergences']} ({m['near_tie_divergences']}) |")
        lines.append("")
    ver = results.get("verify", {})
    if "ms" in ver:
        lines += [f"Verification of w tokens ({'CUDA graph replay' if results['device'] != 'cpu' else 'no graphs'}"
                  ", context 128):", "",
                  "| w | ms | vs w=1 |", "|---:|---:|---:|"]
        lines += [f"| {w} | {ver['ms'][w]:.3f} | {ver['vs_one'][w]:.2f}x |" for w in ver["ms"]]
        lines.append("")
    bat = results.get("batch", {})
    if "rows" in bat:
        lines += [f"ShareGPT first turns, batch {bat['batch']}, {bat['max_new_tokens']} new tokens (the first "
                  f"{bat['batch']} answers identical in both: {bat['identical_answers']}):", "",
                  "| decoder | prompts | tokens | s | tokens/s |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {r['prompts']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f} |"
                  for n, r in bat["rows"].items()]
    for name in ("tests", "decode", "verify", "batch"):
        if "error" in results.get(name, {}):
            lines += ["", f"{name} failed:", "```", results[name]["error"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check")
    parser.add_argument("--mtbench", help="MT-bench question.jsonl (default: the embedded one)")
    parser.add_argument("--sharegpt", help="ShareGPT jsonl (default: the embedded one)")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--smoke", action="store_true",
                        help="a minute's version on any machine (CPU: fp32, no graphs, no tests): checks the script")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("gpu-check: no CUDA device (--smoke runs the script's small version on CPU)")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "triton": triton_version, "smoke": args.smoke}
    if args.smoke:
        results["tests"] = {"skipped": "--smoke"}
    else:
        part(results, "tests", deadline, lambda: run_tests(int(max(60, min(240, deadline - time.monotonic())))))

    from pipeline.models import load_target

    results["dtype"] = "bfloat16" if cuda else "float32"
    target = load_target("smollm2_135m", device="cuda" if cuda else "cpu", dtype=results["dtype"])
    source = lambda path, name: ("file", path) if path else (name, None)
    new_tokens, batch, limit = (8, 2, 2) if args.smoke else (args.max_new_tokens, args.batch, None)
    part(results, "decode", deadline, lambda: decode_part(
        target, conversations(*source(args.mtbench, "mtbench"), per_category=1, limit=limit), new_tokens, cuda))
    part(results, "verify", deadline, lambda: verify_part(target, cuda, WIDTHS[:3] if args.smoke else WIDTHS))
    part(results, "batch", deadline, lambda: batch_part(
        target, conversations(*source(args.sharegpt, "sharegpt"), limit=2 * batch), batch, 2 * new_tokens, cuda))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

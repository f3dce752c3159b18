"""Operations per emitted token of plain decoding: a count, where timings on a small CPU are noisy.

    PYTHONPATH=<checkout> python benchmarks/count_ops.py [--product linear] [--top 25]

Plain decoding (the embedded target, fp32 on CPU, the CPU decode layout, as bench_decode sets
it) of one MT-bench prompt, 8 and then 24 new tokens; the aten ops each dispatches (a
TorchDispatchMode) and the Python calls it makes (sys.setprofile) are counted, and the
difference over the 16 extra tokens is printed per token, the most frequent first. It uses
only what older checkouts also offer, so PYTHONPATH can point at another commit's worktree
(e.g. the one `bench_decode.py --compare` makes) to compare the two.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHORT, LONG = 8, 24


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_calls(fn) -> collections.Counter:
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            counts[f"{frame.f_code.co_filename.split('site-packages/')[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            counts[f"C:{getattr(arg, '__qualname__', arg)}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--product", choices=("linear", "columns", "onednn"), default="linear",
                        help="the CPU small-batch product every layer uses (a measured choice varies by process)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    from pipeline.data.chat import first_prompt_ids
    from pipeline.data.sources import load_conversations
    from pipeline.decode.prepare import prepare_for_decoding
    from pipeline.eval.measure import Settings, make_decode
    from pipeline.kernels import linear
    from pipeline.kinds import DraftOptions
    from pipeline.models import load_target

    linear.FORCE = args.product
    torch.manual_seed(0)
    target = load_target("smollm2_135m", device="cpu")
    model, tok = target.model.eval(), target.tokenizer
    prepare_for_decoding(model, {}, layout=True, compare_hf=False, heads={}, int8=())
    prompts = [first_prompt_ids(tok, load_conversations("mtbench", limit=1).conversations[0])]
    ops, calls = {}, {}
    for n in (SHORT, LONG):
        settings = Settings(model=model, tokenizer=tok, eos_ids=set(), max_new_tokens=n,
                            drafting=DraftOptions(tree_depth=4, tree_topk=4))
        decode = make_decode("plain", settings, None, None)
        decode(prompts)  # warm-up: lazy set-up is not per token
        with CountOps() as mode:
            decode(prompts)
        ops[n] = mode.counts
        calls[n] = count_calls(lambda: decode(prompts))
    for title, counts in (("aten ops", ops), ("Python calls", calls)):
        per_token = {k: (counts[LONG][k] - counts[SHORT][k]) / (LONG - SHORT) for k in counts[LONG] | counts[SHORT]}
        print(f"\n{title} per token: {sum(per_token.values()):.1f}")
        for name, count in sorted(per_token.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{count:8.1f}  {name}")


if __name__ == "__main__":
    main()

"""What one distill training step of the CPU recipe costs in fp32 and under bf16 autocast,
in one process (alternating repetitions, medians).

    python benchmarks/bench_train.py [--batch-size 8] [--length 512] [--reps 3]

The step is the recipe's (conf/draft/new.yaml, experiment=recipe_cpu): a 2-layer draft of the
embedded target with frozen tied embeddings, logits over an 8192-token draft vocabulary at
the answer positions (half of each sequence here), forward KL against a random teacher,
backward and an AdamW step. `distill.precision=auto` picks bf16 only where this machine
computes it natively; the table says what auto would pick here and what the other choice
would cost.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.distill.draft import new_draft
from pipeline.distill.stage import selected_logits
from pipeline.distributed import native_bf16, resolve_precision
from pipeline.models import load_target


def recipe_step(draft, optimizer, vocab, batch_size: int, length: int, bf16: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(vocab), (batch_size, length), generator=gen)
    mask = torch.ones_like(ids)
    rows, cols = torch.meshgrid(torch.arange(batch_size), torch.arange(length // 2, length - 1), indexing="ij")
    teacher = torch.randn((rows.numel(), len(vocab)), generator=gen).log_softmax(-1)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = selected_logits(draft, ids, mask, rows.flatten(), cols.flatten(), vocab)
    loss = torch.nn.functional.kl_div(logits.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3, help="timed steps per precision, after one warm-up each")
    args = parser.parse_args()

    target = load_target("smollm2_135m", dtype="float32", device="cpu")
    draft = new_draft(target.model, num_layers=2, init_layers=[0, -1]).train()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        module.weight.requires_grad_(False)
    vocab = torch.arange(8192)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for rep in range(args.reps + 1):
        for name in times:  # alternating, so drifts in machine speed hit both alike
            seconds = recipe_step(draft, optimizer, vocab, args.batch_size, args.length, name == "bf16")
            if rep:
                times[name].append(seconds)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16('cpu')}, "
          f"distill.precision=auto -> {resolve_precision('auto', 'cpu')}; "
          f"batch {args.batch_size} x {args.length} tokens, {torch.get_num_threads()} threads")
    print("| precision | s/step (median) | vs fp32 |")
    print("|---|---|---|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds:.2f} | {seconds / median['fp32']:.2f}x |")


if __name__ == "__main__":
    main()

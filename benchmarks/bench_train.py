"""What one distill training step of the CPU recipe's shape costs, padded and packed, in fp32
and bf16, in one process (alternating repetitions, medians); on CUDA where there is a GPU.

    python benchmarks/bench_train.py [--batch-size 8] [--length 512] [--reps 3]

The step is the recipe's (conf/draft/new.yaml, experiment=recipe_cpu): a 2-layer draft of the
embedded target with frozen tied embeddings, logits over an 8192-token draft vocabulary at
the answer positions (the second half of each conversation), forward KL against a random
teacher, backward and an AdamW step. The batch's conversations are 1/8 to all of --length
tokens long, as chat data is: `padded` computes every row to the longest, `packed`
(distill.pack=true) shares rows between conversations. tokens/s counts real tokens.
`distill.precision=auto` picks bf16 only where this device computes it natively; the table
says what auto would pick here and what the other choice costs.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.distill.data import Example, collate
from pipeline.distill.draft import new_draft
from pipeline.distill.stage import selected_logits
from pipeline.distributed import native_bf16, resolve_precision
from pipeline.models import load_target


def chat_batch(batch_size: int, length: int, vocab: int) -> list[Example]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 8, length + 1, (batch_size,), generator=gen).tolist()
    return [Example(str(i), torch.randint(0, vocab, (n,), generator=gen).tolist(), list(range(n // 2, n - 1)))
            for i, n in enumerate(lengths)]


def recipe_step(draft, optimizer, vocab, examples: list[Example], pack: bool, bf16: bool, device) -> tuple[float, int]:
    batch = collate(examples, 0, False, pack).to(device)
    teacher = torch.randn((len(batch.rows), len(vocab)), generator=torch.Generator().manual_seed(1))
    teacher = teacher.log_softmax(-1).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = selected_logits(draft, batch.input_ids, batch.model_mask(), batch.rows, batch.cols, vocab,
                                 batch.position_ids)
    loss = torch.nn.functional.kl_div(logits.float().log_softmax(-1), teacher, log_target=True, reduction="batchmean")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, int(batch.attention_mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3, help="timed steps per setting, after one warm-up each")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target("smollm2_135m", dtype="float32", device=str(device))
    draft = new_draft(target.model, num_layers=2, init_layers=[0, -1]).train()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        module.weight.requires_grad_(False)
    vocab = torch.arange(8192, device=device)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    examples = chat_batch(args.batch_size, args.length, len(vocab))
    settings = [(layout, precision) for layout in ("padded", "packed") for precision in ("fp32", "bf16")]
    times: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    tokens = 0
    for rep in range(args.reps + 1):
        for layout, precision in settings:  # alternating, so drifts in machine speed hit all alike
            seconds, tokens = recipe_step(draft, optimizer, vocab, examples, layout == "packed", precision == "bf16",
                                          device)
            if rep:
                times[(layout, precision)].append(seconds)
    median = {s: sorted(t)[len(t) // 2] for s, t in times.items()}
    rows = {layout: collate(examples, 0, False, layout == "packed").input_ids.shape for layout in ("padded", "packed")}
    where = (f"GPU {torch.cuda.get_device_name()}" if device.type == "cuda" else
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print(f"{where}, native bf16: {native_bf16(device.type)}, distill.precision=auto -> "
          f"{resolve_precision('auto', device.type)}; {args.batch_size} conversations, {tokens} tokens "
          f"(padded {rows['padded'][0]} x {rows['padded'][1]}, packed {rows['packed'][0]} x {rows['packed'][1]})")
    base = median[("padded", "fp32")]
    print("| layout | precision | s/step (median) | tokens/s | vs padded fp32 |")
    print("|---|---|---:|---:|---:|")
    for (layout, precision), seconds in median.items():
        print(f"| {layout} | {precision} | {seconds:.3f} | {tokens / seconds:,.0f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()

"""Throughput of the generate stage against HF `generate`, in one process, and of its server
backend against llama.cpp's server.

    python benchmarks/bench_generate.py [--num-prompts 16] [--max-new-tokens 64] [--topk 32] [--no-server]

Every run regenerates the first turn of the same ShareGPT prompts with the embedded target,
greedy, in the target's default dtype; tokens/s counts generated tokens only. HF generate at
the stage's batch size is what the stage decoded with before it used our own decoder. The
last two rows also keep the target's top-k logits at every generated token (the offline
distillation teacher): read off the logits decoding chose each token from (the stage's way),
or from a second, teacher-forced pass over the finished answers (its earlier way).

The server rows (generate.backend=server, with top-k) start llama.cpp's llama-server (built by
`make setup-server`) on 127.0.0.1 with the embedded target's own GGUF, which it runs quantized
(Q4_1) on the same CPU cores with up to 16 parallel slots, and send the same conversations at
concurrency 1, 8 and 64: a different engine and precision, so the rows compare throughput, not
outputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.config import GenerateConfig
from pipeline.data.chat import eos_token_ids, first_prompt_ids
from pipeline.data.generate import regenerate, topk_logits
from pipeline.data.sources import load_conversations
from pipeline.models import load_target


def hf_generate_batch1(target, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    eos = eos_token_ids(target.generation_config, target.tokenizer)
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=target.device)
            out = target.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=eos, pad_token_id=target.tokenizer.pad_token_id,
            )
            new = out[0, ids.shape[1]:].tolist()
            tokens += next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return tokens, time.perf_counter() - t0


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [B, S] left-padded with pad_id, and which entries are real [B, S]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
    return ids, valid


def hf_generate_batched(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple[int, float]:
    """transformers' generate on left-padded, length-sorted batches."""
    eos = eos_token_ids(target.generation_config, target.tokenizer)
    pad = target.tokenizer.pad_token_id
    order = sorted(prompts, key=len, reverse=True)
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            ids, valid = left_pad(order[start : start + batch_size], pad, target.device)
            out = target.model.generate(
                input_ids=ids, attention_mask=valid.long(), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=eos, pad_token_id=pad,
            )
            for new in out[:, ids.shape[1]:].tolist():
                tokens += next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return tokens, time.perf_counter() - t0


def ours(target, convs, max_new_tokens: int, batch_size: int, topk: int = 0,
         teacher_forced: bool = False) -> tuple[int, float]:
    t0 = time.perf_counter()
    rows = regenerate(
        target, convs, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
        batch_size=batch_size, max_length=4096, max_turns=1, topk=0 if teacher_forced else topk,
    )
    if teacher_forced:
        topk_logits(target.model, rows, topk, batch_size)
    assert not topk or all(len(r["topk_ids"]) == sum(r["loss_mask"]) for r in rows)
    return sum(sum(r["loss_mask"]) for r in rows), time.perf_counter() - t0


def served(target, convs, max_new_tokens: int, topk: int, concurrency: list[int]) -> list[tuple[str, int, float]]:
    """The server backend's tokens and seconds at each concurrency, against a llama.cpp server
    started here (and stopped)."""
    from pipeline import llama_cpp
    from pipeline.config import ServerConfig
    from pipeline.data.chat import eos_token_ids as eos_of
    from pipeline.data.generate import end_of_turn_id
    from pipeline.data.server import Pieces, Settings, generate_shards
    from pipeline.models import EMBEDDED_TARGETS, installed_package_dir

    _, import_name, gguf = EMBEDDED_TARGETS["smollm2_135m"]
    slots = min(max(concurrency), 16)  # requests beyond the server's slots wait in its queue
    per_slot = 512 + max_new_tokens  # prompts of at most 256 tokens, the chat template, the answer
    rows = []
    with llama_cpp.Server(installed_package_dir(import_name) / gguf,
                          ["-c", str(per_slot * slots), "-np", str(slots), "-t", str(torch.get_num_threads())]) as server:
        url = server.url
        tok = target.tokenizer
        eos = eos_of(target.generation_config, tok)
        settings = Settings(tokenizer=tok, pieces=Pieces(tok), max_new_tokens=max_new_tokens, temperature=0.0,
                            top_p=1.0, max_length=4096, max_turns=1, topk=topk, end_of_turn=end_of_turn_id(tok, eos),
                            eos_ids=set(eos), seed=0)
        probe = first_prompt_ids(tok, convs[0])
        for c in concurrency:
            tokens = [0]
            t0 = time.perf_counter()
            generate_shards(ServerConfig(urls=[url], concurrency=c), {0: convs}, settings,
                            lambda index, shard, counts, failed, model: None, probe,
                            progress=lambda turns, n: tokens.__setitem__(0, tokens[0] + n))
            rows.append((f"server (llama.cpp), concurrency {c}", tokens[0], time.perf_counter() - t0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=GenerateConfig.batch_size)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--no-server", action="store_true", help="leave out the llama.cpp server rows")
    args = parser.parse_args()

    target = load_target("smollm2_135m")
    tok = target.tokenizer
    convs = load_conversations(
        "sharegpt", split="train", limit=args.num_prompts, max_prompt_tokens=256,
        prompt_length=lambda c: len(first_prompt_ids(tok, c)),
    ).conversations
    prompts = [first_prompt_ids(tok, c) for c in convs]
    ours(target, convs[:2], 8, 2)  # warm-up: first-call allocations and thread pools

    n, b, k = args.max_new_tokens, args.batch_size, args.topk
    rows = [
        ("HF generate, batch 1", *hf_generate_batch1(target, prompts, n)),
        (f"HF generate, batch {b}", *hf_generate_batched(target, prompts, n, b)),
        ("specdraft generate, batch 1", *ours(target, convs, n, 1)),
        (f"specdraft generate, batch {b}", *ours(target, convs, n, b)),
        (f"  + top-{k} logits while decoding", *ours(target, convs, n, b, k)),
        (f"  + top-{k} logits, teacher-forced pass", *ours(target, convs, n, b, k, teacher_forced=True)),
    ]
    if not args.no_server:
        rows += served(target, convs, n, min(k, 20), [1, 8, 64])
    base = rows[0][1] / rows[0][2]
    dtype = next(target.model.parameters()).dtype
    print(f"\n{len(prompts)} ShareGPT prompts, max_new_tokens={args.max_new_tokens}, greedy, "
          f"{dtype}, {torch.get_num_threads()} threads, device {target.device}")
    batched = rows[1][1] / rows[1][2]
    print(f"| {'method':<38} | tokens | seconds | tokens/s | vs HF batch 1 | vs HF batch {b} |")
    print(f"|{'-' * 40}|-------:|--------:|---------:|--------------:|---------------:|")
    for name, tokens, secs in rows:
        rate = tokens / secs
        print(f"| {name:<38} | {tokens:>6} | {secs:>7.1f} | {rate:>8.1f} | {rate / base:>12.2f}x | "
              f"{rate / batched:>13.2f}x |")


if __name__ == "__main__":
    main()

"""Our decoder: plain and speculative chain decoding over static KV caches, at fixed shapes,
with the per-step work on the device; the same code on a CPU and on CUDA (where every forward
replays a captured CUDA graph).

Each row keeps its committed tokens (prompt + emitted) in a device buffer `tokens` [B, T]
with its count in `lengths` [B]; the target's cache holds all but the last. A step:

1. the drafter proposes k tokens per row from the device state (Drafter.propose);
2. the target verifies [last, d_1..d_k] in one forward of width k+1 (a CUDA graph replay on
   CUDA), each row at its own slots;
3. the fused acceptance (pipeline/kernels/acceptance.py) gives each row's accepted length n
   and next token; the accepted tokens and the next one are written into `tokens` and
   `lengths` grows by n + 1, on the device: a rejected draft's cache slots are simply
   written over by the next step;
4. one small device->host copy of (n, emitted tokens) per step feeds the host's stopping
   rules (end of turn, max_new_tokens) and the counts behind τ and α.

Rows never leave the batch (shapes stay fixed): a finished row stops growing and its results
are ignored. Greedy output equals the target's greedy decoding, sampled output is distributed
as the target's (tests/decode/test_sampling.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pipeline.decode.sampling import next_token, process_logits
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.types import DecodeResult, Drafter, Rows, Sequences
from pipeline.kernels.acceptance import accept_greedy, accept_sampling


def plain_decode(target: StaticModel, prompts: list[list[int]], **settings) -> DecodeResult:
    """One token per target pass (speculative_decode without a drafter)."""
    return speculative_decode(target, None, prompts, num_draft_tokens=0, **settings)


@torch.inference_mode()
def speculative_decode(
    target: StaticModel, drafter: Optional[Drafter], prompts: list[list[int]], *, num_draft_tokens: int,
    max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0, top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Lossless speculative decoding of chains (plain decoding where drafter is None)."""
    k = num_draft_tokens if drafter is not None else 0
    device, b = target.device, len(prompts)
    max_len = max(map(len, prompts)) + max_new_tokens + k + 2
    target.ready(b, max_len)
    seqs = Sequences(torch.zeros((b, target.max_len), dtype=torch.long, device=device),
                     torch.tensor([len(p) for p in prompts], device=device))
    for row, p in enumerate(prompts):
        seqs.tokens[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    rows = Rows(prompts, max_new_tokens, eos_ids)
    layers = tuple(getattr(drafter, "feature_layers", ()))  # target hidden states the drafter reads
    out = target.prefill(seqs.tokens, seqs.lengths, layers)
    logits, features = out if layers else (out, None)
    first = next_token(logits, temperature, top_p, generator)  # [B]
    prompt_lengths = seqs.lengths.clone()
    seqs.tokens.scatter_(1, seqs.lengths[:, None], first[:, None])
    seqs.lengths += 1
    done = [rows.emit(r, [t]) for r, t in enumerate(first.tolist())]
    if drafter is not None:
        drafter.start(seqs, target.max_len)
    if features is not None:  # every prompt position, then each pass's kept ones
        drafter.observe(features, torch.zeros_like(prompt_lengths), prompt_lengths)
    result = DecodeResult(rows.out, rows.passes, [0] * k, [0] * k)  # every draft position, verified or not
    active = torch.tensor([not d for d in done], device=device)
    all_columns = torch.arange(k + 1, device=device)
    while not all(done):
        proposal = drafter.propose(seqs, k) if drafter is not None else None
        width = k  # draft tokens verified: all k at fixed shapes, else as many as some row proposed
        if proposal is not None and not target.fixed_shapes:
            width = int(proposal.num_proposed.max())
        verify, inputs = target.replay(width + 1, layers=layers)
        chunk, positions, start = inputs.tokens, inputs.positions, inputs.start
        columns = all_columns[: width + 1]
        start.copy_(seqs.lengths - 1)  # the target's cache holds all but the last committed token
        positions.copy_(start[:, None] + columns)
        chunk[:, :1] = seqs.tokens.gather(1, start[:, None])
        if proposal is not None:
            draft, num_proposed = proposal.tokens[:, :width], proposal.num_proposed
            chunk[:, 1:] = draft
        else:
            draft = chunk[:, 1:]
            num_proposed = torch.zeros(b, dtype=torch.long, device=device)
        out = verify()  # logits [B, width+1, V] (and the drafter's features [B, width+1, F])
        logits, features = out if layers else (out, None)
        if temperature == 0:
            num_accepted, new = accept_greedy(draft, num_proposed, logits)
        else:
            p = process_logits(logits, temperature, top_p)
            q = proposal.probs[:, :width] if proposal is not None else p.new_zeros((b, 0, p.shape[-1]))
            u = torch.rand((b, width), generator=generator, device=device)
            num_accepted, new = accept_sampling(draft, num_proposed, q, p, u,
                                                torch.rand(b, generator=generator, device=device))
        # d_1..d_n then the next token, written after each row's committed tokens.
        emitted = torch.cat([draft, new[:, None]], dim=1).scatter(1, num_accepted[:, None], new[:, None])
        slots = (seqs.lengths[:, None] + columns).clamp(max=target.max_len - 1)
        seqs.tokens.scatter_(1, slots, emitted)
        seqs.lengths += (num_accepted + 1) * active
        if features is not None:  # the target kept `last` and the accepted drafts
            drafter.observe(features, start, num_accepted + 1)
        if drafter is not None:
            drafter.accepted(seqs, num_accepted)
        host = torch.cat([num_accepted[:, None], num_proposed[:, None], emitted], dim=1).tolist()  # the one sync
        for r, (n_acc, n_prop, *tokens) in enumerate(host):
            if done[r]:
                continue
            result.count(min(n_acc + 1, n_prop), n_acc)
            if rows.emit(r, tokens[: n_acc + 1]):
                done[r] = True
                active[r] = False
    return result


@torch.inference_mode()
def continuous_decode(
    target: StaticModel, prompts: list[list[int]], *, batch_size: int, max_new_tokens: int, eos_ids: set[int],
    temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None, topk: int = 0,
    refill_fraction: float = 0.25, on_done: Optional[Callable[[int, list[int]], None]] = None,
) -> DecodeResult:
    """Plain decoding of many prompts through a batch of rows (continuous batching): a row
    whose answer ended takes the next prompt from the queue. Refilled prompts are prefilled in
    one forward and copied into their rows' cache slots.

    At fixed shapes (graphs) every step is the same captured forward at full width, and free
    rows are refilled together once `refill_fraction` of the batch is free (or nothing else is
    decoding). Otherwise (a CPU) no step computes a row nobody reads: a finished row leaves at
    once (the last row computed takes its place) and free rows are refilled after each step.

    topk > 0 also keeps the target's top-k raw logits at every emitted token (a distillation
    teacher for free: no second, teacher-forced pass). on_done(prompt index, its tokens) is
    called as each answer ends.
    """
    n, b = len(prompts), min(batch_size, len(prompts))
    target.ready(b, max(map(len, prompts)) + max_new_tokens + 2)
    device = target.device
    seqs = Sequences(torch.zeros((b, target.max_len), dtype=torch.long, device=device),
                     torch.ones(b, dtype=torch.long, device=device))
    owner = [-1] * b  # the prompt each row decodes (-1: free)
    out: list[list[int]] = [[] for _ in prompts]
    top: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    queue = list(range(n))[::-1]  # popped from the end: prompts in order
    logits = torch.zeros((b, target.model.config.vocab_size), device=device, dtype=target.dtype)
    alive = torch.zeros(b, dtype=torch.bool, device=device)
    step, inputs = target.replay(1)
    chunk, positions, start = inputs.tokens, inputs.positions, inputs.start
    refill_at = refill_fraction * b if target.fixed_shapes else 1
    live = b  # rows [0, live) are computed (all of them at fixed shapes)

    def leave(r: int) -> None:
        """Free row r leaves the batch: the last row computed takes its place."""
        nonlocal live
        last = live - 1
        if r != last:
            length = int(seqs.lengths[last])
            target.cache.copy_row(last, r, length)
            seqs.tokens[r, :length] = seqs.tokens[last, :length]
            seqs.lengths[r], alive[r], owner[r] = seqs.lengths[last], alive[last], owner[last]
            owner[last], alive[last] = -1, False
        live = last

    def refill(rows: list[int]) -> None:
        taken = [queue.pop() for _ in rows[: len(queue)]]
        rows = rows[: len(taken)]
        index = torch.tensor(rows, device=device)
        lengths = torch.tensor([len(prompts[i]) for i in taken], device=device)
        padded = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
        for j, i in enumerate(taken):
            padded[j, : len(prompts[i])] = torch.tensor(prompts[i], dtype=torch.long)
            owner[rows[j]] = i
        padded = padded.to(device)
        seqs.tokens[index, : padded.shape[1]] = padded
        seqs.lengths[index] = lengths
        logits[index] = target.prefill_rows(index, padded, lengths).to(logits.dtype)
        alive[index] = True

    refill(list(range(b)))
    while any(o >= 0 for o in owner):
        drawn = next_token(logits, temperature, top_p, generator)  # [B]
        if topk:
            values, ids = logits.float().topk(topk, dim=-1)  # [B, k]
            values, ids = values.cpu(), ids.to(torch.int32).cpu()
        seqs.tokens.scatter_(1, seqs.lengths[:, None], drawn[:, None])
        seqs.lengths += alive
        free = []
        for r, token in enumerate(drawn.tolist()):  # the step's one sync
            i = owner[r]
            if i < 0:
                continue
            out[i].append(token)
            if topk:
                top[i].append((ids[r], values[r]))
            if token in eos_ids or len(out[i]) >= max_new_tokens:
                owner[r] = -1
                free.append(r)
                if on_done is not None:
                    on_done(i, out[i])
        if free:
            alive[torch.tensor(free, device=device)] = False
        if not any(o >= 0 for o in owner) and not queue:
            break
        if not target.fixed_shapes:
            for r in sorted(free, reverse=True):  # rows above r that finished have left already
                leave(r)
        if any(o >= 0 for o in owner):  # the next token's logits of every row still decoding
            start.copy_(seqs.lengths - 1)
            positions.copy_(start[:, None])
            chunk.copy_(seqs.tokens.gather(1, start[:, None]))
            inputs.rows = live
            logits[:live] = step()[:, -1]
        empty = [r for r in range(b) if owner[r] < 0]  # without fixed shapes: rows live..b-1
        if queue and empty and (len(empty) >= refill_at or len(empty) == b):
            refill(empty)
            live = b if target.fixed_shapes else sum(o >= 0 for o in owner)
    result = DecodeResult(out, [len(o) for o in out])
    if topk:
        result.topk_ids = [torch.stack([i for i, _ in row]) for row in top]
        result.topk_logits = [torch.stack([v for _, v in row]) for row in top]
    return result

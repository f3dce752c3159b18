"""The decoder's fast path: plain and speculative chain decoding over static KV caches, at
fixed shapes, with the per-step work on the device.

Each row keeps its committed tokens (prompt + emitted) in a device buffer `tokens` [B, T]
with its count in `lengths` [B]; the target's cache holds all but the last. A step:

1. the drafter proposes k tokens per row from the device state (FastDrafter.propose);
2. the target verifies [last, d_1..d_k] in one forward of width k+1 (a CUDA graph replay on
   CUDA), each row at its own slots;
3. the fused acceptance (pipeline/kernels/acceptance.py) gives each row's accepted length n
   and next token; the accepted tokens and the next one are written into `tokens` and
   `lengths` grows by n + 1, on the device: a rejected draft's cache slots are simply
   written over by the next step;
4. one small device->host copy of (n, emitted tokens) per step feeds the host's stopping
   rules (end of turn, max_new_tokens) and the counts behind τ and α.

Rows never leave the batch (shapes stay fixed): a finished row stops growing and its results
are ignored. Outputs are those of the CPU path (decoder.py): greedy equals the target's
greedy decoding, sampling is distributed as the target's.
"""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.sampling import next_token, process_logits
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.types import DecodeResult, FastDrafter, Rows, Sequences
from pipeline.kernels.acceptance import accept_greedy, accept_sampling

@torch.inference_mode()
def fast_decode(
    target: StaticModel, drafter: Optional[FastDrafter], prompts: list[list[int]], *, num_draft_tokens: int,
    max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0, top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Plain decoding (drafter None) or lossless speculative decoding of chains on the fast path."""
    k = num_draft_tokens if drafter is not None else 0
    device, b = target.device, len(prompts)
    max_len = max(map(len, prompts)) + max_new_tokens + k + 2
    target.ready(b, max_len)
    seqs = Sequences(torch.zeros((b, target.max_len), dtype=torch.long, device=device),
                     torch.tensor([len(p) for p in prompts], device=device))
    for row, p in enumerate(prompts):
        seqs.tokens[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    rows = Rows(prompts, max_new_tokens, eos_ids)
    first = next_token(target.prefill(seqs.tokens, seqs.lengths), temperature, top_p, generator)  # [B]
    seqs.tokens.scatter_(1, seqs.lengths[:, None], first[:, None])
    seqs.lengths += 1
    done = [rows.emit(r, [t]) for r, t in enumerate(first.tolist())]
    if drafter is not None:
        drafter.start(seqs, target.max_len)
    proposed_at, accepted_at = [0] * k, [0] * k
    active = torch.tensor([not d for d in done], device=device)
    verify, chunk, positions, start = target.replay(k + 1)
    columns = torch.arange(k + 1, device=device)
    while not all(done):
        proposal = drafter.propose(seqs, k) if drafter is not None else None
        start.copy_(seqs.lengths - 1)  # the target's cache holds all but the last committed token
        positions.copy_(start[:, None] + columns)
        chunk[:, :1] = seqs.tokens.gather(1, start[:, None])
        if proposal is not None:
            chunk[:, 1:] = proposal.tokens
            draft, num_proposed = proposal.tokens, proposal.num_proposed
        else:
            draft = chunk[:, 1:]
            num_proposed = torch.zeros(b, dtype=torch.long, device=device)
        logits = verify()  # [B, k+1, V]
        if temperature == 0:
            num_accepted, new = accept_greedy(draft, num_proposed, logits)
        else:
            p = process_logits(logits, temperature, top_p)
            q = proposal.probs if proposal is not None else p.new_zeros((b, 0, p.shape[-1]))
            u = torch.rand((b, k), generator=generator, device=device)
            num_accepted, new = accept_sampling(draft, num_proposed, q, p, u,
                                                torch.rand(b, generator=generator, device=device))
        # d_1..d_n then the next token, written after each row's committed tokens.
        emitted = torch.cat([draft, new[:, None]], dim=1).scatter(1, num_accepted[:, None], new[:, None])
        slots = (seqs.lengths[:, None] + columns).clamp(max=target.max_len - 1)
        seqs.tokens.scatter_(1, slots, emitted)
        seqs.lengths += (num_accepted + 1) * active
        if drafter is not None:
            drafter.accepted(seqs, num_accepted)
        host = torch.cat([num_accepted[:, None], num_proposed[:, None], emitted], dim=1).tolist()  # the one sync
        for r, (n_acc, n_prop, *tokens) in enumerate(host):
            if done[r]:
                continue
            for i in range(min(n_acc + 1, n_prop)):  # position i was verified
                proposed_at[i] += 1
                accepted_at[i] += i < n_acc
            if rows.emit(r, tokens[: n_acc + 1]):
                done[r] = True
                active[r] = False
    return DecodeResult(rows.out, rows.passes, proposed_at, accepted_at)

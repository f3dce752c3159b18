"""Plain and speculative decoding over a target model, batch size 1 or more.

The phases are free functions: `prefill` the prompts, then either `decode_one_token`
repeatedly (plain) or `speculative_step` (draft, verify in one target pass, accept, roll the
caches back). Both return a DecodeResult with the counts that τ and α are made of.

Conventions: a row's committed sequence is prompt + emitted tokens. The target's cache
holds all of it but the last token, which opens the next forward's chunk.
"""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.kv import SlotCache, with_hidden_states
from pipeline.decode.sampling import accept_greedy, accept_sampling, next_token, process_logits
from pipeline.decode.types import DecodeResult, Drafter, Rows, left_pad


def prefill(kv: SlotCache, prompts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cache the prompts [B, S] (left-padded, valid [B, S]); logits for the first new token. [B, V]"""
    return kv.forward(prompts, valid, logits_to_keep=1)[:, -1]


def target_pass(kv: SlotCache, tokens: torch.Tensor, valid: Optional[torch.Tensor] = None, logits_to_keep: int = 0,
                feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The target's logits on `tokens`, and the hidden states `feature_layers` (indices of
    transformers' output_hidden_states) concatenated [B, S, n * H], or None when none are asked."""
    if not feature_layers:
        return kv.forward(tokens, valid, logits_to_keep), None
    out = kv.run(tokens, valid, logits_to_keep, **with_hidden_states(feature_layers))
    return out.logits, torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)


def decode_one_token(kv: SlotCache, last: torch.Tensor) -> torch.Tensor:
    """Cache `last` [B] and return the logits for the token after it. [B, V]"""
    return kv.forward(last[:, None])[:, -1]


@torch.inference_mode()
def plain_decode(
    model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int,
    temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None, topk: int = 0,
) -> DecodeResult:
    """One token per target pass. topk > 0 also keeps the target's top-k raw logits at every
    emitted token (a distillation teacher for free: no second, teacher-forced pass)."""
    device = next(model.parameters()).device
    tokens, valid = left_pad(prompts, pad_id, device)
    kv = SlotCache(model, len(prompts), device)
    rows = Rows(prompts, max_new_tokens, eos_ids)
    top: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    logits = prefill(kv, tokens, valid)
    while True:
        last = next_token(logits, temperature, top_p, generator)  # [B]
        if topk:
            values, ids = logits.float().topk(topk, dim=-1)  # [B, k]
            for r, i in enumerate(rows.active):
                top[i].append((ids[r], values[r]))
        keep = rows.drop([rows.emit(r, [t]) for r, t in enumerate(last.tolist())])
        if not rows.active:
            break
        if keep is not None:
            kv.select_rows(keep.to(device))
            last = last[keep.to(device)]
        logits = decode_one_token(kv, last)
    result = DecodeResult(rows.out, rows.passes)
    if topk:
        result.topk_ids = [torch.stack([i for i, _ in row]).to(torch.int32).cpu() for row in top]
        result.topk_logits = [torch.stack([v for _, v in row]).cpu() for row in top]
    return result


def speculative_step(
    kv: SlotCache, drafter: Drafter, rows: Rows, last: torch.Tensor, num_draft_tokens: int,
    temperature: float, top_p: float, generator: Optional[torch.Generator],
):
    """Draft, verify with one target pass, accept, roll back. Returns (num_accepted, emitted, next_last)."""
    proposal = drafter.propose(rows.live_seqs(), num_draft_tokens)
    # Verify only as many positions as some row proposed: no match anywhere is a plain step.
    k = int(proposal.num_proposed.max())
    draft = proposal.tokens[:, :k]  # [B, K]
    chunk = torch.cat([last[:, None], draft], dim=1)
    logits, features = target_pass(kv, chunk, feature_layers=getattr(drafter, "feature_layers", ()))  # [B, K+1, V]
    if temperature == 0:
        num_accepted, new = accept_greedy(draft, proposal.num_proposed, logits)
    else:
        p = process_logits(logits, temperature, top_p)
        q = proposal.probs[:, :k]
        num_accepted, new = accept_sampling(draft, proposal.num_proposed, q, p, generator)
    # The target keeps `last` and the accepted drafts; the next chunk starts with `new`.
    keep = torch.arange(k + 1, device=draft.device)[None, :] <= num_accepted[:, None]
    kv.keep_last(keep)
    if features is not None:  # heads read the target's hidden states of the kept positions
        drafter.observe(features, keep)
    drafter.accepted(num_accepted)
    return proposal.num_proposed, num_accepted, draft, new


@torch.inference_mode()
def speculative_decode(
    model, drafter: Drafter, prompts: list[list[int]], *, num_draft_tokens: int, max_new_tokens: int,
    eos_ids: set[int], pad_id: int, temperature: float = 0.0, top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Lossless speculative decoding: greedy output equals the target's greedy output, and
    sampled output is distributed as the target's (see sampling.accept_sampling)."""
    device = next(model.parameters()).device
    tokens, valid = left_pad(prompts, pad_id, device)
    kv = SlotCache(model, len(prompts), device)
    drafter.start(tokens, valid)
    rows = Rows(prompts, max_new_tokens, eos_ids)
    k = num_draft_tokens
    proposed_at, accepted_at = [0] * k, [0] * k
    # The prefill is the first target pass and yields the first token.
    layers = getattr(drafter, "feature_layers", ())
    logits, features = target_pass(kv, tokens, valid, logits_to_keep=1, feature_layers=layers)
    if features is not None:
        drafter.observe(features, valid)
    last = next_token(logits[:, -1], temperature, top_p, generator)
    finished = [rows.emit(r, [t]) for r, t in enumerate(last.tolist())]
    while True:
        keep = rows.drop(finished)
        if not rows.active:
            break
        if keep is not None:
            keep = keep.to(device)
            kv.select_rows(keep)
            drafter.select_rows(keep)
            last = last[keep]
        num_proposed, num_accepted, draft, new = speculative_step(
            kv, drafter, rows, last, k, temperature, top_p, generator)
        finished = []
        for r, (n_prop, n_acc) in enumerate(zip(num_proposed.tolist(), num_accepted.tolist())):
            for i in range(min(n_acc + 1, n_prop)):  # position i was verified
                proposed_at[i] += 1
                accepted_at[i] += i < n_acc
            finished.append(rows.emit(r, draft[r, :n_acc].tolist() + [int(new[r])]))
        last = new
    return DecodeResult(rows.out, rows.passes, proposed_at, accepted_at)

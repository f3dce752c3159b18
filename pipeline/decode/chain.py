"""What drafters that propose a chain share: drawing a draft token, stacking a chain into a
Proposal, drafting k tokens autoregressively with an early stop on low confidence."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pipeline.decode.sampling import process_logits, sample
from pipeline.decode.types import Proposal


def draw(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator],
         to_target: Optional[torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One draft token per row from logits [B, V_draft]: the argmax when greedy, else a sample,
    with the distribution it came from ([B, vocab_size], None when greedy). A draft vocabulary
    (`to_target`: draft index -> target id) maps the token back and puts zero probability on
    every target token outside it."""
    q = None
    if temperature > 0:
        q = process_logits(logits, temperature, top_p)
        token = sample(q, generator)
        if to_target is not None:
            q = q.new_zeros((q.shape[0], vocab_size)).index_copy_(1, to_target, q)
    else:
        token = logits.argmax(dim=-1)
    if to_target is not None:
        token = to_target[token]
    return token, q


def chain_proposal(tokens: list[torch.Tensor], probs: list[Optional[torch.Tensor]],
                   num: Optional[torch.Tensor] = None) -> Proposal:
    """A proposal from per-position [B] tokens and [B, V] probs: len(tokens) tokens for every
    row, or num [B] of them (the rest filler)."""
    stacked = torch.stack(tokens, dim=1)
    if num is None:
        num = torch.full((stacked.shape[0],), stacked.shape[1], dtype=torch.long, device=stacked.device)
    return Proposal(stacked, num, torch.stack(probs, dim=1) if probs[0] is not None else None)


def draft_chain(drafter, logits: torch.Tensor, k: int, advance: Callable[[int, torch.Tensor], torch.Tensor],
                to_target: Optional[torch.Tensor], fixed_shapes: bool) -> tuple[Proposal, int]:
    """Draw k tokens per row autoregressively from the first logits [B, V_draft], at fixed
    shapes: always k draws and k - 1 advances (advance(i, token [B]) feeds the i-th drawn token
    and returns the next logits).

    The drafter's confidence_threshold > 0 ends a row's chain early (as transformers' assisted
    generation does): a token the draft gave less than that probability is the row's last
    proposal; the row proposes fewer tokens (the draft still does the work), so the target
    verifies no position that would likely be rejected. The stop depends only on the draft's
    own distributions, so verification stays lossless. Without `fixed_shapes` (no captured
    shape to keep) drawing stops once every row has ended, the rest filler. Returns the proposal
    and how many tokens were drawn (all but the last were fed to the draft)."""
    tokens, probs = [], []
    going = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    num = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    for i in range(k):
        token, q = draw(logits, drafter.temperature, drafter.top_p, drafter.generator, to_target, drafter.vocab_size)
        tokens.append(token)
        probs.append(q)
        num += going
        if drafter.confidence_threshold > 0:
            going &= confidence(logits, token, q) >= drafter.confidence_threshold
            if not fixed_shapes and i < k - 1 and not going.any():
                drawn = i + 1
                tokens += [torch.zeros_like(token)] * (k - drawn)
                probs += [None if q is None else torch.zeros_like(q)] * (k - drawn)
                return chain_proposal(tokens, probs, num), drawn
        if i < k - 1:
            logits = advance(i, token)
    return chain_proposal(tokens, probs, num), k


def confidence(logits: torch.Tensor, token: torch.Tensor, q: Optional[torch.Tensor]) -> torch.Tensor:
    """[B] the probability the draft gave its own choice: q(token) when sampling, the largest
    of softmax(logits [B, V_draft]) when greedy."""
    if q is not None:
        return q.gather(1, token[:, None])[:, 0]
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)

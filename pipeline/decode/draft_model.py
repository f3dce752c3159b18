"""A separate small draft model (distilled, or any LM with the target's tokenizer) as a drafter."""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.chain import draft_chain
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.types import Proposal, Sequences


class ModelDrafter:
    """A separate small causal LM with the target's tokenizer (distilled, or the target's first
    layers with an early-exit adapter): its own static cache, a forward of 2 tokens to start a
    round and k - 1 forwards of 1 token (each a CUDA graph replay on CUDA).

    A draft whose LM head covers only a draft vocabulary carries `draft_to_target` (draft
    index -> target id, distill/draft.py): its proposals are mapped back to target ids, and
    when sampling its distribution is spread onto the target's vocabulary (zero elsewhere).

    The draft's cache holds every committed token but the last two. A round feeds those two at
    their positions (the second to last is already cached unless the whole previous chain was
    accepted: recomputing it writes the same entry), so every round has the same shapes;
    without fixed shapes it feeds the last alone where every row has the one before cached. Its
    chain ends where the draft is unsure (confidence_threshold) by proposing fewer tokens:
    the draft still runs k steps, the target verifies only the confident prefix's matches.
    """

    feature_layers = ()

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, name: str = "draft_model",
                 confidence_threshold: float = 0.0, graphs: bool = False, fixed_shapes: Optional[bool] = None):
        self.model, self.name = model, name
        self.confidence_threshold = confidence_threshold
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.to_target = getattr(model, "draft_to_target", None)
        self.vocab_size = model.config.vocab_size
        self.static = StaticModel(model, graphs, fixed_shapes)
        self.device = self.static.device

    def start(self, seqs: Sequences, max_len: int) -> None:
        self.static.ready(seqs.tokens.shape[0], max_len)
        cached = seqs.lengths - 2  # every row's tokens but its last two
        if int(cached.max()) > 0:
            self.static.prefill(seqs.tokens, cached.clamp(min=1))
        self.feed = 2  # tokens the next round feeds first

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        first, fed = self.static.replay(self.feed, logits_to_keep=1)
        fed.start.copy_(seqs.lengths - self.feed)
        fed.positions.copy_(fed.start[:, None] + torch.arange(self.feed, device=self.device))
        fed.tokens.copy_(seqs.tokens.gather(1, fed.positions))
        logits = first()[:, -1]
        step, one = self.static.replay(1, logits_to_keep=1)

        def advance(i: int, token: torch.Tensor) -> torch.Tensor:
            one.tokens.copy_(token[:, None])  # a target id: a draft vocabulary restricts only the LM head
            one.start.copy_(seqs.lengths + i)
            one.positions.copy_(one.start[:, None])
            return step()[:, -1]

        proposal, self.drawn = draft_chain(self, logits, num_draft_tokens, advance, self.to_target,
                                           self.static.fixed_shapes)
        return proposal

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        # Of the drawn d_1..d_n, all but d_n were fed: a row that accepted all n lacks the entry
        # of its second-to-last token. At fixed shapes the next round recomputes it anyway.
        if not self.static.fixed_shapes:
            self.feed = 2 if bool((num_accepted >= self.drawn).any()) else 1

    def observe(self, features: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        pass

"""A separate small draft model (distilled, or any LM with the target's tokenizer) as a drafter."""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.chain import draft_chain, fixed_chain
from pipeline.decode.kv import SlotCache
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.types import Proposal, Sequences


class ModelDrafter:
    """A separate small causal LM with the target's tokenizer, with its own KV cache kept in
    step with the accepted tokens.

    A draft whose LM head covers only a draft vocabulary carries `draft_to_target` (draft
    index -> target id, distill/draft.py): its proposals are mapped back to target ids, and
    when sampling its distribution is spread onto the target's vocabulary (zero elsewhere).
    confidence_threshold > 0 ends a row's chain at its first unconfident token (draft_chain).
    """

    feature_layers = ()

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, name: str = "draft_model",
                 confidence_threshold: float = 0.0):
        self.model, self.name = model, name
        self.confidence_threshold = confidence_threshold
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.to_target = getattr(model, "draft_to_target", None)
        self.vocab_size = model.config.vocab_size

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        self.kv = SlotCache(self.model, prompts.shape[0], prompts.device)
        self.kv.forward(prompts, prompt_valid, logits_to_keep=1)  # only the cache is needed
        self.last_fed = 0

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        k = num_draft_tokens
        device = self.kv.valid.device
        lengths = self.kv.lengths.tolist()
        # Tokens the draft has not seen: the target's last token, plus the last proposal when
        # every proposal was accepted (it was never fed). Right-aligned, fillers masked.
        pending = [seq[n:] for seq, n in zip(seqs, lengths)]
        width = max(len(p) for p in pending)
        feed = torch.zeros((len(seqs), width), dtype=torch.long)
        feed_valid = torch.zeros((len(seqs), width), dtype=torch.bool)
        for row, p in enumerate(pending):
            feed[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            feed_valid[row, width - len(p):] = True
        logits = self.kv.forward(feed.to(device), feed_valid.to(device), logits_to_keep=1)[:, -1]  # [B, V]

        advance = lambda token: self.kv.forward(token[:, None])[:, -1]
        proposal, drawn = draft_chain(self, logits, k, advance, self.to_target)
        self.last_fed = drawn - 1  # d_1..d_{n-1} of the n drawn are in the cache, d_n is not
        return proposal

    def accepted(self, num_accepted: torch.Tensor) -> None:
        # Keep the fed proposals that were accepted; the rest of d_1..d_{k-1} is dropped.
        fed = self.last_fed
        if fed:
            keep = torch.arange(fed, device=num_accepted.device)[None, :] < num_accepted[:, None]
            self.kv.keep_last(keep)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)


class FastModelDrafter:
    """A draft model on the fast path: its own static cache, a forward of 2 tokens to start a
    round and k - 1 forwards of 1 token (each a CUDA graph replay on CUDA).

    The draft's cache holds every committed token but the last two. A round feeds those two at
    their positions (the second to last is already cached unless the whole previous chain was
    accepted: recomputing it writes the same entry), so every round has the same shapes. Its
    chain ends where the draft is unsure (confidence_threshold) by proposing fewer tokens:
    the draft still runs k steps, the target verifies only the confident prefix's matches.
    """

    feature_layers = ()

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, name: str = "draft_model",
                 confidence_threshold: float = 0.0, graphs: bool = False):
        self.model, self.name = model, name
        self.confidence_threshold = confidence_threshold
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.to_target = getattr(model, "draft_to_target", None)
        self.vocab_size = model.config.vocab_size
        self.static = StaticModel(model, graphs)
        self.device = self.static.device

    def start(self, seqs: Sequences, max_len: int) -> None:
        self.static.ready(seqs.tokens.shape[0], max_len)
        cached = seqs.lengths - 2  # every row's tokens but its last two
        if int(cached.max()) > 0:
            self.static.prefill(seqs.tokens, cached.clamp(min=1))

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        first, two = self.static.replay(2, logits_to_keep=1)
        two.start.copy_(seqs.lengths - 2)
        two.positions.copy_(two.start[:, None] + torch.arange(2, device=self.device))
        two.tokens.copy_(seqs.tokens.gather(1, two.positions))
        logits = first()[:, -1]
        step, one = self.static.replay(1, logits_to_keep=1)

        def advance(i: int, token: torch.Tensor) -> torch.Tensor:
            one.tokens.copy_(token[:, None])  # a target id: a draft vocabulary restricts only the LM head
            one.start.copy_(seqs.lengths + i)
            one.positions.copy_(one.start[:, None])
            return step()[:, -1]

        return fixed_chain(self, logits, num_draft_tokens, advance, self.to_target)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass  # the next round's first step recomputes what the cache may lack

"""Drafters: propose up to `num_draft_tokens` tokens per row, and (when sampling) their probabilities.

A drafter sees the committed sequences (prompt + emitted tokens) of the active rows and is
told after verification how many of its proposals each row accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from pipeline.decode.kv import SlotCache
from pipeline.decode.sampling import process_logits, sample


@dataclass
class Proposal:
    tokens: torch.Tensor
    """[B, K] proposed tokens; positions at or past num_proposed are filler."""
    num_proposed: torch.Tensor
    """[B] real proposals per row (0..K)."""
    probs: Optional[torch.Tensor] = None
    """[B, K, V] the distributions the tokens were drawn from (None when greedy)."""


class Drafter(Protocol):
    name: str

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        """Prompts [B, S] left-padded, prompt_valid [B, S]."""

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        ...

    def accepted(self, num_accepted: torch.Tensor) -> None:
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, temperature: float = 0.0, vocab_size: int = 0):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.temperature, self.vocab_size = temperature, vocab_size

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        self.device = prompts.device

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        k = num_draft_tokens
        tokens = torch.zeros((len(seqs), k), dtype=torch.long)
        counts = torch.zeros(len(seqs), dtype=torch.long)
        for row, seq in enumerate(seqs):
            found = lookup(seq, k, self.max_ngram, self.min_ngram)
            tokens[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            counts[row] = len(found)
        tokens, counts = tokens.to(self.device), counts.to(self.device)
        probs = None
        if self.temperature > 0:  # a deterministic proposal: q is a point mass
            probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens, counts, probs)

    def accepted(self, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass


def lookup(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of seq's last n tokens."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        # Latest match first: recent context predicts best (and repeats in the answer itself).
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


class ModelDrafter:
    """A separate small causal LM with the target's tokenizer, with its own KV cache kept in
    step with the accepted tokens.

    A draft whose LM head covers only a draft vocabulary carries `draft_to_target` (draft
    index -> target id, distill/draft.py): its proposals are mapped back to target ids, and
    when sampling its distribution is spread onto the target's vocabulary (zero elsewhere).
    """

    name = "draft_model"

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None):
        self.model = model
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

        tokens, probs = [], []
        for i in range(k):
            if self.temperature > 0:
                q = process_logits(logits, self.temperature, self.top_p)
                token = sample(q, self.generator)
                if self.to_target is not None:
                    q = q.new_zeros((q.shape[0], self.vocab_size)).index_copy_(1, self.to_target, q)
                probs.append(q)
            else:
                token = logits.argmax(dim=-1)
            if self.to_target is not None:
                token = self.to_target[token]
            tokens.append(token)
            if i < k - 1:
                logits = self.kv.forward(token[:, None])[:, -1]
        self.last_fed = k - 1  # d_1..d_{k-1} are in the cache, d_k is not
        return Proposal(
            torch.stack(tokens, dim=1),
            torch.full((len(seqs),), k, dtype=torch.long, device=device),
            torch.stack(probs, dim=1) if probs else None,
        )

    def accepted(self, num_accepted: torch.Tensor) -> None:
        # Keep the fed proposals that were accepted; the rest of d_1..d_{k-1} is dropped.
        fed = self.last_fed
        if fed:
            keep = torch.arange(fed, device=num_accepted.device)[None, :] < num_accepted[:, None]
            self.kv.keep_last(keep)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)

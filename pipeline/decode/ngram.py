"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier match of the
sequence's last tokens. No model, no training."""

from __future__ import annotations

import torch

from pipeline.decode.types import Proposal, Sequences


def lookup(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of seq's last n tokens (the rule,
    for one sequence on the host: lookup_on_device's reference)."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        # Latest match first: recent context predicts best (and repeats in the answer itself).
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def lookup_on_device(tokens: torch.Tensor, lengths: torch.Tensor, k: int, max_ngram: int,
                     min_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup` for every row at once, with no host round-trip: tokens [B, T] (row b's sequence
    is its first lengths[b] entries) -> the proposals [B, k] and how many are real [B]."""
    b, t = tokens.shape
    starts = torch.arange(t, device=tokens.device)
    found = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    follow = torch.zeros(b, dtype=torch.long, device=tokens.device)  # where the copied tokens begin
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > t - 1:
            continue
        tail = tokens.gather(1, (lengths[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0))  # [B, n]
        match = (tokens.unfold(1, n, 1) == tail[:, None, :]).all(dim=-1)  # [B, T - n + 1]: window at s
        # an earlier occurrence (the tail itself excluded), and n < length as lookup asks
        ok = match & (starts[None, : t - n + 1] <= (lengths[:, None] - n - 1)) & (lengths[:, None] > n)
        latest = torch.where(ok, starts[None, : t - n + 1], -1).amax(dim=1)  # [B]
        new = (latest >= 0) & ~found
        follow = torch.where(new, latest + n, follow)
        found |= new
    proposals = tokens.gather(1, (follow[:, None] + torch.arange(k, device=tokens.device)).clamp(max=t - 1))
    num = torch.where(found, (lengths - follow).clamp(min=0, max=k), 0)
    return proposals, num


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it, on the device."""

    name = "ngram"
    feature_layers = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, temperature: float = 0.0, vocab_size: int = 0):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.temperature, self.vocab_size = temperature, vocab_size

    def start(self, seqs: Sequences, max_len: int) -> None:
        pass

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        tokens, num = lookup_on_device(seqs.tokens, seqs.lengths, num_draft_tokens, self.max_ngram, self.min_ngram)
        probs = None
        if self.temperature > 0:  # a deterministic proposal: q is a point mass
            probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Proposal(tokens, num, probs)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass

    def observe(self, features: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        pass

"""What the decoder's modules share: proposals, results, the rows being decoded, padding.

The bottom of pipeline/decode: it imports nothing of ours. Above it the cache (kv.py) and
sampling rules (sampling.py), then one module per drafter (ngram, draft_model, medusa,
eagle; chain.py holds what the chain drafters share), then the decoding loops (decoder.py:
chains, tree.py: token trees). No module imports one above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    """Emitted tokens per row (an end-of-turn token included)."""
    target_passes: list[int]
    """Target forward passes each row took part in, the prefill included."""
    proposed_by_position: list[int] = field(default_factory=list)
    """How often draft position i was verified (every earlier position accepted)."""
    accepted_by_position: list[int] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    """plain_decode(topk=k): per row, the target's k largest raw logits' token ids [G, k] (int32) at
    each of its G emitted tokens, taken from the logits that token was chosen from."""
    topk_logits: list[torch.Tensor] = field(default_factory=list)
    """... and those logits [G, k] (float32)."""

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (1.0 for plain decoding)."""
        return sum(map(len, self.tokens)) / max(sum(self.target_passes), 1)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]


@dataclass
class Proposal:
    tokens: torch.Tensor
    """[B, K] proposed tokens; positions at or past num_proposed are filler."""
    num_proposed: torch.Tensor
    """[B] real proposals per row (0..K)."""
    probs: Optional[torch.Tensor] = None
    """[B, K, V] the distributions the tokens were drawn from (None when greedy)."""


@dataclass
class TreeProposal:
    tokens: torch.Tensor
    """[N] target token ids; every node comes after its parent."""
    parents: torch.Tensor
    """[N] index of each node's parent node, -1 for the root (the last committed token)."""
    max_depth: Optional[int] = None
    """A bound on the tree's depth where the drafter knows one (the fast path's walk takes that
    many steps); None: N."""


class Drafter(Protocol):
    name: str
    feature_layers: tuple[int, ...]
    """Target hidden states the drafter reads (output_hidden_states indices; empty: none). The
    decoder then hands it those of every position the target keeps, through `observe`."""

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        """Prompts [B, S] left-padded, prompt_valid [B, S]."""

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        ...

    def accepted(self, num_accepted: torch.Tensor) -> None:
        ...

    def observe(self, features: torch.Tensor, kept: torch.Tensor) -> None:
        """features [B, S, F] of the target's last pass; kept [B, S] the positions it cached."""

    def select_rows(self, rows: torch.Tensor) -> None:
        ...


@dataclass
class Sequences:
    """The rows' committed tokens on the device."""

    tokens: torch.Tensor
    """[B, T] prompt + emitted tokens; entries at or past a row's length are stale."""
    lengths: torch.Tensor
    """[B] committed tokens per row."""


class FastDrafter(Protocol):
    name: str
    feature_layers: tuple[int, ...]
    """Target hidden states it reads (output_hidden_states indices; empty: none), handed to
    `observe` for every position the target keeps."""

    def start(self, seqs: Sequences, max_len: int) -> None:
        """Prefill the draft on the prompts (seqs holds them and the first emitted token)."""

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        """Exactly num_draft_tokens columns per row; num_proposed says how many are real."""

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        """After seqs grew by the accepted tokens and the next one."""

    def observe(self, features: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        """features [B, W, F] of positions first[b] .. first[b] + W - 1, of which the target kept
        the first count[b] (the prompt at prefill, then `last` and the accepted drafts)."""


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        tokens[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[row, width - len(p):] = True
    return tokens.to(device), valid.to(device)  # [B, S], [B, S]


class Rows:
    """The rows still decoding: their committed sequences, outputs and stopping rules."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]):
        self.seqs = [list(p) for p in prompts]
        self.out: list[list[int]] = [[] for _ in prompts]
        self.passes = [0] * len(prompts)
        self.active = list(range(len(prompts)))  # original index of each live row
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append tokens to live row `row`, stopping at end-of-turn or the budget; True if finished."""
        i = self.active[row]
        self.passes[i] += 1
        for t in tokens[: self.max_new_tokens - len(self.out[i])]:
            self.out[i].append(t)
            self.seqs[i].append(t)
            if t in self.eos_ids:
                return True
        return len(self.out[i]) >= self.max_new_tokens

    def live_seqs(self) -> list[list[int]]:
        return [self.seqs[i] for i in self.active]

    def drop(self, finished: list[bool]) -> Optional[torch.Tensor]:
        """Forget finished rows; the indices of the rows that remain, or None if none finished."""
        if not any(finished):
            return None
        keep = [r for r, done in enumerate(finished) if not done]
        self.active = [self.active[r] for r in keep]
        return torch.tensor(keep, dtype=torch.long)

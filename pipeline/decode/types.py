"""What the decoder's modules share: proposals, results, the rows' tokens, the drafter protocol.

The bottom of pipeline/decode: it imports nothing of ours. Above it the static cache
(static_kv.py) and sampling rules (sampling.py), then one module per drafter (ngram,
draft_model, medusa, eagle; chain.py holds what the chain drafters share), then the decoding
loops (decoder.py: chains, tree.py: token trees). No module imports one above it.
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
    """continuous_decode(topk=k): per answer, the target's k largest raw logits' token ids [G, k]
    (int32) at each of its G emitted tokens, taken from the logits that token was chosen from."""
    topk_logits: list[torch.Tensor] = field(default_factory=list)
    """... and those logits [G, k] (float32)."""

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (1.0 for plain decoding)."""
        return sum(map(len, self.tokens)) / max(sum(self.target_passes), 1)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    def count(self, verified: int, accepted: int) -> None:
        """One pass's α bookkeeping: draft positions 0..verified-1 were verified (every one before
        them accepted), the first `accepted` of them were accepted."""
        for i in range(verified):
            if i == len(self.proposed_by_position):
                self.proposed_by_position.append(0)
                self.accepted_by_position.append(0)
            self.proposed_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted


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
    """A bound on the tree's depth where the drafter knows one (the walk takes that many steps);
    None: N."""


@dataclass
class Sequences:
    """The rows' committed tokens on the device."""

    tokens: torch.Tensor
    """[B, T] prompt + emitted tokens; entries at or past a row's length are stale."""
    lengths: torch.Tensor
    """[B] committed tokens per row."""


class Drafter(Protocol):
    """What the decoder asks of a drafter. Everything stays on the device at fixed shapes: rows
    never leave the batch (a finished row's results are ignored), so there is no row selection."""

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

    # Drafters of token trees (the kinds with `trees` in pipeline/kinds.py) also have
    # propose_tree(seqs, budget) -> TreeProposal, at batch size 1.


class Rows:
    """The host's view of the rows: their outputs, passes and stopping rules."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]):
        self.out: list[list[int]] = [[] for _ in prompts]
        self.passes = [0] * len(prompts)
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids

    def emit(self, row: int, tokens: list[int]) -> bool:
        """Append tokens to row `row`, stopping at end-of-turn or the budget; True if finished."""
        self.passes[row] += 1
        for t in tokens[: self.max_new_tokens - len(self.out[row])]:
            self.out[row].append(t)
            if t in self.eos_ids:
                return True
        return len(self.out[row]) >= self.max_new_tokens

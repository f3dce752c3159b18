"""Medusa heads as a drafter: head i of the target's last hidden state proposes token i+1;
trees come from the heads' top candidates on a static tree (static_tree)."""

from __future__ import annotations

import heapq
from typing import Optional

import torch

from pipeline.decode.chain import chain_proposal, draw
from pipeline.decode.types import Proposal, Sequences, TreeProposal


class MedusaDrafter:
    """Medusa heads on the target's last hidden state at the last verified position: head i's
    choice is draft token i+1, k columns on the device (past the heads: filler, never
    proposed); trees come from the heads' top candidates (MedusaTrees)."""

    name = "medusa"

    def __init__(self, heads, vocab_size: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, choices: Optional[list] = None):
        self.heads, self.vocab_size = heads, vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.feature_layers = heads.feature_layers
        self.trees = MedusaTrees(heads, choices)

    def start(self, seqs: Sequences, max_len: int) -> None:
        self.hidden = None

    def observe(self, features: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        self.hidden = features[torch.arange(features.shape[0], device=features.device), count - 1]  # [B, H]

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        n = min(num_draft_tokens, self.heads.num_heads)
        logits = self.heads(self.hidden)[:, :n]  # [B, n, V_draft]
        tokens, probs = map(list, zip(*(draw(logits[:, i], self.temperature, self.top_p, self.generator,
                                             self.heads.draft_to_target, self.vocab_size) for i in range(n))))
        for _ in range(num_draft_tokens - n):  # filler past the last head
            tokens.append(torch.zeros_like(tokens[0]))
            probs.append(None if probs[0] is None else torch.zeros_like(probs[0]))
        return chain_proposal(tokens, probs, torch.full_like(tokens[0], n))

    def propose_tree(self, seqs: Sequences, budget: int) -> TreeProposal:
        return self.trees.propose(self.hidden[0], budget)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass


class MedusaTrees:
    """Static trees of Medusa heads' candidates: Medusa's `choices` (paths of candidate ranks
    per head), or for each budget the most promising rank paths (static_tree). The node at path
    (r_1..r_d) is head d's rank-r_d candidate; a tree's layout is computed once, and a round
    gathers its tokens on the device (no host round-trip)."""

    def __init__(self, heads, choices: Optional[list] = None) -> None:
        self.heads = heads
        self.choices = [tuple(c) for c in choices] if choices else None
        if self.choices:
            bad = [c for c in self.choices if len(c) > 1 and c[:-1] not in self.choices or len(c) > heads.num_heads]
            if bad:
                raise ValueError(f"medusa tree choices {bad[:3]} lack their parent path or go deeper than "
                                 f"the {heads.num_heads} heads")
            self.choices.sort(key=lambda c: (len(c), c))
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]] = {}

    def layout(self, budget: int, device: torch.device):
        """(head index [N], rank [N], parents [N] (-1: the root), depth, width) of the tree."""
        if budget not in self._layouts:
            choices = self.choices or static_tree(budget, self.heads.num_heads)
            index = {c: i for i, c in enumerate(choices)}
            as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)
            self._layouts[budget] = (as_tensor([len(c) - 1 for c in choices]), as_tensor([c[-1] for c in choices]),
                                     as_tensor([index[c[:-1]] if len(c) > 1 else -1 for c in choices]),
                                     max(map(len, choices)), max(max(c) for c in choices) + 1)
        return self._layouts[budget]

    def propose(self, hidden: torch.Tensor, budget: int) -> TreeProposal:
        """The tree for the target's hidden state [H] at the last kept position."""
        head, rank, parents, depth, width = self.layout(budget, hidden.device)
        logits = self.heads(hidden[None])[0, :depth]  # [depth, V_draft]
        top = self.heads.draft_to_target[logits.topk(min(width, logits.shape[-1])).indices]  # [depth, width]
        return TreeProposal(top[head, rank.clamp(max=top.shape[1] - 1)], parents, depth)


def static_tree(budget: int, num_heads: int, width: int = 10, head_decay: float = 0.6,
                rank_decay: float = 0.4) -> list[tuple[int, ...]]:
    """A Medusa-style static tree of `budget` nodes as paths of candidate ranks ((0,) is head
    1's top token, (0, 1) head 2's second token after it, ...): the paths most likely to be
    accepted when head d's rank-r candidate is right with probability ∝ head_decay^d rank_decay^r.
    Parents always come before their children."""
    chosen: list[tuple[int, ...]] = []
    heap = [(-1.0, (0,))]
    seen = {(0,)}
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        depth = len(path)
        candidates = [path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < width else []
        if depth < num_heads:
            candidates.append(path + (0,))
        for c in candidates:
            if c not in seen:
                seen.add(c)
                weight = 1.0
                for d, r in enumerate(c):
                    weight *= head_decay ** d * rank_decay ** r
                heapq.heappush(heap, (-weight, c))
    return sorted(chosen, key=lambda p: (len(p), p))

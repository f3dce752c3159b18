"""Medusa heads as a drafter: head i of the target's last hidden state proposes token i+1;
trees come from the heads' top candidates on a static tree (static_tree)."""

from __future__ import annotations

import heapq
from typing import Optional

import torch

from pipeline.decode.chain import chain_proposal, draw, last_kept
from pipeline.decode.types import Proposal, TreeProposal


class MedusaDrafter:
    """Medusa heads on the target's last hidden state at the last verified position: head i's
    choice is draft token i+1 (a chain; trees come from the heads' top candidates)."""

    name = "medusa"

    def __init__(self, heads, vocab_size: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, choices: Optional[list] = None):
        self.heads, self.vocab_size = heads, vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.feature_layers = heads.feature_layers
        self.choices = [tuple(c) for c in choices] if choices else None
        if self.choices:
            bad = [c for c in self.choices if len(c) > 1 and c[:-1] not in self.choices or len(c) > heads.num_heads]
            if bad:
                raise ValueError(f"medusa tree choices {bad[:3]} lack their parent path or go deeper than "
                                 f"the {heads.num_heads} heads")
            self.choices.sort(key=lambda c: (len(c), c))
        self._trees: dict[int, list[tuple[int, ...]]] = {}

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        self.hidden = None

    def propose_tree(self, seq: list[int], budget: int):
        """A static tree (Medusa's choices, or the `budget` most promising rank paths): the node
        at path (r_1..r_d) is head d's rank-r_d candidate."""
        choices = self.choices or self._trees.setdefault(budget, static_tree(budget, self.heads.num_heads))
        depth, width = max(map(len, choices)), max(max(c) for c in choices) + 1
        logits = self.heads(self.hidden)[0, :depth]  # [depth, V_draft]
        top = self.heads.draft_to_target[logits.topk(min(width, logits.shape[-1])).indices]  # [depth, width]
        index = {c: i for i, c in enumerate(choices)}
        tokens = torch.stack([top[len(c) - 1, min(c[-1], top.shape[1] - 1)] for c in choices])
        parents = torch.tensor([index[c[:-1]] if len(c) > 1 else -1 for c in choices], device=tokens.device)
        return TreeProposal(tokens, parents)

    def observe(self, features: torch.Tensor, kept: torch.Tensor) -> None:
        self.hidden = last_kept(features, kept)  # [B, H]

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        n = min(num_draft_tokens, self.heads.num_heads)
        logits = self.heads(self.hidden)[:, :n]  # [B, n, V_draft]
        tokens, probs = zip(*(draw(logits[:, i], self.temperature, self.top_p, self.generator,
                                   self.heads.draft_to_target, self.vocab_size) for i in range(n)))
        return chain_proposal(list(tokens), list(probs))

    def accepted(self, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        self.hidden = self.hidden[rows]


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

"""An EAGLE head as a drafter: chains fed back its own features, and EAGLE-2 dynamic trees."""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.chain import draft_chain
from pipeline.decode.static_kv import StaticModel, StaticStep, static_forward, use_static_attention
from pipeline.decode.types import Proposal, Sequences, TreeProposal


class EagleDrafter:
    """An EAGLE head drafting autoregressively from the target's features: its own static cache,
    one catch-up forward of the target positions the last pass kept (k+1 wide, fixed; replayed
    from a graph on CUDA) and k - 1 single-token steps feeding back its own features.

    Head position t reads (target feature of t, token t+1); the head's cache holds every
    position the target kept before the last pass. The catch-up writes the kept ones (and
    stale fillers past them, which the next catch-up writes over, as it does the drafts)."""

    name = "eagle"

    def __init__(self, head, vocab_size: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, confidence_threshold: float = 0.0,
                 graphs: bool = False, tree_depth: int = 5, tree_topk: int = 4,
                 fixed_shapes: Optional[bool] = None):
        self.head, self.vocab_size = head, vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.confidence_threshold = confidence_threshold
        self.tree_depth, self.tree_topk = tree_depth, tree_topk
        self.feature_layers = head.feature_layers
        use_static_attention(head.decoder)
        self.static = StaticModel(head, graphs, fixed_shapes)
        self.size = head.config.hidden_size

    def start(self, seqs: Sequences, max_len: int) -> None:
        self.static.ready(seqs.tokens.shape[0], max_len)
        self.pending = None

    def observe(self, features: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        self.pending = (features, first, count)

    def _catch_up(self, seqs: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pending target positions; the head's logits and output feature at the last
        kept one of each row ([B, V_draft], [B, H])."""
        features, first, count = self.pending
        fixed = self.static.fixed_shapes
        if not fixed:  # only the kept positions
            features = features[:, : int(count.max())]
        b, width = features.shape[:2]
        columns = torch.arange(width, device=first.device)
        positions = first[:, None] + columns
        ids = seqs.tokens.gather(1, (positions + 1).clamp(max=seqs.tokens.shape[1] - 1))  # token t+1 at t
        fused = self.head.fuse(features)
        rows = torch.arange(b, device=first.device)
        if fixed and width == self.width:  # a pass of the target: the captured catch-up
            replay, inputs = self.static.replay(width, feature_width=self.size)
            inputs.tokens.copy_(ids)
            inputs.positions.copy_(positions)
            inputs.start.copy_(first)
            inputs.features.copy_(fused)
            logits, hidden = replay()
            return logits[rows, count - 1], hidden[rows, count - 1]
        # The prompts (once per call); without fixed shapes every pass, at batch 1 the last logits alone.
        last = not fixed and b == 1
        step = StaticStep(self.static.cache, first, visible=None if self.static.graphs else int(first.max()) + width)
        out = static_forward(self.head, ids, positions, step, logits_to_keep=int(last), features=fused)
        if last:  # the head's output at the last position alone
            return out.logits[:, -1], out.hidden[:, -1]
        return out.logits[rows, count - 1], out.hidden[rows, count - 1]

    def propose(self, seqs: Sequences, num_draft_tokens: int) -> Proposal:
        self.width = num_draft_tokens + 1
        logits, hidden = self._catch_up(seqs)
        _, first, count = self.pending
        step, one = self.static.replay(1, logits_to_keep=1, feature_width=self.size)

        def advance(i: int, token: torch.Tensor) -> torch.Tensor:
            nonlocal hidden
            one.tokens.copy_(token[:, None])
            one.start.copy_(first + count + i)
            one.positions.copy_(one.start[:, None])
            one.features.copy_(hidden[:, None])
            logits, out = step()
            hidden = out[:, -1]
            return logits[:, -1]

        return draft_chain(self, logits, num_draft_tokens, advance, self.head.draft_to_target,
                           self.static.fixed_shapes)[0]

    def propose_tree(self, seqs: Sequences, budget: int) -> TreeProposal:
        """An EAGLE-2 dynamic tree (batch size 1) on the device, at fixed shapes: from the root,
        expand the `tree_topk` most probable nodes of each depth (cumulative draft
        log-probability) with their `tree_topk` best children, for `tree_depth` depths, and keep
        the `budget` most probable nodes; each depth's expansion is one captured head forward
        whose nodes see the committed cache and their own ancestors."""
        self.width = self.tree_depth + 1  # a tree pass keeps at most that many positions
        logits, hidden = self._catch_up(seqs)  # the root's: [1, V_draft], [1, H]
        _, first, count = self.pending
        k, depths, device = self.tree_topk, self.tree_depth, logits.device
        total = k + (depths - 1) * k * k  # candidate nodes: k at depth 1, k * k at each deeper one
        score = torch.zeros(total, device=device)
        token = torch.zeros(total, dtype=torch.long, device=device)
        parent = torch.full((total,), -1, dtype=torch.long, device=device)
        depth = torch.ones(total, dtype=torch.long, device=device)
        anc = torch.zeros((total, total), dtype=torch.bool, device=device)  # node -> its ancestors and itself
        fed_hidden = torch.zeros(((depths - 1) * k, self.size), dtype=hidden.dtype, device=device)
        fed_node = torch.zeros((depths - 1) * k, dtype=torch.long, device=device)  # fed slot -> node
        top = torch.log_softmax(logits[0].float(), dim=-1).topk(k)
        score[:k], token[:k] = top.values, top.indices
        anc[torch.arange(k, device=device), torch.arange(k, device=device)] = True
        committed = first + count  # [1] the head's cache after the catch-up
        step, one = self.static.replay(k, feature_width=self.size, mask=True)
        slots = torch.arange(one.mask.shape[-1], device=device)
        lo, hi = 0, k
        for d in range(2, depths + 1):
            expand = lo + torch.sort(score[lo:hi], descending=True, stable=True).indices[:k]  # [K]
            fed = (d - 2) * k  # tree slots already written
            parent_hidden = hidden[0][None].expand(k, -1)  # depth-1 nodes: the root's feature
            if fed:  # deeper: the feature their parent was given when it was fed
                parent_hidden = fed_hidden[fed_slot_of(fed_node, parent[expand], fed)]
            one.tokens.copy_(self.head.draft_to_target[token[expand]][None])
            one.features.copy_(parent_hidden[None])
            one.positions.copy_((committed + d - 2)[:, None].expand(-1, k))  # the expanded nodes' depth is d - 1
            one.start.copy_(committed + fed)
            # Each expanded node sees the committed slots, the tree slots of its ancestors, and itself.
            rel = slots - committed  # [T] slot relative to the tree's first
            mask = (rel < 0)[None, :].expand(k, -1)
            if fed:
                sees_fed = anc[expand][:, fed_node[:fed]]  # [K, fed]
                in_fed = (rel >= 0) & (rel < fed)
                mask = mask | (in_fed[None, :] & sees_fed.gather(1, rel.clamp(0, fed - 1)[None, :].expand(k, -1)))
            mask = mask | (rel[None, :] == fed + torch.arange(k, device=device)[:, None])
            one.mask.copy_(mask[None, None])
            out_logits, out_hidden = step()
            fed_hidden[fed: fed + k] = out_hidden[0]
            fed_node[fed: fed + k] = expand
            children = torch.log_softmax(out_logits[0].float(), dim=-1).topk(k)  # [K, K] per expanded node
            new = hi + torch.arange(k * k, device=device)
            score[new] = (score[expand][:, None] + children.values).reshape(-1)
            token[new] = children.indices.reshape(-1)
            parent[new] = expand.repeat_interleave(k)
            depth[new] = d
            anc[new] = anc[parent[new]]
            anc[new, new] = True
            lo, hi = hi, hi + k * k
        # The budget's most probable nodes (ties: the shallower, then the first made), parents first.
        by_depth = torch.sort(depth, stable=True).indices
        best = by_depth[torch.sort(score[by_depth], descending=True, stable=True).indices][: min(budget, total)]
        chosen = best[torch.sort(depth[best] * total + best).indices]
        position = torch.full((total,), -1, dtype=torch.long, device=device)
        position[chosen] = torch.arange(len(chosen), device=device)
        parents = torch.where(parent[chosen] >= 0, position[parent[chosen].clamp(min=0)], -1)
        return TreeProposal(self.head.draft_to_target[token[chosen]], parents, depths)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass  # the next catch-up writes over the drafted entries


def fed_slot_of(fed_node: torch.Tensor, nodes: torch.Tensor, fed: int) -> torch.Tensor:
    """The tree slot each of `nodes` was fed at (each was): fed_node maps the first `fed` slots to nodes."""
    return (fed_node[None, :fed] == nodes[:, None]).long().argmax(dim=1)

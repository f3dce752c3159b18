"""An EAGLE head as a drafter: chains fed back its own features, and EAGLE-2 dynamic trees."""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.chain import draft_chain, fixed_chain
from pipeline.decode.kv import SlotCache
from pipeline.decode.static_kv import StaticModel, StaticStep, static_forward, use_static_attention
from pipeline.decode.types import Proposal, Sequences, TreeProposal


class EagleDrafter:
    """An EAGLE head drafting autoregressively from the target's features.

    Head position t reads (target feature of t, token t+1). The target's features arrive for
    every position it keeps; before drafting, the head consumes those still pending (their
    next tokens are known by then), then drafts k tokens feeding back its own feature. Its
    draft entries are dropped from its cache before the next round.
    """

    name = "eagle"

    def __init__(self, head, vocab_size: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, tree_depth: int = 5, tree_topk: int = 4,
                 confidence_threshold: float = 0.0):
        self.head, self.vocab_size = head, vocab_size
        self.confidence_threshold = confidence_threshold
        self.tree_depth, self.tree_topk = tree_depth, tree_topk
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.feature_layers = head.feature_layers

    def start(self, prompts: torch.Tensor, prompt_valid: torch.Tensor) -> None:
        self.kv = SlotCache(self.head, prompts.shape[0], prompts.device)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(prompts.shape[0])]
        self.drafted = 0

    def observe(self, features: torch.Tensor, kept: torch.Tensor) -> None:
        for row in range(features.shape[0]):
            self.pending[row].append(features[row][kept[row]])

    def _catch_up(self, seqs: list[list[int]]):
        """Drop the last round's drafts and feed the pending target features; the head's output
        at the last one (its logits predict the first draft token)."""
        device = self.kv.valid.device
        if self.drafted:
            self.kv.keep_last(torch.zeros((len(seqs), self.drafted), dtype=torch.bool, device=device))
            self.drafted = 0
        # Pending features are of positions n-1-m .. n-2 of a row's n tokens; their next tokens
        # are the row's last m. Right-aligned, fillers masked.
        new = [torch.cat(chunks) for chunks in self.pending]
        width = max(len(f) for f in new)
        feats = new[0].new_zeros((len(seqs), width, new[0].shape[-1]))
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        valid = torch.zeros((len(seqs), width), dtype=torch.bool)
        for row, (f, seq) in enumerate(zip(new, seqs)):
            m = len(f)
            feats[row, width - m:] = f
            ids[row, width - m:] = torch.tensor(seq[len(seq) - m:], dtype=torch.long)
            valid[row, width - m:] = True
        self.pending = [[] for _ in seqs]
        return self.kv.run(ids.to(device), valid.to(device), logits_to_keep=1, features=self.head.fuse(feats))

    def propose(self, seqs: list[list[int]], num_draft_tokens: int) -> Proposal:
        k = num_draft_tokens
        out = self._catch_up(seqs)
        hidden = out.hidden[:, -1:]

        def advance(token: torch.Tensor) -> torch.Tensor:
            nonlocal hidden
            step = self.kv.run(token[:, None], features=hidden)
            hidden = step.hidden[:, -1:]
            return step.logits[:, -1]

        proposal, drawn = draft_chain(self, out.logits[:, -1], k, advance, self.head.draft_to_target)
        self.drafted = drawn - 1
        return proposal

    def propose_tree(self, seq: list[int], budget: int):
        """An EAGLE-2 dynamic tree: from the root, expand the `tree_topk` most probable nodes of
        each depth (cumulative draft log-probability) with their `tree_topk` best children,
        for `tree_depth` depths; keep the `budget` most probable nodes."""
        out = self._catch_up([seq])
        topk, to_target = self.tree_topk, self.head.draft_to_target
        device = out.logits.device
        committed = self.kv.valid.shape[1]
        scores, parents, tokens, depths = [], [], [], []  # every candidate node
        fed_slot: dict[int, int] = {}  # node -> its slot among the head's tree entries
        fed_hidden: dict[int, torch.Tensor] = {}

        def add_children(logits: torch.Tensor, parent: int, base: float) -> list[int]:
            logp = torch.log_softmax(logits.float(), dim=-1).topk(min(topk, logits.shape[-1]))
            new = []
            for value, index in zip(logp.values.tolist(), logp.indices.tolist()):
                new.append(len(scores))
                scores.append(base + value)
                parents.append(parent)
                tokens.append(index)
                depths.append(1 if parent < 0 else depths[parent] + 1)
            return new

        frontier = add_children(out.logits[0, -1], -1, 0.0)
        root_hidden = out.hidden[0, -1]
        for depth in range(1, self.tree_depth):
            expand = sorted(frontier, key=lambda n: -scores[n])[:topk]
            m, fed = len(expand), len(fed_slot)
            allowed = torch.zeros((m, committed + fed + m), dtype=torch.bool, device=device)
            allowed[:, :committed] = True
            for row, node in enumerate(expand):
                ancestor = parents[node]
                while ancestor >= 0:
                    allowed[row, committed + fed_slot[ancestor]] = True
                    ancestor = parents[ancestor]
                allowed[row, committed + fed + row] = True
            feats = torch.stack([root_hidden if parents[n] < 0 else fed_hidden[parents[n]] for n in expand])[None]
            ids = to_target[torch.tensor([tokens[n] for n in expand], device=device)][None]
            positions = torch.full((m,), committed - 1 + depth, device=device)
            step = self.kv.run_masked(ids, allowed, positions, features=feats)
            frontier = []
            for row, node in enumerate(expand):
                fed_slot[node] = fed + row
                fed_hidden[node] = step.hidden[0, row]
                frontier += add_children(step.logits[0, row], node, scores[node])
        self.drafted = len(fed_slot)
        # The budget's most probable nodes; a child never scores above its parent, and ties go
        # to the shallower node, so every chosen node's ancestors are chosen too.
        chosen = sorted(sorted(range(len(scores)), key=lambda n: (-scores[n], depths[n]))[:budget],
                        key=lambda n: (depths[n], n))
        position = {n: i for i, n in enumerate(chosen)}
        return TreeProposal(to_target[torch.tensor([tokens[n] for n in chosen], device=device)],
                            torch.tensor([position[parents[n]] if parents[n] >= 0 else -1 for n in chosen],
                                         device=device))

    def accepted(self, num_accepted: torch.Tensor) -> None:
        pass  # every draft entry is dropped before the next round

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]


class FastEagleDrafter:
    """An EAGLE head on the fast path: its own static cache, one catch-up forward of the target
    positions the last pass kept (k+1 wide, fixed; replayed from a graph on CUDA) and k - 1
    single-token steps feeding back its own features.

    Head position t reads (target feature of t, token t+1); the head's cache holds every
    position the target kept before the last pass. The catch-up writes the kept ones (and
    stale fillers past them, which the next catch-up writes over, as it does the drafts)."""

    name = "eagle"

    def __init__(self, head, vocab_size: int, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, confidence_threshold: float = 0.0,
                 graphs: bool = False, tree_depth: int = 5, tree_topk: int = 4):
        self.head, self.vocab_size = head, vocab_size
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.confidence_threshold = confidence_threshold
        self.tree_depth, self.tree_topk = tree_depth, tree_topk
        self.feature_layers = head.feature_layers
        use_static_attention(head.decoder)
        self.static = StaticModel(head, graphs)
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
        b, width = features.shape[:2]
        columns = torch.arange(width, device=first.device)
        positions = first[:, None] + columns
        ids = seqs.tokens.gather(1, (positions + 1).clamp(max=seqs.tokens.shape[1] - 1))  # token t+1 at t
        fused = self.head.fuse(features)
        if width == self.width:  # a pass of the target: the captured catch-up
            replay, inputs = self.static.replay(width, feature_width=self.size)
            inputs.tokens.copy_(ids)
            inputs.positions.copy_(positions)
            inputs.start.copy_(first)
            inputs.features.copy_(fused)
            logits, hidden = replay()
        else:  # the prompts, once per call
            out = static_forward(self.head, ids, positions, StaticStep(self.static.cache, first), features=fused)
            logits, hidden = out.logits, out.hidden
        rows = torch.arange(b, device=first.device)
        return logits[rows, count - 1], hidden[rows, count - 1]

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

        return fixed_chain(self, logits, num_draft_tokens, advance, self.head.draft_to_target)

    def propose_tree(self, seqs: Sequences, budget: int) -> TreeProposal:
        """EagleDrafter.propose_tree on the device (batch size 1), at fixed shapes: the same
        EAGLE-2 tree (the `tree_topk` most probable nodes of each depth expanded with their
        `tree_topk` best children, `tree_depth` depths, the `budget` most probable nodes kept),
        each depth's expansion one captured head forward whose nodes see the committed cache and
        their own ancestors."""
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

"""Token-tree speculative decoding, batch size 1: the drafter proposes a tree of candidate
continuations, the target scores every node in one pass (tree attention: a node attends the
cache and its own ancestors, at position cached length + depth), and the longest path the
target agrees with is kept -- its KV entries moved together in the static cache, the other
nodes' left to be written over. The layout, the walk and the move run on the device, one
small device->host copy a round.

Acceptance walks down from the root (the last committed token):
- greedy: follow the child whose token is the target's argmax; stop where none is;
- sampling: the children's tokens are fixed by the drafter (its top candidates), so each is a
  point-mass proposal. Child x is accepted with probability p(x) / (remaining mass); on
  rejection x's mass is removed and the next sibling tried; when every child is rejected the
  next token is sampled from what remains. That is sampling from p by sequential
  elimination, so the emitted tokens are distributed exactly as the target's.
"""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.decode.sampling import next_token, process_logits
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.types import DecodeResult, Rows, Sequences


def tree_layout(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestors [N+1, N+1] over (root, nodes) (i may attend j: j is i or one of its ancestors)
    and each node's depth [N+1] (the root's 0), with a fixed number of operations (no host
    round-trip): parents [N] (-1: the root), at most max_depth deep."""
    n = parents.shape[0]
    up = torch.zeros((n + 1, n + 1), device=parents.device)
    up[torch.arange(1, n + 1, device=parents.device), parents + 1] = 1.0  # node -> its parent
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    reach = anc.float()
    for _ in range(max_depth):
        reach = reach @ up
        anc |= reach > 0
    return anc, anc.sum(dim=1) - 1


def greedy_walk_on_device(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor,
                          logits: torch.Tensor):
    """The greedy walk: logits [N+1, V] at (root, nodes); follow the child whose token is the
    target's argmax, stop where none is. A node is kept when
    it is the first child of its parent whose token is the target's argmax there, and so are
    its ancestors; the deepest kept node ends the accepted path. Returns (end node, its depth
    = tokens accepted, the next token, whether the end node has children), all device scalars."""
    best = logits.argmax(dim=-1)  # [N+1]
    index = torch.arange(len(best), device=best.device)
    parent = torch.cat([index[:1], parents + 1])  # each node's parent (the root: itself)
    node_tokens = torch.cat([best.new_full((1,), -1), tokens])
    matched = (node_tokens == best[parent]) | (index == 0)
    earlier = (parent[:, None] == parent[None, :]) & (index[None, :] < index[:, None]) & (index[None, :] > 0)
    first = matched & ~(earlier & matched[None, :]).any(dim=1)
    kept = ~(anc & ~first[None, :]).any(dim=1)
    end = (kept.long() * (depth + 1)).argmax()
    return end, depth[end], best[end], (parent[1:] == end).any()


def sampling_walk_on_device(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, max_depth: int,
                            temperature: float, top_p: float, generator: Optional[torch.Generator]):
    """The sampling walk, one fixed step per depth: at each node its children
    are tried in order, child x accepted with probability p(x) / (the mass not yet removed) and
    its mass removed when rejected (a duplicate token is never accepted twice); when none is
    accepted the next token is drawn from what remains. The same rule as `walk`, with the
    children of a node decided together from one uniform each. Returns (path [max_depth + 1]:
    root first, then the accepted nodes, then repeats of the last; tokens accepted; the next
    token; whether the last node reached had children), all on the device."""
    probs = process_logits(logits, temperature, top_p)  # [N+1, V]
    n = len(tokens)
    index = torch.arange(n + 1, device=tokens.device)
    parent = torch.cat([index[:1], parents + 1])
    node_tokens = torch.cat([tokens.new_full((1,), 0), tokens])
    is_child = (parent[None, :] == index[:, None]) & (index[None, :] > 0)  # [N+1, N+1] j is a child of i
    children = torch.sort(torch.where(is_child, index, n + 1 + index), dim=1).indices  # children first, in order
    node = index[0]
    path, going = [node], torch.ones((), dtype=torch.bool, device=tokens.device)
    accepted = torch.zeros((), dtype=torch.long, device=tokens.device)
    following = torch.zeros((), dtype=torch.long, device=tokens.device)
    had_kids = torch.zeros((), dtype=torch.bool, device=tokens.device)
    for _ in range(max_depth + 1):
        p = probs[node]  # [V]
        kids = children[node]  # [N+1]
        real = is_child[node][kids]  # [N+1]
        kid_tokens = node_tokens[kids]
        repeat = ((kid_tokens[None, :] == kid_tokens[:, None]) & real[None, :]
                  & (index[None, :] < index[:, None])).any(dim=1)  # the token came earlier among the siblings
        first = real & ~repeat
        mass = torch.where(first, p[kid_tokens], 0.0)
        removed_before = torch.cumsum(mass, dim=0) - mass
        u = torch.rand(n + 1, generator=generator, device=tokens.device)
        accept = first & (u * (p.sum() - removed_before) < mass)
        found = accept.any()
        chosen = kids[accept.long().argmax()]
        tried = torch.zeros_like(p).scatter_add(0, kid_tokens, first.to(p.dtype))  # [V] > 0: a child's token
        residual = torch.where(tried > 0, 0.0, p)
        residual = torch.where(residual.sum() > 0, residual, p)  # only drawn from where nothing was accepted
        drawn = torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]
        stop = going & ~found
        following = torch.where(stop, drawn, following)
        had_kids = torch.where(going, real.any(), had_kids)
        accepted = accepted + (going & found).long()
        node = torch.where(going & found, chosen, node)
        going = going & found
        path.append(node)
    return torch.stack(path[: max_depth + 1]), accepted, following, had_kids


@torch.inference_mode()
def tree_decode(target: StaticModel, drafter, prompts: list[list[int]], *, budget: int, max_new_tokens: int,
                eos_ids: set[int], temperature: float = 0.0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> DecodeResult:
    """Lossless tree speculative decoding, one prompt at a time (a captured verification per
    tree size): greedy output equals the target's, sampled output is distributed as its."""
    device = target.device
    layers = tuple(drafter.feature_layers)
    result = DecodeResult([], [])
    for prompt in prompts:
        target.ready(1, len(prompt) + max_new_tokens + budget + 2)
        seqs = Sequences(torch.zeros((1, target.max_len), dtype=torch.long, device=device),
                         torch.tensor([len(prompt)], device=device))
        seqs.tokens[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        rows = Rows([prompt], max_new_tokens, eos_ids)
        out = target.prefill(seqs.tokens, seqs.lengths, layers)
        logits, features = out if layers else (out, None)
        first = next_token(logits, temperature, top_p, generator)
        seqs.tokens[0, len(prompt)] = first[0]
        seqs.lengths += 1
        drafter.start(seqs, target.max_len)
        if features is not None:
            drafter.observe(features, torch.zeros_like(seqs.lengths), seqs.lengths - 1)
        finished = rows.emit(0, first.tolist())
        while not finished:
            proposal = drafter.propose_tree(seqs, budget)
            n = len(proposal.tokens)
            max_depth = proposal.max_depth or n
            anc, depth = tree_layout(proposal.parents, max_depth)
            verify, inputs = target.replay(n + 1, layers=layers, tree=True)
            inputs.start.copy_(seqs.lengths - 1)
            inputs.positions.copy_(inputs.start[:, None] + depth[None])
            inputs.tokens[:, :1] = seqs.tokens.gather(1, inputs.start[:, None])
            inputs.tokens[0, 1:] = proposal.tokens
            inputs.tree.copy_(anc)
            out = verify()
            logits, features = out if layers else (out, None)
            if temperature == 0:
                end, num_accepted, new, has_kids = greedy_walk_on_device(proposal.tokens, proposal.parents, anc,
                                                                         depth, logits[0])
                # The accepted path, root first, then the other nodes (stale past the path's end).
                path = torch.sort(torch.where(anc[end], depth, n + 1 + depth)).indices[: max_depth + 1]
            else:
                path, num_accepted, new, has_kids = sampling_walk_on_device(
                    proposal.tokens, proposal.parents, logits[0], max_depth, temperature, top_p, generator)
            # The accepted path made contiguous (the root is in place already): without fixed
            # shapes only as far as it goes, and not at all where no node was accepted.
            moved = len(path) if target.fixed_shapes else int(num_accepted) + 1
            if moved > 1:
                target.cache.move(inputs.start, path[None], moved)
            node_tokens = torch.cat([inputs.tokens[0, :1], proposal.tokens])
            emitted = torch.cat([node_tokens[path[1:]], new[None]]).scatter(0, num_accepted[None], new[None])
            slots = (seqs.lengths + torch.arange(len(emitted), device=device)).clamp(max=target.max_len - 1)
            seqs.tokens[0, slots] = emitted
            seqs.lengths += num_accepted + 1
            if features is not None:
                drafter.observe(features[:, path], inputs.start, num_accepted[None] + 1)
            n_acc, kids, *tokens = torch.cat([num_accepted[None], has_kids[None].long(), emitted]).tolist()
            result.count(n_acc + kids, n_acc)  # depth d had candidates; all but the last reached were accepted
            finished = rows.emit(0, tokens[: n_acc + 1])
        result.tokens.append(rows.out[0])
        result.target_passes.append(rows.passes[0])
    return result

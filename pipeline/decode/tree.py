"""Token-tree speculative decoding, batch size 1: the drafter proposes a tree of candidate
continuations, the target scores every node in one pass (tree attention: a node attends the
cache and its own ancestors, at position cached length + depth), and the longest path the
target agrees with is kept -- its KV entries moved together, every other node's dropped.

Acceptance walks down from the root (the last committed token):
- greedy: follow the child whose token is the target's argmax; stop where none is;
- sampling: the children's tokens are fixed by the drafter (its top candidates), so each is a
  point-mass proposal. Child x is accepted with probability p(x) / (remaining mass); on
  rejection x's mass is removed and the next sibling tried; when every child is rejected the
  next token is sampled from what remains. That is sampling from p by sequential
  elimination, so the emitted tokens are distributed exactly as the target's.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from pipeline.decode.kv import SlotCache, with_hidden_states
from pipeline.decode.sampling import next_token, process_logits, sample
from pipeline.decode.types import DecodeResult, Rows, TreeProposal, left_pad


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[N+1, N+1] bool over (root, nodes): i may attend j when j is i or one of its ancestors."""
    n = len(parents)
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    for i, parent in enumerate(parents.tolist()):
        anc[i + 1] |= anc[parent + 1]
    return anc


def walk(proposal: TreeProposal, logits: torch.Tensor, temperature: float, top_p: float,
         generator: Optional[torch.Generator]) -> tuple[list[int], int, list[bool]]:
    """Accept down the tree. logits [N+1, V] at (root, nodes). Returns the accepted path as
    chunk indices (root first), the next token, and for each depth reached whether its
    candidate was accepted (the bookkeeping of α by position)."""
    children: list[list[int]] = [[] for _ in range(len(proposal.parents) + 1)]
    for i, parent in enumerate(proposal.parents.tolist()):
        children[parent + 1].append(i + 1)
    tokens = [-1] + proposal.tokens.tolist()
    node, path, verdicts = 0, [0], []
    while True:
        kids = children[node]
        if temperature == 0:
            best = int(logits[node].argmax())
            chosen = next((c for c in kids if tokens[c] == best), None)
            following = best
        else:
            p = process_logits(logits[node][None], temperature, top_p)[0].clone()
            chosen = None
            for c in kids:
                u = torch.rand((), generator=generator, device=p.device)
                if u * p.sum() < p[tokens[c]]:
                    chosen = c
                    break
                p[tokens[c]] = 0.0
            following = None if chosen is not None else int(sample(p / p.sum(), generator))
        if kids:
            verdicts.append(chosen is not None)
        if chosen is None:
            return path, following, verdicts
        node = chosen
        path.append(node)


@torch.inference_mode()
def tree_decode(
    model, drafter, prompts: list[list[int]], *, budget: int, max_new_tokens: int, eos_ids: set[int], pad_id: int,
    temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Lossless tree speculative decoding of one prompt at a time (each is decoded alone)."""
    results = [_tree_decode_one(model, drafter, p, budget, max_new_tokens, eos_ids, pad_id, temperature, top_p,
                                generator) for p in prompts]
    proposed = [sum(x) for x in itertools.zip_longest(*(r.proposed_by_position for r in results), fillvalue=0)]
    accepted = [sum(x) for x in itertools.zip_longest(*(r.accepted_by_position for r in results), fillvalue=0)]
    return DecodeResult([r.tokens[0] for r in results], [r.target_passes[0] for r in results], proposed, accepted)


def _tree_decode_one(model, drafter, prompt, budget, max_new_tokens, eos_ids, pad_id, temperature, top_p,
                     generator) -> DecodeResult:
    device = next(model.parameters()).device
    tokens, valid = left_pad([prompt], pad_id, device)
    kv = SlotCache(model, 1, device)
    drafter.start(tokens, valid)
    rows = Rows([prompt], max_new_tokens, eos_ids)
    layers = drafter.feature_layers
    out = kv.run(tokens, valid, logits_to_keep=1, **with_hidden_states(layers))
    if layers:
        drafter.observe(torch.cat([out.hidden_states[i] for i in layers], dim=-1), valid)
    last = next_token(out.logits[:, -1], temperature, top_p, generator)
    finished = rows.emit(0, [int(last)])
    proposed, accepted = [], []
    while not finished:
        proposal = drafter.propose_tree(rows.live_seqs()[0], budget)
        chunk = torch.cat([last, proposal.tokens.to(device)])[None]  # [1, N+1]
        anc = ancestors(proposal.parents.to(device))
        out = kv.run_tree(chunk, anc, **with_hidden_states(layers))
        path, following, verdicts = walk(proposal, out.logits[0], temperature, top_p, generator)
        for depth, ok in enumerate(verdicts):
            if depth == len(proposed):
                proposed.append(0)
                accepted.append(0)
            proposed[depth] += 1
            accepted[depth] += ok
        index = torch.tensor(path, device=device)
        kv.keep_tree(chunk.shape[1], index)
        if layers:  # the features of the kept path, in order
            features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)[:, index]
            drafter.observe(features, torch.ones((1, len(path)), dtype=torch.bool, device=device))
        finished = rows.emit(0, chunk[0, index[1:]].tolist() + [following])
        last = torch.tensor([following], device=device)
    return DecodeResult(rows.out, rows.passes, proposed, accepted)

"""Drafters: propose up to `num_draft_tokens` tokens per row, and (when sampling) their probabilities.

A drafter sees the committed sequences (prompt + emitted tokens) of the active rows and is
told after verification how many of its proposals each row accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

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


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    name = "ngram"
    feature_layers = ()

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


def draw(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator],
         to_target: Optional[torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One draft token per row from logits [B, V_draft]: the argmax when greedy, else a sample,
    with the distribution it came from ([B, vocab_size], None when greedy). A draft vocabulary
    (`to_target`: draft index -> target id) maps the token back and puts zero probability on
    every target token outside it."""
    q = None
    if temperature > 0:
        q = process_logits(logits, temperature, top_p)
        token = sample(q, generator)
        if to_target is not None:
            q = q.new_zeros((q.shape[0], vocab_size)).index_copy_(1, to_target, q)
    else:
        token = logits.argmax(dim=-1)
    if to_target is not None:
        token = to_target[token]
    return token, q


def chain_proposal(tokens: list[torch.Tensor], probs: list[Optional[torch.Tensor]],
                   num: Optional[torch.Tensor] = None) -> Proposal:
    """A proposal from per-position [B] tokens and [B, V] probs: len(tokens) tokens for every
    row, or num [B] of them (the rest filler)."""
    stacked = torch.stack(tokens, dim=1)
    if num is None:
        num = torch.full((stacked.shape[0],), stacked.shape[1], dtype=torch.long, device=stacked.device)
    return Proposal(stacked, num, torch.stack(probs, dim=1) if probs[0] is not None else None)


def draft_chain(drafter, logits: torch.Tensor, k: int, advance: Callable[[torch.Tensor], torch.Tensor],
                to_target: Optional[torch.Tensor]) -> tuple[Proposal, int]:
    """Draw up to k tokens per row autoregressively from the first logits [B, V_draft];
    advance(token [B]) feeds a drawn token to the draft and returns its next logits.

    The drafter's confidence_threshold > 0 ends a row's chain early (as transformers' assisted
    generation does): a token the draft gave less than that probability is the row's last
    proposal, and drawing stops once every row has ended. Each skipped token saves a draft
    step and a verified position that would likely be rejected; the stop depends only on the
    draft's own distributions, so verification stays lossless. Returns the proposal and the
    number of tokens drawn (all but the last were fed to the draft)."""
    threshold = drafter.confidence_threshold
    going = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)  # rows still proposing
    num = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    tokens, probs = [], []
    for i in range(k):
        token, q = draw(logits, drafter.temperature, drafter.top_p, drafter.generator, to_target, drafter.vocab_size)
        tokens.append(token)
        probs.append(q)
        num += going
        if threshold > 0:
            going &= confidence(logits, token, q) >= threshold
            if not going.any():
                break
        if i < k - 1:
            logits = advance(token)
    return chain_proposal(tokens, probs, num), len(tokens)


def confidence(logits: torch.Tensor, token: torch.Tensor, q: Optional[torch.Tensor]) -> torch.Tensor:
    """[B] the probability the draft gave its own choice: q(token) when sampling, the largest
    of softmax(logits [B, V_draft]) when greedy."""
    if q is not None:
        return q.gather(1, token[:, None])[:, 0]
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


class ModelDrafter:
    """A separate small causal LM with the target's tokenizer, with its own KV cache kept in
    step with the accepted tokens.

    A draft whose LM head covers only a draft vocabulary carries `draft_to_target` (draft
    index -> target id, distill/draft.py): its proposals are mapped back to target ids, and
    when sampling its distribution is spread onto the target's vocabulary (zero elsewhere).
    confidence_threshold > 0 ends a row's chain at its first unconfident token (draft_chain).
    """

    feature_layers = ()

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, name: str = "draft_model",
                 confidence_threshold: float = 0.0):
        self.model, self.name = model, name
        self.confidence_threshold = confidence_threshold
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

        advance = lambda token: self.kv.forward(token[:, None])[:, -1]
        proposal, drawn = draft_chain(self, logits, k, advance, self.to_target)
        self.last_fed = drawn - 1  # d_1..d_{n-1} of the n drawn are in the cache, d_n is not
        return proposal

    def accepted(self, num_accepted: torch.Tensor) -> None:
        # Keep the fed proposals that were accepted; the rest of d_1..d_{k-1} is dropped.
        fed = self.last_fed
        if fed:
            keep = torch.arange(fed, device=num_accepted.device)[None, :] < num_accepted[:, None]
            self.kv.keep_last(keep)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)


def last_kept(features: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Each row's features at its last kept position: [B, S, F], [B, S] -> [B, F]."""
    s = kept.shape[1]
    index = (kept.long() * torch.arange(1, s + 1, device=kept.device)).argmax(dim=1)
    return features[torch.arange(features.shape[0], device=features.device), index]


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
        from pipeline.decode.tree import TreeProposal, static_tree

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
        from pipeline.decode.tree import TreeProposal

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

"""What the heads learn from one batch: the frozen target's hidden states and distributions in,
a loss (and, on held-out data, acceptance statistics) out, for medusa, eagle (with
training-time test) and early exit.

Every loss compares a head's distribution over its draft vocabulary with the target's own
next-token distribution renormalised to that vocabulary (train/losses.py): a training step
computes only those V_draft logits of the target (its last hidden state times those rows of
its LM head), never the full vocabulary. The held-out statistics are against the target's full
distribution: α = Σ_v min(p(v), q(v)) (the expected acceptance when sampling, 1 − TV), top-1
agreement (the acceptance of greedy decoding) and the rank of the target's token among the
head's candidates, from which Tally.means derives the τ a chain and a token tree would reach.

A batch may pack several conversations into a row (collate's pack): positions restart with
each, attention and training-time test never cross them, and every loss is the one the same
conversations give one per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.train.data import Batch
from pipeline.train.losses import Teacher, distill_loss


@dataclass
class TargetView:
    """One frozen target pass over a batch; its distributions at the batch's learned positions
    (batch.rows, batch.cols), computed once for every head and step that learns from them."""

    hidden: dict[int, torch.Tensor]
    """output_hidden_states index -> [B, T, H] (the last index is after the final norm)."""
    logits: torch.Tensor
    """[N, V_draft] the target's logits at the draft vocabulary's tokens."""
    probs: Optional[torch.Tensor] = None
    """[N, V_draft] the target's probabilities (over its full vocabulary) of those tokens;
    with `top`, only for the held-out statistics (stats=True)."""
    top: Optional[torch.Tensor] = None
    """[N] the target's own argmax token."""

    def at(self, index: torch.Tensor) -> "TargetView":
        if self.probs is None:
            return TargetView(self.hidden, self.logits[index])
        return TargetView(self.hidden, self.logits[index], self.probs[index], self.top[index])


RANKS = 8
"""Held-out statistics count the rank of the target's token among a head's first RANKS candidates."""


@dataclass
class Terms:
    loss: torch.Tensor
    alpha: list[torch.Tensor] = field(default_factory=list)
    """Per draft position (medusa head, eagle step; one for early exit): α at each example
    (held-out statistics only, like top1 and rank)."""
    top1: list[torch.Tensor] = field(default_factory=list)
    rank: list[torch.Tensor] = field(default_factory=list)
    """Per draft position: the rank of the target's token among the head's candidates (0: its
    first), RANKS where it is not among the first RANKS or not in the draft vocabulary."""


def target_layers(target: nn.Module, layers: tuple[int, ...]) -> list[int]:
    """The hidden states a head learns from: its own layers and the last (the teacher's)."""
    return sorted(set(layers) | {target.config.num_hidden_layers})


@torch.no_grad()
def view_from_hidden(target: nn.Module, hidden: dict[int, torch.Tensor], batch: Batch,
                     draft_to_target: torch.Tensor, bf16: bool = False, stats: bool = False) -> TargetView:
    """The target's distributions at the learned positions, from its last hidden state: only the
    draft vocabulary's logits (those rows of the LM head), or with `stats` the full distribution
    the held-out statistics read."""
    last = hidden[target.config.num_hidden_layers][batch.rows, batch.cols]  # [N, H]
    head = target.get_output_embeddings()
    with torch.autocast(last.device.type, dtype=torch.bfloat16, enabled=bf16):
        if not stats:
            bias = head.bias[draft_to_target] if head.bias is not None else None
            return TargetView(hidden, F.linear(last, head.weight[draft_to_target], bias).float())
        logits = head(last).float()
    return TargetView(hidden, logits[:, draft_to_target], torch.softmax(logits, dim=-1)[:, draft_to_target],
                      logits.argmax(dim=-1))


def target_view(target: nn.Module, batch: Batch, layers: tuple[int, ...], draft_to_target: torch.Tensor,
                bf16: bool = False, stats: bool = False) -> TargetView:
    """One frozen target pass (online features); with bf16 under bfloat16 autocast (on CPU about
    twice as fast)."""
    from pipeline.heads.cache import run_target

    hidden = run_target(target, batch, target_layers(target, layers), bf16)
    return view_from_hidden(target, hidden, batch, draft_to_target, bf16, stats)


def score(student: torch.Tensor, view: TargetView, draft_to_target: torch.Tensor, loss: str,
          terms: Terms) -> torch.Tensor:
    """The loss of draft-vocabulary logits [N, V_d] against the target; where the view has the
    full distribution (held-out), α, top-1 agreement and the target token's rank [N] are
    appended to `terms` as the next draft position's."""
    value = distill_loss(loss, student, Teacher(view.logits), None)
    if view.probs is not None:
        with torch.no_grad():
            terms.alpha.append(torch.minimum(view.probs, torch.softmax(student.float(), dim=-1)).sum(-1))
            terms.top1.append((draft_to_target[student.argmax(-1)] == view.top).float())
            terms.rank.append(candidate_rank(student, view.top, draft_to_target))
    return value


def candidate_rank(student: torch.Tensor, token: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """[N] the rank of target token `token` [N] among the draft logits [N, V_d] (0: the head's
    first candidate), capped at RANKS; RANKS where the token is not in the draft vocabulary."""
    index = torch.full((int(draft_to_target.max()) + 2,), -1, dtype=torch.long, device=student.device)
    index[draft_to_target] = torch.arange(len(draft_to_target), device=student.device)
    where = index[token.clamp(max=len(index) - 1)]  # [N] draft index, -1 outside
    own = student.gather(-1, where.clamp(min=0)[:, None])  # [N, 1]
    rank = (student > own).sum(-1)
    return torch.where(where >= 0, rank.clamp(max=RANKS), RANKS)


def no_position(terms: Terms, like: torch.Tensor) -> None:
    """A draft position with nothing to measure in this batch (its statistics stay in order)."""
    terms.alpha.append(like.new_zeros(0)), terms.top1.append(like.new_zeros(0))
    terms.rank.append(like.new_zeros(0, dtype=torch.long))


def medusa_terms(heads, view: TargetView, batch: Batch, loss: str, decay: float) -> Terms:
    """Head i at learned position (r, c) predicts token c + i + 2: the target's distribution
    at c + i + 1, where that position is learned too (in the same conversation)."""
    final = view.hidden[max(view.hidden)]
    b, t = batch.input_ids.shape
    index = torch.full((b, t), -1, dtype=torch.long, device=final.device)  # learned position -> row of the view's distributions
    index[batch.rows, batch.cols] = torch.arange(len(batch.rows), device=final.device)
    if batch.segments is not None:  # packed: never a position of the next conversation
        index = torch.where(batch.segments > 0, index, -1)
    terms, total, weights = Terms(loss=final.new_zeros(())), 0.0, 0.0
    for i, block in enumerate(heads.blocks):
        ahead = (batch.cols + i + 1).clamp(max=t - 1)
        teacher_row = torch.where(batch.cols + i + 1 < t, index[batch.rows, ahead], -1)
        if batch.segments is not None:
            teacher_row = torch.where(batch.segments[batch.rows, ahead] == batch.segments[batch.rows, batch.cols],
                                      teacher_row, -1)
        ok = teacher_row >= 0
        if not bool(ok.any()):
            if view.probs is not None:
                no_position(terms, final)
            continue
        student = heads.lm_head(block(final[batch.rows[ok], batch.cols[ok]]))
        value = score(student, view.at(teacher_row[ok]), heads.draft_to_target, loss, terms)
        total, weights = total + decay ** i * value, weights + decay ** i
    terms.loss = total / weights if weights else terms.loss
    return terms


def ttt_mask(valid: torch.Tensor, step: int, dtype: torch.dtype, segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Additive attention mask [B, 1, T, step*T] of simulated draft step `step` (1-based) over
    the keys of steps 1..step, as the head sees them when drafting: the query at position t
    (its chain began at t - step + 1) sees step-1 keys up to t - step + 1 (the target's
    features) and, of each later step r, the one key at t - (step - r) (its own drafts).
    Packed rows (`segments` [B, T], collate's): only keys of the query's own conversation."""
    b, t = valid.shape
    pos = torch.arange(t, device=valid.device)
    first = (pos[None, :] <= pos[:, None] - (step - 1))[None] & valid[:, None, :]  # [B, T, T]
    if segments is not None:
        first = first & (segments[:, :, None] == segments[:, None, :])
    blocks = [first]
    for r in range(2, step + 1):
        blocks.append((pos[None, :] == pos[:, None] - (step - r))[None].expand(b, t, t))
    allowed = torch.cat(blocks, dim=2)
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


def eagle_terms(head, view: TargetView, batch: Batch, loss: str, steps: int) -> Terms:
    """Head position t reads (fused target features of t, token t+1) and predicts token t+2:
    the target's distribution at learned position c = t + 1. Step s > 1 (training-time test)
    feeds the head's own step s-1 output of t-1 in place of the target's features of t."""
    from transformers import DynamicCache

    ids, valid = batch.input_ids, batch.attention_mask.bool()
    b, t = ids.shape
    feats = head.fuse(torch.cat([view.hidden[i] for i in head.feature_layers], dim=-1))
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token t+1 at position t (the last is filler)
    positions = batch.position_ids if batch.position_ids is not None else \
        torch.arange(t, device=ids.device)[None].expand(b, t)
    depth = positions[batch.rows, batch.cols]  # each learned position's place in its conversation
    cache = DynamicCache(config=head.config)
    terms, total = Terms(loss=feats.new_zeros(())), 0.0
    for step in range(1, steps + 1):
        hidden = head.features_out(next_ids, feats, attention_mask=ttt_mask(valid, step, feats.dtype, batch.segments),
                                   position_ids=positions, cache=cache, use_cache=True)
        ok = depth >= step  # the chain starts at t - step + 1, within the conversation
        total = total + score(head.logits(hidden[batch.rows[ok], batch.cols[ok] - 1]), view.at(ok),
                              head.draft_to_target, loss, terms)
        feats = torch.cat([hidden.new_zeros((b, 1, hidden.shape[-1])), hidden[:, :-1]], dim=1)
    terms.loss = total / steps
    return terms


def early_exit_terms(adapter, view: TargetView, batch: Batch, loss: str, target_norm: nn.Module) -> Terms:
    """The adapter on layer `exit_layer`'s output, then the target's norm and the LM head's rows,
    against the target's distribution at the same position."""
    hidden = view.hidden[adapter.feature_layers[0]][batch.rows, batch.cols]
    terms = Terms(loss=hidden.new_zeros(()))
    terms.loss = score(adapter.lm_head(target_norm(adapter(hidden))), view, adapter.draft_to_target, loss, terms)
    return terms


class HeadsForTraining(nn.Module):
    """The heads behind one forward(view, batch) -> Terms, so DDP and DeepSpeed see every call.
    `draft` is the trained module, the attribute pipeline/train/loop.py checkpoints."""

    def __init__(self, heads: nn.Module, target: nn.Module, loss: str, medusa_decay: float, ttt_steps: int) -> None:
        super().__init__()
        self.draft = heads
        self.loss, self.medusa_decay, self.ttt_steps = loss, medusa_decay, ttt_steps
        object.__setattr__(self, "target_norm", target.get_decoder().norm)  # borrowed, not a submodule

    def forward(self, view: TargetView, batch: Batch, depth: Optional[int] = None) -> Terms:
        """`depth`: EAGLE's draft steps (training-time test's, ttt_steps, unless given: the
        held-out statistics measure deeper chains than training may simulate)."""
        kind = self.draft.kind
        if kind == "medusa":
            return medusa_terms(self.draft, view, batch, self.loss, self.medusa_decay)
        if kind == "eagle":
            return eagle_terms(self.draft, view, batch, self.loss, depth or self.ttt_steps)
        return early_exit_terms(self.draft, view, batch, self.loss, self.target_norm)

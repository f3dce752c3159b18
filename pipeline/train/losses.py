"""Distillation losses between the target's next-token distribution p and the draft's q.

Each divergence takes aligned log-probabilities over the same support, [N, S], and returns
one value per position, [N]. The support is the whole vocabulary when the target's full
logits are at hand (online), or the target's top-k tokens plus one bucket for the rest of
the vocabulary when only its top-k logits were stored (offline): there the target's tail
mass is 0, and the draft's tail is whatever it puts outside the target's top-k.

Total variation is the direct objective: a draft token is accepted with expected
probability α = 1 − TV(p, q) (Leviathan et al.), so minimising TV maximises acceptance.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.config import LOSS_KINDS

REVERSE_KL_FLOOR = 1e-8
"""Reverse KL needs p > 0 wherever q > 0; a top-k teacher has p = 0 on its tail bucket."""


def forward_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = Σ p (log p − log q): mass-covering. [N, S] -> [N]"""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def reverse_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(q || p) = Σ q (log q − log p): mode-seeking. [N, S] -> [N]"""
    q = q_log.exp()
    p_log = p_log.clamp(min=math.log(REVERSE_KL_FLOOR))
    return torch.where(q > 0, q * (q_log - p_log), torch.zeros_like(q)).sum(-1)


def jsd(p_log: torch.Tensor, q_log: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen–Shannon: β KL(p || m) + (1 − β) KL(q || m), m = β p + (1 − β) q.

    β → 0 behaves like forward KL and β → 1 like reverse KL (up to scale), as in GKD and
    DistillSpec. [N, S] -> [N]"""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    m_log = torch.logaddexp(p_log + math.log(beta), q_log + math.log(1.0 - beta))
    return beta * forward_kl(p_log, m_log) + (1.0 - beta) * forward_kl(q_log, m_log)


def total_variation(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = ½ Σ |p − q| = 1 − expected acceptance of one draft token. [N, S] -> [N]"""
    return 0.5 * (p_log.exp() - q_log.exp()).abs().sum(-1)


@dataclass
class Teacher:
    """The target's next-token distribution at N positions: full logits or its top-k."""

    logits: torch.Tensor
    """[N, V] full logits, or [N, k] top-k logits with `ids`."""
    ids: Optional[torch.Tensor] = None
    """[N, k] token ids of the top-k logits; None for full logits."""


def aligned_log_probs(student_logits: torch.Tensor, teacher: Teacher, temperature: float = 1.0):
    """(p_log, q_log) over a common support, both [N, S], at the given temperature."""
    q_full = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [N, V]
    p_log = F.log_softmax(teacher.logits.float() / temperature, dim=-1)
    if teacher.ids is None:
        return p_log, q_full
    # A teacher logit of -inf marks a token the draft cannot propose (DraftVocab.teacher): q = 0 there.
    q_top = q_full.gather(-1, teacher.ids).masked_fill(teacher.logits.isneginf(), float("-inf"))  # [N, k]
    # The draft's mass outside the teacher's top-k: log(1 − Σ q_top), computed stably.
    q_rest = torch.log1p(-torch.logsumexp(q_top, dim=-1).exp().clamp(max=1 - 1e-7))
    p_rest = torch.full_like(q_rest, float("-inf"))
    return torch.cat([p_log, p_rest[:, None]], dim=-1), torch.cat([q_top, q_rest[:, None]], dim=-1)


def distill_loss(kind: str, student_logits: torch.Tensor, teacher: Teacher, labels: torch.Tensor,
                 temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Mean loss over N positions. student_logits [N, V]; labels [N], the tokens the target chose."""
    if kind == "ce":
        return F.cross_entropy(student_logits.float(), labels)
    p_log, q_log = aligned_log_probs(student_logits, teacher, temperature)
    if kind == "forward_kl":
        per_position = forward_kl(p_log, q_log)
    elif kind == "reverse_kl":
        per_position = reverse_kl(p_log, q_log)
    elif kind == "jsd":
        per_position = jsd(p_log, q_log, beta)
    elif kind == "tv":
        per_position = total_variation(p_log, q_log)
    else:
        raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSS_KINDS)}")
    # KL-type gradients shrink as 1/T²; scaling back keeps the step size independent of T (Hinton et al.).
    scale = temperature**2 if kind in ("forward_kl", "reverse_kl", "jsd") else 1.0
    return scale * per_position.mean()


class DraftVocab:
    """A draft that proposes only some of the target's tokens: its logit i is token ids[i].

    Training such a draft against the target's distribution renormalised to those tokens is
    the best it can do (both for KL and for acceptance); its statistics stay against the
    target's whole distribution, so they count the mass it cannot reach.
    """

    def __init__(self, ids: torch.Tensor, vocab_size: int) -> None:
        self.ids = ids
        self.index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        self.index[ids] = torch.arange(len(ids), device=ids.device)
        """[V] the draft index of each target token, -1 outside the draft vocabulary."""

    def teacher(self, teacher: Teacher) -> tuple[Teacher, torch.Tensor]:
        """(the teacher over draft indices, keep [N]): positions where none of the teacher's
        top-k tokens is in the draft vocabulary have nothing to learn and are dropped."""
        if teacher.ids is None:
            return Teacher(teacher.logits[:, self.ids]), torch.ones(len(teacher.logits), dtype=torch.bool,
                                                                     device=teacher.logits.device)
        index = self.index[teacher.ids]
        keep = (index >= 0).any(-1)
        logits = teacher.logits.masked_fill(index < 0, float("-inf"))
        return Teacher(logits[keep], index.clamp(min=0)[keep]), keep

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target tokens as draft indices; -100 (cross-entropy's ignore index) outside."""
        index = self.index[labels]
        return index.masked_fill(index < 0, -100)


@torch.no_grad()
def expected_acceptance(student_logits: torch.Tensor, teacher: Teacher,
                        vocab: Optional[DraftVocab] = None) -> torch.Tensor:
    """α = Σ_v min(p(v), q(v)) = 1 − TV(p, q) at temperature 1, per position, against the
    teacher's whole distribution (its top-k renormalised, for a top-k teacher). [N]

    student_logits: [N, V], or [N, V_d] over `vocab` (q is 0 outside it)."""
    if vocab is None:
        p_log, q_log = aligned_log_probs(student_logits, teacher)
        return 1.0 - total_variation(p_log, q_log)
    q = torch.softmax(student_logits.float(), dim=-1)
    p = torch.softmax(teacher.logits.float(), dim=-1)
    if teacher.ids is None:
        return torch.minimum(p[:, vocab.ids], q).sum(-1)
    index = vocab.index[teacher.ids]
    q_at = q.gather(-1, index.clamp(min=0)).masked_fill(index < 0, 0.0)
    return torch.minimum(p, q_at).sum(-1)


@torch.no_grad()
def top1_agreement(student_logits: torch.Tensor, teacher: Teacher, vocab: Optional[DraftVocab] = None) -> torch.Tensor:
    """Whether the draft's argmax is the teacher's (the acceptance of greedy decoding). [N] float"""
    choice = student_logits.argmax(-1)
    if vocab is not None:
        choice = vocab.ids[choice]
    best = teacher.logits.argmax(-1)
    if teacher.ids is not None:
        best = teacher.ids.gather(-1, best[:, None]).squeeze(-1)
    return (choice == best).float()

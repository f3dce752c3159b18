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
    q_top = q_full.gather(-1, teacher.ids)  # [N, k]
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


@torch.no_grad()
def expected_acceptance(student_logits: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """α = 1 − TV(p, q) at temperature 1, per position. [N]"""
    p_log, q_log = aligned_log_probs(student_logits, teacher)
    return 1.0 - total_variation(p_log, q_log)

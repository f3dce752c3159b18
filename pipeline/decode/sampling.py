"""Token distributions and the lossless acceptance rules of speculative decoding.

Temperature and top-p are applied by one function to target and draft alike: the decoder
is lossless with respect to the target's processed distribution p, whatever q is.
"""

from __future__ import annotations

from typing import Optional

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering. [..., V] -> [..., V]"""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept_greedy(draft: torch.Tensor, num_proposed: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification.

    draft [B, K] proposed tokens; num_proposed [B] how many of them are real (<= K);
    target_logits [B, K+1, V] at the chunk [last, d_1..d_K].
    Returns (num_accepted [B], next_token [B]): the target's own token after the accepted prefix.
    """
    target_tokens = target_logits.argmax(dim=-1)  # [B, K+1]
    k = draft.shape[1]
    real = torch.arange(k, device=draft.device)[None, :] < num_proposed[:, None]  # [B, K]
    matches = (draft == target_tokens[:, :k]) & real
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B] length of the matching prefix
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def accept_sampling(
    draft: torch.Tensor,
    num_proposed: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator],
):
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample
    from norm(max(0, p_i - q_i)); when every real proposal is accepted, sample the bonus
    token from p. The emitted tokens are distributed exactly as samples from p.

    draft [B, K]; num_proposed [B]; draft_probs q [B, K, V]; target_probs p [B, K+1, V].
    Returns (num_accepted [B], next_token [B]).
    """
    b, k = draft.shape
    rows = torch.arange(b, device=draft.device)
    p_draft = target_probs[:, :k].gather(2, draft[..., None]).squeeze(2)  # [B, K] p_i(d_i)
    q_draft = draft_probs.gather(2, draft[..., None]).squeeze(2)  # [B, K] q_i(d_i)
    u = torch.rand((b, k), generator=generator, device=draft.device)
    real = torch.arange(k, device=draft.device)[None, :] < num_proposed[:, None]
    accepted = (u * q_draft < p_draft) & real  # u < p/q without dividing by a zero q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    p_next = target_probs[rows, num_accepted]  # [B, V] p at the first unaccepted position
    rejected = num_accepted < num_proposed  # a real proposal was turned down (else: bonus token)
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)] if k else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection implies p(d) < q(d), so p - q has positive mass somewhere; the guard only
    # catches float round-off.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    next_probs = torch.where(rejected[:, None], residual, p_next)
    return num_accepted, sample(next_probs, generator)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """[B, V] -> [B]: argmax when greedy, else a sample from the processed distribution."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample(process_logits(logits, temperature, top_p), generator)

"""Token distributions and the lossless acceptance rules of speculative decoding.

Temperature and top-p are applied by one function to target and draft alike: the decoder
is lossless with respect to the target's processed distribution p, whatever q is.
"""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.kernels.acceptance import accept_greedy_reference, accept_sampling_reference


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
    return accept_greedy_reference(draft, num_proposed, target_logits)


def accept_sampling(
    draft: torch.Tensor,
    num_proposed: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator],
):
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with uniforms drawn from
    `generator`: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection sample from norm(max(0, p_i - q_i)); when every real proposal is accepted, sample
    the bonus token from p. The emitted tokens are distributed exactly as samples from p
    (pipeline/kernels/acceptance.py holds the rule, and its fused kernel).

    draft [B, K]; num_proposed [B]; draft_probs q [B, K, V]; target_probs p [B, K+1, V].
    Returns (num_accepted [B], next_token [B]).
    """
    b, k = draft.shape
    u = torch.rand((b, k), generator=generator, device=draft.device)
    u_next = torch.rand(b, generator=generator, device=draft.device)
    return accept_sampling_reference(draft, num_proposed, draft_probs, target_probs, u, u_next)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """[B, V] -> [B]: argmax when greedy, else a sample from the processed distribution."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample(process_logits(logits, temperature, top_p), generator)

"""Token distributions: temperature and top-p, applied by one function to target and draft
alike (the decoder is lossless with respect to the target's processed distribution p, whatever
q is), and drawing from them. The acceptance rules are pipeline/kernels/acceptance.py's."""

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


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """[B, V] -> [B]: argmax when greedy, else a sample from the processed distribution."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample(process_logits(logits, temperature, top_p), generator)

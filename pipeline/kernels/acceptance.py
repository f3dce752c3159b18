"""The lossless acceptance rules of speculative decoding over a chain of k draft tokens, as one
launch per batch: which prefix of the draft the target keeps, and the token after it.

Greedy: a draft token is kept while it equals the target's argmax at its position; the next
token is the target's argmax after the kept prefix (ties: the lowest token id, as
torch.argmax).

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(0, p_i - q_i)); when
every real proposal is accepted draw the bonus token from p_k. The random numbers come in as
arguments (u [B, K] for the tests, u_next [B] for the draw, by inverse CDF), so the two
implementations are compared on the same draws and a CUDA graph can own the buffers they
live in.

Shapes: draft [B, K] token ids; num_proposed [B] real proposals per row (positions at or
past it are filler and never accepted); logits / target_probs [B, K+1, V]; draft_probs
[B, K, V]. Both return (num_accepted [B] int64, next_token [B] int64).
"""

from __future__ import annotations

import torch

from pipeline.kernels import backend


def accept_greedy_reference(draft: torch.Tensor, num_proposed: torch.Tensor, logits: torch.Tensor):
    target_tokens = logits.argmax(dim=-1)  # [B, K+1]
    k = draft.shape[1]
    real = torch.arange(k, device=draft.device)[None, :] < num_proposed[:, None]  # [B, K]
    matches = (draft == target_tokens[:, :k]) & real
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B] length of the matching prefix
    return num_accepted, target_tokens.gather(1, num_accepted[:, None]).squeeze(1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of `weights` [B, V] (non-negative, not normalised) drawn with the
    uniform u [B] in [0, 1): the first index whose cumulative weight exceeds u * total (the
    last index of positive weight where round-off leaves none)."""
    cdf = weights.float().cumsum(dim=-1)  # [B, V]
    index = torch.searchsorted(cdf, (u.float() * cdf[:, -1])[:, None], right=True)[:, 0]
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last = torch.where(weights > 0, positions, -1).amax(dim=-1)
    return torch.minimum(index, last)


def accept_sampling_reference(draft: torch.Tensor, num_proposed: torch.Tensor, draft_probs: torch.Tensor,
                              target_probs: torch.Tensor, u: torch.Tensor, u_next: torch.Tensor):
    b, k = draft.shape
    rows = torch.arange(b, device=draft.device)
    p_draft = target_probs[:, :k].gather(2, draft[..., None]).squeeze(2).float()  # [B, K] p_i(d_i)
    q_draft = draft_probs.gather(2, draft[..., None]).squeeze(2).float()  # [B, K] q_i(d_i)
    real = torch.arange(k, device=draft.device)[None, :] < num_proposed[:, None]
    accepted = (u * q_draft < p_draft) & real  # u < p/q without dividing by a zero q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    p_next = target_probs[rows, num_accepted].float()  # [B, V] p at the first unaccepted position
    rejected = num_accepted < num_proposed  # a real proposal was turned down (else: the bonus token)
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)].float() if k else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0.0)
    # A rejection implies p(d) < q(d), so p - q has positive mass somewhere; only float
    # round-off leaves none, and then p itself is drawn from.
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    return num_accepted, inverse_cdf(torch.where(use_residual[:, None], residual, p_next), u_next)


def accept_greedy(draft: torch.Tensor, num_proposed: torch.Tensor, logits: torch.Tensor):
    """Greedy verification of a chain; see the module docstring."""
    if backend(logits) == "triton":
        from pipeline.kernels.acceptance_triton import accept_greedy_triton

        return accept_greedy_triton(draft, num_proposed, logits)
    return accept_greedy_reference(draft, num_proposed, logits)


def accept_sampling(draft: torch.Tensor, num_proposed: torch.Tensor, draft_probs: torch.Tensor,
                    target_probs: torch.Tensor, u: torch.Tensor, u_next: torch.Tensor):
    """Rejection-sampling verification of a chain with the given uniforms; see the module docstring."""
    if draft.shape[1] and backend(target_probs) == "triton":  # with no draft position: a plain draw from p
        from pipeline.kernels.acceptance_triton import accept_sampling_triton

        return accept_sampling_triton(draft, num_proposed, draft_probs, target_probs, u, u_next)
    return accept_sampling_reference(draft, num_proposed, draft_probs, target_probs, u, u_next)

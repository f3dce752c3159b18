"""Attention of w new query tokens against a static KV cache, under a token-tree mask.

The cache holds, for each row b, `lengths[b]` committed tokens at slots 0.. and the w new
tokens' keys and values right after them (slots lengths[b] .. lengths[b] + w - 1, written
before the call); the slots past those are stale and never read. Query i sees every
committed slot, and new token j where tree[i, j] (j is i or an ancestor of i; None: the
causal chain, j <= i). Rows of a batch hold different lengths, so one launch serves a batch
whose rows accepted different numbers of tokens, with no copy of the cache.

Shapes: query [B, Hq, W, D]; keys, values [B, Hkv, T, D] with Hq a multiple of Hkv (grouped
queries share a key/value head); lengths [B] (int); tree [W, W] bool with a true diagonal, or
None. Returns [B, Hq, W, D] in the query's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.kernels import backend


def visible_slots(lengths: torch.Tensor, tree: Optional[torch.Tensor], width: int, slots: int) -> torch.Tensor:
    """[B, W, T] bool: which cache slots each new token attends (see the module docstring)."""
    rel = torch.arange(slots, device=lengths.device)[None, :] - lengths[:, None]  # [B, T]
    new = (rel >= 0) & (rel < width)
    if tree is None:
        allowed = rel[:, None, :] <= torch.arange(width, device=lengths.device)[None, :, None]  # [B, W, T]
    else:
        allowed = tree[torch.arange(width, device=lengths.device)[None, :, None], rel.clamp(0, width - 1)[:, None, :]]
    return (rel < 0)[:, None, :] | (new[:, None, :] & allowed)


def tree_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                             tree: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    mask = visible_slots(lengths, tree, query.shape[2], keys.shape[2])[:, None]  # [B, 1, W, T]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != keys.shape[1])


MAX_TRITON_WIDTH = 128  # wider (a prompt's prefill): SDPA's own kernels, which tile long queries


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                   tree: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """See the module docstring."""
    if query.shape[2] <= MAX_TRITON_WIDTH and backend(query) == "triton":
        from pipeline.kernels.tree_attention_triton import tree_attention_triton

        return tree_attention_triton(query, keys, values, lengths, tree, scale)
    return tree_attention_reference(query, keys, values, lengths, tree, scale)

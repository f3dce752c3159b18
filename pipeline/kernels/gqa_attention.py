"""Grouped-query attention without copying the cache, for our decoder on CPU.

transformers' sdpa attention gives torch's SDPA the grouped keys and values as they are
(`enable_gqa`) only when there is no mask; a step of one token packs the query heads instead.
A step of several tokens after a cache, which is every verification, has a mask, so it
copies the whole cache's keys and values once per query head group in every layer
(repeat_kv) before SDPA reads them, a cost that grows with the context and the tree size
(`make bench-verify`). `gqa_attention` registers the same attention with `enable_gqa` under masks (same
masks: sdpa's mask builder) and switches a model to it; torch's CPU SDPA reads the shared
heads itself and gives the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """transformers' sdpa attention, with grouped keys/values passed to SDPA as they are."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and attention_mask is None
    simple = (query.shape[1] != key.shape[1] and q_length > 1 and not (is_causal and kv_length != q_length)
              and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
              and not kwargs.get("output_attentions", False))
    if not simple:  # one token (packed heads), no groups, or a case sdpa treats specially
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def gqa_attention(model: torch.nn.Module) -> bool:
    """Switch a CPU model that uses sdpa attention to sdpa_gqa, in place; whether it changed."""
    config = getattr(model, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation") or next(model.parameters()).device.type != "cpu"):
        return False
    register()
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME

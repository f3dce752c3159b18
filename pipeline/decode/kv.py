"""A model's KV cache with per-row slot validity, so rows of a batch can accept different lengths.

Every forward appends the same number of slots to every row. A slot a row must not attend
to (left padding, a rejected draft token, a filler) is marked invalid and masked out;
invalid slots at the end of every row are cropped. At batch size 1 nothing is ever masked
and the model runs its plain causal path: rejected tokens are simply cropped.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch


@functools.cache
def _cache_keyword(module_type: type) -> str:
    params = inspect.signature(module_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(module, cache) -> dict:
    """The keyword argument that hands `cache` to a transformers model's forward: `cache` from
    transformers 5.24, `past_key_values` before (an unknown keyword would be swallowed by
    **kwargs and the model would silently run without our cache)."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _selects_hidden_states() -> bool:
    try:  # transformers 5.23+ keeps only the hidden states a list of indices (negative ones too) selects
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


def with_hidden_states(layers) -> dict:
    """The keyword argument that makes a transformers model return the hidden states `layers`
    (output_hidden_states indices, negative from the end) at those indices of its
    `hidden_states`: only those where transformers can select them, else all of them (older
    versions read a list as non-negative indices only)."""
    if not layers:
        return {}
    return {"output_hidden_states": list(layers) if _selects_hidden_states() else True}


def in_place_cache(config):
    """transformers' DynamicCache whose full-attention layers write into preallocated buffers.

    DynamicLayer concatenates every new key/value onto the cache, copying all of it at each
    step (a cost that grows with the context); this layer writes in place and
    returns views, doubling its capacity when it runs out.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.length = 0
            self.key_buffer = self.value_buffer = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self.key_buffer is None or end > self.key_buffer.shape[-2]:
                self._grow(max(end, 2 * self.length, 64), key_states, value_states)
            self.key_buffer[..., self.length:end, :] = key_states
            self.value_buffer[..., self.length:end, :] = value_states
            self._set_length(end)
            return self.keys, self.values

        def _grow(self, capacity, key_states, value_states):
            def bigger(old, new):
                shape = (*new.shape[:-2], capacity, new.shape[-1])
                buffer = new.new_empty(shape)
                if old is not None:
                    buffer[..., : self.length, :] = old[..., : self.length, :]
                return buffer
            self.key_buffer = bigger(self.key_buffer, key_states)
            self.value_buffer = bigger(self.value_buffer, value_states)

        def _set_length(self, length: int) -> None:
            self.length = length
            self.keys = self.key_buffer[..., :length, :]
            self.values = self.value_buffer[..., :length, :]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove and self.is_initialized:
                self._set_length(self.length - abs(tokens_to_remove))

        def keep_tail(self, tail: int, index: torch.Tensor) -> None:
            """Of the last `tail` slots keep those at `index` (in that order), contiguously."""
            start = self.length - tail
            end = start + len(index)
            self.key_buffer[..., start:end, :] = self.key_buffer[..., start + index, :]
            self.value_buffer[..., start:end, :] = self.value_buffer[..., start + index, :]
            self._set_length(end)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized and self.key_buffer is not None:
                self.key_buffer = self.key_buffer[indices]
                self.value_buffer = self.value_buffer[indices]
                self._set_length(self.length)

    cache = DynamicCache(config=config)
    if cache.layers:
        cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    elif cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = InPlaceLayer
    return cache


class SlotCache:
    def __init__(self, model, batch_size: int, device: torch.device) -> None:
        self.model = model
        self.cache = in_place_cache(model.config)
        self.valid = torch.zeros((batch_size, 0), dtype=torch.bool, device=device)  # [B, T]

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens each row has in the cache. [B]"""
        return self.valid.sum(dim=1)

    def run(self, tokens: torch.Tensor, new_valid: Optional[torch.Tensor] = None, logits_to_keep: int = 0,
            **inputs):
        """Run the model on `tokens` [B, S] appended after each row's cached tokens; its output.

        new_valid [B, S] marks real tokens (default: all); `inputs` go to the model as they are
        (a head's features, output_hidden_states).
        """
        if new_valid is None:
            new_valid = torch.ones_like(tokens, dtype=torch.bool)
        positions = self.lengths[:, None] + new_valid.long().cumsum(dim=1) - 1  # [B, S]
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        # All slots valid: leave the mask to the model's causal fast path.
        mask = None if bool(self.valid.all()) else self.valid.long()
        return self.model(
            input_ids=tokens, attention_mask=mask, position_ids=positions.clamp(min=0),
            use_cache=True, logits_to_keep=logits_to_keep, **with_cache(self.model, self.cache), **inputs,
        )

    def forward(
        self, tokens: torch.Tensor, new_valid: Optional[torch.Tensor] = None, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """Logits [B, S', V] of `run` where S' = logits_to_keep or S."""
        return self.run(tokens, new_valid, logits_to_keep).logits

    def run_masked(self, tokens: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor, **inputs):
        """Run tokens [1, S] after the cache with an explicit mask, batch size 1: allowed [S, T + S]
        (query i may attend slot j, T = slots already cached), positions [S]. Token trees use it:
        each token attends the cache and its own ancestors."""
        if self.valid.shape[0] != 1 or not bool(self.valid.all()):
            raise ValueError("tree verification runs at batch size 1")
        s = tokens.shape[1]
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros((1, 1, *allowed.shape), dtype=dtype, device=tokens.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
        self.valid = torch.cat([self.valid, self.valid.new_ones((1, s))], dim=1)
        return self.model(input_ids=tokens, attention_mask=mask, position_ids=positions[None], use_cache=True,
                          **with_cache(self.model, self.cache), **inputs)

    def run_tree(self, tokens: torch.Tensor, ancestors: torch.Tensor, **inputs):
        """A token tree after the cache: tokens [1, S], parents before children; ancestors [S, S]
        (i attends j: j is i or an ancestor of i). A token sits at (cached length + its depth)."""
        cached = self.valid.shape[1]
        allowed = torch.cat([ancestors.new_ones((ancestors.shape[0], cached)), ancestors], dim=1)
        return self.run_masked(tokens, allowed, cached + ancestors.sum(dim=1) - 1, **inputs)

    def keep_tree(self, tail: int, index: torch.Tensor) -> None:
        """Of the last `tail` slots (a tree) keep those at `index` (a path, in order), moving their
        keys and values together; the rest are dropped. Batch size 1."""
        for layer in self.cache.layers:
            if not hasattr(layer, "keep_tail"):
                raise ValueError(f"tree verification needs full-attention cache layers, not {type(layer).__name__}")
            layer.keep_tail(tail, index)
        self.valid = self.valid[:, : self.valid.shape[1] - tail + len(index)]

    def keep_last(self, keep: torch.Tensor) -> None:
        """Of the last forward's S slots, keep those where keep [B, S] is True; drop the rest."""
        s = keep.shape[1]
        self.valid[:, -s:] &= keep
        self.crop_invalid_tail()

    def crop_invalid_tail(self) -> None:
        used = self.valid.any(dim=0).nonzero()
        new_len = int(used[-1]) + 1 if len(used) else 0
        drop = self.valid.shape[1] - new_len
        if drop:
            self.cache.crop(-drop)
            self.valid = self.valid[:, :new_len]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices) of the batch: finished rows stop costing compute."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.crop_invalid_tail()

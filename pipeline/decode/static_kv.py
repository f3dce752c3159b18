"""Static KV caches and fixed-shape forwards: what our decoder is made of.

A StaticCache preallocates every layer's keys and values for the longest sequence,
[B, Hkv, T, D]. A forward of w tokens per row writes their keys and values at each row's
own slots (`start[b]` .. `start[b] + w - 1`) and attends the row's slots before `start[b]`
plus the new tokens under a tree mask (pipeline/kernels/tree_attention.py); nothing is
masked by padding, nothing is copied, and rows hold different lengths. Slots past a row's
length are stale and never read, so rolling back a rejected draft costs nothing: the next
forward writes over it.

The model runs its own transformers forward with attention implementation `specdraft_static`
and a `static_step=StaticStep(...)` keyword, which transformers hands to every attention
layer; the same model called without it (HF generate, training) gets transformers' sdpa
attention. `Replay` runs one such forward at fixed shapes from static input buffers: from a
captured CUDA graph on CUDA (when asked), else by calling it, the same code either way.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pipeline.kernels import backend
from pipeline.kernels.tree_attention import tree_attention, visible_slots

ATTENTION = "specdraft_static"
SLACK = 256  # caches grow in steps of this many slots, so that a slightly longer call reuses them


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


class StaticCache:
    """Keys and values of every attention layer of `model`, preallocated: [B, Hkv, T, D] each."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch_size, heads, max_len, head_dim)
        devices = layer_devices(model, config.num_hidden_layers, device)
        self.keys = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.values = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.max_len = max_len

    def copy_row(self, source: int, dest: int, length: int) -> None:
        """Row `source`'s first `length` slots into row `dest` (a finished row's place taken)."""
        for cache in (*self.keys, *self.values):
            cache[dest, :, :length] = cache[source, :, :length]

    def move(self, start: torch.Tensor, source: torch.Tensor, count: int) -> None:
        """For each row b, copy the entries at slots start[b] + source[b, j] to start[b] + j
        (j < count; source [B, count], non-decreasing): a tree's accepted path made contiguous."""
        b = start.shape[0]
        src = (start[:, None] + source[:, :count])[:, None, :, None]  # [B, 1, count, 1]
        dst = (start[:, None] + torch.arange(count, device=start.device))[:, None, :, None]
        for cache in (*self.keys, *self.values):
            index = src.to(cache.device).expand(b, cache.shape[1], count, cache.shape[3])
            cache.scatter_(2, dst.to(cache.device).expand_as(index), cache.gather(2, index))


def layer_devices(model: torch.nn.Module, layers: int, default: torch.device) -> list[torch.device]:
    """The device of each attention layer's weights (a target split across devices with
    device_map keeps each layer's cache beside it), `default` where none is found."""
    devices = [default] * layers
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        weights = next(module.parameters(), None)
        if isinstance(index, int) and 0 <= index < layers and weights is not None:
            devices[index] = weights.device
    return devices


@dataclass
class Inputs:
    """The static input buffers of one captured forward."""

    tokens: torch.Tensor
    """[B, W] token ids."""
    positions: torch.Tensor
    """[B, W] their positions."""
    start: torch.Tensor
    """[B] each row's first slot (its visible committed slots)."""
    features: Optional[torch.Tensor] = None
    """[B, W, F] a head's input features (EAGLE), when it reads any."""
    tree: Optional[torch.Tensor] = None
    """[W, W] bool ancestors among the new tokens (a token tree), when they are not a chain."""
    mask: Optional[torch.Tensor] = None
    """[B, 1, W, T] bool: every slot each new token sees, where neither a chain nor a tree says
    it (EAGLE's tree expansion: a node sees its ancestors written by earlier steps)."""
    rows: Optional[int] = None
    """Without graphs: compute only the first `rows` rows (the others idle); None (what
    StaticModel.replay() sets): every row."""


@dataclass
class StaticStep:
    """What one forward's attention layers read besides their q, k, v: where each row's new
    tokens go and what they see."""

    cache: StaticCache
    start: torch.Tensor
    """[B] slot of each row's first new token (= the row's visible committed slots)."""
    tree: Optional[torch.Tensor] = None
    """[W, W] bool ancestors among the new tokens; None: a causal chain."""
    mask: Optional[torch.Tensor] = None
    """[B, 1, W, T] bool: the slots each new token sees, instead of `start` and `tree`."""
    visible: Optional[int] = None
    """Read only the first `visible` slots (at least every row's start + W), where the caller
    knows that count on the host (no graphs); None: all T, the fixed shape a graph replays."""
    built: Optional[torch.Tensor] = None
    """The mask [B, 1, W, visible] the first layer built for the others, from `mask` or (with
    `visible`) from `start` and `tree` (reset before every forward)."""
    slots: Optional[torch.Tensor] = None
    """The cache slots [B, Hkv, W, D] the new keys and values go to, built by the first layer for
    the others (reset before every forward, inside a captured graph too)."""


def static_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     static_step: Optional[StaticStep] = None, **kwargs):
    """transformers' attention interface: the static cache's write and tree attention when called
    with static_step, else transformers' own sdpa attention."""
    if static_step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, hkv, w, d = key.shape
    keys = static_step.cache.keys[module.layer_idx]  # [B, Hkv, T, D]
    values = static_step.cache.values[module.layer_idx]
    if keys.shape[0] != b:  # only the rows computed
        keys, values = keys[:b], values[:b]
    start = static_step.start
    if start.device != key.device:  # a target split across devices
        start = start.to(key.device)
    slots = static_step.slots
    if slots is None or slots.shape != key.shape or slots.device != key.device:  # built once per forward
        slots = (start[:, None] + torch.arange(w, device=key.device))[:, None, :, None].expand(b, hkv, w, d)
        static_step.slots = slots
    keys.scatter_(2, slots, key if key.dtype == keys.dtype else key.to(keys.dtype))
    values.scatter_(2, slots, value if value.dtype == values.dtype else value.to(values.dtype))
    scale = scaling if scaling is not None else d ** -0.5
    read = static_step.visible or keys.shape[2]
    if read != keys.shape[2]:
        keys, values = keys[:, :, :read], values[:, :, :read]
    gqa = query.shape[1] != keys.shape[1]
    if static_step.mask is not None:
        if static_step.built is None or static_step.built.device != key.device:  # once per forward
            static_step.built = static_step.mask[..., :read].to(key.device)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=static_step.built, scale=scale,
                                             enable_gqa=gqa)
    elif w == 1 and b == 1 and static_step.visible is not None:  # one token that sees every slot read
        hq = query.shape[1]  # its query heads grouped by the key/value head they share: no mask, no copies
        out = F.scaled_dot_product_attention(query.reshape(b, hkv, hq // hkv, d), keys, values, scale=scale)
        out = out.reshape(b, hq, 1, d)
    elif static_step.visible is None or backend(query) == "triton":
        tree = static_step.tree.to(key.device) if static_step.tree is not None else None
        out = tree_attention(query, keys, values, start, tree, scale)  # [B, Hq, W, D]
    else:  # no graph: the reference's mask once per forward, for every layer
        if static_step.built is None or static_step.built.device != key.device:
            tree = static_step.tree.to(key.device) if static_step.tree is not None else None
            static_step.built = visible_slots(start, tree, w, read)[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=static_step.built, scale=scale,
                                             enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def use_static_attention(model: torch.nn.Module) -> None:
    """Register `specdraft_static` with transformers and switch `model` to it, in place."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, static_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # for calls without static_step
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise ValueError(f"{type(model).__name__} does not take the attention implementation {ATTENTION}")


def static_forward(model, tokens: torch.Tensor, positions: torch.Tensor, step: StaticStep,
                   logits_to_keep: int = 0, **inputs):
    """The model's output for tokens [B, W] at positions [B, W] after the static cache."""
    return model(input_ids=tokens, position_ids=positions, use_cache=False, static_step=step,
                 logits_to_keep=logits_to_keep, **inputs)


class Replay:
    """A function of static buffers, run as it is or replayed from a captured CUDA graph.

    `fn()` reads input tensors the caller fills in place before each call and returns an
    output tensor; with `graph` (CUDA only) the first call warms it up on a side stream and
    captures it, and every call replays the capture, whose output tensor is the same storage
    each time (read it before the next call)."""

    def __init__(self, fn: Callable[[], torch.Tensor], graph: bool, pool=None) -> None:
        self.fn, self.graph, self.pool = fn, graph, pool
        self.captured: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if not self.graph:
            return self.fn()
        if self.captured is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits and autotuning happen outside the capture
                    self.fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.captured, pool=self.pool):
                self.out = self.fn()
        self.captured.replay()
        return self.out


class StaticModel:
    """A model with its static cache and its captured forwards, kept across calls of the same
    batch size (a call that needs longer sequences reallocates them). A transformers model is
    switched to the static attention here (a head that wraps one switches its own); with
    `graphs` (one CUDA device) every forward replays a captured CUDA graph.

    `fixed_shapes` (default: with graphs) keeps every decoding step at the same shapes, as a
    graph needs; without it (a CPU) a step does only the work some row needs: it verifies as
    many draft tokens as the longest proposal, and a chain that every row ended stops drafting.
    Tests run both on a CPU."""

    def __init__(self, model: torch.nn.Module, graphs: bool = False, fixed_shapes: Optional[bool] = None) -> None:
        if hasattr(model, "set_attn_implementation"):
            use_static_attention(model)
        self.model, self.graphs = model, graphs
        self.fixed_shapes = graphs if fixed_shapes is None else fixed_shapes
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.batch = self.max_len = 0
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def ready(self, batch: int, max_len: int) -> None:
        if batch == self.batch and max_len <= self.max_len:
            return
        self.batch, self.max_len = batch, -(-max_len // SLACK) * SLACK
        self.cache = StaticCache(self.model, batch, self.max_len, self.device, self.dtype)
        self.replays: dict[tuple, tuple[Replay, Inputs]] = {}

    def replay(self, width: int, logits_to_keep: int = 0, layers: tuple[int, ...] = (), feature_width: int = 0,
               tree: bool = False, mask: bool = False):
        """A forward of `width` tokens per row from static buffers, as (replay, its Inputs): fill
        the inputs, then call the replay. It returns logits [B, W', V] (W' = logits_to_keep or
        W), or (logits, extra) with extra the target's hidden states `layers` (output_hidden_states
        indices) concatenated [B, W, n * H], or with feature_width > 0 (a head that reads
        `features` [B, W, feature_width], as EAGLE's) the head's output features [B, W', H].
        With `tree` the new tokens attend each other as Inputs.tree says (a token tree), with
        `mask` they see what Inputs.mask says."""
        key = (width, logits_to_keep, layers, feature_width, tree, mask)
        if key not in self.replays:
            tokens = torch.zeros((self.batch, width), dtype=torch.long, device=self.device)
            inputs = Inputs(tokens, torch.zeros_like(tokens), torch.zeros(self.batch, dtype=torch.long, device=self.device),
                            torch.zeros((self.batch, width, feature_width), dtype=self.dtype, device=self.device)
                            if feature_width else None,
                            torch.eye(width, dtype=torch.bool, device=self.device) if tree else None,
                            torch.zeros((self.batch, 1, width, self.max_len), dtype=torch.bool, device=self.device)
                            if mask else None)
            self.replays[key] = (Replay(self._forward(inputs, logits_to_keep, layers), self.graphs, self.pool), inputs)
        self.replays[key][1].rows = None
        return self.replays[key]

    def _forward(self, inputs: Inputs, logits_to_keep: int, layers: tuple[int, ...]) -> Callable[[], object]:
        step = StaticStep(self.cache, inputs.start, inputs.tree, inputs.mask)
        width = inputs.tokens.shape[1]

        def forward(**extra):
            step.slots = step.built = None  # rebuilt by the first layer from this forward's inputs
            if self.graphs:
                return static_forward(self.model, inputs.tokens, inputs.positions, step, logits_to_keep, **extra)
            # no shape to keep: only the rows asked for, attention reads only the slots they use
            rows = slice(inputs.rows)
            step.start = inputs.start[rows]
            step.mask = inputs.mask[rows] if inputs.mask is not None else None
            step.visible = int(step.start.max()) + width
            return static_forward(self.model, inputs.tokens[rows], inputs.positions[rows], step, logits_to_keep,
                                  **{name: value[rows] if torch.is_tensor(value) else value
                                     for name, value in extra.items()})

        if inputs.features is not None:
            def fn():
                out = forward(features=inputs.features)
                return out.logits, out.hidden
        elif layers:
            def fn():
                out = forward(**with_hidden_states(layers))
                return out.logits, torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        else:
            def fn():
                return forward().logits
        return fn

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, layers: tuple[int, ...] = ()):
        """Cache each row's first lengths[b] >= 1 tokens of tokens [B, T] (rows right-padded); the
        logits after each row's last one [B, V], and with `layers` the hidden states there
        concatenated at every prompt position [B, P, n * H] (P: the longest)."""
        return prefill(self.model, self.cache, tokens, lengths, layers)

    def prefill_rows(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`prefill` for some rows of the batch (rows [n], their tokens [n, T], lengths [n]): computed
        in a cache of their own, then copied into those rows' slots. [n, V]"""
        width = int(lengths.max())
        scratch = StaticCache(self.model, rows.shape[0], width, self.device, self.dtype)
        logits = prefill(self.model, scratch, tokens[:, :width], lengths)
        for mine, theirs in zip((*self.cache.keys, *self.cache.values), (*scratch.keys, *scratch.values)):
            mine[rows, :, :width] = theirs
        return logits


def prefill(model, cache: StaticCache, tokens: torch.Tensor, lengths: torch.Tensor, layers: tuple[int, ...] = ()):
    """StaticModel.prefill into `cache`, from slot 0."""
    b, width = tokens.shape[0], int(lengths.max())
    positions = torch.arange(width, device=tokens.device).expand(b, width)
    last = lengths - 1
    keep = torch.unique(last)  # the rows' last positions, each once
    step = StaticStep(cache, torch.zeros(b, dtype=torch.long, device=tokens.device), visible=width)
    out = static_forward(model, tokens[:, :width], positions, step, logits_to_keep=keep, **with_hidden_states(layers))
    logits = out.logits[torch.arange(b, device=tokens.device), torch.searchsorted(keep, last)]
    if not layers:
        return logits
    return logits, torch.cat([out.hidden_states[i] for i in layers], dim=-1)

"""Self-speculation drafts that read the target's own hidden states: Medusa heads, an EAGLE
head and an early-exit adapter.

Each module holds the target modules it borrows (input embeddings, decoder layers) without
owning them: only its own trainable weights and its draft vocabulary are saved
(`heads.safetensors` + `heads_config.json`), and loading rebuilds the rest from the target.
Every module proposes from a draft vocabulary: `lm_head` holds the LM-head rows of
`draft_to_target` (draft index -> target id), a fraction of the target's 49k-row head.

Hidden states come from transformers' own `output_hidden_states` (index 0 is the embeddings,
i the output of layer i, the last one after the final norm); no modeling code is copied.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import HEAD_KINDS
from pipeline.decode.static_kv import with_cache
from pipeline.errors import PipelineError

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"


def _fresh_norm(norm: nn.Module) -> nn.Module:
    """A new norm of the target's kind (RMSNorm), weight 1, trainable."""
    fresh = copy.deepcopy(norm)
    with torch.no_grad():
        fresh.weight.fill_(1.0)
    fresh.weight.requires_grad_(True)
    return fresh


def _vocab_head(target: nn.Module, draft_to_target: torch.Tensor, trainable: bool) -> nn.Linear:
    """A Linear over the target's LM-head rows of the draft vocabulary (a copy)."""
    weight = target.get_output_embeddings().weight.detach()[draft_to_target.to(target.device)].clone()
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    head.weight = nn.Parameter(weight, requires_grad=trainable)
    return head


def feature_indices(target_config, layers: list[int]) -> tuple[int, ...]:
    """`output_hidden_states` indices of target layers (negative from the end; empty: EAGLE-3's
    low, middle and high layers 2, L/2, L-3)."""
    n = target_config.num_hidden_layers
    if not layers:
        layers = [min(2, n - 1), n // 2, max(n - 3, 0)]
    if any(not -n <= i < n for i in layers):
        raise PipelineError(f"heads.feature_layers {list(layers)} must be layers of the target's {n}")
    return tuple(i % n + 1 for i in layers)  # hidden_states[i + 1] is layer i's output


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero at start: a new head begins as the target's own LM head."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads on the target's last (normed) hidden state at position t; head i predicts the
    token at t + i + 2, through the target's LM-head rows of the draft vocabulary (frozen)."""

    kind = "medusa"

    def __init__(self, target: nn.Module, draft_to_target: torch.Tensor, num_heads: int, num_layers: int) -> None:
        super().__init__()
        size = target.config.hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(size) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.lm_head = _vocab_head(target, draft_to_target, trainable=False)
        self.register_buffer("draft_to_target", draft_to_target.clone(), persistent=False)
        self.feature_layers = (target.config.num_hidden_layers,)
        self.settings = dict(num_heads=num_heads, num_layers=num_layers)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits [..., K, V_draft]."""
        return self.lm_head(torch.stack([block(hidden) for block in self.blocks], dim=-2))


@dataclass
class HeadOutput:
    logits: torch.Tensor
    """[B, S', V_draft]"""
    hidden: torch.Tensor
    """[B, S', H] the head's output feature before the norm (fed back as the next feature)."""


class Eagle3LayerMixin:
    """EAGLE-3's draft layer over a decoder layer of the target's class: the input is
    [embedding; feature] (2H), attention reads both halves normalised (`input_layernorm`
    the embedding, `hidden_norm` the feature) through q/k/v projections of 2H inputs, and
    the residual stream is the feature. The layer's own modules and names are the target's,
    so its weights are the `midlayer.*` of the EAGLE-3 layout (heads/formats.py)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        embeds, feature = hidden_states.chunk(2, dim=-1)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        attn = self.self_attn(hidden_states=x, attention_mask=attention_mask,
                              position_embeddings=position_embeddings, **kwargs)
        hidden = feature + (attn[0] if isinstance(attn, tuple) else attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _widen(linear: nn.Linear) -> nn.Linear:
    """A projection of [embedding; feature] inputs: the feature half keeps `linear`'s
    weights, the embedding half starts fresh."""
    wide = nn.Linear(2 * linear.in_features, linear.out_features, bias=linear.bias is not None,
                     dtype=linear.weight.dtype, device=linear.weight.device)
    with torch.no_grad():
        wide.weight[:, linear.in_features:] = linear.weight
        if linear.bias is not None:
            wide.bias.copy_(linear.bias)
    return wide


class EagleHead(nn.Module):
    """EAGLE-3: at position t the head reads the target's low, middle and high layer features
    of t, fused by `fc`, and the embedding of token t+1; one decoder layer (Eagle3LayerMixin
    over the target's layer class) predicts token t+2 and a feature for position t+1, which
    drafting feeds back in place of the target's.

    The architecture is EAGLE-3's own, so the head exports to the layouts vLLM, SGLang and
    speculators read: `fc` is a plain linear map of the raw concatenated features. Their scale
    differs by layer (on the embedded target a token's feature norm is ~80 at layer 2 and
    ~650 at layer 27, and the first position of every sequence reaches 2.5e4), so
    `calibrate` scales fc's blocks once, before training, by each layer's typical norm."""

    kind = "eagle"

    def __init__(self, target: nn.Module, draft_to_target: torch.Tensor, feature_layers: tuple[int, ...],
                 ttt_steps: int = 1) -> None:
        from transformers import AutoModel

        super().__init__()
        config = copy.deepcopy(target.config)
        size = config.hidden_size
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[-1:]
        config.vocab_size, config.pad_token_id, config.tie_word_embeddings = 1, None, False
        self.config = config
        dtype = next(target.parameters()).dtype
        self.fc = nn.Linear(len(feature_layers) * size, size, bias=False, dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the head starts the same in every run
            self.fc.reset_parameters()
            self.decoder = AutoModel.from_config(config, dtype=dtype)
            layer = self.decoder.layers[0]
            # The layer starts as the target's last layer; its attention reads 2H inputs.
            layer.load_state_dict(target.get_decoder().layers[-1].state_dict())
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(layer.self_attn, name, _widen(getattr(layer.self_attn, name)))
        layer.hidden_norm = _fresh_norm(layer.input_layernorm)
        layer.__class__ = type(f"Eagle3{type(layer).__name__}", (Eagle3LayerMixin, type(layer)), {})
        self.decoder.norm = nn.Identity()  # the raw output is the next feature; self.norm feeds the head
        self.decoder.get_input_embeddings().requires_grad_(False)  # unused (1 row): inputs_embeds come in
        self.norm = copy.deepcopy(target.get_decoder().norm).requires_grad_(True)  # starts as the target's
        self.lm_head = _vocab_head(target, draft_to_target, trainable=True)
        self.embed_tokens = target.get_input_embeddings()  # borrowed, frozen, not saved
        self.register_buffer("draft_to_target", draft_to_target.clone(), persistent=False)
        self.feature_layers = feature_layers
        self.settings = dict(feature_layers=list(feature_layers), ttt_steps=ttt_steps)
        self.to(target.device)

    @property
    def layer(self) -> nn.Module:
        return self.decoder.layers[0]

    @torch.no_grad()
    def calibrate(self, features: list[torch.Tensor], valid: torch.Tensor) -> list[float]:
        """Divide fc's block of each target layer by the median root-mean-square of that layer's
        features [B, T, H] over the valid tokens [B, T], so every layer enters fc at one scale
        (a linear change: the exported fc holds it). The scales used."""
        scales = []
        size = self.config.hidden_size
        for i, feature in enumerate(features):
            norm = feature[valid].float().norm(dim=-1).median().item() / size ** 0.5
            scale = norm if math.isfinite(norm) and norm > 0 else 1.0
            self.fc.weight[:, i * size : (i + 1) * size] /= scale
            scales.append(scale)
        return scales

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., n_layers * H] concatenated target features -> [..., H]."""
        return self.fc(target_features)

    def features_out(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask=None, position_ids=None,
                     cache=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """The head's output features [B, S, H] for input_ids [B, S] (token t+1 at position t)
        and features [B, S, H] (fused target features, or its own fed back); kwargs go to the
        decoder's attention (our decoder's static_step)."""
        with torch.no_grad():
            embeds = self.embed_tokens(input_ids)
        x = torch.cat([embeds.to(features.dtype), features], dim=-1)
        return self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, **with_cache(self.decoder, cache), **kwargs).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] output features -> [..., V_draft] logits."""
        return self.lm_head(self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask=None, position_ids=None,
                cache=None, use_cache: bool = False, logits_to_keep: int = 0, **kwargs) -> HeadOutput:
        hidden = self.features_out(input_ids, features, attention_mask, position_ids, cache, use_cache, **kwargs)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return HeadOutput(self.logits(hidden), hidden)


class ExitAdapter(nn.Module):
    """Early exit: h + up(SiLU(down(h))) on the output of target layer `exit_layer`, then the
    target's final norm and LM head (rows of the draft vocabulary). `up` starts at zero, so the
    untrained draft is the plain early exit."""

    kind = "early_exit"

    def __init__(self, target: nn.Module, draft_to_target: torch.Tensor, exit_layer: int, rank: int) -> None:
        super().__init__()
        n = target.config.num_hidden_layers
        if not 0 < exit_layer < n:
            raise PipelineError(f"heads.exit_layer={exit_layer} must be between 1 and {n - 1} "
                                f"(the target has {n} layers)")
        size = target.config.hidden_size
        dtype = next(target.parameters()).dtype
        self.down = nn.Linear(size, rank, bias=False, dtype=dtype, device=target.device)
        self.up = nn.Linear(rank, size, bias=False, dtype=dtype, device=target.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.down.reset_parameters()
        nn.init.zeros_(self.up.weight)
        self.lm_head = _vocab_head(target, draft_to_target, trainable=False)
        self.register_buffer("draft_to_target", draft_to_target.clone(), persistent=False)
        self.feature_layers = (exit_layer,)
        self.settings = dict(exit_layer=exit_layer, adapter_rank=rank)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(F.silu(self.down(hidden)))


def early_exit_model(target: nn.Module, adapter: ExitAdapter) -> nn.Module:
    """A causal LM made of the target's own embeddings and first layers, the adapter, the
    target's final norm and the adapter's draft-vocabulary LM head. It shares those modules
    with the target (no weights are copied) and keeps its own KV cache when drafting."""
    from transformers import AutoModelForCausalLM

    exit_layer = adapter.settings["exit_layer"]
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:exit_layer]
    with torch.device("meta"):
        shallow = AutoModelForCausalLM.from_config(config)
    source, own = target.get_decoder(), shallow.get_decoder()
    for name, child in source.named_children():
        setattr(own, name, child)  # embeddings, rotary embedding, norm, ... (all shared)
    own.layers = nn.ModuleList(source.layers[:exit_layer])
    own.norm = nn.Sequential(adapter, source.norm)
    shallow.lm_head = adapter.lm_head
    shallow.draft_to_target = adapter.draft_to_target
    return shallow.eval()


def build_heads(kind: str, target: nn.Module, draft_to_target: torch.Tensor, settings: dict) -> nn.Module:
    """A new head module of `kind` for `target` with the given settings (see HeadsConfig)."""
    if kind not in BUILDERS:
        raise PipelineError(f"unknown heads kind {kind!r}")
    target.requires_grad_(False)
    heads = BUILDERS[kind](target, draft_to_target, settings)
    return heads.to(device=target.device, dtype=next(target.parameters()).dtype)


BUILDERS = {  # heads kind -> its module from the saved settings
    "medusa": lambda target, ids, s: MedusaHeads(target, ids, s["num_heads"], s["num_layers"]),
    "eagle": lambda target, ids, s: EagleHead(target, ids, tuple(s["feature_layers"]), s.get("ttt_steps", 1)),
    "early_exit": lambda target, ids, s: ExitAdapter(target, ids, s["exit_layer"], s["adapter_rank"]),
}
assert tuple(BUILDERS) == HEAD_KINDS


def own_state(heads: nn.Module) -> dict[str, torch.Tensor]:
    """What a heads folder stores: the trained weights (the borrowed, frozen ones are rebuilt)."""
    return {n: p.detach().contiguous().cpu() for n, p in heads.named_parameters() if p.requires_grad}


def save_heads(heads: nn.Module, folder: Path, extra: Optional[dict] = None,
               state: Optional[dict[str, torch.Tensor]] = None) -> None:
    from safetensors.torch import save_file

    tensors = dict(state if state is not None else own_state(heads))
    tensors["draft_to_target"] = heads.draft_to_target.to(torch.int64).cpu().contiguous()
    save_file(tensors, str(Path(folder) / HEADS_FILE))
    config = dict(kind=heads.kind, settings=heads.settings, draft_vocab_size=len(heads.draft_to_target), **(extra or {}))
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_heads_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot read {path}: {e}") from None
    if config.get("kind") not in HEAD_KINDS or not isinstance(config.get("settings"), dict):
        raise PipelineError(f"{path}: not a heads config (kind must be one of {', '.join(HEAD_KINDS)})")
    return config


def load_heads(folder: Path, target: nn.Module) -> nn.Module:
    """The heads saved in `folder`, rebuilt around `target` (safetensors only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_heads_config(folder)
    try:
        tensors = load_file(str(folder / HEADS_FILE))
    except (SafetensorError, OSError) as e:
        raise PipelineError(f"cannot read {folder / HEADS_FILE}: {e}") from None
    ids = tensors.pop("draft_to_target", None)
    vocab = target.config.vocab_size
    if ids is None or ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise PipelineError(f"{folder / HEADS_FILE}: draft_to_target must hold token ids below {vocab}")
    heads = build_heads(config["kind"], target, ids, config["settings"])
    expected = own_state(heads)
    if set(tensors) != set(expected):
        raise PipelineError(f"{folder / HEADS_FILE} does not match a {config['kind']} head for this target "
                            f"(missing {sorted(set(expected) - set(tensors))[:3]}, "
                            f"unexpected {sorted(set(tensors) - set(expected))[:3]})")
    params = dict(heads.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            if params[name].shape != value.shape:
                raise PipelineError(f"{folder / HEADS_FILE}: {name} has shape {tuple(value.shape)}, "
                                    f"this target needs {tuple(params[name].shape)}")
            params[name].copy_(value)
    return heads.eval()

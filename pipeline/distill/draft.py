"""Draft models: a new small model built from the target, or an existing small causal LM.

A new draft copies the target's config with fewer (or narrower) layers, so it speaks the
target's tokenizer and vocabulary, and starts from the target's embeddings, LM head and
final norm, optionally from some of its decoder layers. An existing model must have the
target's vocabulary; it is trained fully or through LoRA adapters (merged when saved).

A draft vocabulary (draft.draft_vocab_size) is the set of target tokens the draft may
propose: the most frequent answer tokens of the training data, saved beside the draft as
draft_vocab.safetensors (`draft_to_target`: draft index -> target id). At decode time the
draft's LM head keeps only those rows: a small draft spends most of its time in its LM head
over the full 49k vocabulary, and a token it never proposes costs nothing. Acceptance stays
lossless (any proposal distribution is); it only loses the rare target tokens outside the set.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional, Sequence

import torch

from pipeline.errors import PipelineError


def new_draft(
    target: torch.nn.Module, *, num_layers: int, init_layers: Optional[Sequence[int]] = None,
    hidden_size: Optional[int] = None, intermediate_size: Optional[int] = None,
    num_attention_heads: Optional[int] = None, num_key_value_heads: Optional[int] = None,
    tie_embeddings: Optional[bool] = None, init_embeddings: bool = True,
) -> torch.nn.Module:
    """A `num_layers`-layer model of the target's architecture and vocabulary.

    init_layers: target layer indices (negative from the end) copied into the draft's
    layers, in order (fewer than num_layers leaves the rest random). init_embeddings copies the embeddings, LM head and
    final norm; both need the target's hidden size.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    for name, value in dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads).items():
        if value is not None:
            setattr(config, name, value)
    if hidden_size is not None and getattr(config, "head_dim", None):
        config.head_dim = hidden_size // config.num_attention_heads
    if tie_embeddings is not None:  # default: tied exactly when the target's are
        config.tie_word_embeddings = tie_embeddings
    n = target.config.num_hidden_layers
    if any(not -n <= i < n for i in init_layers or []):
        raise PipelineError(f"init_layers {list(init_layers)} must be layers of the target's {n} (negative counts from the end)")
    init_layers = [i % n for i in init_layers or []]
    same_width = config.hidden_size == target.config.hidden_size
    if (init_layers or init_embeddings) and not same_width:
        raise PipelineError(f"a draft of hidden size {config.hidden_size} cannot start from the target's weights "
                            f"(hidden size {target.config.hidden_size}); set init_layers=[] and init_embeddings=false")
    if len(init_layers) > num_layers:
        raise PipelineError(f"init_layers {init_layers} names more layers than the draft's {num_layers}")
    dtype = next(target.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the random part of the draft is the same in every run
        draft = AutoModelForCausalLM.from_config(config, dtype=dtype)
    source, own = target.state_dict(), draft.state_dict()
    copied = {}
    if init_embeddings:
        for key in own:
            if ".layers." not in key and key in source:
                copied[key] = source[key]
        if config.tie_word_embeddings:
            copied.pop("lm_head.weight", None)  # one matrix: the target's input embeddings
        elif "lm_head.weight" in own:  # the draft unties what the target ties
            copied["lm_head.weight"] = target.get_output_embeddings().weight
    for mine, theirs in enumerate(init_layers):
        prefix, their_prefix = _layer_prefix(own, mine), _layer_prefix(source, theirs)
        for key in own:
            if key.startswith(prefix):
                copied[key] = source[their_prefix + key[len(prefix):]]
    if copied:
        with torch.no_grad():
            for key, value in copied.items():
                own[key].copy_(value)
    return draft.to(next(target.parameters()).device).eval()


def _layer_prefix(state: dict, index: int) -> str:
    for key in state:
        marker = f".layers.{index}."
        if marker in key:
            return key[: key.index(marker) + len(marker)]
    raise PipelineError(f"no decoder layer {index} in the model")


def first_layers_draft(target: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target's first layers, embeddings, norm and LM head: an untrained baseline draft."""
    if num_layers >= target.config.num_hidden_layers:
        raise PipelineError(f"a draft of {num_layers} layers is not smaller than the target "
                            f"({target.config.num_hidden_layers})")
    return new_draft(target, num_layers=num_layers, init_layers=range(num_layers))


def pretrained_draft(path: str, target: torch.nn.Module, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """An existing causal LM (HF id or folder) as the draft; it must share the target's vocabulary."""
    from transformers import AutoModelForCausalLM

    try:
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=next(target.parameters()).dtype,
                                                     use_safetensors=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load draft {path!r}: {str(e).strip().splitlines()[0]}") from None
    check_vocabulary(draft, target, path)
    return draft.to(next(target.parameters()).device)


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def save_draft_vocab(ids: torch.Tensor, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({"draft_to_target": ids.to(torch.int64).cpu().contiguous()}, str(Path(folder) / DRAFT_VOCAB_FILE))


def read_draft_vocab(folder: Path, vocab_size: int) -> Optional[torch.Tensor]:
    """The draft vocabulary saved with a draft, or None when it proposes from the full vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = load_file(str(path)).get("draft_to_target")
    except (SafetensorError, OSError) as e:
        raise PipelineError(f"cannot read {path}: {e}") from None
    if ids is None or ids.dim() != 1 or ids.dtype != torch.int64 or not len(ids) \
            or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != len(ids):
        raise PipelineError(f"{path}: draft_to_target must be distinct int64 token ids below {vocab_size}")
    return ids


def check_vocabulary(draft: torch.nn.Module, target: torch.nn.Module, name: str) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise PipelineError(f"draft {name} has a vocabulary of {draft.config.vocab_size} tokens but the target has "
                            f"{target.config.vocab_size}: a draft must use the target's tokenizer")


def load_draft(path: Path, target) -> torch.nn.Module:
    """A separate draft model from a save_pretrained folder (safetensors, no remote code), on the
    target's device and dtype, with its draft vocabulary (draft_to_target) when it has one."""
    from transformers import AutoModelForCausalLM

    if not path.is_dir():
        raise PipelineError(f"draft folder {path} does not exist")
    dtype = next(target.model.parameters()).dtype
    try:
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load a draft model from {path}: {str(e).strip().splitlines()[0]}") from None
    check_vocabulary(draft, target.model, str(path))
    draft.draft_to_target = read_draft_vocab(path, target.model.config.vocab_size)
    return draft.to(target.device).eval()


def add_lora(draft: torch.nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str]):
    """Wrap the draft with peft LoRA adapters; only they train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type="CAUSAL_LM")
    return get_peft_model(draft, config)


def save_draft(draft: torch.nn.Module, tokenizer, folder: Path, state_dict: Optional[dict] = None,
               draft_vocab: Optional[torch.Tensor] = None) -> None:
    """save_pretrained (safetensors) with LoRA merged in and the target's tokenizer beside it
    (and the draft vocabulary, if any). The draft itself is left as it is (merging a copy), so
    training can go on."""
    model = copy.deepcopy(draft).merge_and_unload() if hasattr(draft, "merge_and_unload") else draft
    # state_dict: weights gathered elsewhere (DeepSpeed ZeRO-3 leaves the module's own empty).
    state = {k: v.contiguous() for k, v in (state_dict or model.state_dict()).items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if draft_vocab is not None:
        save_draft_vocab(draft_vocab, folder)

"""Make the target and drafts ready for our decoder on this device, in place: a draft
vocabulary's LM-head rows only, int8 draft layers on CPU, the CPU decode layout."""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch

from pipeline.kernels.linear import decode_layout, int8_linears

log = logging.getLogger(__name__)


def restrict_vocabulary(draft: torch.nn.Module, ids: torch.Tensor) -> None:
    """Keep only the LM-head rows of `ids` (a new, untied head), in place; the draft's logits
    then index ids, and `draft.draft_to_target` maps them back to target tokens."""
    head = draft.get_output_embeddings()
    weight = head.weight.detach()[ids.to(head.weight.device)].clone()
    new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    new.weight = torch.nn.Parameter(weight, requires_grad=False)
    draft.set_output_embeddings(new)
    draft.draft_to_target = ids.to(weight.device)


def prepare_for_decoding(model: torch.nn.Module, drafts: dict[str, torch.nn.Module], *, layout: bool,
                         compare_hf: bool, heads: Optional[dict[str, torch.nn.Module]] = None,
                         int8: tuple[str, ...] = ()):
    """Prepare the target and drafts for our decoder, in place: drafts with a draft vocabulary
    keep only its LM-head rows (distill/draft.py), the drafts and heads named in `int8` run
    their own CPU linear layers in int8 (kernels/linear.py), and on CPU with `layout` every linear layer
    runs few-row inputs through the small-batch product (kernels/linear.py).

    Returns the target and drafts for HF's methods: copies as transformers loaded them (where
    anything changed), so that HF generate runs on the model every transformers user gets. The
    copy costs the target's weights in memory once more."""
    layout = layout and next(model.parameters()).device.type == "cpu"
    restricted = {name for name, d in drafts.items() if getattr(d, "draft_to_target", None) is not None}
    hf_model = copy.deepcopy(model) if layout else model
    hf_drafts = {name: copy.deepcopy(d) if layout or name in restricted or name in int8 else d
                 for name, d in drafts.items()} if compare_hf else {}
    for name in restricted:
        restrict_vocabulary(drafts[name], drafts[name].draft_to_target)
        log.info("%s proposes from its draft vocabulary of %d tokens", name, len(drafts[name].draft_to_target))
    for name in int8:
        if changed := int8_linears(drafts[name] if name in drafts else heads[name]):
            log.info("%s: %d linear layers in int8 (dynamic activations)", name, changed)
    if layout:
        moved = sum(decode_layout(m) for m in (model, *drafts.values(), *(heads or {}).values()))
        log.info("decode layout: %d linear layers use the small-batch product for our decoder; HF methods "
                 "use a copy", moved)
    return hf_model, hf_drafts

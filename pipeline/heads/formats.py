"""Engine formats written beside our own: layouts other serving stacks read.

- Medusa (the Medusa-1 layout FastChat / Medusa's code and TGI read): `config.json` with
  `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`, and
  `medusa_lm_head.safetensors` holding head i as `medusa_head.{i}.{j}.linear.{weight,bias}`
  (residual blocks j) and `medusa_head.{i}.{num_layers}.weight` (its LM head, the target's
  full LM head: our heads use it frozen, proposing from its draft-vocabulary rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.errors import PipelineError

MEDUSA_DIR = "medusa"
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"


def medusa_tensors(heads, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    num_layers = heads.settings["num_layers"]
    lm_head = target.get_output_embeddings().weight.detach().cpu().contiguous()
    tensors = {}
    for i, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            tensors[f"medusa_head.{i}.{j}.linear.weight"] = block.linear.weight.detach().cpu().contiguous()
            tensors[f"medusa_head.{i}.{j}.linear.bias"] = block.linear.bias.detach().cpu().contiguous()
        tensors[f"medusa_head.{i}.{num_layers}.weight"] = lm_head.clone()
    return tensors


def write_medusa(heads, target: torch.nn.Module, base_model: str, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(medusa_tensors(heads, target), str(folder / MEDUSA_WEIGHTS))
    config = dict(medusa_num_heads=heads.num_heads, medusa_num_layers=heads.settings["num_layers"],
                  base_model_name_or_path=base_model, hidden_size=target.config.hidden_size,
                  vocab_size=target.config.vocab_size)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# EAGLE-3 ---------------------------------------------------------------------------------
#
# - The EAGLE-3 layout (EAGLE's reference code, SGLang and vLLM read it): `config.json` of a
#   one-layer Llama with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`,
#   `target_hidden_size` and `eagle_aux_hidden_state_layer_ids` (at the top and under `eagle_config`); weights `fc.weight`,
#   `midlayer.*` (the decoder layer, with `hidden_norm` and 2H-input q/k/v), `norm.weight`,
#   `lm_head.weight` (draft-vocabulary rows), `d2t` (draft id -> target id offset:
#   target = draft + d2t[draft]) and `t2d` (a bool mask of the target ids in the draft
#   vocabulary). The embeddings are the target's and are not stored.
# - The speculators layout (vLLM's `speculators` config): the same weights with the layer as
#   `layers.0.*` plus `embed_tokens.weight` (the target's, as speculators saves it), and
#   `config.json` with `speculators_model_type: eagle3`, `transformer_layer_config` and
#   `speculators_config` (proposal method, verifier).
#
# Layer ids are indices of transformers' `output_hidden_states`: id i is the input of target
# layer i (the output of layer i - 1), the hidden state vLLM captures for id i.

EAGLE3_DIR = "eagle3"
SPECULATORS_DIR = "speculators"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config fields these are


def eagle3_tensors(head, layer_prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """The head's weights under EAGLE-3's names, the draft vocabulary sorted by target id."""
    ids = head.draft_to_target.detach().cpu().long()
    order = torch.argsort(ids)
    ids = ids[order]
    vocab = head.embed_tokens.weight.shape[0]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight,
               "lm_head.weight": head.lm_head.weight.detach()[order.to(head.lm_head.weight.device)]}
    tensors.update({layer_prefix + name: value for name, value in head.layer.state_dict().items()})
    tensors = {name: value.detach().cpu().contiguous() for name, value in tensors.items()}
    tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()
    tensors["t2d"] = t2d
    return tensors


def _layer_config(head, target: torch.nn.Module) -> dict:
    """The draft layer's transformers config: the target's, one layer, the target's vocabulary."""
    n = target.config.num_hidden_layers
    if any(not 0 < i < n for i in head.feature_layers):
        raise PipelineError(f"the EAGLE head reads hidden states {list(head.feature_layers)}; EAGLE-3 layouts "
                            f"take the inputs of target layers 1..{n - 1} (transformers' hidden state {n} is "
                            "after the final norm, which serving stacks do not capture)")
    config = head.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "architectures", "auto_map", "id2label", "label2id",
                "layer_types"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])  # where readers of older configs look
    config.update(num_hidden_layers=1, vocab_size=target.config.vocab_size, tie_word_embeddings=False,
                  pad_token_id=target.config.pad_token_id,
                  torch_dtype=str(next(head.parameters()).dtype).removeprefix("torch."))
    return config


def write_eagle3(head, target: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(eagle3_tensors(head), str(folder / "model.safetensors"))
    config = _layer_config(head, target)
    # The layer ids at both levels: EAGLE's code, SGLang and vLLM read them under eagle_config,
    # llama.cpp's converter only at the top (without them it takes layers [2, n/2, n-3]).
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(head.draft_to_target),
                  target_hidden_size=target.config.hidden_size,
                  eagle_aux_hidden_state_layer_ids=list(head.feature_layers),
                  eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(head.feature_layers),
                                    use_aux_hidden_state=True))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_speculators(head, target: torch.nn.Module, base_model: str, num_draft_tokens: int, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = eagle3_tensors(head, layer_prefix="layers.0.")
    # speculators' own checkpoints carry the embeddings, and its loader reads the verifier's only
    # into a still-uninitialised table: without them a load may keep garbage (seen with 0.9.0).
    tensors["embed_tokens.weight"] = head.embed_tokens.weight.detach().cpu().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = dict(
        architectures=["Eagle3Speculator"], speculators_model_type="eagle3", speculators_version=SPECULATORS_VERSION,
        draft_vocab_size=len(head.draft_to_target), norm_before_residual=False,
        target_hidden_size=target.config.hidden_size, eagle_aux_hidden_state_layer_ids=list(head.feature_layers),
        transformer_layer_config=_layer_config(head, target),
        speculators_config=dict(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[dict(proposal_type="greedy", speculative_tokens=int(num_draft_tokens),
                                   verifier_accept_k=1, accept_tolerance=0.0)],
            verifier=dict(name_or_path=base_model, architectures=list(target.config.architectures or []))),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

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

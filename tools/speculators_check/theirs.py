"""speculators' side (its own venv): load our export with speculators' Eagle3DraftModel (the
embeddings come from the verifier folder the config names) and draft the same sequence."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

out = Path(sys.argv[1])
ours = load_file(str(out / "ours.safetensors"))
config = Eagle3SpeculatorConfig.from_pretrained(str(out / "speculators"))
config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
model = Eagle3DraftModel.from_pretrained(str(out / "speculators"), config=config).eval()
with torch.no_grad():
    t = ours["aux"].shape[1]
    drafts = model(hidden_states=ours["aux"], input_ids=ours["next_ids"],
                   document_ids=torch.zeros(1, t, dtype=torch.long), ttt_steps=1)[0]
    target_ids = drafts + model.d2t[drafts]
print(f"speculators: {target_ids.shape[1]} drafts", target_ids.tolist()[0][-12:], "(last 12)")
agree = (target_ids == ours["drafts"]).sum().item()
print(f"agree at {agree} of {target_ids.shape[1]} positions; equal: {torch.equal(target_ids, ours['drafts'])}")
sys.exit(0 if torch.equal(target_ids, ours["drafts"]) else 1)

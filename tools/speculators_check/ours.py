"""Our side: a tiny random target and a random EAGLE head, exported in the speculators and
EAGLE-3 layouts, and the head's own first-step greedy drafts for one sequence."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from heads.test_heads_decode import tiny_target  # noqa: E402
from pipeline.export.formats import write_eagle3, write_speculators  # noqa: E402
from pipeline.heads.models import build_heads  # noqa: E402

out = Path(sys.argv[1])
target = tiny_target(vocab=40, layers=4)
target.config.architectures = ["LlamaForCausalLM"]
target.save_pretrained(out / "target")
vocab = torch.randperm(40, generator=torch.Generator().manual_seed(5))[:25]  # an unsorted draft vocabulary
head = build_heads("eagle", target, vocab, dict(feature_layers=[1, 2, 3], ttt_steps=1))
gen = torch.Generator().manual_seed(1)
with torch.no_grad():
    for p in head.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
head.eval()
write_speculators(head, target, str(out / "target"), 3, out / "speculators")
write_eagle3(head, target, out / "eagle3")
ids = torch.randint(0, 40, (1, 24), generator=gen)
with torch.no_grad():
    states = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in head.feature_layers], -1)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # token t+1 at position t
    drafts = head.draft_to_target[head(next_ids, head.fuse(aux)).logits.argmax(-1)]
save_file({"aux": aux.contiguous(), "next_ids": next_ids.contiguous(), "drafts": drafts.contiguous()},
          str(out / "ours.safetensors"))
print("ours:        drafts", drafts.tolist())

"""Our side: an EAGLE head in the speculators layout and the head's own first-step greedy
drafts for one sequence. Without a bundle: a random head on a tiny random target (written
here, with an unsorted 25-of-40 draft vocabulary). With `ours.py OUT BUNDLE`: the exported
eagle bundle's head on the embedded target, on a chat prompt."""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from heads.test_heads_decode import tiny_target  # noqa: E402
from pipeline.heads.formats import write_speculators  # noqa: E402
from pipeline.heads.models import build_heads  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
if len(sys.argv) > 2:
    from pipeline.export import load_bundle
    from pipeline.models import load_target

    loaded = load_target("smollm2_135m", device="cpu", dtype="float32")
    target, head = loaded.model, load_bundle(sys.argv[2], loaded).draft
    shutil.copytree(Path(sys.argv[2]) / "speculators", out / "speculators")
    ids = torch.tensor([loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip to Hawaii."}],
        add_generation_prompt=True, return_dict=True)["input_ids"] + loaded.tokenizer.encode(
        "Aloha! I recently had the pleasure of visiting Hawaii, and")])
else:
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
    ids = torch.randint(0, 40, (1, 24), generator=gen)
with torch.no_grad():
    states = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in head.feature_layers], -1)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # token t+1 at position t
    drafts = head.draft_to_target[head(next_ids, head.fuse(aux)).logits.argmax(-1)]
save_file({"aux": aux.contiguous(), "next_ids": next_ids.contiguous(), "drafts": drafts.contiguous()},
          str(out / "ours.safetensors"))
print(f"ours:        {drafts.shape[1]} drafts", drafts.tolist()[0][-12:], "(last 12)")

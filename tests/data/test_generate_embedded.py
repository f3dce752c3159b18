"""The generate stage on the real embedded target (SmolLM2-135M-Instruct) and MT-bench."""

import json

import datasets
import pytest
import torch

from conftest import run_cli
from pipeline.models import load_target
from pipeline.runs import MANIFEST

pytestmark = pytest.mark.slow


def test_mtbench_first_turns_are_the_targets_greedy_continuations(tmp_path):
    # The command from the README, as a user types it.
    proc = run_cli("stage=generate", "data=mtbench", "data.limit=8", "generate.max_new_tokens=32", "run=check",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "check" / "generate"
    assert "-> runs/check/generate/dataset" in proc.stdout
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert len(ds) == 8 and set(ds["source"]) == {"mtbench"} and all(ds["category"])
    assert all(n == 2 for n in ds["num_turns"])  # both MT-bench turns regenerated
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["config"]["target"]["name_or_path"] == "smollm2_135m"

    target = load_target("smollm2_135m", dtype="float32", device="cpu")
    assert manifest["target_fingerprint"] == target.fingerprint()
    eos = target.tokenizer.eos_token_id
    for row in ds:
        mask = row["loss_mask"]
        start = mask.index(1)
        end = start + next((i for i, m in enumerate(mask[start:]) if not m), len(mask) - start)
        prompt = torch.tensor([row["input_ids"][:start]])
        with torch.inference_mode():
            ref = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                        do_sample=False, pad_token_id=eos, eos_token_id=eos)[0, start:].tolist()
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row["input_ids"][start:end] == ref, row["id"]

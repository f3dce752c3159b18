"""The eval stage on the real embedded target and MT-bench, as a user runs it (reduced budget)."""

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def test_eval_on_mtbench_is_lossless_and_complete(tmp_path):
    proc = run_cli("stage=eval", "data.limit=2", "eval.max_new_tokens=16", "eval.sweep=[1,3]",
                   "eval.sweep_prompts=1", "run=check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "check" / "eval"
    report = json.loads((out / "report.json").read_text())
    assert report["dataset"] == "mtbench" and report["num_prompts"] == 2 and report["num_turns"] == 4
    assert report["target"]["name"] == "smollm2_135m"
    assert report["baselines"]["hf_generate"]["lossless"] is True  # HF greedy equals ours token for token
    ngram = report["methods"]["ngram"]
    assert ngram["lossless"] is True and ngram["num_draft_tokens"] in (1, 3)
    assert set(ngram["per_category"]) == {"writing"}  # MT-bench's first two questions
    for name in ("acceptance_by_position.png", "speedup_vs_k.png", "per_category.png"):
        assert (out / name).stat().st_size > 10_000, name
    assert "| ngram | ngram |" in (out / "report.md").read_text()
    assert "eval: 2 methods on 2 conversations" in proc.stdout

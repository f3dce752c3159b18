"""generate.backend=server against a real serving engine: llama.cpp's own llama-server (which
`make setup-server` builds) serving the embedded target's own GGUF on 127.0.0.1; then distill,
heads and eval train on and measure the dataset it wrote."""

from __future__ import annotations

import json

import datasets
import pytest

from conftest import run_cli
from pipeline import llama_cpp
from pipeline.models import EMBEDDED_TARGETS, installed_package_dir
from pipeline.runs import MANIFEST

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_server():
    if llama_cpp.server_binary() is None:
        pytest.fail("llama.cpp's llama-server is not installed: `make setup-server` builds it (`make test` does)")
    package, import_name, gguf = EMBEDDED_TARGETS["smollm2_135m"]
    with llama_cpp.Server(installed_package_dir(import_name) / gguf, ["-c", "8192", "-np", "4"]) as server:
        yield server.url


def test_generate_through_llama_cpp_then_distill_heads_and_eval(llama_server, tmp_path):
    common = ["run=srv", "data=mtbench", "data.limit=4", "data.max_turns=1"]
    gen = run_cli("stage=generate", *common, "generate.max_new_tokens=24", "generate.save_topk_logits=4",
                  "generate.backend=server", f"generate.server.urls=[{llama_server}]", "generate.server.concurrency=2",
                  cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    out = tmp_path / "runs" / "srv" / "generate"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["backend"] == "server" and manifest["server"]["urls"] == [llama_server]
    assert manifest["server"]["model"].endswith(".gguf")
    tokens = manifest["server"]["answer_tokens"]
    assert tokens["round_tripped"] > 0.9 * (tokens["round_tripped"] + tokens["not_round_tripped"])
    assert f"{tokens['round_tripped']} answer tokens round-trip" in gen.stdout
    rows = datasets.load_from_disk(str(out / "dataset")).to_list()
    assert len(rows) == 4 and all(r["answers"] == "target" for r in rows)
    for r in rows:
        assert len(r["topk_ids"]) == sum(r["loss_mask"]) > 0
        # The server's greedy token is its own top-1 wherever the token round-trips.
        learned = [t for t, m in enumerate(r["loss_mask"]) if m]
        top1 = [ids[0] for ids in r["topk_ids"]]
        same = sum(r["input_ids"][t] == i for t, i in zip(learned, top1))
        assert same >= 0.9 * len(learned)

    distill = run_cli("stage=distill", *common, "distill.max_steps=2", "distill.eval_every=2", "distill.batch_size=2",
                      cwd=tmp_path)
    assert distill.returncode == 0, distill.stderr[-3000:]
    heads = run_cli("stage=heads", *common, "heads.kind=medusa", "heads.max_steps=2", "heads.eval_every=2",
                    "heads.batch_size=2", cwd=tmp_path)
    assert heads.returncode == 0, heads.stderr[-3000:]
    evaluated = run_cli("stage=eval", *common, "data.limit=1", "eval.max_new_tokens=8", "eval.sweep=[1]",
                        "eval.sweep_prompts=1", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "srv" / "eval" / "report.json").read_text())
    assert {"draft_model", "medusa"} <= set(report["methods"])
    assert all(m["lossless"] for m in report["methods"].values())

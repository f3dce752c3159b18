"""The export stage on a tiny random target: the bundle, its checks, eval from it, HF assisted generation."""

import json
import shutil

import pytest
import torch

from conftest import compose_config, make_tiny_target, write_jsonl
from pipeline import data, distill, export
from pipeline import eval as evaluation
from pipeline.errors import PipelineError
from pipeline.export import load_bundle
from pipeline.models import load_target


def common(target_dir, runs_dir, run="x"):
    return ["target=hf", f"target.name_or_path={target_dir}", f"runs_dir={runs_dir}", f"run={run}"]


def eval_overrides(prompts, *extra):
    return ["data=file", f"data.path={prompts}", "eval.max_new_tokens=8", "eval.sweep=[1,2]", "eval.sweep_prompts=1",
            *extra]


@pytest.fixture(scope="module")
def exported(tiny_target_dir, tmp_path_factory):
    """generate -> distill -> eval -> export in run x, shared by the tests (copied where changed)."""
    root = tmp_path_factory.mktemp("export")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"} for i in range(8)])
    base = common(tiny_target_dir, root)
    data.run(compose_config(*base, "data=file", f"data.path={prompts}", "data.split=all", "generate.max_new_tokens=12",
                            "generate.save_topk_logits=8"))
    distill.run(compose_config(*base, "draft.num_layers=1", "draft.init_layers=[0]", "draft.draft_vocab_size=48",
                               "distill.batch_size=2", "distill.max_steps=4", "distill.eval_every=2", stage="distill"))
    evaluation.run(compose_config(*base, *eval_overrides(prompts), stage="eval"))
    out = export.run(compose_config(*base, stage="export"))
    return root, out, prompts


def copy_bundle(out, tmp_path):
    dest = tmp_path / "bundle"
    shutil.copytree(out, dest)
    return dest


def test_bundle_layout_and_metadata(exported, tiny_target_dir):
    root, out, _ = exported
    assert out == root / "x" / "export"
    for name in ("bundle.json", "SHA256SUMS", "README.md", "draft/config.json", "draft/model.safetensors",
                 "draft/tokenizer.json", "draft/draft_vocab.safetensors", "eval/report.json", "eval/report.md"):
        assert (out / name).is_file(), name
    assert list(out.glob("eval/*.png"))
    meta = json.loads((out / "bundle.json").read_text())
    report = json.loads((root / "x" / "eval" / "report.json").read_text())
    target = load_target(str(tiny_target_dir), device="cpu")
    assert meta["method"] == "draft_model" and meta["target"]["fingerprint"] == target.fingerprint()
    assert meta["num_draft_tokens"] == report["methods"]["draft_model"]["num_draft_tokens"]
    assert meta["measured"]["tau"] == report["methods"]["draft_model"]["tau"]
    assert meta["training"]["data"]["conversations"] == 8 and meta["draft"]["draft_vocab_size"] == 48
    assert "torch" in meta["package_versions"] and meta["formats"] == {"hf_draft": "draft"}
    listed = {line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()}
    assert listed == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    assert "tau" in (out / "README.md").read_text() and target.name in (out / "README.md").read_text()


def test_load_bundle_refuses_tampered_missing_and_added_files(exported, tiny_target_dir, tmp_path):
    _, out, _ = exported
    target = load_target(str(tiny_target_dir), device="cpu")
    assert load_bundle(out, target).num_draft_tokens >= 1

    tampered = copy_bundle(out, tmp_path / "a")
    weights = tampered / "draft" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(raw))
    with pytest.raises(PipelineError, match="checksum mismatch for draft/model.safetensors"):
        load_bundle(tampered, target)

    missing = copy_bundle(out, tmp_path / "b")
    (missing / "draft" / "config.json").unlink()
    with pytest.raises(PipelineError, match="draft/config.json is missing"):
        load_bundle(missing, target)

    added = copy_bundle(out, tmp_path / "c")
    (added / "draft" / "pytorch_model.bin").write_bytes(b"not a pickle we would ever open")
    with pytest.raises(PipelineError, match="pytorch_model.bin is not in SHA256SUMS"):
        load_bundle(added, target)


def test_load_bundle_refuses_another_target(exported, tmp_path):
    _, out, _ = exported
    other = load_target(str(make_tiny_target(tmp_path / "other", seed=1)), device="cpu")
    with pytest.raises(PipelineError, match="was made for target"):
        load_bundle(out, other)


def test_eval_from_the_bundle_reproduces_its_tau(exported, tiny_target_dir, tmp_path):
    root, out, prompts = exported
    cfg = compose_config(*common(tiny_target_dir, tmp_path, run="y"), *eval_overrides(prompts, f"eval.bundle={out}"),
                         stage="eval")
    report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    meta = json.loads((out / "bundle.json").read_text())
    got = report["methods"]["draft_model"]
    assert got["num_draft_tokens"] == meta["num_draft_tokens"] and got["num_draft_tokens_mode"] == "bundle"
    assert got["tau"] == pytest.approx(meta["measured"]["tau"])  # greedy on the same prompts: the same acceptance
    assert got["lossless"] is True


def test_cli_eval_of_a_tampered_bundle_fails_in_one_line(exported, tiny_target_dir, tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    _, out, prompts = exported
    tampered = copy_bundle(out, tmp_path)
    weights = tampered / "draft" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage=eval", f"eval.bundle={tampered}",
                           *common(tiny_target_dir, tmp_path, run="z"), *eval_overrides(prompts)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: bundle") and "checksum mismatch" in proc.stderr


def test_export_needs_a_finished_eval(tiny_target_dir, tmp_path):
    with pytest.raises(PipelineError, match="distill"):
        export.run(compose_config(*common(tiny_target_dir, tmp_path), stage="export"))


def test_hf_assisted_generation_with_the_exported_draft_equals_plain_greedy(exported, tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out, _ = exported
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(out / "draft")
    ids = tok.apply_chat_template([{"role": "user", "content": "tell me about number 3"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        plain = target.generate(ids, max_new_tokens=16, do_sample=False)
        assisted = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft,
                                   num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
    assert assisted.tolist() == plain.tolist()


def test_heads_export_medusa_format_and_eval_from_the_bundle(tiny_target_dir, tmp_path):
    """generate -> heads (medusa) -> eval -> export.method=medusa: our heads folder, the Medusa-1
    layout with its keys and shapes, and eval from the bundle reproduces the heads' tau."""
    from safetensors.torch import load_file

    from pipeline.heads import stage as heads_stage

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"} for i in range(8)])
    base = common(tiny_target_dir, tmp_path)
    data.run(compose_config(*base, "data=file", f"data.path={prompts}", "data.split=all", "generate.max_new_tokens=12"))
    heads_stage.run(compose_config(*base, "heads=medusa", "heads.medusa_num_heads=3", "heads.medusa_num_layers=2",
                                   "heads.draft_vocab_size=48", "heads.batch_size=2", "heads.max_steps=3",
                                   stage="heads"))
    evaluation.run(compose_config(*base, *eval_overrides(prompts, "eval.ngram=false", "eval.trees=false"), stage="eval"))
    with pytest.raises(PipelineError, match="heads/eagle does not exist.*stage=heads heads=eagle run=x"):
        export.run(compose_config(*base, "export.method=eagle", stage="export"))
    out = export.run(compose_config(*base, "export.method=medusa", stage="export"))
    meta = json.loads((out / "bundle.json").read_text())
    assert meta["method"] == "medusa" and meta["formats"] == {"specdraft_heads": "heads", "medusa": "medusa"}
    assert meta["draft"]["medusa_num_heads"] == 3 and meta["draft"]["draft_vocab_size"] == 48
    for name in ("heads/heads.safetensors", "heads/heads_config.json", "medusa/config.json",
                 "medusa/medusa_lm_head.safetensors", "README.md", "SHA256SUMS"):
        assert (out / name).is_file(), name
    config = json.loads((out / "medusa/config.json").read_text())
    target = load_target(str(tiny_target_dir), device="cpu")
    hidden, vocab = target.model.config.hidden_size, target.model.config.vocab_size
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
    assert config["base_model_name_or_path"] == target.name
    weights = load_file(out / "medusa/medusa_lm_head.safetensors")
    want = {}
    for i in range(3):
        for j in range(2):
            want[f"medusa_head.{i}.{j}.linear.weight"] = (hidden, hidden)
            want[f"medusa_head.{i}.{j}.linear.bias"] = (hidden,)
        want[f"medusa_head.{i}.2.weight"] = (vocab, hidden)
    assert {k: tuple(v.shape) for k, v in weights.items()} == want
    trained = load_file(tmp_path / "x/heads/medusa/heads.safetensors")
    torch.testing.assert_close(weights["medusa_head.1.0.linear.weight"], trained["blocks.1.0.linear.weight"])
    torch.testing.assert_close(weights["medusa_head.0.2.weight"], target.model.lm_head.weight.detach())

    bundle = load_bundle(out, target)
    assert bundle.method == "medusa" and bundle.num_draft_tokens == meta["num_draft_tokens"]
    again = evaluation.run(compose_config(*common(tiny_target_dir, tmp_path, run="y"), f"eval.bundle={out}",
                                          *eval_overrides(prompts, "eval.ngram=false", "eval.trees=false"),
                                          stage="eval"))
    report = json.loads((again / "report.json").read_text())
    assert report["methods"]["medusa"]["tau"] == meta["measured"]["tau"]
    assert report["methods"]["medusa"]["num_draft_tokens_mode"] == "bundle"

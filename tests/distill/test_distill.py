"""The distill stage on a tiny random target: output, teachers, resume, processes, eval hand-off."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, compose_config, free_port, write_jsonl
from pipeline import data, distill
from pipeline import eval as evaluation
from pipeline.errors import PipelineError


def overrides(target_dir, runs_dir, *extra):
    return ["target=hf", f"target.name_or_path={target_dir}", f"runs_dir={runs_dir}", "run=d",
            "draft.num_layers=1", "draft.init_layers=[0]", "distill.batch_size=2", "distill.max_steps=6",
            "distill.eval_every=3", "distill.lr=0.01", "distill.warmup_steps=1", *extra]


@pytest.fixture(scope="module")
def generated(tiny_target_dir, tmp_path_factory):
    """A finished generate stage (with top-k logits) shared by the tests, copied per test."""
    root = tmp_path_factory.mktemp("gen")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"}
                                             for i in range(12)])
    cfg = compose_config("target=hf", f"target.name_or_path={tiny_target_dir}", "data=file", f"data.path={prompts}",
                         "data.split=all", f"runs_dir={root}", "run=d", "generate.max_new_tokens=12",
                         "generate.save_topk_logits=8")
    data.run(cfg)
    return root


def fresh_run(generated, tmp_path):
    import shutil

    shutil.copytree(generated / "d" / "generate", tmp_path / "d" / "generate")
    return tmp_path


def test_distill_writes_a_draft_that_eval_finds(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    out = distill.run(compose_config(*overrides(tiny_target_dir, runs, "draft.draft_vocab_size=40"), stage="distill"))
    for name in ("checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint/tokenizer.json",
                 "checkpoint/draft_vocab.safetensors", "initial/model.safetensors",
                 "initial/draft_vocab.safetensors", "metrics.jsonl", "manifest.json"):
        assert (out / name).is_file(), name
    assert not (out / "state").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["teacher"] == "offline" and manifest["metrics"]["steps"] == 6
    assert manifest["metrics"]["draft_vocab_size"] == 40 and 0 < manifest["metrics"]["draft_vocab_heldout_coverage"] <= 1
    vocab = load_file(out / "checkpoint/draft_vocab.safetensors")["draft_to_target"]
    assert vocab.shape == (40,) and torch.equal(vocab, load_file(out / "initial/draft_vocab.safetensors")["draft_to_target"])
    assert manifest["inputs"]["generate"]["manifest"].endswith("generate/manifest.json")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all("heldout_alpha" in r for r in records if r["step"] in (3, 6))
    # The frozen embeddings did not move; the layer did.
    before, after = load_file(out / "initial/model.safetensors"), load_file(out / "checkpoint/model.safetensors")
    torch.testing.assert_close(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert not torch.allclose(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])

    prompts = write_jsonl(tmp_path / "e.jsonl", [{"id": "e0", "prompt": "hello"}, {"id": "e1", "prompt": "bye"}])
    cfg = compose_config("target=hf", f"target.name_or_path={tiny_target_dir}", f"runs_dir={runs}", "run=d",
                         "data=file", f"data.path={prompts}", "eval.max_new_tokens=6", "eval.num_draft_tokens=2",
                         stage="eval")
    report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    assert report["methods"]["draft_model"]["drafter"] == "draft_model"
    assert report["methods"]["draft_model"]["lossless"] is True
    assert report["costs"]["draft_cost_ratio"]["draft_model"] > 0


# (With a draft vocabulary and the nearly uniform online teacher, q ≥ p on every draft token from
# the start, so α is already the teacher's mass on the vocabulary and cannot rise: not a case.)
@pytest.mark.parametrize("teacher,vocab", [("online", 0), ("offline", 0), ("offline", 60)])
def test_training_lowers_the_loss_and_raises_the_heldout_acceptance(tiny_target_dir, generated, tmp_path, teacher,
                                                                    vocab):
    runs = fresh_run(generated, tmp_path)
    out = distill.run(compose_config(*overrides(tiny_target_dir, runs, f"distill.teacher={teacher}",
                                                f"draft.draft_vocab_size={vocab}",
                                                "distill.max_steps=20", "distill.eval_every=20",
                                                "distill.eval_fraction=0.3"), stage="distill"))
    metrics = json.loads((out / "manifest.json").read_text())["metrics"]
    assert metrics["teacher"] == teacher
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) < 0.98 * sum(losses[:3]), losses
    # The random tiny target is nearly uniform, so α starts high; it must still rise.
    assert metrics["heldout_alpha_end"] > metrics["heldout_alpha_start"], metrics
    assert 0 <= metrics["heldout_top1_start"] <= 1 and 0 <= metrics["heldout_top1_end"] <= 1


def test_a_packed_run_follows_the_padded_one(tiny_target_dir, generated, tmp_path):
    """distill.pack=true through the stage (draft, online teacher, held-out α): the same losses
    and α as padded rows (the rows' logits are tested equal below)."""
    common = ["distill.teacher=online", "distill.batch_size=6", "distill.max_steps=3", "distill.eval_every=3"]
    padded = distill.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "a"), *common),
                                        stage="distill"))
    packed = distill.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "b"), *common,
                                                   "distill.pack=true"), stage="distill"))
    read = lambda out: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(read(padded), read(packed), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a.keys() == b.keys()
        if "heldout_alpha" in a:
            assert a["heldout_alpha"] == pytest.approx(b["heldout_alpha"], rel=1e-4)


def test_onpolicy_steps_sample_from_the_draft(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    out = distill.run(compose_config(*overrides(tiny_target_dir, runs, "distill.onpolicy_fraction=0.5",
                                                "distill.onpolicy_tokens=4"), stage="distill"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < sum(r["onpolicy"] for r in records) < len(records)


def test_a_stopped_run_resumes_to_the_same_weights(tiny_target_dir, generated, tmp_path, monkeypatch):
    whole = distill.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "a")),
                                       stage="distill"))
    runs = fresh_run(generated, tmp_path / "b")
    cfg = compose_config(*overrides(tiny_target_dir, runs, "distill.save_every=2"), stage="distill")
    calls = {"n": 0}
    real = distill.stage.distill_loss

    def dies_in_step_five(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as if the process were killed during step 5
        return real(*args, **kwargs)

    monkeypatch.setattr(distill.stage, "distill_loss", dies_in_step_five)
    with pytest.raises(KeyboardInterrupt):
        distill.run(cfg)
    assert json.loads((runs / "d/distill/state/last/trainer.json").read_text())["step"] == 4
    assert not (runs / "d/distill/manifest.json").exists()
    monkeypatch.setattr(distill.stage, "distill_loss", real)
    changed = compose_config(*overrides(tiny_target_dir, runs, "distill.save_every=2", "distill.lr=0.02"),
                             stage="distill")
    with pytest.raises(PipelineError, match="another config"):
        distill.run(changed)
    resumed = distill.run(cfg)
    a, b = load_file(whole / "checkpoint/model.safetensors"), load_file(resumed / "checkpoint/model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    initial = load_file(resumed / "initial/model.safetensors")
    for key in initial:  # the baseline is the resumed plan's own
        torch.testing.assert_close(initial[key], load_file(whole / "initial/model.safetensors")[key])


def test_a_new_plan_in_a_finished_run_writes_its_own_baseline(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    distill.run(compose_config(*overrides(tiny_target_dir, runs, "distill.max_steps=2"), stage="distill"))
    out = distill.run(compose_config(*overrides(tiny_target_dir, runs, "distill.max_steps=2", "draft.num_layers=2",
                                                "draft.init_layers=[0,1]", "distill.overwrite=true"), stage="distill"))
    for folder in ("initial", "checkpoint"):
        assert json.loads((out / folder / "config.json").read_text())["num_hidden_layers"] == 2, folder


def test_missing_generate_stage_and_missing_topk_are_clear_errors(tiny_target_dir, generated, tmp_path):
    with pytest.raises(PipelineError, match="stage=generate"):
        distill.run(compose_config(*overrides(tiny_target_dir, tmp_path), stage="distill"))


def test_a_pretrained_draft_with_another_vocabulary_is_refused(tiny_target_dir, generated, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    runs = fresh_run(generated, tmp_path)
    with pytest.raises(PipelineError, match="vocabulary"):
        distill.run(compose_config(*overrides(tiny_target_dir, runs, "draft=pretrained", f"draft.path={other}"),
                                   stage="distill"))


def test_lora_on_a_pretrained_draft_is_merged_when_saved(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    out = distill.run(compose_config(*overrides(tiny_target_dir, runs, "draft=pretrained",
                                                f"draft.path={tiny_target_dir}", "draft.lora_rank=4"),
                                     stage="distill"))
    saved = load_file(out / "checkpoint/model.safetensors")
    assert not any("lora" in k for k in saved)
    base = load_file(tiny_target_dir / "model.safetensors")
    changed = [k for k in base if k in saved and not torch.allclose(base[k], saved[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for k in changed)


@pytest.mark.slow
def test_two_deepspeed_processes_follow_the_one_process_loss_trajectory(tiny_target_dir, generated, tmp_path):
    """ZeRO-2 over 2 CPU processes (gloo) at batch 2 each = 1 process at batch 2 x grad_accum 2."""
    runs = fresh_run(generated, tmp_path)
    import shutil

    shutil.copytree(runs / "d", runs / "one")
    common = ["target=hf", f"target.name_or_path={tiny_target_dir}", f"runs_dir={runs}", "draft.num_layers=1",
              "draft.init_layers=[0]", "distill.batch_size=2", "distill.max_steps=4", "distill.lr=0.01",
              "distill.warmup_steps=1", "distill.eval_every=4"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), "-m", "pipeline",
                          "stage=distill", "run=d", "distill.deepspeed=zero2", *common],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "pipeline", "stage=distill", "run=one", "distill.grad_accum=2",
                          *common], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]

    def losses(run):
        return [json.loads(line)["loss"] for line in (runs / run / "distill/metrics.jsonl").read_text().splitlines()]

    manifest = json.loads((runs / "d/distill/manifest.json").read_text())
    assert manifest["metrics"]["distributed"] == "DEEPSPEED" and manifest["metrics"]["processes"] == 2
    assert losses("d") == pytest.approx(losses("one"), rel=1e-3, abs=1e-7)
    assert (runs / "d/distill/checkpoint/model.safetensors").is_file()


def test_onpolicy_samples_stay_in_the_draft_vocabulary(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from pipeline.train.data import Example
    from pipeline.distill.stage import onpolicy_batch

    draft = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    examples = [Example(id=str(i), input_ids=list(range(3 + i, 10 + i)), positions=[3, 4, 5]) for i in range(3)]
    vocab = torch.tensor([7, 11, 19, 23])
    batch = onpolicy_batch(draft, examples, 6, 0, torch.Generator().manual_seed(0), "cpu", vocab)
    assert torch.isin(batch.labels, vocab).all() and len(batch.labels) == 18
    unrestricted = onpolicy_batch(draft, examples, 6, 0, torch.Generator().manual_seed(0), "cpu")
    assert not torch.isin(unrestricted.labels, vocab).all()


def test_packed_rows_give_the_padded_logits_labels_and_teacher():
    """distill.pack: conversations sharing a row see only themselves (block-diagonal causal
    attention, positions restarting), so every learned position gets the logits it gets alone."""
    from conftest import tiny_llama
    from pipeline.train.data import Example, collate, pack_rows
    from pipeline.distill.stage import selected_logits

    model = tiny_llama(0, vocab=64)
    gen = torch.Generator().manual_seed(0)
    examples = []
    for i, n in enumerate([9, 4, 3, 7, 2, 5]):
        ids = torch.randint(0, 64, (n,), generator=gen).tolist()
        positions = list(range(n // 2, n - 1)) or [0]
        examples.append(Example(f"e{i}", ids, positions, torch.randint(0, 64, (len(positions), 4), generator=gen),
                                torch.randn((len(positions), 4), generator=gen)))
    rows = pack_rows([len(ex.input_ids) for ex in examples])
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(len(examples[i].input_ids) for i in r) <= 9 for r in rows)
    padded, packed = collate(examples, 0, True), collate(examples, 0, True, pack=True)
    assert packed.input_ids.shape[0] == len(rows) < padded.input_ids.shape[0]
    assert packed.attention_mask.sum() == padded.attention_mask.sum()
    assert torch.equal(packed.labels, padded.labels)
    assert torch.equal(packed.teacher.ids, padded.teacher.ids)
    with torch.no_grad():
        want = selected_logits(model, padded.input_ids, padded.model_mask(), padded.rows, padded.cols)
        got = selected_logits(model, packed.input_ids, packed.model_mask(), packed.rows, packed.cols,
                              position_ids=packed.position_ids)
    assert torch.allclose(got, want, atol=1e-5)

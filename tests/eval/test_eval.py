import json

import pytest
import torch
from PIL import Image

from conftest import compose_config, make_tiny_target, run_cli, write_jsonl
from pipeline import eval as evaluation
from pipeline.errors import PipelineError
from pipeline.eval.measure import (
    Measurement, Method, Settings, best_num_draft_tokens, expected_tokens_per_pass, greedy_divergences, make_decode,
    measure, predicted_speedup,
)
from pipeline.models import load_target
from pipeline.runs import MANIFEST, consumed, sha256_file, write_manifest

PLOTS = ("acceptance_by_position.png", "speedup_vs_k.png", "per_category.png")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


@pytest.fixture
def prompts_file(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": f"q{i}", "category": ["math", "writing"][i % 2], "messages": [
            {"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "and again " * (i + 1)}]}
        for i in range(4)])


def eval_overrides(target_dir, data, runs_dir, *extra):
    return ["target=hf", f"target.name_or_path={target_dir}", "data=file", f"data.path={data}",
            f"runs_dir={runs_dir}", "run=e", "eval.max_new_tokens=8", "eval.sweep=[1,2]", "eval.sweep_prompts=2", *extra]


def test_eval_report_has_every_field_and_readable_plots(tiny_target_dir, draft_dir, prompts_file, tmp_path):
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={draft_dir}",
                                         "eval.compare_hf=true"), stage="eval")
    out = evaluation.run(cfg)
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["name"] == str(tiny_target_dir) and len(report["target"]["fingerprint"]) == 64
    assert report["dataset"] == str(prompts_file) and report["num_prompts"] == 4 and report["num_turns"] == 8
    assert report["max_new_tokens"] == 8 and report["temperature"] == 0.0
    for baseline in ("plain", "hf_generate"):
        assert report["baselines"][baseline]["tokens_per_s"] > 0
    assert report["baselines"]["hf_generate"]["lossless"] is True
    assert set(report["methods"]) == {"plain", "ngram", "draft_model"}
    keys = {"drafter", "num_draft_tokens", "tau", "acceptance_by_position", "tokens_per_s", "speedup_vs_plain",
            "speedup_vs_hf", "lossless", "per_category"}
    for name, m in report["methods"].items():
        assert keys <= set(m), name
        assert m["lossless"] is True, name
        assert set(m["per_category"]) == {"math", "writing"}
        assert m["speedup_vs_plain"] == pytest.approx(m["tokens_per_s"] / report["baselines"]["plain"]["tokens_per_s"])
        assert m["speedup_vs_hf"] == pytest.approx(m["tokens_per_s"] / report["baselines"]["hf_generate"]["tokens_per_s"])
    assert report["methods"]["plain"]["tau"] == 1.0
    # auto picked the sweep value with the highest predicted speedup (from τ and the interleaved costs).
    for name in ("ngram", "draft_model"):
        sweep = report["sweeps"][name]
        assert [r["num_draft_tokens"] for r in sweep] == [1, 2]
        assert all(r["predicted_speedup"] > 0 for r in sweep)
        assert report["methods"][name]["num_draft_tokens"] == best_num_draft_tokens(sweep)
        assert len(report["methods"][name]["acceptance_by_position"]) == report["methods"][name]["num_draft_tokens"]
    assert set(report["hf_methods"]) == {"hf_prompt_lookup", "hf_assisted"}
    assert report["costs"]["draft_cost_ratio"]["draft_model"] > 0

    for name in PLOTS:
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 400
    md = (out / "report.md").read_text()
    assert "| draft_model | draft_model |" in md and "hf_assisted" in md
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["stage"] == "eval"
    for rel, digest in manifest["outputs"].items():
        assert sha256_file(out / rel) == digest


def test_fixed_num_draft_tokens_skips_the_sweep(tiny_target_dir, prompts_file, tmp_path):
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, "eval.num_draft_tokens=3"),
                         stage="eval")
    report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    assert report["sweeps"] == {}
    assert report["methods"]["ngram"]["num_draft_tokens"] == 3
    assert report["methods"]["ngram"]["num_draft_tokens_mode"] == "fixed"


def test_cuda_graphs_on_without_a_cuda_device_is_one_line(tiny_target_dir, prompts_file, tmp_path):
    """eval.cuda_graphs=on asks for graphs; on a CPU there are none (auto leaves them off there)."""
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, "eval.cuda_graphs=on"), stage="eval")
    with pytest.raises(PipelineError, match=r"eval.cuda_graphs=on needs the target on one CUDA device; it is on cpu"):
        evaluation.run(cfg)


def test_batch_sizes_measure_every_method_at_each_size(tiny_target_dir, draft_dir, prompts_file, tmp_path):
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={draft_dir}",
                                         "eval.num_draft_tokens=2", "eval.batch_sizes=[1,4]"), stage="eval")
    out = evaluation.run(cfg)
    report = json.loads((out / "report.json").read_text())
    assert set(report["by_batch_size"]) == {"1", "4"}
    for size in ("1", "4"):
        assert set(report["by_batch_size"][size]) == {"plain", "ngram", "draft_model"}
        assert report["by_batch_size"][size]["plain"]["speedup_vs_plain"] == 1.0
        assert all(m["tokens_per_s"] > 0 for m in report["by_batch_size"][size].values())
    with Image.open(out / "speedup_vs_batch_size.png") as image:
        assert image.format == "PNG"
    assert "| method | batch 1 | batch 4 |" in (out / "report.md").read_text()


def test_sampling_eval_reports_no_greedy_check(tiny_target_dir, draft_dir, prompts_file, tmp_path):
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={draft_dir}",
                                         "eval.temperature=0.8", "eval.num_draft_tokens=2"), stage="eval")
    report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    assert report["temperature"] == 0.8
    assert report["methods"]["draft_model"]["lossless"] is None


def test_confidence_threshold_is_applied_and_reported(tiny_target_dir, draft_dir, prompts_file, tmp_path):
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={draft_dir}",
                                         "eval.num_draft_tokens=4", "eval.confidence_threshold=0.99"), stage="eval")
    out = evaluation.run(cfg)
    report = json.loads((out / "report.json").read_text())
    m = report["methods"]["draft_model"]
    assert report["confidence_threshold"] == 0.99 and m["lossless"] is True
    assert m["predicted_speedup"] is None  # k draft steps per pass no longer holds
    assert "probability below 0.99" in (out / "report.md").read_text()


def test_int8_draft_and_its_fp32_twin_are_both_measured(tiny_target_dir, draft_dir, prompts_file, tmp_path, caplog):
    """On CPU a draft model runs in int8 by default; compare_draft_fp32 measures the same weights
    in fp32 beside it, both lossless, each with its own cost line."""
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={draft_dir}",
                                         "eval.num_draft_tokens=2", "eval.compare_draft_fp32=true",
                                         "eval.ngram=false"), stage="eval")
    with caplog.at_level("INFO"):
        report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    assert set(report["methods"]) == {"plain", "draft_model", "draft_model:fp32"}
    for name in ("draft_model", "draft_model:fp32"):
        assert report["methods"][name]["lossless"] is True
        assert report["costs"]["draft_cost_ratio"][name] > 0
    assert "draft_model: 8 linear layers in int8" in caplog.text  # 1 layer of 7 projections, the LM head
    assert "draft_model:fp32: " not in caplog.text
    assert report["int8_drafts"] == ["draft_model"]


def test_eval_finds_the_runs_distilled_draft(tiny_target_dir, draft_dir, prompts_file, tmp_path):
    import shutil

    distill, generate = tmp_path / "e" / "distill", tmp_path / "e" / "generate"
    shutil.copytree(draft_dir, distill / "checkpoint")
    fingerprint = load_target(str(tiny_target_dir), device="cpu").fingerprint()
    write_manifest(generate, stage="generate", config={}, target_fingerprint=fingerprint, outputs={}, wall_time_s=0.0)
    write_manifest(distill, stage="distill", config={}, target_fingerprint=fingerprint, outputs={}, wall_time_s=0.0,
                   inputs={"generate": consumed(generate)})
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, "eval.num_draft_tokens=2",
                                         f"eval.draft={draft_dir}"), stage="eval")
    out = evaluation.run(cfg)
    report = json.loads((out / "report.json").read_text())
    assert report["methods"]["draft_model"]["drafter"] == "draft_model"
    assert report["methods"][f"draft_model:{draft_dir.name}"]["drafter"] == "draft_model"
    assert "distill" in json.loads((out / MANIFEST).read_text())["inputs"]


def test_a_draft_with_another_vocabulary_is_refused(tiny_target_dir, prompts_file, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    cfg = compose_config(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={other}"), stage="eval")
    with pytest.raises(PipelineError, match="vocabulary of 300 tokens"):
        evaluation.run(cfg)


def test_missing_draft_folder_is_a_one_line_cli_error(tiny_target_dir, prompts_file, tmp_path):
    proc = run_cli(*eval_overrides(tiny_target_dir, prompts_file, tmp_path, f"eval.draft={tmp_path}/nope"),
                   "stage=eval", cwd=tmp_path)
    assert proc.returncode == 1
    assert f"error: draft folder {tmp_path}/nope does not exist" in proc.stderr


def test_expected_tokens_and_predicted_speedup_follow_the_formula():
    assert expected_tokens_per_pass([]) == 1.0
    assert expected_tokens_per_pass([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    # Constant alpha: (1 - a^(k+1)) / (1 - a), the closed form of Leviathan et al.
    a, k = 0.7, 5
    assert expected_tokens_per_pass([a] * k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert predicted_speedup([a] * k, draft_cost=0.1, verify_cost=1.2) == pytest.approx(
        (1 - a ** (k + 1)) / (1 - a) / (1.2 + k * 0.1))
    # Proposals on a quarter of the passes: a quarter of the accepted run and of the extra verify cost.
    assert predicted_speedup([0.5], draft_cost=0.0, verify_cost=2.0, proposal_rate=0.25) == pytest.approx(
        (1 + 0.25 * 0.5) / (1 + 0.25 * 1.0))


def test_greedy_divergences_finds_the_first_differing_token(tiny_target_dir, cache_dir):
    from pipeline.data.sources import Conversation

    target = load_target(str(tiny_target_dir), cache_dir=str(cache_dir))
    settings = Settings(model=target.model, tokenizer=target.tokenizer, eos_ids={target.tokenizer.eos_token_id},
                        max_new_tokens=6)
    convs = [Conversation(id="a", source="t", user_turns=["hello", "more"])]
    plain = measure({"plain": Method(make_decode("plain", settings), "plain")}, convs, settings)["plain"]
    assert greedy_divergences(target.model, plain, plain) == []
    other = Measurement(drafter="x", num_draft_tokens=None, outputs={"a": [list(t) for t in plain.outputs["a"]]})
    other.outputs["a"][0][3] = (other.outputs["a"][0][3] + 1) % 250
    found = greedy_divergences(target.model, plain, other)
    assert [(d.conversation, d.turn, d.position, d.tie) for d in found] == [("a", 0, 3, False)]


def test_methods_take_turns_on_each_batch():
    calls = []

    def recorder(name):
        def decode(prompts):
            from pipeline.decode import DecodeResult

            calls.append(name)
            return DecodeResult([[1, 2]] * len(prompts), [2] * len(prompts))
        return Method(decode, name)

    from pipeline.data.sources import Conversation

    class Tok:
        def apply_chat_template(self, messages, **kw):
            return " ".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    settings = Settings(model=torch.nn.Linear(1, 1), tokenizer=Tok(), eos_ids={2}, max_new_tokens=2)
    convs = [Conversation(id=str(i), source="t", user_turns=["a b"]) for i in range(3)]
    results = measure({n: recorder(n) for n in "ABC"}, convs, settings)
    assert calls == list("ABCBCACAB")
    assert all(r.total.tokens == 6 and r.total.tau == 1.0 for r in results.values())


def test_median_seconds_times_the_calls_round_robin():
    """Cost lines are ratios of these medians: every call is timed once per round, after warm-up
    rounds that are not counted, so drift of the machine's speed touches them all alike."""
    from pipeline.eval.measure import median_seconds

    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("one", "verify 1", "draft d")}
    seconds = median_seconds(steps, torch.nn.Linear(2, 2), reps=5, warmup=2)
    assert order == ["one", "verify 1", "draft d"] * 7
    assert set(seconds) == set(steps) and all(s >= 0 for s in seconds.values())

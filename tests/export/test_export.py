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
    with pytest.raises(PipelineError, match="stage=eval"):
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


def eagle3_reference_logits(folder, input_ids, aux_hidden, embed):
    """EAGLE-3's first draft step written from the exported files alone (config.json +
    model.safetensors, plain torch): position t reads token t+1's embedding and the target's
    aux hidden states of t; the logits over the target vocabulary (-inf off the draft vocabulary).
    Independent of pipeline/heads, so it checks what the layout means, not only its names."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(folder / "model.safetensors")
    heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x):  # [heads, T, dim]
        t = x.shape[1]
        freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
        angle = torch.arange(t).float()[:, None] * freq[None]
        cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
        half = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    m = lambda name: w[f"midlayer.{name}.weight"]
    hidden = aux_hidden @ w["fc.weight"].T  # [T, H]
    x = torch.cat([rms(embed[input_ids], m("input_layernorm")), rms(hidden, m("hidden_norm"))], -1)
    t = x.shape[0]
    q = (x @ m("self_attn.q_proj").T).view(t, heads, dim).transpose(0, 1)
    k = (x @ m("self_attn.k_proj").T).view(t, kv, dim).transpose(0, 1).repeat_interleave(heads // kv, 0)
    v = (x @ m("self_attn.v_proj").T).view(t, kv, dim).transpose(0, 1).repeat_interleave(heads // kv, 0)
    scores = rope(q) @ rope(k).transpose(1, 2) / dim ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * dim) @ m("self_attn.o_proj").T
    h = hidden + attn
    post = rms(h, m("post_attention_layernorm"))
    h = h + (torch.nn.functional.silu(post @ m("mlp.gate_proj").T) * (post @ m("mlp.up_proj").T)) @ m("mlp.down_proj").T
    draft_logits = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T  # [T, V_draft]
    target_ids = torch.arange(len(w["d2t"])) + w["d2t"]
    out = torch.full((t, cfg["vocab_size"]), float("-inf"))
    out[:, target_ids] = draft_logits
    assert w["t2d"].nonzero().flatten().tolist() == target_ids.tolist()
    return out


def test_heads_export_eagle3_and_speculators_formats(tiny_target_dir, tmp_path):
    """generate -> heads (eagle) -> eval -> export.method=eagle: the EAGLE-3 and speculators
    layouts' keys, shapes and config fields, and the EAGLE-3 files, read by a reference forward
    written from the layout alone, give the trained head's own logits."""
    from safetensors.torch import load_file

    from pipeline.export.bundle import load_bundle
    from pipeline.heads import stage as heads_stage

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"} for i in range(8)])
    base = common(tiny_target_dir, tmp_path)
    data.run(compose_config(*base, "data=file", f"data.path={prompts}", "data.split=all", "generate.max_new_tokens=12"))
    heads_stage.run(compose_config(*base, "heads=eagle", "heads.feature_layers=[0,0]", "heads.draft_vocab_size=48",
                                   "heads.batch_size=2",
                                   "heads.max_steps=3", stage="heads"))
    evaluation.run(compose_config(*base, *eval_overrides(prompts, "eval.ngram=false", "eval.trees=false"), stage="eval"))
    out = export.run(compose_config(*base, "export.method=eagle", stage="export"))
    meta = json.loads((out / "bundle.json").read_text())
    assert meta["formats"] == {"specdraft_heads": "heads", "eagle3": "eagle3", "speculators": "speculators"}
    target = load_target(str(tiny_target_dir), device="cpu")
    tc = target.model.config
    hidden, vocab, inter = tc.hidden_size, tc.vocab_size, tc.intermediate_size
    q_out, kv_out = tc.num_attention_heads * tc.head_dim, tc.num_key_value_heads * tc.head_dim
    layers = json.loads((tmp_path / "x/heads/eagle/heads_config.json").read_text())["settings"]["feature_layers"]
    shapes = {"fc.weight": (hidden, len(layers) * hidden), "norm.weight": (hidden,), "lm_head.weight": (48, hidden),
              "d2t": (48,), "t2d": (vocab,)}
    layer = {"input_layernorm.weight": (hidden,), "hidden_norm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,), "self_attn.q_proj.weight": (q_out, 2 * hidden),
             "self_attn.k_proj.weight": (kv_out, 2 * hidden), "self_attn.v_proj.weight": (kv_out, 2 * hidden),
             "self_attn.o_proj.weight": (hidden, q_out), "mlp.gate_proj.weight": (inter, hidden),
             "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
    for folder, prefix in (("eagle3", "midlayer."), ("speculators", "layers.0.")):
        weights = load_file(out / folder / "model.safetensors")
        want = dict(shapes, **{prefix + k: v for k, v in layer.items()})
        if folder == "speculators":
            want["embed_tokens.weight"] = (vocab, hidden)
        assert {k: tuple(v.shape) for k, v in weights.items()} == want, folder
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert int(weights["t2d"].sum()) == 48
    e3 = json.loads((out / "eagle3/config.json").read_text())
    assert e3["architectures"] == ["LlamaForCausalLMEagle3"] and e3["num_hidden_layers"] == 1
    assert e3["draft_vocab_size"] == 48 and e3["vocab_size"] == vocab and e3["target_hidden_size"] == hidden
    assert e3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == e3["eagle_aux_hidden_state_layer_ids"] == layers
    sp = json.loads((out / "speculators/config.json").read_text())
    assert sp["speculators_model_type"] == "eagle3" and sp["architectures"] == ["Eagle3Speculator"]
    assert sp["draft_vocab_size"] == 48 and sp["eagle_aux_hidden_state_layer_ids"] == layers
    assert sp["transformer_layer_config"]["num_hidden_layers"] == 1
    assert sp["transformer_layer_config"]["vocab_size"] == vocab
    spec = sp["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == meta["num_draft_tokens"]
    assert spec["verifier"]["name_or_path"] == target.name

    head = load_bundle(out, target).draft
    ids = torch.tensor([[1, 7, 3, 9, 12, 4, 30, 2]])
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in layers], -1)
        nxt = torch.cat([ids[0, 1:], ids[0, -1:]])
        ours = head(nxt[None], head.fuse(aux[None])).logits[0]
        ref = eagle3_reference_logits(out / "eagle3", nxt, aux, target.model.get_input_embeddings().weight)
    full = torch.full_like(ref, float("-inf"))
    full[:, head.draft_to_target] = ours
    torch.testing.assert_close(ref, full, rtol=1e-4, atol=1e-4)


def test_eagle3_formats_refuse_the_post_norm_hidden_state(tmp_path):
    """transformers' last hidden state is after the final norm; serving stacks capture layer
    inputs before it, so a head reading it cannot be written as EAGLE-3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.heads.formats import write_eagle3
    from pipeline.heads.models import build_heads, feature_indices

    target = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    head = build_heads("eagle", target, torch.arange(40), dict(feature_layers=list(feature_indices(target.config, [-1]))))
    with pytest.raises(PipelineError, match=r"hidden states \[3\].*after the final norm"):
        write_eagle3(head, target, tmp_path / "e")
    head = build_heads("eagle", target, torch.arange(40), dict(feature_layers=list(feature_indices(target.config, [0, 1]))))
    write_eagle3(head, target, tmp_path / "e")
    assert json.loads((tmp_path / "e/config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]


def test_auto_exports_the_fastest_method_and_an_ngram_bundle_evaluates_as_measured(exported, tiny_target_dir,
                                                                                   tmp_path, capsys):
    root, _, prompts = exported
    report = json.loads((root / "x" / "eval" / "report.json").read_text())
    candidates = {n: m for n, m in report["methods"].items() if n != "plain" and ":" not in n}
    fastest = max(candidates, key=lambda n: candidates[n]["speedup_vs_plain"])
    auto = export.run(compose_config(*common(tiny_target_dir, root), "export.method=auto",
                                     f"export.dir={tmp_path / 'auto'}", stage="export"))
    assert json.loads((auto / "bundle.json").read_text())["measured"]["method"] == fastest
    printed = capsys.readouterr().out
    assert f"{fastest}" in printed and "<- fastest, exported" in printed
    beats = candidates[fastest]["speedup_vs_plain"] >= 1.03  # closer to plain is timing noise
    assert ("fastest: " in printed) == beats
    assert ("no method beats plain decoding by more than timing noise" in printed) == (not beats)
    for name in candidates:
        assert name in printed

    ngram = export.run(compose_config(*common(tiny_target_dir, root), "export.method=ngram",
                                      f"export.dir={tmp_path / 'ngram'}", stage="export"))
    meta = json.loads((ngram / "bundle.json").read_text())
    assert meta["method"] == "ngram" and meta["tree"] is False and meta["training"] is None
    assert meta["draft"] == {"kind": "ngram", "ngram_max": 3, "ngram_min": 2}
    assert meta["num_draft_tokens"] == report["methods"]["ngram"]["num_draft_tokens"]
    assert not (ngram / "draft").exists() and "prompt_lookup_num_tokens" in (ngram / "README.md").read_text()
    cfg = compose_config(*common(tiny_target_dir, tmp_path, run="y"),
                         *eval_overrides(prompts, f"eval.bundle={ngram}", "eval.ngram=false"), stage="eval")
    measured = json.loads((evaluation.run(cfg) / "report.json").read_text())["methods"]["ngram"]
    assert measured["num_draft_tokens_mode"] == "bundle" and measured["num_draft_tokens"] == meta["num_draft_tokens"]
    assert measured["tau"] == pytest.approx(meta["measured"]["tau"]) and measured["lossless"] is True

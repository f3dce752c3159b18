"""gguf/ for llama.cpp: drafts converted by llama.cpp's own converter (vendored with the server
`make setup-server` builds), on a tiny random target with the embedded target's tokenizer
(the converter recognises real tokenizers only)."""

import json

import pytest
import torch

from conftest import compose_config, make_tiny_target, run_cli, write_jsonl
from pipeline import data, distill, export, llama_cpp
from pipeline import eval as evaluation
from pipeline.errors import PipelineError
from pipeline.export import gguf, load_bundle
from pipeline.models import EMBEDDED_TARGETS, installed_package_dir, load_target


def read_gguf(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def field(reader, key):
    value = reader.get_field(key)
    assert value is not None, key
    return value.contents()


@pytest.fixture(scope="module")
def smol_target_dir(tmp_path_factory):
    """4 layers, 32 wide, over SmolLM2's tokenizer (read from the embedded GGUF)."""
    from transformers import AutoTokenizer

    if llama_cpp.source() is None:
        pytest.fail("llama.cpp's converter is not installed: `make setup-server` unpacks it (`make test` does)")
    _, import_name, gguf_file = EMBEDDED_TARGETS["smollm2_135m"]
    tokenizer = AutoTokenizer.from_pretrained(installed_package_dir(import_name), gguf_file=gguf_file)
    return make_tiny_target(tmp_path_factory.mktemp("smol_target"), layers=4, tokenizer=tokenizer)


def test_an_eagle_head_converts_with_its_trained_layers(smol_target_dir, tmp_path):
    """llama.cpp's converter reads the layer ids at the top level of eagle3/config.json; without
    them it silently takes its default layers (the bug export had: ids only under eagle_config)."""
    from pipeline.heads.formats import write_eagle3
    from pipeline.heads.models import build_heads, feature_indices

    target = load_target(str(smol_target_dir), device="cpu")
    layers = feature_indices(target.model.config, [0, 1, 2])
    head = build_heads("eagle", target.model, torch.arange(100, 2100), dict(feature_layers=list(layers)))
    write_eagle3(head, target.model, tmp_path / "eagle3")
    gguf.convert(tmp_path / "eagle3", tmp_path / "e.gguf", "f32", target_dir=smol_target_dir)
    reader = read_gguf(tmp_path / "e.gguf")
    assert field(reader, "general.architecture") == "eagle3"
    assert field(reader, "eagle3.target_layers") == [1, 2, 3]
    assert any(2000 in t.shape.tolist() for t in reader.tensors)  # the draft vocabulary's LM head

    config = json.loads((tmp_path / "eagle3/config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "eagle3/config.json").write_text(json.dumps(config))
    gguf.convert(tmp_path / "eagle3", tmp_path / "old.gguf", "f32", target_dir=smol_target_dir)
    assert field(read_gguf(tmp_path / "old.gguf"), "eagle3.target_layers") == [2, 2, 1]  # [2, L/2, L-3]


@pytest.fixture(scope="module")
def draft_bundle(smol_target_dir, tmp_path_factory):
    """generate -> distill -> eval of a 1-layer draft made of the target's first layer (it agrees
    with the target often, not always: acceptance that tells drafts apart)."""
    root = tmp_path_factory.mktemp("gguf_run")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"} for i in range(6)])
    base = ["target=hf", f"target.name_or_path={smol_target_dir}", f"runs_dir={root}", "run=g"]
    data.run(compose_config(*base, "data=file", f"data.path={prompts}", "data.split=all", "generate.max_new_tokens=8"))
    distill.run(compose_config(*base, "draft.num_layers=1", "draft.init_layers=[0]", "distill.batch_size=2",
                               "distill.max_steps=2", "distill.eval_every=2", "distill.lr=1e-6", stage="distill"))
    evaluation.run(compose_config(*base, "data=file", f"data.path={prompts}", "eval.max_new_tokens=8", "eval.sweep=[2]",
                                  "eval.trees=false", stage="eval"))
    return root, base, prompts


def test_a_draft_model_bundle_holds_the_llama_cpp_files_and_says_how_to_run_them(draft_bundle, smol_target_dir,
                                                                                  tmp_path, capsys):
    root, base, _ = draft_bundle
    out = export.run(compose_config(*base, "export.method=draft_model", f"export.dir={tmp_path / 'b'}", stage="export"))
    meta = json.loads((out / "bundle.json").read_text())
    engine = meta["llama_cpp"]
    assert meta["formats"]["gguf"] == "gguf" and engine["spec_type"] == "draft-simple"
    assert engine["command"] == ("llama-server -m gguf/target.gguf -md gguf/draft.gguf --spec-type draft-simple "
                                 "--spec-draft-n-max 2 --poll 0 --spec-draft-poll 0")
    assert engine["command"] in capsys.readouterr().out and engine["command"] in (out / "README.md").read_text()
    sums = (out / "SHA256SUMS").read_text()
    assert "gguf/draft.gguf" in sums and "gguf/target.gguf" in sums
    draft, target = read_gguf(out / "gguf/draft.gguf"), read_gguf(out / "gguf/target.gguf")
    assert field(draft, "llama.block_count") == 1 and field(target, "llama.block_count") == 4
    assert field(draft, "llama.embedding_length") == 32
    load_bundle(out, load_target(str(smol_target_dir), device="cpu"))  # every file checks

    # A method llama.cpp cannot run: the bundle says why in one line; required, it is an error.
    ngram = export.run(compose_config(*base, "export.method=ngram", f"export.dir={tmp_path / 'ngram'}", stage="export"))
    assert "n-gram lookup" in json.loads((ngram / "bundle.json").read_text())["llama_cpp"]["skipped"]
    assert not (ngram / "gguf").exists()
    with pytest.raises(PipelineError, match=r"^export.gguf=true: prompt lookup needs no file"):
        export.run(compose_config(*base, "export.method=ngram", "export.gguf=true", f"export.dir={tmp_path / 'n2'}",
                                  stage="export"))
    off = export.run(compose_config(*base, "export.method=draft_model", "export.gguf=false",
                                    f"export.dir={tmp_path / 'off'}", stage="export"))
    assert not (off / "gguf").exists() and "llama_cpp" not in json.loads((off / "bundle.json").read_text())


def test_stage_all_checks_its_draft_in_llama_server_losslessly_and_as_our_replay_predicts(
        draft_bundle, smol_target_dir):
    """stage=all eval.engine=llama.cpp (what `make demo` runs): after export, the bundle is served
    by llama-server with and without its draft, beside our decoder's numbers for it."""
    if llama_cpp.server_binary() is None:
        pytest.fail("llama.cpp's llama-server is not installed: `make setup-server` builds it (`make test` does)")
    root, _, prompts = draft_bundle
    proc = run_cli("stage=all", "target=hf", f"target.name_or_path={smol_target_dir}", f"runs_dir={root}", "run=all",
                   "data=file", f"data.path={prompts}", "data.split=all", "generate.max_new_tokens=8",
                   "draft.num_layers=1", "draft.init_layers=[0]", "distill.batch_size=2", "distill.max_steps=2",
                   "distill.eval_every=2", "distill.lr=1e-6", "eval.max_new_tokens=24", "eval.sweep=[2]",
                   "eval.trees=false", "export.method=draft_model", "eval.engine=llama.cpp", "eval.engine_repeats=2",
                   cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = root / "all"
    assert "ngram" in json.loads((run / "eval/report.json").read_text())["methods"]  # the run's own eval, intact
    report = json.loads((run / "eval-llama.cpp/report.json").read_text())
    assert set(report["methods"]) == {"plain", "draft_model"}  # the bundle's draft alone, at its k
    checked = report["engines"]["llama.cpp"]
    assert checked["turns"] == 6 and checked["outputs_differ"] == 0, checked["divergences"]
    assert checked["draft_n"] > 0 and checked["num_draft_tokens"] == 2
    replay = checked["replay"]
    assert abs(checked["draft_n_accepted"] - replay["accepted"]) <= 0.02 * replay["accepted"], (checked, replay)
    assert 0 < checked["draft_n_accepted"] < checked["draft_n"]  # a draft that is right sometimes
    assert checked["tau"] > 1 and checked["plain_tokens_per_s"] > 0
    assert checked["ours_tau"] == report["methods"]["draft_model"]["tau"]
    assert "llama-server + draft" in proc.stdout and "our decoder's tau for the same draft and k" in proc.stdout
    # Recorded in the bundle too, which still checks.
    assert json.loads((run / "export/bundle.json").read_text())["engines"]["llama.cpp"]["draft_n"] == checked["draft_n"]
    load_bundle(run / "export", load_target(str(smol_target_dir), device="cpu"))


def test_stage_all_refuses_an_engine_check_it_cannot_run(tmp_path):
    proc = run_cli("stage=all", "eval.engine=llama.cpp", "export.method=medusa", cwd=tmp_path)
    assert proc.returncode == 2 and "llama.cpp, which runs export.method=draft_model|eagle, not medusa" in proc.stderr
    proc = run_cli("stage=eval", "eval.engine=llama.cpp", cwd=tmp_path)
    assert proc.returncode == 2 and "set eval.bundle=<bundle folder>" in proc.stderr


def test_a_conversion_that_fails_is_one_line(tmp_path):
    """A tokenizer llama.cpp's converter does not know (the tests' byte tokenizer): its last line."""
    folder = make_tiny_target(tmp_path / "byte")
    with pytest.raises(PipelineError, match=r"^llama.cpp's converter failed on .*byte: .+") as e:
        gguf.convert(folder, tmp_path / "x.gguf", "f16")
    assert "\n" not in str(e.value) and not (tmp_path / "x.gguf").exists()


def test_llama_server_runs_the_exported_eagle_head_losslessly(draft_bundle, smol_target_dir, tmp_path):
    """EAGLE-3 in llama.cpp (--spec-type draft-eagle3 over the three layers the head was trained on)."""
    if llama_cpp.server_binary() is None:
        pytest.fail("llama.cpp's llama-server is not installed: `make setup-server` builds it (`make test` does)")
    from pipeline.heads import stage as heads_stage

    root, base, prompts = draft_bundle
    heads_stage.run(compose_config(*base, "heads=eagle", "heads.feature_layers=[0,1,2]", "heads.draft_vocab_size=256",
                                   "heads.batch_size=2", "heads.max_steps=60", "heads.lr=1e-2", stage="heads"))
    common = ["data=file", f"data.path={prompts}", "eval.max_new_tokens=16", "eval.ngram=false", "eval.trees=false",
              "eval.sweep=[2]"]
    evaluation.run(compose_config(*base, *common, stage="eval"))
    out = export.run(compose_config(*base, "export.method=eagle", f"export.dir={tmp_path / 'e'}", stage="export"))
    engine = json.loads((out / "bundle.json").read_text())["llama_cpp"]
    assert engine["spec_type"] == "draft-eagle3" and engine["draft"] == "gguf/eagle3.gguf"
    assert field(read_gguf(out / "gguf/eagle3.gguf"), "eagle3.target_layers") == [1, 2, 3]
    evaluation.run(compose_config(*base, *common, f"eval.bundle={out}", "eval.engine=llama.cpp",
                                  "eval.engine_repeats=1", stage="eval"))
    checked = json.loads((root / "g/eval-llama.cpp/report.json").read_text())["engines"]["llama.cpp"]
    assert checked["outputs_differ"] == 0, checked["divergences"]
    assert checked["draft_n"] > 0 and checked["turns"] == 6
    # llama.cpp drafts what our replay of the head over its answers predicts (the same features,
    # layers, feedback and vocabulary map), and the head is right sometimes, not always.
    replay = checked["replay"]
    assert abs(checked["draft_n_accepted"] - replay["accepted"]) <= 0.02 * replay["accepted"], (checked, replay)
    assert 0 < checked["draft_n_accepted"] < checked["draft_n"], checked
    # the control for turns that differ: plain and drafted again, one token per micro-batch
    from pipeline.eval import engine as check

    turns = [check.Turn(context=list(range(40, 40 + n))) for n in (5, 23)]
    assert check.control(out / engine["target"], ["-t", "2", "-c", "1024", "--no-warmup"],
                         check.spec_flags(out, engine), turns, 16) == dict(
        flags="-ub 1", turns=2, outputs_differ=0)

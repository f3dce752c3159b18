"""The heads stage on a tiny random target: outputs, training, resume, the eval hand-off, and
that EAGLE's training-time test sees exactly what drafting later feeds the head."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import compose_config, run_cli, write_jsonl
from pipeline import data
from pipeline import eval as evaluation
from pipeline.train.data import collate, load_examples
from pipeline.errors import PipelineError
from pipeline.heads import stage as heads_stage
from pipeline.heads.models import build_heads
from pipeline.heads.train import eagle_terms, target_view, ttt_mask
from pipeline.models import load_target

KIND_OVERRIDES = {"medusa": ["heads.medusa_num_heads=3"], "eagle": ["heads.ttt_steps=2"],
                  "early_exit": ["heads.exit_layer=1", "heads.adapter_rank=8"]}


def overrides(target_dir, runs_dir, kind, *extra):
    return ["target=hf", f"target.name_or_path={target_dir}", f"runs_dir={runs_dir}", "run=h", f"heads={kind}",
            *KIND_OVERRIDES[kind], "heads.batch_size=2", "heads.max_steps=6", "heads.eval_every=3",
            "heads.lr=0.01", "heads.warmup_steps=1", "heads.draft_vocab_size=40", *extra]


@pytest.fixture(scope="module")
def generated(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about number {i}"}
                                             for i in range(12)])
    data.run(compose_config("target=hf", f"target.name_or_path={tiny_target_dir}", "data=file",
                            f"data.path={prompts}", "data.split=all", f"runs_dir={root}", "run=h",
                            "generate.max_new_tokens=12"))
    return root


def fresh_run(generated, tmp_path):
    import shutil

    shutil.copytree(generated / "h" / "generate", tmp_path / "h" / "generate")
    return tmp_path


def test_every_kind_trains_and_eval_reports_it(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    for kind in ("medusa", "eagle", "early_exit"):
        out = heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, kind), stage="heads"))
        assert out == runs / "h" / "heads" / kind
        for name in ("heads.safetensors", "heads_config.json", "initial/heads.safetensors", "metrics.jsonl",
                     "manifest.json"):
            assert (out / name).is_file(), (kind, name)
        assert not (out / "state").exists()
        config = json.loads((out / "heads_config.json").read_text())
        assert config["kind"] == kind and config["draft_vocab_size"] == 40
        metrics = json.loads((out / "manifest.json").read_text())["metrics"]
        assert metrics["steps"] == 6 and 0 <= metrics["heldout_alpha_end"] <= 1
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        before, after = load_file(out / "initial/heads.safetensors"), load_file(out / "heads.safetensors")
        assert any(not torch.equal(before[k], after[k]) for k in before if k != "draft_to_target"), kind
    positions = {"medusa": 3, "eagle": 5, "early_exit": 1}  # EAGLE's held-out chains: eval's tree depth
    for kind, n in positions.items():
        metrics = json.loads((runs / "h/heads" / kind / "manifest.json").read_text())["metrics"]
        assert len(metrics["heldout_alpha_by_position_end"]) == n, kind

    prompts = write_jsonl(tmp_path / "e.jsonl", [{"id": "e0", "prompt": "hello"}, {"id": "e1", "prompt": "bye"}])
    cfg = compose_config("target=hf", f"target.name_or_path={tiny_target_dir}", f"runs_dir={runs}", "run=h",
                         "data=file", f"data.path={prompts}", "eval.max_new_tokens=8", "eval.sweep=[1,2]",
                         "eval.sweep_prompts=1", "eval.compare_hf=true", stage="eval")
    report = json.loads((evaluation.run(cfg) / "report.json").read_text())
    for kind in ("medusa", "eagle", "early_exit"):
        method = report["methods"][kind]
        assert method["drafter"] == kind and method["lossless"] is True, kind
        assert method["tau"] >= 1.0 and report["costs"]["draft_cost_ratio"][kind] > 0
    assert not any(kind in name for kind in positions for name in report["hf_methods"])
    assert report["int8_drafts"] == ["medusa"]  # EAGLE's error would compound; early exit is the target's layers
    assert {"medusa_tree", "eagle_tree"} <= set(report["methods"])
    assert all(m["lossless"] is True for m in report["methods"].values())



def test_training_lowers_the_loss_and_raises_the_heldout_acceptance(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    out = heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, "eagle", "heads.max_steps=20",
                                                    "heads.eval_every=20", "heads.draft_vocab_size=0"), stage="heads"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "manifest.json").read_text())["metrics"]
    assert sum(r["loss"] for r in records[-3:]) < sum(r["loss"] for r in records[:3])
    assert metrics["heldout_alpha_end"] > metrics["heldout_alpha_start"]


def test_a_stopped_run_resumes_to_the_same_weights(tiny_target_dir, generated, tmp_path, monkeypatch):
    whole = heads_stage.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "a"), "eagle"),
                                           stage="heads"))
    runs = fresh_run(generated, tmp_path / "b")
    cfg = compose_config(*overrides(tiny_target_dir, runs, "eagle", "heads.save_every=2"), stage="heads")
    calls = {"n": 0}
    real = heads_stage.target_view

    def dies_in_step_five(*args, **kwargs):
        calls["n"] += torch.is_grad_enabled()  # a training step (held-out passes run without grad)
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as if the process were killed during step 5
        return real(*args, **kwargs)

    monkeypatch.setattr(heads_stage, "target_view", dies_in_step_five)
    with pytest.raises(KeyboardInterrupt):
        heads_stage.run(cfg)
    assert json.loads((runs / "h/heads/eagle/state/last/trainer.json").read_text())["step"] == 4
    assert not (runs / "h/heads/eagle/manifest.json").exists()
    monkeypatch.setattr(heads_stage, "target_view", real)
    changed = compose_config(*overrides(tiny_target_dir, runs, "eagle", "heads.save_every=2", "heads.lr=0.02"),
                             stage="heads")
    with pytest.raises(PipelineError, match="another config"):
        heads_stage.run(changed)
    resumed = heads_stage.run(cfg)
    a, b = load_file(whole / "heads.safetensors"), load_file(resumed / "heads.safetensors")
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    # The held-out statistics before training come back with the checkpoint.
    metrics = [json.loads((folder / "manifest.json").read_text())["metrics"] for folder in (whole, resumed)]
    assert metrics[1]["heldout_top1_by_position_start"] == metrics[0]["heldout_top1_by_position_start"]


def test_the_cli_trains_heads_after_generate_and_refuses_without_it(tiny_target_dir, generated, tmp_path):
    runs = fresh_run(generated, tmp_path)
    common = ["target=hf", f"target.name_or_path={tiny_target_dir}", f"runs_dir={runs}"]
    done = run_cli("stage=heads", "heads=medusa", "heads.max_steps=4", "heads.draft_vocab_size=40", "run=h", *common,
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (runs / "h/heads/medusa/manifest.json").is_file()
    missing = run_cli("stage=heads", "heads=eagle", "heads.max_steps=4", "run=nothing", *common, cwd=tmp_path)
    assert missing.returncode == 1 and "stage=generate" in missing.stderr.strip().splitlines()[-1]
    bad = run_cli("stage=heads", "heads=early_exit", "heads.exit_layer=9", "heads.max_steps=4", "run=h", *common,
                  cwd=tmp_path)
    assert bad.returncode == 1 and "heads.exit_layer=9" in bad.stderr.strip().splitlines()[-1]


def test_ttt_mask_shows_each_step_what_drafting_shows_it():
    valid = torch.tensor([[True, True, True, True, False]])
    allowed = lambda step: (ttt_mask(valid, step, torch.float32)[0, 0] == 0)  # [T, step*T]
    assert torch.equal(allowed(1), torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                                 [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], dtype=torch.bool))
    two = allowed(2)
    # Position 3 at step 2 (chain from position 2): the target's features up to 2, its own key at 3.
    assert two[3].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3]
    three = allowed(3)
    # Position 3 at step 3 (chain from position 1): target features up to 1, step 2's key at 2, its own at 3.
    assert three[3].nonzero().flatten().tolist() == [0, 1, 5 + 2, 10 + 3]
    assert bool(three.any(dim=1).all())  # no query is left without a key


def test_eagle_training_steps_equal_drafting_step_by_step(tiny_target_dir, generated):
    """The logits that training-time test computes at step s for position t are the logits the
    head produces when it drafts: target features up to the chain's start, then its own."""
    target = load_target(name_or_path=str(tiny_target_dir))
    examples, _ = load_examples(generated / "h/generate/dataset", 64)
    batch = collate(examples[:1], target.tokenizer.pad_token_id, False)
    head = build_heads("eagle", target.model, torch.arange(target.model.config.vocab_size),
                       dict(feature_layers=[1, 2], ttt_steps=3)).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.2)
    view = target_view(target.model, batch, head.feature_layers, head.draft_to_target)
    captured = []
    real_logits = head.logits
    head.logits = lambda hidden: captured.append(real_logits(hidden)) or captured[-1]
    with torch.no_grad():
        eagle_terms(head, view, batch, "forward_kl", steps=3)
    del head.logits
    ids = batch.input_ids[0]
    feats = head.fuse(torch.cat([view.hidden[i] for i in head.feature_layers], dim=-1))
    with torch.no_grad():
        for step in (1, 2, 3):
            cols = batch.cols[batch.cols >= step].tolist()
            for j, c in enumerate(cols[:: max(1, len(cols) // 4)]):
                j = cols.index(c)
                start = c - 1 - (step - 1)  # the chain's first position: target features up to it
                chain = feats.new_zeros((1, 0, feats.shape[-1]))
                for s in range(1, step + 1):  # plain causal passes, the head's own outputs appended
                    h = head.features_out(ids[None, 1 : start + s + 1], torch.cat([feats[:, : start + 1], chain], 1))
                    chain = torch.cat([chain, h[:, -1:]], dim=1)
                torch.testing.assert_close(head.logits(chain[0, -1]), captured[step - 1][j], rtol=1e-4, atol=1e-4)


def test_offline_features_train_like_online_and_resume_by_shard(tiny_target_dir, generated, tmp_path, capsys):
    fp32 = ("heads.precision=fp32", "heads.target_bf16=false")  # what differs is the cache's fp16 alone
    online = heads_stage.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "a"), "eagle",
                                                       *fp32), stage="heads"))
    runs = fresh_run(generated, tmp_path / "b")
    offline = heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, "eagle", "heads.features=offline",
                                                        "heads.cache_shard_size=4", *fp32), stage="heads"))
    printed = capsys.readouterr().out
    assert "caching target features" in printed and "GiB on disk" in printed
    shards = sorted((runs / "h/heads/features").glob("*/shard-*.safetensors"))
    assert len(shards) == 3 and json.loads((offline / "manifest.json").read_text())["metrics"]["features"] == "offline"
    # fp16 features: the same training within fp16 rounding.
    a, b = load_file(online / "heads.safetensors"), load_file(offline / "heads.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0.05, atol=2e-3)
    # A missing shard (a killed caching run) is computed again; the others are reused.
    stamp = {p: p.stat().st_mtime_ns for p in shards}
    shards[0].unlink()
    (offline / "manifest.json").unlink()  # a finished stage is left alone: make it one killed before its end
    heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, "eagle", "heads.features=offline",
                                              "heads.cache_shard_size=4", "heads.resume=false", *fp32), stage="heads"))
    assert shards[0].is_file() and all(p.stat().st_mtime_ns == t for p, t in stamp.items() if p != shards[0])
    assert f"{len(shards) - 1} of {len(shards)} shards already there" in capsys.readouterr().out


def test_medusa_reads_the_cache_eagle_built(tiny_target_dir, generated, tmp_path, capsys):
    """EAGLE's cached layers include the last, all Medusa needs: Medusa trains from that cache
    (no second target pass over the data) to the weights its own cache gives."""
    offline = ("heads.features=offline", "heads.cache_shard_size=4")
    runs = fresh_run(generated, tmp_path / "a")
    heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, "eagle", *offline), stage="heads"))
    capsys.readouterr()
    shared = heads_stage.run(compose_config(*overrides(tiny_target_dir, runs, "medusa", *offline), stage="heads"))
    assert "3 of 3 shards already there" in capsys.readouterr().out
    assert len(list((runs / "h/heads/features").iterdir())) == 1
    alone = heads_stage.run(compose_config(*overrides(tiny_target_dir, fresh_run(generated, tmp_path / "b"), "medusa",
                                                      *offline), stage="heads"))
    a, b = load_file(shared / "heads.safetensors"), load_file(alone / "heads.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "early_exit"])
def test_packed_rows_give_the_losses_and_statistics_of_one_conversation_per_row(tiny_target_dir, generated, kind):
    """heads.pack: the conversations of a micro-batch share rows (positions restart, attention
    and training-time test stay within each): the same loss and held-out statistics."""
    from pipeline.heads.train import HeadsForTraining

    target = load_target(name_or_path=str(tiny_target_dir))
    examples, _ = load_examples(generated / "h/generate/dataset", 64)
    examples = [examples[i] for i in (0, 3, 5, 7)]
    for i, n in enumerate((9, 40, 25, 64)):  # lengths that pack: 64 | 40 + 9 | 25
        ex = examples[i]
        examples[i] = type(ex)(ex.id, ex.input_ids[:n], [t for t in ex.positions if t < n - 1])
    settings = {"medusa": dict(num_heads=3, num_layers=1), "eagle": dict(feature_layers=[1, 2], ttt_steps=3),
                "early_exit": dict(exit_layer=1, adapter_rank=8)}[kind]
    heads = build_heads(kind, target.model, torch.arange(target.model.config.vocab_size), settings)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    model = HeadsForTraining(heads, target.model, "forward_kl", 0.8, 3)
    terms = []
    for pack in (False, True):
        batch = collate(examples, target.tokenizer.pad_token_id, False, pack)
        view = target_view(target.model, batch, heads.feature_layers, heads.draft_to_target, stats=True)
        with torch.no_grad():
            terms.append(model(view, batch))
    padded, packed = terms
    assert collate(examples, 0, False, True).input_ids.shape[0] == 3  # packing really shared a row
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(padded.alpha + padded.top1 + padded.rank, packed.alpha + packed.top1 + packed.rank):
        torch.testing.assert_close(b.float().sort().values, a.float().sort().values, rtol=1e-4, atol=1e-5)


def test_the_implied_tau_of_a_chain_and_of_the_best_tree():
    from pipeline.heads.stage import tree_tau

    chances = [[0.6, 0.2], [0.5, 0.3], [0.5, 0.1]]
    assert tree_tau([c[:1] for c in chances], 3) == pytest.approx(1 + 0.6 + 0.3 + 0.15)  # the chain
    # Best-first: 0.6, 0.6*0.5, 0.6*0.3, 0.2, 0.3*0.5 (the next best is 0.2*0.5 = 0.1 < 0.15)
    assert tree_tau(chances, 5) == pytest.approx(1 + 0.6 + 0.3 + 0.18 + 0.2 + 0.15)
    assert tree_tau(chances, 100) == pytest.approx(1 + 0.8 + 0.8 * 0.8 + 0.8 * 0.8 * 0.6)  # every node
    assert tree_tau([], 8) == 1.0


def test_the_best_heldout_weights_are_kept_not_the_last(tmp_path):
    from pipeline.train.loop import Best

    draft = torch.nn.Linear(2, 2)
    best = Best(tmp_path / "best", "heldout_tau")
    weights = {}
    for step, tau in ((0, 1.0), (3, 2.0), (6, 1.5)):
        with torch.no_grad():
            draft.weight.fill_(step)
        weights[step] = draft.weight.clone()
        best.consider(step, {"heldout_tau": tau, "heldout_alpha": tau / 4}, draft)
    chosen = best.restore(draft, 6, {"heldout_tau": 1.5})
    assert chosen["selected_step"] == 3 and chosen["stats"] == {"heldout_tau": 2.0, "heldout_alpha": 0.5}
    assert torch.equal(draft.weight, weights[3]) and not (tmp_path / "best").exists()
    best.consider(0, {"heldout_tau": 1.0}, draft)  # a fresh run forgets what an earlier one kept
    assert best.restore(draft, 6, {"heldout_tau": 1.2})["selected_step"] == 6


def test_right_padded_rows_need_no_mask_under_causal_attention(tiny_target_dir, generated):
    """run_target drops the padding mask (so the causal kernel can skip what lies above the
    diagonal): every real token's hidden states are those the masked pass gives."""
    from pipeline.heads.cache import run_target

    target = load_target(name_or_path=str(tiny_target_dir))
    examples, _ = load_examples(generated / "h/generate/dataset", 64)
    batch = collate([examples[0], type(examples[1])("short", examples[1].input_ids[:7], [3])], 0, False)
    layers = [1, 2]
    with torch.no_grad():
        masked = target.model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                            output_hidden_states=True).hidden_states
    unmasked = run_target(target.model, batch, layers, bf16=False)
    real = batch.attention_mask.bool()
    for layer in layers:
        torch.testing.assert_close(unmasked[layer][real], masked[layer][real], rtol=1e-5, atol=1e-5)
    assert bool((~real).any())  # the batch had padding


def test_a_draft_position_with_nothing_to_measure_is_tallied_as_nothing():
    """A batch too short for a later Medusa head adds no statistics for it (the CI failure of
    heads.max_steps=2 on 4-token answers: bincount of an empty float tensor)."""
    from pipeline.heads.stage import Tally
    from pipeline.heads.train import Terms, no_position

    terms = Terms(loss=torch.zeros(()))
    terms.alpha.append(torch.tensor([0.5, 1.0])), terms.top1.append(torch.tensor([1.0, 0.0]))
    terms.rank.append(torch.tensor([0, 3]))
    no_position(terms, torch.zeros(2, 4))
    tally = Tally()
    tally.add(terms)
    tally.add(terms)
    assert tally.count == [4, 0] and tally.ranks[1].sum() == 0
    means = tally.means(tree_budget=4, autoregressive=False)
    assert means["heldout_alpha_by_position"] == [0.75, None] and means["heldout_top1"] == 0.5

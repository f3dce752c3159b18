import json
import os
import subprocess
import sys

import datasets
import pytest
import torch

from conftest import REPO, compose_config, free_port, kill_9_when, write_jsonl
from pipeline.data import generate
from pipeline.data.chat import encode, first_prompt_ids, next_turn_ids
from pipeline.data.generate import regenerate
from pipeline.data.sources import Conversation
from pipeline.errors import PipelineError
from pipeline.models import load_target
from pipeline.runs import MANIFEST, sha256_file


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, cache_dir):
    return load_target(str(tiny_target_dir), cache_dir=str(cache_dir))


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: one per regenerated turn."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    eos = target.tokenizer.eos_token_id
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos, eos_token_id=eos)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


CONVS = [
    Conversation(id="a", source="t", user_turns=["Hello there", "Say more"], system="Be kind."),
    Conversation(id="b", source="t", user_turns=["A much longer first question, to force left padding"]),
    Conversation(id="c", source="t", user_turns=["Q", "Q2", "Q3"], category="x"),
]


def test_rows_are_the_template_rendering_of_the_regenerated_conversation(tiny):
    tok = tiny.tokenizer
    rows = regenerate(tiny, CONVS, max_new_tokens=12, temperature=0.0, top_p=1.0,
                      batch_size=2, max_length=4096, max_turns=None)
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    for conv, row in zip(CONVS, rows):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask) and row["num_turns"] == len(conv.user_turns)
        answers = [ids[s:e] for s, e in spans(mask)]
        assert len(answers) == len(conv.user_turns)
        # The same conversation rendered as text by the template and tokenized in one go.
        texts = [tok.decode(a[:-1] if a[-1] == tok.eos_token_id else a) for a in answers]
        messages = ([{"role": "system", "content": conv.system}] if conv.system else []) + [
            m for q, a in zip(conv.user_turns, texts) for m in
            ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        full = encode(tok, tok.apply_chat_template(messages, tokenize=False))
        # The rendering closes the last answer with "<|im_end|>\n"; ours stops at the last generated token.
        closing = 1 if answers[-1][-1] == tok.eos_token_id else 2
        assert ids == full[:-closing]


@pytest.mark.parametrize("batch_size", [1, 3])  # 3: left-padded rows that finish at different steps
def test_first_turn_is_the_targets_greedy_continuation(tiny, batch_size):
    rows = regenerate(tiny, CONVS, max_new_tokens=16, temperature=0.0, top_p=1.0,
                      batch_size=batch_size, max_length=4096, max_turns=1)
    for conv, row in zip(CONVS, rows):
        prompt = first_prompt_ids(tiny.tokenizer, conv)
        (start, end), = spans(row["loss_mask"])
        assert row["input_ids"][:start] == prompt
        assert row["input_ids"][start:end] == hf_greedy(tiny, prompt, 16)


def test_later_turns_continue_from_the_targets_own_tokens(tiny):
    row, = regenerate(tiny, CONVS[:1], max_new_tokens=10, temperature=0.0, top_p=1.0,
                      batch_size=4, max_length=4096, max_turns=None)
    (s1, e1), (s2, _) = spans(row["loss_mask"])
    answer = tiny.tokenizer.decode(row["input_ids"][s1:e1], skip_special_tokens=True)
    between = next_turn_ids(tiny.tokenizer, CONVS[0], 1, [answer], row["input_ids"][e1 - 1], [tiny.tokenizer.eos_token_id])
    assert row["input_ids"][e1:s2] == between
    assert tiny.tokenizer.decode(between).startswith(("\n<|im_start|>user\nSay more", "<|im_end|>\n<|im_start|>user"))


def test_max_length_ends_conversations_and_max_turns_caps_them(tiny):
    first = len(first_prompt_ids(tiny.tokenizer, CONVS[2]))
    rows = regenerate(tiny, CONVS[2:], max_new_tokens=8, temperature=0.0, top_p=1.0,
                      batch_size=4, max_length=first + 8 + 5, max_turns=None)
    assert rows[0]["num_turns"] == 1 and len(spans(rows[0]["loss_mask"])) == 1
    rows = regenerate(tiny, CONVS[2:], max_new_tokens=8, temperature=0.0, top_p=1.0,
                      batch_size=4, max_length=4096, max_turns=2)
    assert rows[0]["num_turns"] == 2
    # A conversation whose first prompt alone does not fit produces no row.
    assert regenerate(tiny, CONVS[2:], max_new_tokens=8, temperature=0.0, top_p=1.0,
                      batch_size=4, max_length=first, max_turns=None) == []


def test_sampling_follows_the_seed(tiny):
    def sample(seed):
        torch.manual_seed(seed)
        return regenerate(tiny, CONVS, max_new_tokens=12, temperature=1.0, top_p=0.9,
                          batch_size=3, max_length=4096, max_turns=1)
    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def stage_overrides(target_dir, data_path, runs_dir, *extra):
    return ["target=hf", f"target.name_or_path={target_dir}", "data=file", f"data.path={data_path}",
            f"runs_dir={runs_dir}", "run=t", "generate.max_new_tokens=8", "generate.shard_size=5", *extra]


def test_stage_writes_dataset_topk_logits_and_manifest(tiny, tiny_target_dir, chat_file, tmp_path):
    cfg = compose_config(*stage_overrides(tiny_target_dir, chat_file, tmp_path, "generate.save_topk_logits=4"))
    out = generate.run(cfg)
    assert out == tmp_path / "t" / "generate"
    ds = datasets.load_from_disk(str(out / "dataset"))
    assert len(ds) == 12 and len(set(ds["id"])) == 12
    assert set(ds.column_names) == {"id", "source", "category", "num_turns", "answers", "input_ids", "loss_mask",
                                    "topk_ids", "topk_logits"}
    assert set(ds["answers"]) == {"target"}
    assert not (out / "shards").exists()

    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["stage"] == "generate" and manifest["status"] == "complete"
    assert manifest["target_fingerprint"] == tiny.fingerprint()
    assert manifest["skipped_records"] == {"invalid_json": 1, "malformed": 1, "empty": 1}
    assert manifest["config"]["data"]["path"] == str(chat_file)
    assert manifest["num_generated_tokens"] == sum(sum(m) for m in ds["loss_mask"])
    for rel, digest in manifest["outputs"].items():
        assert sha256_file(out / rel) == digest, rel

    # Top-k logits: fp16, one row per generated token, taken where that token is predicted. They
    # come from decoding (batched, left-padded, turn by turn), so they must equal a teacher-forced
    # pass over the finished conversation, every turn of every row.
    assert ds.features["topk_logits"].dtype == "float16" and ds.features["topk_ids"].dtype == "int32"
    assert max(ds["num_turns"]) > 1
    for row in ds.with_format("numpy"):
        positions = row["loss_mask"].nonzero()[0]
        assert row["topk_logits"].shape == row["topk_ids"].shape == (len(positions), 4)
        with torch.inference_mode():
            logits = tiny.model(torch.from_numpy(row["input_ids"]).long()[None]).logits[0]
        want_vals, want_ids = logits[positions - 1].topk(4, dim=-1)
        assert torch.equal(torch.from_numpy(row["topk_ids"]).long(), want_ids), row["id"]
        torch.testing.assert_close(torch.from_numpy(row["topk_logits"]).float(), want_vals, atol=1e-2, rtol=1e-3)
        # Greedy: each generated token is the argmax of its own logits (unless at an exact tie).
        tokens = row["input_ids"][positions]
        gap = want_vals[:, 0] - logits[positions - 1].gather(1, torch.from_numpy(tokens).long()[:, None])[:, 0]
        assert bool(((want_ids[:, 0].numpy() == tokens) | (gap.numpy() < 1e-5)).all())


def test_a_batch_size_change_writes_the_same_dataset(tiny_target_dir, chat_file, tmp_path):
    """Continuous batching (rows refilled from the queue) regenerates the same answers and top-k
    ids whether 3 rows or 1 decode at a time."""
    datasets_by = {}
    for rows in (1, 3):
        cfg = compose_config(*stage_overrides(tiny_target_dir, chat_file, tmp_path / str(rows),
                                              "generate.save_topk_logits=4", f"generate.batch_size={rows}"))
        datasets_by[rows] = datasets.load_from_disk(str(generate.run(cfg) / "dataset"))
    one, three = datasets_by[1], datasets_by[3]
    assert three["id"] == one["id"] and three["input_ids"] == one["input_ids"] and three["loss_mask"] == one["loss_mask"]
    assert three["topk_ids"] == one["topk_ids"]


def test_stage_rerun_is_a_no_op_and_a_changed_config_is_refused(tiny_target_dir, chat_file, tmp_path):
    overrides = stage_overrides(tiny_target_dir, chat_file, tmp_path)
    out = generate.run(compose_config(*overrides))
    stamp = (out / MANIFEST).stat().st_mtime_ns
    generate.run(compose_config(*overrides, "generate.batch_size=3"))  # batch size may change freely
    assert (out / MANIFEST).stat().st_mtime_ns == stamp
    with pytest.raises(PipelineError, match="another config"):
        generate.run(compose_config(*overrides, "generate.max_new_tokens=9"))
    generate.run(compose_config(*overrides, "generate.max_new_tokens=9", "generate.overwrite=true"))
    assert json.loads((out / MANIFEST).read_text())["config"]["generate"]["max_new_tokens"] == 9


def cli(*args):
    return [sys.executable, "-m", "pipeline", "stage=generate", *args]


def with_run(args, name):
    return [f"run={name}" if a == "run=t" else a for a in args]


def load_rows(path):
    return datasets.load_from_disk(str(path)).to_list()


@pytest.fixture
def many_prompts(tmp_path):
    return write_jsonl(tmp_path / "many.jsonl", [{"id": f"p{i}", "prompt": f"prompt number {i} " * (1 + i % 4)}
                                                 for i in range(60)])


def test_resume_after_sigkill_loses_and_duplicates_nothing(tiny_target_dir, many_prompts, tmp_path):
    # Sampling, so that resumed shards must reproduce their seeds exactly.
    args = stage_overrides(tiny_target_dir, many_prompts, tmp_path, "generate.shard_size=3",
                           "generate.max_new_tokens=48", "generate.temperature=0.8", "generate.top_p=0.95")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shards = tmp_path / "t" / "generate" / "shards"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen(cli(*args), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    kill_9_when(proc, lambda: len(list(shards.glob("shard-*"))) >= 3)
    done_before = len(list(shards.glob("shard-*")))
    assert 3 <= done_before < 20, (tmp_path / "killed.log").read_text()[-3000:]
    assert not (tmp_path / "t" / "generate" / MANIFEST).exists()

    resumed = subprocess.run(cli(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({done_before} already done)" in resumed.stdout + resumed.stderr
    clean = subprocess.run(cli(*with_run(args, "clean")), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert clean.returncode == 0, clean.stderr

    got = load_rows(tmp_path / "t" / "generate" / "dataset")
    want = load_rows(tmp_path / "clean" / "generate" / "dataset")
    assert [r["id"] for r in got] == [f"p{i}" for i in range(60)]
    assert got == want


def test_two_processes_split_the_work_and_merge_into_one_dataset(tiny_target_dir, many_prompts, tmp_path):
    args = stage_overrides(tiny_target_dir, many_prompts, tmp_path, "generate.shard_size=4",
                           "generate.max_new_tokens=16", "generate.temperature=0.8")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
              "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "pipeline", "stage=generate"]
    two = subprocess.run([*launch, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout + two.stderr
    one = subprocess.run(cli(*with_run(args, "one")), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr

    manifest = json.loads((tmp_path / "t" / "generate" / MANIFEST).read_text())
    assert manifest["num_processes"] == 2
    got = load_rows(tmp_path / "t" / "generate" / "dataset")
    assert [r["id"] for r in got] == [f"p{i}" for i in range(60)]
    assert got == load_rows(tmp_path / "one" / "generate" / "dataset")


def test_source_answers_are_kept_and_scored_instead_of_regenerated(tiny, tiny_target_dir, chat_file, tmp_path):
    """generate.target_answers=0: records that carry answers keep them; the others are regenerated."""
    from pipeline.data.chat import encode
    from pipeline.data.generate import end_of_turn_id

    cfg = compose_config(*stage_overrides(tiny_target_dir, chat_file, tmp_path, "generate.save_topk_logits=4",
                                          "generate.target_answers=0.0"))
    out = generate.run(cfg)
    ds = datasets.load_from_disk(str(out / "dataset"))
    by_id = {r["id"]: r for r in ds}
    kept = [i for i in by_id if i.startswith("c")]  # the records with an assistant answer
    assert kept and all(by_id[i]["answers"] == "source" for i in kept)
    assert all(r["answers"] == "target" for i, r in by_id.items() if i not in kept)
    assert all(len(r["topk_ids"]) == sum(r["loss_mask"]) for r in by_id.values())
    eot = end_of_turn_id(tiny.tokenizer, [tiny.tokenizer.eos_token_id])
    want = encode(tiny.tokenizer, "old answer") + [eot]
    for i in kept:
        row = by_id[i]
        assert row["num_turns"] == 1  # the source answers only the first question
        answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert answer == want[:8] and len(row["topk_ids"]) == len(answer)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["num_scored_source_tokens"] == sum(sum(by_id[i]["loss_mask"]) for i in kept) > 0
    assert manifest["num_generated_tokens"] + manifest["num_scored_source_tokens"] == \
        sum(sum(m) for m in ds["loss_mask"])

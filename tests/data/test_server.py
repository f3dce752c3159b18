"""generate.backend=server against a small OpenAI-compatible server on 127.0.0.1 that runs a
tiny target (tests/data/fake_server.py): the same dataset as the local backend, top-k from
log-probabilities, retries, counted skips, one-line errors, and resume after kill -9 of the
client or the death of the server. tests/data/test_llama_server.py runs a real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import REPO, compose_config, kill_9_when, write_jsonl
from fake_server import FakeServer, Faults, ascii_chat_tokenizer, overrides, rows, server
from fake_server import ascii_target, prompts  # noqa: F401 (fixtures)
from pipeline.data import generate
from pipeline.errors import PipelineError
from pipeline.runs import MANIFEST


@pytest.mark.parametrize("ids, text_prompts", [(False, False), (True, False), (False, True)],
                         ids=["token-texts", "token-ids", "text-prompts"])
def test_the_server_backend_writes_the_local_backends_dataset(ascii_target, prompts, tmp_path, ids, text_prompts):
    """Greedy, the same target: the same ids, turns and (where the server gives the end of
    turn's logprobs) masks; top-k ids equal and log-probabilities = logits − a constant per row.
    Prompts go as token ids, or as text to a server that takes no ids (prompt=auto)."""
    local = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "generate.save_topk_logits=4")))
    fake = FakeServer(ascii_target, ids=ids, text_prompts=text_prompts)
    try:
        remote = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "run=s",
                                                        "generate.save_topk_logits=4", *server(fake.url))))
    finally:
        fake.stop()
    want, got = rows(local), rows(remote)
    assert [r["id"] for r in got] == [r["id"] for r in want] == [f"p{i}" for i in range(10)]
    eos = ascii_chat_tokenizer().eos_token_id
    finished = 0
    for w, g in zip(want, got):
        assert g["input_ids"] == w["input_ids"] and g["num_turns"] == w["num_turns"] == 2
        ends = [t for t, token in enumerate(w["input_ids"]) if token == eos and w["loss_mask"][t]]
        finished += len(ends)
        # llama.cpp names no end-of-turn token: that one token is not learned with top-k
        expect = [0 if t in ends and not ids else m for t, m in enumerate(w["loss_mask"])]
        assert g["loss_mask"] == expect
        keep = [i for i, t in enumerate(t for t, m in enumerate(w["loss_mask"]) if m) if ids or t not in ends]
        w_ids, w_top = torch.tensor(w["topk_ids"])[keep], torch.tensor(w["topk_logits"])[keep]
        g_ids, g_top = torch.tensor(g["topk_ids"]), torch.tensor(g["topk_logits"])
        assert torch.equal(g_ids, w_ids)
        shift = w_top - g_top  # log Σ exp logits, one value per row
        assert torch.allclose(shift, shift[:, :1].expand_as(shift), atol=2e-2)
    assert finished  # some answers end with an end-of-turn token
    manifest = json.loads((remote / MANIFEST).read_text())
    tokens = manifest["server"]["answer_tokens"]
    assert manifest["backend"] == "server" and manifest["server"]["model"] == "tiny-target"
    assert manifest["server"]["urls"] == [fake.url]
    assert tokens["not_round_tripped"] == 0 and tokens["round_tripped"] > 0
    assert tokens["end_of_turn_without_logprobs"] == (0 if ids else finished)
    prompts_sent = [r["prompt"] for r in fake.requests if r["max_tokens"] > 1]
    assert all(isinstance(p, str) if text_prompts else isinstance(p, list) for p in prompts_sent)


def test_kd_losses_are_equal_on_logits_and_on_log_probabilities():
    """The stored top-k of the server is log p = logit − log Σ exp logits: every KD loss over the
    top-k sees the same distribution."""
    from pipeline.train.losses import Teacher, distill_loss

    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3
    student = torch.randn(7, 50)
    top = logits.topk(5, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, top.indices)
    for kind in ("forward_kl", "reverse_kl", "jsd", "tv"):
        on_logits = distill_loss(kind, student, Teacher(top.values, top.indices), top.indices[:, 0])
        on_logprobs = distill_loss(kind, student, Teacher(logprobs, top.indices), top.indices[:, 0])
        assert torch.allclose(on_logits, on_logprobs, atol=1e-6), kind


def test_a_token_that_does_not_round_trip_is_not_learned_and_is_counted():
    from pipeline.data.server import Answer, Completion, Pieces, answer_from

    tok = ascii_chat_tokenizer()
    pieces = Pieces(tok)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    # The server split "ab" into one token "ab" that our tokenizer does not have: a and b
    # are not what it generated; "c" and "d" are.
    done = Completion(text="abcd", finished=True, tokens=["ab", "c", "d", ""],
                      top=[{"ab": -0.1}, {"c": -0.2, "x": -3.0}, {"d": -0.3}, {"<|im_end|>": -0.01}])
    counts = Counter()
    answer = answer_from(done, pieces, tok, {tok.eos_token_id}, tok.eos_token_id, 2, counts)
    assert answer.ids == encode("abcd") + [tok.eos_token_id]
    assert answer.mask == [0, 0, 1, 1, 1]
    assert counts == Counter(round_tripped=2, not_round_tripped=2)
    assert answer.topk_ids.tolist() == [[pieces.id("c"), pieces.id("x")], [pieces.id("d"), 0],
                                        [tok.eos_token_id, 0]]
    assert answer.topk_logits[1, 1] == float("-inf")  # fewer than k: no probability
    assert isinstance(answer, Answer)


def test_both_logprobs_forms_are_read():
    """The completions form (vLLM, SGLang, llama-cpp-python) and the chat form llama.cpp's own
    server answers /completions with give the same tokens and top-k."""
    from pipeline.data.server import parse_completion

    completions = {"choices": [{"text": "Hi!", "finish_reason": "stop", "logprobs": {
        "tokens": ["Hi", "!"], "top_logprobs": [{"Hi": -0.1, "Hello": -2.5}, {"!": -0.3}], "text_offset": [7, 9]}}]}
    chat = {"choices": [{"text": "Hi!", "finish_reason": "stop", "logprobs": {"content": [
        {"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1},
                                                         {"token": "Hello", "logprob": -2.5}]},
        {"token": "!", "logprob": -0.3, "top_logprobs": [{"token": "!", "logprob": -0.3}]}]}}]}
    a, b = parse_completion(completions), parse_completion(chat)
    assert a.tokens == b.tokens == ["Hi", "!"] and a.top == b.top and a.finished and b.finished
    assert a.offsets == [7, 9] and b.offsets is None


def test_round_trips_follow_characters_not_decoded_pieces():
    """A SentencePiece-style tokenizer (▁ for a space, merges): decoded alone, "▁world" loses
    its space, and an emoji is cut into byte tokens. A server that cut the text where we do
    round-trips every token (found through text_offset where its token texts do not spell the
    answer); where it cut otherwise, only those tokens are not learned."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.data.server import Completion, Pieces, answer_from

    raw = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    raw.train_from_iterator(["hello world, hello there", "the world says hello"] * 50, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    text = "hello world 🙂 there"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["hello", "▁world", "▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁there"]
    assert tok.decode(ids[1:2]) == "world"  # decoded alone, the space is gone
    learned = [1, 1, 1, 0, 0, 0, 0, 1]  # the emoji's four byte tokens never round-trip
    # llama.cpp names a byte that ends no character with no text: the tokens spell the answer.
    spelled = ["hello", " world", " ", "", "", "", "🙂", " there"]
    # Another engine names each byte "\ufffd": the tokens do not spell it; text_offset places them.
    replaced = ["hello", " world", " ", *["\ufffd"] * 4, " there"]
    offsets = [100 + o for o in (0, 5, 11, 12, 12, 12, 12, 13)]
    for served, where in ((spelled, None), (replaced, offsets)):
        counts = Counter()
        answer = answer_from(Completion(text, False, served, [{} for _ in served], where), Pieces(tok), tok, {1}, 1,
                             0, counts)
        assert answer.ids == ids and answer.mask == learned
        assert counts == Counter(round_tripped=4, not_round_tripped=4)
    # A server that cut " there" in two: that token is not learned either.
    counts = Counter()
    answer = answer_from(Completion(text, False, [*spelled[:-1], " t", "here"], []), Pieces(tok), tok, {1}, 1, 0,
                         counts)
    assert answer.mask == [1, 1, 1, 0, 0, 0, 0, 0] and counts["not_round_tripped"] == 5


def test_retries_skips_and_counts(ascii_target, prompts, tmp_path):
    """500s, dropped connections and answers slower than the timeout are retried; a
    conversation that keeps failing is skipped and counted; the rest are all there."""
    faults = Faults(fail_first=1, drop_first=1, slow_first=1, slow_s=1.5, always_fail=("question 4", "and then 7"))
    fake = FakeServer(ascii_target, faults)
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, *server(
            fake.url, "generate.server.timeout_s=0.5", "generate.server.retries=3", "generate.server.concurrency=4"))))
    finally:
        fake.stop()
    got = rows(out)
    assert [r["id"] for r in got] == [f"p{i}" for i in range(10) if i not in (4, 7)]  # p7 failed in its 2nd turn
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["skipped_records"] == {"server_failed": 2}
    asked = {prompt: n for prompt, n in faults.seen.items() if "user\nHello<" not in prompt}  # not the checks'
    assert len(asked) == 10 * 2 - 1  # both turns of each conversation but p4's second
    assert all(n == 4 for prompt, n in asked.items())  # 3 failures then an answer, or 4 failures
    # the round trips counted are the rows' learned tokens (ends of turn aside): none of p7's first turn
    eos = ascii_chat_tokenizer().eos_token_id
    learned = sum(m and t != eos for r in got for t, m in zip(r["input_ids"], r["loss_mask"]))
    assert manifest["server"]["answer_tokens"]["round_tripped"] == learned


def test_bad_server_settings_are_one_line(ascii_target, prompts, tmp_path):
    fake = FakeServer(ascii_target, Faults(max_logprobs=5))
    try:
        with pytest.raises(PipelineError, match=r"generate.save_topk_logits=8 is more top_logprobs than "
                                                r"http://127.0.0.1:\d+/v1 allows \(HTTP 400: .*max_logprobs 5"):
            generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "generate.save_topk_logits=8",
                                                   *server(fake.url))))
        with pytest.raises(PipelineError, match="generate.server.api_key_env=NO_SUCH_KEY_VAR but that environment"):
            generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "run=k",
                                                   *server(fake.url, "generate.server.api_key_env=NO_SUCH_KEY_VAR"))))
    finally:
        fake.stop()
    dead = fake.url  # nothing listens there any more
    with pytest.raises(PipelineError, match=rf"cannot reach {dead}/models \(ConnectError"):
        generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "run=d", *server(dead))))
    with pytest.raises(ValueError, match="needs generate.server.urls"):
        compose_config(*overrides(ascii_target, prompts, tmp_path, "generate.backend=server"))


def test_the_key_comes_from_the_environment_and_is_written_nowhere(ascii_target, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_TEST_KEY", "sk-secret-123")
    fake = FakeServer(ascii_target)
    seen = []
    real = fake.answer

    def answer(body, handler):
        seen.append(handler.headers.get("Authorization"))
        return real(body, handler)

    fake.answer = answer
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "data.limit=2", *server(
            fake.url, "generate.server.api_key_env=SPECDRAFT_TEST_KEY"))))
    finally:
        fake.stop()
    assert seen and set(seen) == {"Bearer sk-secret-123"}
    for path in out.parent.rglob("*"):
        if path.is_file():
            assert b"sk-secret-123" not in path.read_bytes(), path


def cli(*args):
    return [sys.executable, "-m", "pipeline", "stage=generate", *args]


@pytest.fixture
def many(tmp_path) -> Path:
    return write_jsonl(tmp_path / "many.jsonl", [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(24)])


def test_kill_9_of_the_client_then_rerun_gives_every_conversation_once(ascii_target, many, tmp_path):
    fake = FakeServer(ascii_target, Faults(delay_s=0.05))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = overrides(ascii_target, many, tmp_path, *server(fake.url, "generate.server.concurrency=2"))
    shards = tmp_path / "t" / "generate" / "shards"
    try:
        with open(tmp_path / "killed.log", "w") as log:
            proc = subprocess.Popen(cli(*args), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            kill_9_when(proc, lambda: len(list(shards.glob("shard-*"))) >= 2)
        finished = {int(p.name.removeprefix("shard-")) for p in shards.glob("shard-*")}
        done_before = len(finished)
        assert 2 <= done_before < 8, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.5)  # requests the killed client sent are all in
        asked_before = len(fake.requests)
        again = subprocess.run(cli(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"({done_before} already done)" in again.stdout + again.stderr
    finally:
        fake.stop()
    got = rows(tmp_path / "t" / "generate")
    assert [r["id"] for r in got] == [f"p{i}" for i in range(24)]
    # the finished shards were not asked again (the rerun's one extra request: its one-token check)
    asked = [r["text"] for r in fake.requests[asked_before:] if r["max_tokens"] > 1]
    assert sorted(asked) == sorted(f"<|im_start|>user\nprompt {i}<|im_end|>\n<|im_start|>assistant\n"
                                   for i in range(24) if i // 3 not in finished)


def test_a_server_that_dies_stops_the_run_in_one_line_and_the_rerun_completes(ascii_target, many, tmp_path):
    fake = FakeServer(ascii_target, Faults(die_after=12))  # 2 checks, then 10 conversations: mid-shard
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = overrides(ascii_target, many, tmp_path, *server(fake.url, "generate.server.concurrency=1",
                                                            "generate.server.retries=1"))
    died = subprocess.run(cli(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert died.returncode == 1, died.stderr[-2000:]
    last = died.stderr.strip().splitlines()[-1]
    assert last.startswith("error: generate.server: no URL answers any more") and "restart the server" in last
    assert "Traceback" not in died.stderr
    assert not (tmp_path / "t" / "generate" / MANIFEST).exists()
    kept = len(list((tmp_path / "t" / "generate" / "shards").glob("shard-*")))
    assert kept == 3  # the three whole shards before the death; the fourth's finished conversation is redone
    restarted = FakeServer(ascii_target)  # on another port: the URLs are not part of the plan
    try:
        again = subprocess.run(cli(*[a.replace(fake.url, restarted.url) for a in args]), cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
    finally:
        restarted.stop()
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"({kept} already done)" in again.stdout + again.stderr
    assert [r["id"] for r in rows(tmp_path / "t" / "generate")] == [f"p{i}" for i in range(24)]

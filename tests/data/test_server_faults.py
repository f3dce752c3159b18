"""generate.backend=server against servers that misbehave as real ones do (tests/data/fake_server.py):
no answer can abort the run, wedge it or slip into the dataset unchecked. Each test names the
defect it guards (issue 32); a conversation a server fails is that conversation's failure,
counted under a reason, and `generate.retry_failed=true` asks for exactly those again."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from pathlib import Path

import datasets
import pytest

from conftest import compose_config, run_cli
from fake_server import FakeServer, Faults, ascii_chat_tokenizer, overrides, rows, server
from fake_server import ascii_target, prompts  # noqa: F401 (fixtures)
from pipeline.data import generate
from pipeline.errors import PipelineError
from pipeline.runs import MANIFEST

ALL = [f"p{i}" for i in range(10)]


def manifest_of(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def completions(fake: FakeServer) -> list[str]:
    """The prompts of the answers the run asked for (not the checks' one-token requests)."""
    return [r["text"] for r in fake.requests if r["max_tokens"] > 1]


def test_a_shard_whose_conversations_all_failed_completes_and_retry_failed_asks_only_for_them(
        ascii_target, prompts, tmp_path):
    """Defect 1: one conversation per shard, the server fails every request of one of them. The
    run completes with it counted; once the server is healthy, retry_failed sends only its turns
    and the dataset is then the one a run that never failed writes."""
    clean = FakeServer(ascii_target)
    try:
        want = rows(generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "run=clean",
                                                           "generate.shard_size=1", *server(clean.url)))))
    finally:
        clean.stop()
    failing = FakeServer(ascii_target, Faults(always_fail=("question 4",)))
    args = overrides(ascii_target, prompts, tmp_path, "generate.shard_size=1",
                     *server(failing.url, "generate.server.retries=1"))
    try:
        out = generate.run(compose_config(*args))
        first = manifest_of(out)
        asked = len(completions(failing))
        generate.run(compose_config(*args, "generate.retry_failed=true"))  # still failing: counted again
        asked = completions(failing)[asked:]
    finally:
        failing.stop()
    assert first["skipped_records"] == {"server_failed": 1}
    assert first["server"]["failed_conversations"] == {"p4": "server_failed"}
    assert [r["id"] for r in rows(out)] == [i for i in ALL if i != "p4"]
    assert len(asked) == 2 and all("question 4" in prompt for prompt in asked)  # p4's first turn, tried twice
    manifest = manifest_of(out)
    assert manifest["skipped_records"] == first["skipped_records"] and manifest["counts"] == first["counts"]
    assert manifest["server"]["failed_conversations"] == {"p4": "server_failed"}
    assert [r["id"] for r in rows(out)] == [i for i in ALL if i != "p4"]

    healthy = FakeServer(ascii_target)
    args = [a.replace(failing.url, healthy.url) for a in args]
    try:
        generate.run(compose_config(*args))  # a finished stage: nothing is asked again without the setting
        assert completions(healthy) == []
        again = generate.run(compose_config(*args, "generate.retry_failed=true"))
        asked = completions(healthy)
        generate.run(compose_config(*args, "generate.retry_failed=true"))  # nothing left to retry
    finally:
        healthy.stop()
    assert len(asked) == 2 and all("question 4" in prompt for prompt in asked)  # p4's two turns, nothing else
    assert len(completions(healthy)) == 2
    assert rows(again) == want
    manifest = manifest_of(again)
    assert manifest["skipped_records"] == {} and manifest["server"]["failed_conversations"] == {}
    assert manifest["num_conversations"] == 10
    assert manifest["num_generated_tokens"] == sum(sum(r["loss_mask"]) for r in want)


def test_an_empty_shard_of_earlier_code_is_merged_as_nothing(tmp_path):
    """Defect 1's wedge: the code before this fix saved a shard with no surviving conversation as
    a dataset of no rows, which load_from_disk cannot read; the rerun's merge takes it as empty."""
    from pipeline.files import mark

    columns = generate.features(0)
    old = tmp_path / "shard-00000"
    datasets.Dataset.from_dict({name: [] for name in columns}, features=columns).save_to_disk(str(old))
    mark(old, "shard")
    (old / generate.DROPPED).write_text(json.dumps({"server_failed": 1}))
    row = dict(id="p1", source="file", category="", num_turns=1, answers="target", input_ids=[1, 2, 3],
               loss_mask=[0, 1, 1])
    generate.write_shard(tmp_path / "shard-00001", [row], 0, Counter(round_tripped=2))
    generate.write_shard(tmp_path / "shard-00002", [], 0, Counter(server_failed=1), {"p2": "server_failed"})
    merged = generate.merge_shards([tmp_path / f"shard-0000{i}" for i in range(3)], tmp_path / "dataset", 0)
    assert merged.rows == 1 and merged.generated_tokens == 2
    assert merged.counts == Counter(server_failed=2, round_tripped=2)
    assert merged.failed == {"p2": "server_failed"}  # the earlier shard's conversation was not recorded
    assert datasets.load_from_disk(str(tmp_path / "dataset")).to_list() == [row]


@pytest.mark.parametrize("how", ["top_strings", "text_null", "no_logprobs", "id_beyond_vocab", "huge_logprob"])
def test_a_malformed_answer_fails_its_conversation_not_the_run(ascii_target, prompts, tmp_path, how):
    """Defects 2, 4 and 7: an answer that cannot be read (strings for log-probabilities, no text,
    no logprobs), names a token beyond the vocabulary or a log-probability above 0 skips its
    conversation (malformed_answer, not retried: the server would answer the same); nothing of
    it is stored."""
    fake = FakeServer(ascii_target, Faults(mangle={"and then 1": how}), ids=how == "id_beyond_vocab")
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "generate.save_topk_logits=4",
                                                     *server(fake.url))))
    finally:
        fake.stop()
    got = rows(out)
    assert [r["id"] for r in got] == [i for i in ALL if i != "p1"]  # p1's second turn was malformed
    manifest = manifest_of(out)
    assert manifest["skipped_records"] == {"malformed_answer": 1}
    assert manifest["server"]["failed_conversations"] == {"p1": "malformed_answer"}
    assert sum("and then 1" in prompt for prompt in completions(fake)) == 1
    vocab = len(ascii_chat_tokenizer())
    for r in got:
        assert max(r["input_ids"]) < vocab and max(max(top) for top in r["topk_ids"]) < vocab
        assert all(v <= 0 for top in r["topk_logits"] for v in top)  # log-probabilities, -inf for none


def answers_of(row: dict) -> list[str]:
    """The assistant turns of a row, as text (the ASCII tokenizer: one token a character)."""
    text = ascii_chat_tokenizer().decode(row["input_ids"])
    return [re.split(r"<\|im_end\|>|<\|im_start\|>", part)[0] for part in text.split("<|im_start|>assistant\n")[1:]]


@pytest.mark.parametrize("how", ["too_long", "megabytes"])
def test_an_answer_longer_than_asked_is_cut_and_counted(ascii_target, prompts, tmp_path, how):
    """Defect 6: a server returning 140 tokens more than max_tokens, or 10 MB of text, gives
    answers of max_new_tokens tokens, counted (answer_too_long): both of p2's (its first user
    turn is in both prompts)."""
    fake = FakeServer(ascii_target, Faults(mangle={"question 2": how}))
    t0 = time.perf_counter()
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, *server(fake.url))))
    finally:
        fake.stop()
    got = {r["id"]: r for r in rows(out)}
    assert list(got) == ALL
    first, second = answers_of(got["p2"])
    assert len(first) == len(second) == 12  # cut at 12 tokens
    assert all(len(answer) <= 12 for r in got.values() for answer in answers_of(r))
    manifest = manifest_of(out)
    assert manifest["server"]["answer_too_long"] == 2 and manifest["skipped_records"] == {}
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("how", ["empty_stop", "not_spelling"])
def test_a_first_row_with_no_learned_token_ends_the_run_normally(ascii_target, prompts, tmp_path, how, capsys):
    """Defect 3: the first conversation's answers have no learned token (an immediate end of turn
    without logprobs, as llama.cpp gives under top-k; tokens that do not spell the text): the
    stage completes and says so, instead of raising after its manifest is written."""
    fake = FakeServer(ascii_target, Faults(mangle={"question 0": how}))  # both turns' prompts hold it
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, "generate.save_topk_logits=4",
                                                     *server(fake.url))))
    finally:
        fake.stop()
    got = rows(out)
    assert [r["id"] for r in got] == ALL and sum(got[0]["loss_mask"]) == 0
    printed = capsys.readouterr().out
    assert "first regenerated answer (file p1)" in printed  # the first row with a learned token
    assert printed.strip().splitlines()[-1].startswith("generate: 10 conversations")


def test_timeout_s_bounds_the_whole_answer(ascii_target, prompts, tmp_path):
    """Defect 5: a server that trickles its answer a byte at a time never trips a per-read
    timeout; timeout_s bounds the whole request, so the conversation fails after its tries."""
    fake = FakeServer(ascii_target, Faults(trickle=("question 3",), trickle_s=0.05))
    t0 = time.perf_counter()
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, *server(
            fake.url, "generate.server.timeout_s=1", "generate.server.retries=1"))))
    finally:
        fake.stop()
    assert time.perf_counter() - t0 < 30  # two tries of one second, not minutes of trickling
    assert [r["id"] for r in rows(out)] == [i for i in ALL if i != "p3"]
    assert manifest_of(out)["skipped_records"] == {"server_failed": 1}


def test_prompt_auto_is_not_decided_by_transient_failures(ascii_target, prompts, tmp_path):
    """Defect 8: the probe's first two tries answer HTTP 500; that is no refusal of token ids."""
    fake = FakeServer(ascii_target, Faults(fail_requests=2))
    try:
        out = generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, *server(
            fake.url, "generate.server.retries=1"))))
    finally:
        fake.stop()
    assert [r["id"] for r in rows(out)] == ALL
    assert all(isinstance(r["prompt"], list) for r in fake.requests)


def test_secrets_reach_no_message(ascii_target, prompts, tmp_path):
    """Defect 9: a URL's password, a key that cannot go in a header (a newline, a non-ASCII
    character) and a key a server echoes in a refusal are printed nowhere; the bad key is one
    line naming its variable."""
    url_with_password = run_cli("stage=generate", *overrides(ascii_target, prompts, tmp_path, *server(
        "http://user:hunter2@127.0.0.1:9/v1")), cwd=tmp_path)
    assert url_with_password.returncode != 0
    assert "hunter2" not in url_with_password.stdout + url_with_password.stderr
    assert "generate.server.urls" in url_with_password.stderr
    fake = FakeServer(ascii_target, Faults(refuse=("question 2",)))
    try:
        for key in ("sk-abc\nxyz-777", "sk-abc-é-777"):
            bad = run_cli("stage=generate", *overrides(ascii_target, prompts, tmp_path, "run=bad", *server(
                fake.url, "generate.server.api_key_env=SPECDRAFT_TEST_KEY")), cwd=tmp_path,
                env={"SPECDRAFT_TEST_KEY": key})
            said = bad.stdout + bad.stderr
            assert bad.returncode == 1 and "Traceback" not in said and "777" not in said, said[-2000:]
            assert bad.stderr.strip().splitlines()[-1].startswith(
                "error: generate.server.api_key_env=SPECDRAFT_TEST_KEY holds a key that cannot be sent")
        echoed = run_cli("stage=generate", *overrides(ascii_target, prompts, tmp_path, "run=echo", *server(
            fake.url, "generate.server.api_key_env=SPECDRAFT_TEST_KEY")), cwd=tmp_path,
            env={"SPECDRAFT_TEST_KEY": "sk-secret-456"})
    finally:
        fake.stop()
    said = echoed.stdout + echoed.stderr
    assert echoed.returncode == 0, said[-2000:]
    assert "HTTP 401" in said and "sk-secret-456" not in said


def test_a_skip_says_how_many_tries_were_made(ascii_target, prompts, tmp_path, caplog):
    """Defect 10: a refusal (4xx) is not retried, and its skip says one try."""
    fake = FakeServer(ascii_target, Faults(refuse=("question 5",)))
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.data.server"):
            generate.run(compose_config(*overrides(ascii_target, prompts, tmp_path, *server(
                fake.url, "generate.server.retries=3"))))
    finally:
        fake.stop()
    skips = [r.getMessage() for r in caplog.records if "conversation p" in r.getMessage()]
    assert len(skips) == 1 and "p5 skipped after 1 try: HTTP 401" in skips[0], skips


def test_a_resumed_run_finds_its_model_wherever_the_server_lists_it(ascii_target, prompts, tmp_path):
    """Defect 10: the run's finished shards came from tiny-target; after a restart the server lists
    it second, and the resumed run (generate.server.model unset) uses it."""
    dying = FakeServer(ascii_target, Faults(die_after=8))  # the 2 checks, then shard 0's 6 answers
    args = overrides(ascii_target, prompts, tmp_path, *server(dying.url, "generate.server.concurrency=1",
                                                              "generate.server.retries=0"))
    try:
        with pytest.raises(PipelineError, match="no URL answers any more"):
            generate.run(compose_config(*args))
    finally:
        dying.stop()
    assert (tmp_path / "t" / "generate" / "shards" / "shard-00000").is_dir()
    restarted = FakeServer(ascii_target, Faults(models=("another-model", "tiny-target")))
    try:
        out = generate.run(compose_config(*[a.replace(dying.url, restarted.url) for a in args]))
    finally:
        restarted.stop()
    assert [r["id"] for r in rows(out)] == ALL
    assert manifest_of(out)["server"]["model"] == "tiny-target"
    assert {r["model"] for r in restarted.requests} == {"tiny-target"}

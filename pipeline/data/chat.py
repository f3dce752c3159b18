"""Chat formatting: turn conversations into the exact token ids the target conditions on.

Multi-turn regeneration appends to the target's own generated tokens instead of
re-tokenising decoded text, so the stored ids are exactly what the target saw and produced.
The tokens between one answer and the next question come from the chat template itself:
render the conversation with a sentinel as the last answer and keep what follows it.
"""

from __future__ import annotations

from typing import Iterable, Optional

from pipeline.data.sources import Conversation, LoadResult, load_conversations
from pipeline.errors import PipelineError

ANSWER_SENTINEL = "\x00specdraft-answer\x00"


def encode(tokenizer, text: str) -> list[int]:
    # Templates render special tokens as text; encoding maps them back to their ids.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def messages_for(conv: Conversation, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """System message, then user/assistant pairs up to and including user turn `turn`."""
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for i in range(turn + 1):
        messages.append({"role": "user", "content": conv.user_turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def first_prompt_ids(tokenizer, conv: Conversation) -> list[int]:
    text = tokenizer.apply_chat_template(messages_for(conv, 0, []), add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text)


def next_turn_ids(
    tokenizer, conv: Conversation, turn: int, answers: list[str], last_token: int, eos_ids: Iterable[int]
) -> list[int]:
    """The ids that follow the target's answer to turn `turn - 1` and prompt its answer to `turn`.

    `last_token` is the last token the target generated; when it is an end-of-turn token
    that the template would also write, it is not written twice.
    """
    messages = messages_for(conv, turn, answers[: turn - 1] + [ANSWER_SENTINEL])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    _, found, tail = text.rpartition(ANSWER_SENTINEL)
    if not found:
        raise PipelineError(
            "the target's chat template does not copy assistant messages verbatim, so multi-turn "
            "regeneration cannot continue from the target's tokens; set data.max_turns=1"
        )
    if last_token in set(eos_ids):
        eos_text = tokenizer.decode([last_token])
        if tail.startswith(eos_text):
            tail = tail[len(eos_text):]
    return encode(tokenizer, tail)


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    """Every id that ends a turn: the generation config's (int or list; it may be None) and
    the tokenizer's."""
    ids: set[int] = set()
    configured: Optional[object] = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_chat_data(data, tokenizer, max_context: Optional[int] = None) -> LoadResult:
    """The conversations a DataConfig selects; a first prompt longer than data.max_prompt_tokens
    (or than `max_context`) in this tokenizer's chat template is skipped and counted."""
    return load_conversations(
        data.source, data.path, split=data.split, eval_fraction=data.eval_fraction, limit=data.limit,
        per_category=data.per_category, max_prompt_tokens=data.max_prompt_tokens, max_context=max_context,
        prompt_length=lambda c: len(first_prompt_ids(tokenizer, c)),
    )

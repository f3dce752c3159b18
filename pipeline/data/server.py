"""generate.backend=server: the target's answers from OpenAI-compatible serving engines (vLLM,
SGLang, llama.cpp) instead of our decoder, with the rows `local` writes.

Each conversation's turns go in order to one of the URLs through `/completions`, the prompt
our chat template's rendering (the server applies no template of its own) as token ids where
the server takes them (vLLM, SGLang, llama.cpp's C++ server), else as its text
(llama-cpp-python). The answer's text is tokenized again with the target's tokenizer; a token
is kept for learning (loss mask 1) only where it round-trips: the server generated one token
spanning the same characters (or, where the server gives ids, it is that id), since only
there are the stored ids what the target produced and the server's top-k its distribution there.

Top-k comes from `top_logprobs`: log-probabilities are the logits minus one constant per
position (log Σ exp logits), which the KD losses' softmax over the top-k removes, so they are
stored in the top-k logits column unchanged (docs/generate.md; tests/data/test_server.py).

Nothing a server answers can abort, wedge or corrupt a run (tests/data/test_server_faults.py):
every answer is checked where it is read (parse_completion, answer_from) and one that is not
a well-formed completion of known tokens is its conversation's failure (MalformedAnswer), as a
request that keeps failing is (RequestFailed); an answer longer than asked is cut and counted;
timeout_s bounds a whole request; the key and any echo of it are redacted from every message.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import numpy as np

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
TOKEN_ID = re.compile(r"token_id:(\d+)")
"""vLLM's --return-tokens-as-token-ids form of a token."""
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
HEADER_SAFE = re.compile(r"[\x21-\x7e]+")
"""What a bearer token can hold: visible ASCII (a header cannot carry line breaks or other bytes)."""
LOGPROB_SLACK = 1e-3
"""A log-probability above 0 by this much is rounding (fp32 log-softmax of a sure token); above, an error."""
FP16_LOWEST = float(np.finfo(np.float16).min)


class ServerGone(PipelineError):
    """No URL answers any more: the run stops (its finished shards stay) until a restart."""


class RequestFailed(Exception):
    """A conversation's request failed, after its retries where one can help: the conversation
    is skipped and counted under `reason`."""

    reason = "server_failed"

    def __init__(self, message: str, tries: int = 1) -> None:
        super().__init__(message)
        self.tries = tries
        self.turns_left = 0
        """Set by converse: the conversation's planned turns not done."""


class MalformedAnswer(RequestFailed):
    """An answer (HTTP 200) that is not a well-formed completion, or names a token beyond the
    vocabulary or a log-probability above 0. Not retried: the server would answer the same."""

    reason = "malformed_answer"


FAILURES = (RequestFailed.reason, MalformedAnswer.reason)
"""The reasons a conversation is skipped for by the server backend (skipped_records)."""


@dataclass
class Completion:
    text: str
    finished: bool
    """The server stopped at an end of turn (finish_reason "stop"), not at max_tokens."""
    tokens: list[str]
    """The generated tokens as the server names them (their text, or vLLM's token_id:N)."""
    top: list[dict[str, float]]
    """Per generated token, its top_logprobs (token -> log-probability); [] when not asked."""
    offsets: Optional[list[int]] = None
    """Per generated token, where it starts (text_offset, from the prompt's start), if given."""


def first_line(text: str, width: int = 200, secrets: tuple[str, ...] = ()) -> str:
    """`text` on one line, at most `width` characters, each of `secrets` shown as ***."""
    line = str(text)
    for secret in secrets:
        line = line.replace(secret, "***")
    line = " ".join(line.split())
    return line[:width] + ("..." if len(line) > width else "")


def api_key(env: str) -> str:
    """The key in the environment variable `env`, checked to fit in an HTTP header (one line
    naming the variable, never the key, when it does not)."""
    key = os.environ.get(env, "").strip()
    if not key:
        raise PipelineError(f"generate.server.api_key_env={env} but that environment variable is not set")
    if not HEADER_SAFE.fullmatch(key):
        what = ("a line break" if any(c in key for c in "\r\n") else
                "a non-ASCII character" if not key.isascii() else "a space or control character")
        raise PipelineError(f"generate.server.api_key_env={env} holds a key that cannot be sent in an HTTP header "
                            f"(it contains {what}); check that variable")
    return key


@dataclass
class Sent:
    """What became of a request after its tries (Client.send)."""

    status: int
    """The last HTTP status; 0 for no answer (connection error, timeout)."""
    answer: Any
    """Its JSON, or its text, or the error's name."""
    failures: list[str]
    """The failures that were tried again, one line each."""
    tries: int


class Client:
    """The endpoints of generate.server: `check` before the run, `complete` per turn; a request
    that fails is tried again on the next URL after a backoff."""

    def __init__(self, server, *, topk: int, decode: Callable[[list[int]], str]) -> None:
        """decode: token ids -> the prompt's text, for a server that takes text."""
        import httpx

        self.urls = [u.rstrip("/") for u in server.urls]
        self.server, self.topk, self.decode = server, topk, decode
        self.model: Optional[str] = server.model
        self.prompt_ids = server.prompt == "ids"
        headers, self.secrets = {}, ()
        if server.api_key_env:
            key = api_key(server.api_key_env)
            headers["Authorization"] = f"Bearer {key}"
            self.secrets = (key,)
        limits = httpx.Limits(max_connections=server.concurrency, max_keepalive_connections=server.concurrency)
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(server.timeout_s, connect=10.0),
                                      limits=limits)
        self.requests = 0

    async def close(self) -> None:
        await self.http.aclose()

    def line(self, text: Any, width: int = 200) -> str:
        """`text` (an answer, an error) for a message: one line, the key redacted."""
        return first_line(text, width, self.secrets)

    async def check(self, probe: list[int], expected: Optional[str] = None) -> str:
        """Every URL answers /models and serves the model (one line naming the first that does
        not; the model: generate.server.model, else `expected` (the run's finished shards'
        model) wherever the first URL lists it, else the first it lists), the prompt form
        (generate.server.prompt=auto: text only where the first URL refuses token ids by name),
        and a one-token request with the top-k asked for answers with
        log-probabilities on every URL (a k the server refuses is one line naming both)."""
        for url in self.urls:
            served = await self.models(url)
            if self.model is None:
                if not served:
                    raise PipelineError(f"{url}/models lists no model; set generate.server.model=<id>")
                self.model = expected if expected in served else served[0]
            elif served and self.model not in served:
                raise PipelineError(f"{url} serves {', '.join(served[:3])}, not generate.server.model={self.model}")
        tries = self.server.retries + 1
        if self.server.prompt == "auto":
            sent = await self.send(self.body(probe, 1, 0.0, 1.0, None, as_ids=True), [self.urls[0]] * tries,
                                   final=refuses_ids)
            self.prompt_ids = not refuses_ids(sent.status, sent.answer)
            log.info("generate: prompts go to the server as %s", "token ids" if self.prompt_ids else "text")
        for url in self.urls:
            sent = await self.send(self.body(probe, 1, 0.0, 1.0, None), [url] * tries)
            status, answer = sent.status, sent.answer
            if status != 200:
                if self.topk and "logprob" in str(answer).lower():
                    raise PipelineError(f"generate.save_topk_logits={self.topk} is more top_logprobs than {url} "
                                        f"allows (HTTP {status}: {self.line(answer)}); lower it, or raise the "
                                        "server's limit (vLLM: --max-logprobs)")
                raise PipelineError(f"{url}/completions refused a one-token request for {self.model!r}: "
                                    f"{'HTTP ' + str(status) if status else 'no answer'} {self.line(answer)}")
            try:
                choice = answer["choices"][0]
            except (TypeError, KeyError, IndexError):
                raise PipelineError(f"{url}/completions answered {self.line(answer)}: not a completion") from None
            if not isinstance(choice, dict) or choice.get("logprobs") is None:
                raise PipelineError(f"{url}/completions answered without logprobs, which generate needs to check "
                                    "the answer's tokens; use an engine that returns them (vLLM, SGLang, llama.cpp)")
        return self.model

    async def models(self, url: str) -> list[str]:
        import httpx

        try:
            response = await asyncio.wait_for(self.http.get(f"{url}/models"), MODELS_TIMEOUT_S)
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            raise PipelineError(f"generate.server.urls: cannot reach {url}/models ({type(e).__name__}: "
                                f"{self.line(e) or 'no answer'}); start the server or fix the URL") from None
        if response.status_code != 200:
            raise PipelineError(f"generate.server.urls: {url}/models answered HTTP {response.status_code}: "
                                f"{self.line(response.text)}")
        try:
            return [m["id"] for m in response.json().get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            raise PipelineError(f"generate.server.urls: {url}/models answered {self.line(response.text)}: not "
                                "an OpenAI model list") from None

    async def send(self, body: dict, urls: list[str], final: Optional[Callable[[int, Any], bool]] = None) -> Sent:
        """`body` to urls[0], then, after a backoff of 1, 2, 4 ... × backoff_s, to urls[1], ...
        while the failure may pass (no answer within timeout_s, HTTP 5xx, 429) and `final`
        (status, answer) does not say it will not."""
        import httpx

        failures = []
        for attempt, url in enumerate(urls):
            if attempt:
                await asyncio.sleep(self.server.backoff_s * 2 ** (attempt - 1))
            try:  # timeout_s bounds the whole answer: httpx's own timeouts bound each read only
                response = await asyncio.wait_for(self.http.post(f"{url}/completions", json=body),
                                                  self.server.timeout_s)
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                status, answer = 0, type(e).__name__
            else:
                try:
                    status, answer = response.status_code, response.json()
                except ValueError:
                    status, answer = response.status_code, response.text
            if status and (status not in RETRY_STATUS or (final is not None and final(status, answer))):
                break
            failures.append(f"{url}: {f'HTTP {status}' if status else answer}")
        return Sent(status, answer, failures, attempt + 1)

    def body(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: Optional[int],
             as_ids: Optional[bool] = None) -> dict:
        """The request: the prompt as ids or as its text (as_ids; None: as the server takes it)."""
        as_ids = self.prompt_ids if as_ids is None else as_ids
        body = dict(model=self.model, prompt=prompt if as_ids else self.decode(prompt), max_tokens=max_tokens,
                    temperature=temperature, top_p=top_p, logprobs=max(self.topk, 1), stream=False)
        if seed is not None:
            body["seed"] = seed
        return body

    async def complete(self, prompt: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       seed: Optional[int]) -> Completion:
        first = self.requests
        self.requests += 1
        urls = [self.urls[(first + attempt) % len(self.urls)] for attempt in range(self.server.retries + 1)]
        sent = await self.send(self.body(prompt, max_tokens, temperature, top_p, seed), urls)
        if sent.status == 200:
            try:
                return parse_completion(sent.answer)
            except MalformedAnswer as e:
                raise MalformedAnswer(self.line(e), sent.tries) from None
        if sent.status and sent.status not in RETRY_STATUS:  # refused (4xx): no try would pass
            raise RequestFailed(f"HTTP {sent.status} {self.line(sent.answer)}", sent.tries)
        if not await self.any_alive():
            raise ServerGone(f"generate.server: no URL answers any more ({self.line('; '.join(sent.failures[-2:]))})")
        raise RequestFailed(self.line("; ".join(sent.failures[-3:]), 400), sent.tries)

    async def any_alive(self) -> bool:
        import httpx

        for url in self.urls:
            try:
                if (await asyncio.wait_for(self.http.get(f"{url}/models"), MODELS_TIMEOUT_S)).status_code == 200:
                    return True
            except (httpx.HTTPError, asyncio.TimeoutError):
                pass
        return False


MODELS_TIMEOUT_S = 10.0
"""The longest wait for /models (the start's checks, and whether any URL is alive)."""


def refuses_ids(status: int, answer: Any) -> bool:
    """Whether a server's answer to a prompt of token ids refuses them: an HTTP error that names
    the prompt (llama-cpp-python answers 500 with its validation errors: body.prompt must be a
    string). An error that names nothing (a server starting, busy or gone) is tried again like
    any, and says nothing of the prompt form."""
    return status >= 400 and "prompt" in str(answer).lower()


def parse_completion(answer: Any) -> Completion:
    """A /completions answer, its logprobs in the completions form (tokens, top_logprobs,
    text_offset: vLLM, SGLang, llama-cpp-python) or the chat form (content: llama.cpp's server),
    checked: MalformedAnswer where a part is missing or of the wrong type, or a log-probability
    is not a number <= 0 (-inf, no probability, is one). Logprobs may be absent only from an
    empty answer."""
    try:
        choice = answer["choices"][0]
        text, logprobs = choice["text"], choice.get("logprobs")
        if not isinstance(text, str):
            raise MalformedAnswer(f"its text is {type(text).__name__}, not a string")
        if logprobs is None and text:
            raise MalformedAnswer("it has no logprobs")
        logprobs = logprobs or {}
        if "content" in logprobs:
            entries = logprobs["content"] or []
            tokens = [e["token"] for e in entries]
            top = [{t["token"]: log_probability(t["logprob"]) for t in e.get("top_logprobs") or []} for e in entries]
            offsets = None
        else:
            tokens = list(logprobs.get("tokens") or [])
            top = [{t: log_probability(v) for t, v in (row or {}).items()} for row in logprobs.get("top_logprobs") or []]
            offsets = logprobs.get("text_offset")
        finished = choice.get("finish_reason") == "stop"
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        raise MalformedAnswer(f"not a completion ({type(e).__name__}: {e})") from None
    if not all(isinstance(t, str) for t in tokens) or not all(isinstance(t, str) for row in top for t in row):
        raise MalformedAnswer("a token is not a string")
    if offsets is not None and not (isinstance(offsets, list) and all(type(o) is int for o in offsets)):
        raise MalformedAnswer("its text_offset is not a list of integers")
    return Completion(text=text, finished=finished, tokens=tokens, top=top, offsets=offsets)


def log_probability(value: Any) -> float:
    """A log-probability from an answer: a number <= 0 (rounding's few 1e-4 above are 0), -inf
    for none; anything else is a MalformedAnswer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedAnswer(f"a log-probability is {value!r}, not a number")
    if math.isnan(value) or value > LOGPROB_SLACK:
        raise MalformedAnswer(f"a log-probability is {value!r}, not <= 0")
    return min(float(value), 0.0)


class Pieces:
    """The server's token strings mapped back to ids: vLLM's token_id:N, or a text that exactly
    one id of the target's tokenizer decodes to (the whole vocabulary decoded once, when a
    text first needs it: top-k alternatives)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        """Ids the tokenizer decodes: an answer's ids must be, for the next turn's prompt to be its text."""

    @functools.cached_property
    def id_of(self) -> dict[str, int]:
        texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        counts = Counter(texts)
        return {t: i for i, t in enumerate(texts) if counts[t] == 1 and t}

    @functools.cached_property
    def longest(self) -> int:
        """The most characters one token spells (its vocabulary string's length bounds its text's)."""
        return max(map(len, self.tokenizer.get_vocab()))

    def id(self, token: str) -> Optional[int]:
        """The id `token` names; None for a text no single id decodes to; MalformedAnswer for a
        token_id:N beyond the vocabulary."""
        named = TOKEN_ID.fullmatch(token)
        if not named:
            return self.id_of.get(token)
        i = int(named.group(1))
        if i >= self.vocab_size:
            raise MalformedAnswer(f"it names {token}, beyond the vocabulary of {self.vocab_size}")
        return i


@dataclass
class Answer:
    ids: list[int]
    mask: list[int]
    """1 where the token round-trips (learned), 0 where it does not."""
    topk_ids: Optional[np.ndarray] = None
    """[sum(mask), k] int32 / float16, the server's top_logprobs at the learned tokens."""
    topk_logits: Optional[np.ndarray] = None


def token_ends(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """The target's tokens of `text` and the character offset where each ends (the fast
    tokenizer's offsets; a slow one's by decoding growing prefixes)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [end for _, end in encoded["offset_mapping"]]
    except NotImplementedError:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]


def server_spans(completion: Completion) -> Optional[list[tuple[int, int]]]:
    """Where each of the server's tokens lies in its text: from the tokens themselves where they
    spell the text, else from text_offset; None when neither says."""
    tokens, text = completion.tokens, completion.text
    if "".join(tokens) == text:
        starts = [0]
        for t in tokens:
            starts.append(starts[-1] + len(t))
        return list(zip(starts, starts[1:]))
    if completion.offsets and len(completion.offsets) == len(tokens):
        starts = [o - completion.offsets[0] for o in completion.offsets]
        return list(zip(starts, [*starts[1:], len(text)]))
    return None


def answer_from(completion: Completion, pieces: Pieces, tokenizer, eos_ids: set[int], end_of_turn: int, topk: int,
                counts: Counter, max_new_tokens: Optional[int] = None) -> Answer:
    """The answer as target token ids with its loss mask (and top-k rows for the learned
    tokens), counting in `counts` round_tripped / not_round_tripped tokens, the learned ones
    left out for want of a top-k (without_topk; a row of no probability would make the KD
    losses NaN), ends of turn without logprobs, and answers cut (answer_too_long).

    Server ids (vLLM's token_id:N) are the answer itself. Otherwise the text is tokenized
    again, and a token round-trips where the server generated exactly one token over the same
    characters: both tokenizations cut the text at its start and at its end, with no cut in
    between (the bytes of one character, cut in several tokens, never round-trip). A finished
    answer ends with an end-of-turn token, as a local one does: the server's own stop id where
    it lists it, else the template's; its top-k is the server's entry after the text (a stop
    id, or a trailing token of no text) where there is one. An answer of more than
    max_new_tokens tokens (a server that ignored max_tokens) is cut to them, without an end of
    turn: only the characters that many tokens can spell are tokenized.
    """
    tokens, text, finished = completion.tokens, completion.text, completion.finished
    limit = max_new_tokens
    too_long = limit is not None and len(text) > limit * pieces.longest
    top_of: list[Optional[int]] = []  # per answer token: its index among the server's tokens (None: no round trip)
    end_id, end_top = end_of_turn, None
    if tokens and all(TOKEN_ID.fullmatch(t) for t in tokens):
        ids = [pieces.id(t) for t in tokens]
        top_of = list(range(len(ids)))
        if finished and ids[-1] in eos_ids:
            end_id, end_top = ids[-1], len(ids) - 1
            ids, top_of = ids[:-1], top_of[:-1]
    else:
        ids, ends = token_ends(tokenizer, text[: limit * pieces.longest] if too_long else text)
        spans = server_spans(completion) or []
        starting = {}
        for j, (start, end) in enumerate(spans):
            if end > start:
                starting.setdefault(start, (j, end))
            elif start >= len(text) and end_top is None:
                end_top = j  # a token of no text after the answer: the stop token
        cut = 0
        for i, end in enumerate(ends):
            j, server_end = starting.get(cut, (None, None))
            alone = end > cut and (i + 1 == len(ends) or ends[i + 1] > end)  # not one of several bytes of a character
            top_of.append(j if alone and server_end == end else None)
            cut = max(cut, end)
    if limit is not None and len(ids) + finished > limit:
        too_long = True
    if too_long:
        ids, top_of, finished = ids[:limit], top_of[:limit], False
        counts["answer_too_long"] += 1
    counts["not_round_tripped"] += sum(j is None for j in top_of)
    if finished:
        ids.append(end_id)
        learnable = not topk or (end_top is not None and end_top < len(completion.top))
        top_of.append(end_top if learnable else None)
        counts["end_of_turn_without_logprobs"] += not learnable
    mask = [int(j is not None) for j in top_of]
    answer = Answer(ids, mask)
    if topk:
        learned = [t for t, m in enumerate(mask) if m]
        top_ids, top_values = top_arrays([completion.top[top_of[t]] if top_of[t] < len(completion.top) else {}
                                          for t in learned], pieces, topk)
        some = np.isfinite(top_values).any(axis=1)
        for t in (t for t, has in zip(learned, some) if not has):
            mask[t] = 0
        counts["without_topk"] += int((~some).sum())
        answer.topk_ids, answer.topk_logits = top_ids[some], top_values[some]
    counts["round_tripped"] += sum(mask[: len(mask) - finished])
    return answer


def top_arrays(rows: list[dict[str, float]], pieces: Pieces, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[len(rows), k] ids and log-probabilities, best first; an alternative whose token maps to
    no single id, or a row with fewer than k, is filled with -inf (no probability). Values are
    checked log-probabilities (parse_completion); those below fp16's range are stored as its
    lowest, not as -inf."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    values = np.full((len(rows), k), -np.inf, dtype=np.float16)
    for r, top in enumerate(rows):
        mapped = sorted(((lp, i) for t, lp in top.items() if math.isfinite(lp) and (i := pieces.id(t)) is not None),
                        reverse=True)
        seen = set()
        col = 0
        for lp, i in mapped:
            if i in seen or col == k:
                continue
            seen.add(i)
            ids[r, col], values[r, col] = i, max(lp, FP16_LOWEST)
            col += 1
    return ids, values


async def run_all(items: list, work: Callable[[object], Awaitable[None]], concurrency: int) -> None:
    """work(item) for every item, at most `concurrency` at once; the first ServerGone (or any
    other error) cancels the rest and is raised."""
    queue = iter(items)

    async def worker() -> None:
        for item in queue:
            await work(item)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(items)))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Settings:
    """What every conversation of a run is generated with."""

    tokenizer: object
    pieces: Pieces
    max_new_tokens: int
    temperature: float
    top_p: float
    max_length: int
    max_turns: Optional[int]
    topk: int
    end_of_turn: int
    eos_ids: set[int]
    seed: int


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    import hashlib

    return int(hashlib.sha256(f"{seed}/{conv_id}/{turn}".encode()).hexdigest()[:7], 16)


async def converse(client: Client, conv, s: Settings, counts: Counter,
                   progress: Optional[Callable[[int, int], None]] = None) -> Optional[dict]:
    """One conversation, its turns in order (each sees the target's earlier answers): its row
    as the local backend writes it, or None when its first turn does not fit max_length. Adds
    to `counts` (cut turns, whole conversations dropped, round trips) once it is done; a
    RequestFailed it raises (MalformedAnswer for anything in an answer it cannot take) says in
    `turns_left` how many planned turns it did not do."""
    from pipeline.data.chat import first_prompt_ids, next_turn_ids

    tok = s.tokenizer
    num_turns = min(len(conv.user_turns), s.max_turns or len(conv.user_turns))
    ids, mask, answers = [], [], []
    top_ids, top_logits = [], []
    mine = Counter()
    done = 0
    for turn in range(num_turns):
        if turn == 0:
            new = first_prompt_ids(tok, conv)
        else:
            new = next_turn_ids(tok, conv, turn, answers, ids[-1], s.eos_ids)
        if len(ids) + len(new) + s.max_new_tokens > s.max_length:
            mine["turns_cut_by_max_length"] += num_turns - turn
            mine["too_long_for_max_length"] += turn == 0
            if progress:
                progress(num_turns - turn, 0)
            break
        context = ids + new
        try:
            completion = await client.complete(context, max_tokens=s.max_new_tokens, temperature=s.temperature,
                                               top_p=s.top_p, seed=turn_seed(s.seed, conv.id, turn))
            try:
                answer = answer_from(completion, s.pieces, tok, s.eos_ids, s.end_of_turn, s.topk, mine,
                                     s.max_new_tokens)
            except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # whatever else an answer holds
                raise MalformedAnswer(client.line(f"{type(e).__name__}: {e}")) from None
        except RequestFailed as e:
            e.turns_left = num_turns - turn
            raise
        mask += [0] * len(new) + answer.mask
        ids = context + answer.ids
        answers.append(tok.decode(answer.ids, skip_special_tokens=True))
        if s.topk:
            top_ids.append(answer.topk_ids)
            top_logits.append(answer.topk_logits)
        done += 1
        if progress:
            progress(1, len(answer.ids))
    counts.update(mine)
    if not done:
        return None
    row = dict(id=conv.id, source=conv.source, category=conv.category, num_turns=done, answers="target",
               input_ids=ids, loss_mask=mask)
    if s.topk:
        row["topk_ids"] = np.concatenate(top_ids)
        row["topk_logits"] = np.concatenate(top_logits)
    return row


def generate_shards(server, shards: dict[int, list], s: Settings,
                    write: Callable[[int, list[dict], Counter, dict[str, str], str], None], probe: list[int],
                    progress: Optional[Callable[[int, int], None]] = None, expected_model: Optional[str] = None) -> str:
    """Check the endpoints (Client.check, with the prompt ids `probe`), then every conversation
    of `shards` (index -> conversations) through them, at most server.concurrency in flight;
    write(index, rows in order, counts, failed conversations {id: reason}, model id) as each
    shard completes. A conversation whose request still fails after its retries, or whose answer
    is malformed, is skipped and counted (FAILURES); ServerGone stops the run, the shards
    written so far stay. The served model must be `expected_model` (the one the run's finished
    shards came from) where that is given. Returns the model id."""
    order = [(index, position, conv) for index, convs in shards.items() for position, conv in enumerate(convs)]
    rows = {index: [None] * len(convs) for index, convs in shards.items()}
    left = {index: len(convs) for index, convs in shards.items()}
    counts = {index: Counter() for index in shards}
    failed = {index: {} for index in shards}

    async def main() -> str:
        client = Client(server, topk=s.topk, decode=s.tokenizer.decode)
        model = ""

        async def one(item) -> None:
            index, position, conv = item
            try:
                rows[index][position] = await converse(client, conv, s, counts[index], progress)
            except RequestFailed as e:
                counts[index][e.reason] += 1
                failed[index][conv.id] = e.reason
                if progress:
                    progress(e.turns_left, 0)
                log.warning("generate: conversation %s skipped after %d %s: %s", conv.id, e.tries,
                            "try" if e.tries == 1 else "tries", e)
            left[index] -= 1
            if not left[index]:
                write(index, [r for r in rows[index] if r is not None], counts[index], failed[index], model)

        try:
            model = await client.check(probe, expected_model)
            if expected_model is not None and model != expected_model:
                raise PipelineError(f"generate: this run's finished shards came from {expected_model}, the server "
                                    f"now serves {model}; serve that model again, or start another run=<name>")
            log.info("generate: %s from %s, %d conversations in flight", model, ", ".join(client.urls),
                     server.concurrency)
            await run_all(order, one, server.concurrency)
            return model
        finally:
            await client.close()

    return asyncio.run(main())

"""A small OpenAI-compatible completions server on 127.0.0.1 for the server backend's tests:
it answers with a real (tiny) target's greedy continuation and its top log-probabilities, as
llama.cpp does (token texts, no ids; or vLLM's token_id:N with ids=True), and fails on purpose
where told: HTTP 500s, dropped connections, slow or trickled answers, refusals, death after N
answers, and answers that are malformed in the ways real servers' are (MANGLES)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets
import pytest
import torch

from conftest import byte_chat_tokenizer, make_tiny_target, write_jsonl


@dataclass
class Faults:
    fail_first: int = 0
    """Every prompt's first n requests answer HTTP 500."""
    drop_first: int = 0
    """... or drop the connection without an answer."""
    slow_first: int = 0
    """... or answer only after `slow_s`."""
    slow_s: float = 0.0
    always_fail: tuple[str, ...] = ()
    """A prompt containing one of these texts always answers HTTP 500."""
    die_after: int = 0
    """Stop listening after this many answers (0: never)."""
    max_logprobs: int = 20
    delay_s: float = 0.0
    """Every answer waits this long (a server busy with others)."""
    fail_requests: int = 0
    """The server's first n completion requests, whatever their prompt, answer HTTP 500."""
    refuse: tuple[str, ...] = ()
    """A prompt containing one of these texts is refused: HTTP 401, the request's Authorization echoed."""
    trickle: tuple[str, ...] = ()
    """The answer to a prompt containing one of these texts comes one byte every trickle_s."""
    trickle_s: float = 0.05
    mangle: dict = field(default_factory=dict)
    """Prompt text -> one of MANGLES: the answer to a prompt containing it is malformed that way."""
    models: tuple[str, ...] = ("tiny-target",)
    """What /models lists."""
    seen: dict = field(default_factory=dict)
    answered: int = 0
    requests: int = 0


MANGLES = ("top_strings", "text_null", "no_logprobs", "id_beyond_vocab", "huge_logprob", "too_long",
           "megabytes", "empty_stop", "not_spelling")
"""What a mangled 200 answer does: top_logprobs values as strings; "text": null; no logprobs; a
token_id:N beyond the vocabulary; a log-probability of 1e6; 140 tokens more than max_tokens; 10 MB
more text than its tokens; an immediate end of turn (no text, no token: llama.cpp under top-k);
tokens that do not spell the text, without text_offset."""


class FakeServer:
    def __init__(self, target_dir, faults: Faults | None = None, ids: bool = False, text_prompts: bool = False,
                 port: int = 0) -> None:
        """ids: name tokens token_id:N (vLLM); text_prompts: refuse token-id prompts with HTTP 422
        (llama-cpp-python)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        self.faults, self.ids, self.text_prompts, self.lock = faults or Faults(), ids, text_prompts, threading.Lock()
        self.requests: list[dict] = []
        self.dead = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def reply(self, status: int, body: dict, trickle_s: float = 0.0) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not trickle_s:
                    self.wfile.write(data)
                    return
                for byte in data:  # each read of the client's gets a byte well within any read timeout
                    if server.dead:
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(trickle_s)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self.reply(200, {"object": "list",
                                     "data": [{"id": m, "object": "model"} for m in server.faults.models]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer, trickle_s = server.answer(body, self)
                if status is None:  # dropped
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.reply(status, answer, trickle_s)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a connection this server or the client dropped on purpose

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.dead = True  # kept-alive connections get no more answers either
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, body: dict, handler):
        f = self.faults
        if self.dead:
            return None, None, 0.0
        if isinstance(body["prompt"], list):
            if self.text_prompts:
                return 422, {"detail": [{"loc": ["body", "prompt"], "msg": "Input should be a valid string"}]}, 0.0
            ids, prompt = body["prompt"], self.tok.decode(body["prompt"])
        else:
            prompt = body["prompt"]
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        with self.lock:
            self.requests.append({**body, "text": prompt})
            tries = f.seen[prompt] = f.seen.get(prompt, 0) + 1
            f.requests += 1
            failing = f.requests <= f.fail_requests
        if failing:
            return 500, {"error": "warming up"}, 0.0
        if any(text in prompt for text in f.refuse):
            return 401, {"error": f"not authorized: {handler.headers.get('Authorization')}"}, 0.0
        if body.get("logprobs") and body["logprobs"] > f.max_logprobs:
            return 400, {"error": {"message": f"logprobs {body['logprobs']} > max_logprobs {f.max_logprobs}"}}, 0.0
        if any(text in prompt for text in f.always_fail):
            return 500, {"error": "internal"}, 0.0
        if tries <= f.fail_first:
            return 500, {"error": "internal"}, 0.0
        if tries <= f.fail_first + f.drop_first:
            return None, None, 0.0
        if tries <= f.fail_first + f.drop_first + f.slow_first:
            time.sleep(f.slow_s)
        time.sleep(f.delay_s)
        text, tokens, tops, finish = self.decode(ids, body["max_tokens"], body.get("logprobs") or 0)
        with self.lock:
            f.answered += 1
            if f.die_after and f.answered >= f.die_after:
                threading.Thread(target=self.stop, daemon=True).start()
        logprobs = dict(tokens=tokens, top_logprobs=tops) if body.get("logprobs") else None
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        for part, how in f.mangle.items():
            if part in prompt:
                self.malform(choice, how)
        trickle_s = f.trickle_s if any(text in prompt for text in f.trickle) else 0.0
        return 200, {"id": "cmpl", "object": "text_completion", "model": body["model"], "choices": [choice]}, trickle_s

    def malform(self, choice: dict, how: str) -> None:
        """Break an answer the way `how` (one of MANGLES) says."""
        logprobs = choice["logprobs"]
        if how == "top_strings":
            logprobs["top_logprobs"] = [{t: str(v) for t, v in top.items()} for top in logprobs["top_logprobs"]]
        elif how == "text_null":
            choice["text"] = None
        elif how == "no_logprobs":
            choice["logprobs"] = None
        elif how == "id_beyond_vocab":
            logprobs["tokens"][0] = f"token_id:{len(self.tok) + 5}"
        elif how == "huge_logprob":
            top = logprobs["top_logprobs"][0]
            top[next(iter(top))] = 1e6
        elif how == "too_long":
            choice["text"] += self.tok.decode([self.z]) * 140
            logprobs["tokens"] += [self.name(self.z)] * 140
            logprobs["top_logprobs"] += [{self.name(self.z): -0.5}] * 140
            choice["finish_reason"] = "length"
        elif how == "megabytes":  # the tokens listed are the answer's; the text goes on
            choice.update(text=choice["text"] + "z" * 10_000_000, finish_reason="length")
        elif how == "empty_stop":
            choice.update(text="", finish_reason="stop", logprobs=dict(tokens=[], top_logprobs=[]))
        elif how == "not_spelling":
            logprobs["tokens"] = ["\ufffd"] * len(logprobs["tokens"])
        else:
            raise ValueError(f"no such mangle: {how}")

    @property
    def z(self) -> int:
        return self.tok.convert_tokens_to_ids("z")

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.ids else self.tok.decode([token])

    @torch.inference_mode()
    def decode(self, ids: list[int], max_tokens: int, k: int):
        """Greedy, as llama.cpp: the end-of-turn token ends the text and is not in it; with
        ids (vLLM) it is the last token listed."""
        eos = self.tok.eos_token_id
        out, tokens, tops, finish = [], [], [], "length"
        for _ in range(max_tokens):
            logprobs = torch.log_softmax(self.model(torch.tensor([ids + out])).logits[0, -1].float(), dim=-1)
            token = int(logprobs.argmax())
            top = logprobs.topk(max(k, 1))
            entry = {self.name(int(i)): float(v) for v, i in zip(top.values, top.indices)}
            if token == eos:
                finish = "stop"
                if self.ids:
                    tokens.append(self.name(token))
                    tops.append(entry)
                break
            out.append(token)
            tokens.append(self.name(token))
            tops.append(entry)
        return self.tok.decode(out), tokens, tops, finish


def ascii_chat_tokenizer():
    """Printable ASCII and newline, one token each, and ChatML specials: every token's text is
    its own, so a greedy answer's text tokenizes back to the same ids."""
    return byte_chat_tokenizer("".join(map(chr, range(32, 127))) + "\n")


def make_ascii_target(folder: Path) -> Path:
    """A tiny random Llama over ascii_chat_tokenizer, saved in `folder`: the target the tests' servers run."""
    def end_early(model, tok) -> None:  # the end of turn wins where "|" would, so some answers end early
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[tok.convert_tokens_to_ids("|")]

    # initializer_range 0.3: varied answers (at 0.02 a random model repeats one token)
    return make_tiny_target(folder, seed=1, tokenizer=ascii_chat_tokenizer(), edit=end_early, initializer_range=0.3)


@pytest.fixture(scope="module")
def ascii_target(tmp_path_factory) -> Path:
    """make_ascii_target, once per test module (import it there: `from fake_server import ascii_target`)."""
    return make_ascii_target(tmp_path_factory.mktemp("ascii_target"))


@pytest.fixture
def prompts(tmp_path) -> Path:
    return ten_prompts(tmp_path)


def ten_prompts(folder: Path) -> Path:
    """Ten two-turn conversations p0..p9: "question i" (and i % 3 question marks), then "and then i"."""
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}" + "?" * (i % 3)},
                                            {"role": "assistant", "content": "an answer"},
                                            {"role": "user", "content": f"and then {i}"}]}
               for i in range(10)]
    return write_jsonl(folder / "prompts.jsonl", records)


def overrides(target, data, runs, *extra):
    """stage=generate on `target` and `data` in `runs`, run=t, 12 new tokens, 3 conversations a shard."""
    return ["target=hf", f"target.name_or_path={target}", "data=file", f"data.path={data}", f"runs_dir={runs}",
            "run=t", "generate.max_new_tokens=12", "generate.shard_size=3", *extra]


def server(url, *extra):
    return ["generate.backend=server", f"generate.server.urls=[{url}]", "generate.server.backoff_s=0.05", *extra]


def rows(out: Path) -> list[dict]:
    return datasets.load_from_disk(str(out / "dataset")).to_list()

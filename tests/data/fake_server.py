"""A small OpenAI-compatible completions server on 127.0.0.1 for the server backend's tests:
it answers with a real (tiny) target's greedy continuation and its top log-probabilities, as
llama.cpp does (token texts, no ids; or vLLM's token_id:N with ids=True), and fails on purpose
where told: HTTP 500s, dropped connections, slow answers, death after N answers."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


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
    seen: dict = field(default_factory=dict)
    answered: int = 0


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

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": "tiny-target", "object": "model"}]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = server.answer(body, self)
                if status is None:  # dropped
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.reply(status, answer)

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
            return None, None
        if isinstance(body["prompt"], list):
            if self.text_prompts:
                return 422, {"detail": [{"loc": ["body", "prompt"], "msg": "Input should be a valid string"}]}
            ids, prompt = body["prompt"], self.tok.decode(body["prompt"])
        else:
            prompt = body["prompt"]
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        with self.lock:
            self.requests.append({**body, "text": prompt})
            tries = f.seen[prompt] = f.seen.get(prompt, 0) + 1
        if body.get("logprobs") and body["logprobs"] > f.max_logprobs:
            return 400, {"error": {"message": f"logprobs {body['logprobs']} > max_logprobs {f.max_logprobs}"}}
        if any(text in prompt for text in f.always_fail):
            return 500, {"error": "internal"}
        if tries <= f.fail_first:
            return 500, {"error": "internal"}
        if tries <= f.fail_first + f.drop_first:
            return None, None
        if tries <= f.fail_first + f.drop_first + f.slow_first:
            time.sleep(f.slow_s)
        time.sleep(f.delay_s)
        text, tokens, tops, finish = self.decode(ids, body["max_tokens"], body.get("logprobs") or 0)
        with self.lock:
            f.answered += 1
            if f.die_after and f.answered >= f.die_after:
                threading.Thread(target=self.stop, daemon=True).start()
        logprobs = dict(tokens=tokens, top_logprobs=tops) if body.get("logprobs") else None
        return 200, {"id": "cmpl", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

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

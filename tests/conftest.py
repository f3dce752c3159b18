"""Shared fixtures: a tiny random Llama target with a byte-level chat tokenizer, built in code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for the network
os.environ.setdefault("WANDB_MODE", "offline")
# Without CUDA, Triton kernels run under Triton's interpreter on CPU tensors. It must be set
# before anything imports Triton (its own library functions are built at import); it does not
# make our dispatchers choose Triton on CPU (only SPECDRAFT_KERNELS=triton does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_module(name: str):
    """A pipeline/kernels Triton module, for the kernel tests (compiled where CUDA is, else
    interpreted: see TRITON_INTERPRET above)."""
    import importlib

    pytest.importorskip("triton")
    return importlib.import_module(name)


def kernel_device() -> torch.device:
    """Where the Triton kernels run in the tests: the GPU, or the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def free_port() -> int:
    """A TCP port free right now, for a test's process group: the launchers' fixed default
    (29500) collides with any other process group on the machine, another test run's included."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_chat_tokenizer(chars: str | None = None):
    """A ByteLevel tokenizer with one token per byte (or per character of `chars`, printable
    ASCII or newline, in that order) and ChatML specials; no merges, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chars is None:
        vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    else:  # GPT-2's printable character for each byte: itself, or 256 + n for the n-th other
        others = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
        level = {b: chr(256 + others.index(b)) if b in others else chr(b) for b in range(256)}
        vocab = {level[ord(ch)]: i for i, ch in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                             "additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    return fast


def kill_9_when(proc: subprocess.Popen, done, timeout: float = 300) -> None:
    """SIGKILL `proc` as soon as done() (or it ended, or `timeout` passed), and reap it."""
    import time

    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()
    proc.wait()


def tiny_llama(seed: int, layers: int = 2, vocab: int = 32):
    """A random Llama of `layers` layers, 32 wide, 4 query / 2 key-value heads, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def make_tiny_target(folder: Path, seed: int = 0, layers: int = 2, tokenizer=None, edit=None, **config) -> Path:
    """A random Llama of `layers` layers, 32 wide, over `tokenizer` (byte_chat_tokenizer()), saved
    with it in `folder`; `edit(model, tokenizer)` changes its weights first, `config` its config."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or byte_chat_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **config,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if edit is not None:
        with torch.no_grad():
            edit(model, tokenizer)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("specdraft_cache")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture
def chat_file(tmp_path) -> Path:
    """Twelve usable records in every accepted shape, plus three bad ones."""
    records = []
    for i in range(12):
        kind = i % 3
        if kind == 0:
            records.append({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": f"follow-up {i}"}]})
        elif kind == 1:
            records.append({"id": f"s{i}", "conversations": [{"from": "human", "value": f"sharegpt {i}"}]})
        else:
            records.append({"prompt": f"plain prompt {i}", "category": "plain"})
    records += ["{not json", {"messages": "not a list"}, {"prompt": "   "}]
    return write_jsonl(tmp_path / "chat.jsonl", records)


def compose_config(*overrides: str, stage: str = "generate"):
    """The validated Config that `python -m pipeline stage=<stage> <overrides>` would run."""
    from hydra import compose, initialize_config_dir

    from pipeline.__main__ import CONF_DIR
    from pipeline.config import to_config

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        chosen = [] if any(o.startswith("stage=") for o in overrides) else [f"stage={stage}"]
        cfg = compose(config_name="config", overrides=[*chosen, *overrides])
    return to_config(cfg)


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )

"""Kernels for decoding: each operation as a Triton kernel beside a plain-PyTorch reference of
the same signature, and a function that picks one (`backend`).

- acceptance.py: the lossless acceptance rules over w positions in one launch per batch
  (greedy match; rejection sampling with its residual distribution), returning the accepted
  length and the next token;
- tree_attention.py: attention of w query tokens against a static KV cache whose rows hold
  different lengths, the w new tokens masked by a token tree (a chain is the causal tree);
- linear.py: CPU-only layouts (small-batch linear products, int8 drafts). Grouped-query
  attention reads the static cache's shared heads as they are (SDPA's enable_gqa).

Triton runs on CUDA tensors; on CPU tensors only under `TRITON_INTERPRET=1` (its interpreter:
slow, for tests) with `SPECDRAFT_KERNELS=triton`, which forces it (`torch` forces the
references). This package
imports nothing else of ours: the decoder and the stages build on it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend(tensor: torch.Tensor) -> str:
    """"triton" for CUDA tensors where Triton is installed, else "torch";
    SPECDRAFT_KERNELS=torch|triton forces one (triton on CPU tensors needs TRITON_INTERPRET=1)."""
    forced = os.environ.get("SPECDRAFT_KERNELS", "")
    if forced not in ("", "torch", "triton"):
        raise ValueError(f"SPECDRAFT_KERNELS={forced!r}: choose torch or triton")
    if forced == "triton":
        if not triton_available() or (tensor.device.type != "cuda" and not interpreting()):
            raise ValueError("SPECDRAFT_KERNELS=triton needs Triton, and CUDA tensors or TRITON_INTERPRET=1")
        return "triton"
    if forced == "torch" or not triton_available():
        return "torch"
    return "triton" if tensor.device.type == "cuda" else "torch"

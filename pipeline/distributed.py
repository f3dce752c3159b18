"""Processes: one on a laptop, N under `accelerate launch` or `torchrun`, on CPUs or GPUs."""

from __future__ import annotations

import datetime

import torch


def process_state():
    """accelerate's PartialState: rank, world size and a barrier (gloo on CPUs, nccl on GPUs)."""
    from accelerate import PartialState

    # Ranks wait for each other only at stage ends; a slow rank must not time the others out.
    return PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(hours=12))


def native_bf16(device_type: str) -> bool:
    """Whether this machine computes bfloat16 natively: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX. Elsewhere (an AVX2 laptop, say) bf16 autocast is emulated and many
    times slower than fp32 (`make bench-train` measures both)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
        return any(check is not None and check() for check in checks)
    return False


def resolve_precision(precision: str, device_type: str) -> str:
    """fp32 or bf16 as given; auto: bf16 where the device computes it natively, else fp32."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device_type) else "fp32"

"""Processes: one on a laptop, N under `accelerate launch` or `torchrun`, on CPUs or GPUs."""

from __future__ import annotations

import datetime

import torch


def process_state():
    """accelerate's PartialState: rank, world size and a barrier (gloo on CPUs, nccl on GPUs)."""
    from accelerate import PartialState

    # Ranks wait for each other only at stage ends; a slow rank must not time the others out.
    return PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(hours=12))


def finish(state) -> None:
    """Tear the process group down cleanly (gloo otherwise aborts at exit about 1 run in 3)."""
    if state.num_processes > 1 and torch.distributed.is_initialized():
        state.wait_for_everyone()
        torch.distributed.destroy_process_group()

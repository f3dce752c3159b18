"""The Triton kernels of acceptance.py (same signatures as its references). Importing this
module imports Triton; set TRITON_INTERPRET=1 before that to run them on CPU tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def argmax_row(row_ptr, V, BLOCK_V: tl.constexpr):
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        idx = (tl.argmax(x, 0, tie_break_left=True) + start).to(tl.int32)
        better = m > best_val  # strictly: an equal maximum in a later block keeps the lower id
        best_idx = tl.where(better, idx, best_idx)
        best_val = tl.where(better, m, best_val)
    return best_idx


@triton.jit
def greedy_kernel(draft_ptr, nprop_ptr, logits_ptr, out_n_ptr, out_next_ptr, V,
                  s_db, s_lb, s_lk, K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    nprop = tl.load(nprop_ptr + b).to(tl.int32)
    n = tl.full((), 0, tl.int32)  # accepted so far
    nxt = tl.full((), 0, tl.int32)
    for i in tl.static_range(K + 1):
        best = argmax_row(logits_ptr + b * s_lb + i * s_lk, V, BLOCK_V)
        nxt = tl.where(n == i, best, nxt)  # the target's token right after the kept prefix
        if i < K:
            d = tl.load(draft_ptr + b * s_db + i).to(tl.int32)
            n += ((n == i) & (i < nprop) & (d == best)).to(tl.int32)
    tl.store(out_n_ptr + b, n.to(tl.int64))
    tl.store(out_next_ptr + b, nxt.to(tl.int64))


@triton.jit
def sampling_kernel(draft_ptr, nprop_ptr, q_ptr, p_ptr, u_ptr, unext_ptr, out_n_ptr, out_next_ptr, V,
                    s_db, s_qb, s_qk, s_pb, s_pk, s_ub, K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    nprop = tl.load(nprop_ptr + b).to(tl.int32)
    n = tl.full((), 0, tl.int32)
    for i in tl.static_range(K):
        d = tl.load(draft_ptr + b * s_db + i)
        pd = tl.load(p_ptr + b * s_pb + i * s_pk + d).to(tl.float32)
        qd = tl.load(q_ptr + b * s_qb + i * s_qk + d).to(tl.float32)
        ui = tl.load(u_ptr + b * s_ub + i).to(tl.float32)
        n += ((n == i) & (i < nprop) & (ui * qd < pd)).to(tl.int32)
    rejected = n < nprop
    p_row = p_ptr + b * s_pb + n * s_pk
    q_row = q_ptr + b * s_qb + tl.minimum(n, K - 1) * s_qk
    # Pass 1: the residual's mass (and p's, for the round-off fallback).
    mass_res = tl.full((), 0.0, tl.float32)
    mass_p = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        mass_res += tl.sum(tl.maximum(p - q, 0.0), 0)
        mass_p += tl.sum(p, 0)
    use_res = rejected & (mass_res > 0)
    target = tl.load(unext_ptr + b).to(tl.float32) * tl.where(use_res, mass_res, mass_p)
    # Pass 2: the first index whose cumulative weight exceeds the target.
    running = tl.full((), 0.0, tl.float32)
    choice = tl.full((), -1, tl.int32)
    last = tl.full((), -1, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        w = tl.where(use_res, tl.maximum(p - q, 0.0), p)
        cum = tl.cumsum(w, 0) + running
        first = tl.min(tl.where((cum > target) & (offs < V), offs, V), 0).to(tl.int32)
        choice = tl.where((choice < 0) & (first < V), first, choice)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), 0).to(tl.int32))
        running += tl.sum(w, 0)
    choice = tl.where(choice < 0, last, choice)
    tl.store(out_n_ptr + b, n.to(tl.int64))
    tl.store(out_next_ptr + b, choice.to(tl.int64))

BLOCK_V = 1024  # vocabulary entries per step of a row scan


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def accept_greedy_triton(draft: torch.Tensor, num_proposed: torch.Tensor, logits: torch.Tensor):
    b, k = draft.shape
    logits = _last_dim_contiguous(logits)
    draft = draft.contiguous()
    num_accepted = torch.empty(b, dtype=torch.long, device=draft.device)
    next_token = torch.empty(b, dtype=torch.long, device=draft.device)
    greedy_kernel[(b,)](draft, num_proposed, logits, num_accepted, next_token, logits.shape[-1],
                        draft.stride(0), logits.stride(0), logits.stride(1), K=k, BLOCK_V=BLOCK_V)
    return num_accepted, next_token


def accept_sampling_triton(draft: torch.Tensor, num_proposed: torch.Tensor, draft_probs: torch.Tensor,
                           target_probs: torch.Tensor, u: torch.Tensor, u_next: torch.Tensor):
    b, k = draft.shape
    if k == 0:
        raise ValueError("accept_sampling_triton needs at least one draft position (acceptance.accept_sampling "
                         "draws from p itself when there is none)")
    q, p = _last_dim_contiguous(draft_probs), _last_dim_contiguous(target_probs)
    draft, u = draft.contiguous(), u.contiguous()
    num_accepted = torch.empty(b, dtype=torch.long, device=draft.device)
    next_token = torch.empty(b, dtype=torch.long, device=draft.device)
    sampling_kernel[(b,)](draft, num_proposed, q, p, u, u_next, num_accepted, next_token, p.shape[-1],
                          draft.stride(0), q.stride(0), q.stride(1), p.stride(0), p.stride(1), u.stride(0),
                          K=k, BLOCK_V=BLOCK_V)
    return num_accepted, next_token



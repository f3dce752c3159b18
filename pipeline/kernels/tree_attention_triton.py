"""The Triton kernel of tree_attention.py (same signature as its reference): one program per
(row, key/value head, block of up to 64 queries) takes that head's group of query heads times
the w new tokens as rows of one block (grouped heads share each key/value load) and streams
the row's visible slots once, with an online softmax in fp32.
Products run in TF32 for bf16/fp16 caches (q.k exactly: TF32 holds every bf16 value; the
softmax weights rounded to TF32 for the product with v) and in IEEE fp32 for fp32 caches
(the lossless check in fp32 wants no TF32 rounding).
Importing this module imports Triton; set TRITON_INTERPRET=1 before that to run it on CPU
tensors."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

MASKED = -1.0e30  # finite: a block in which a query sees nothing must not make exp() NaN


@triton.jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, len_ptr, tree_ptr, scale, W, D,
                          s_qb, s_qh, s_qw, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ow,
                          GROUP: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    length = tl.load(len_ptr + b).to(tl.int32)
    rows = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query row r: head kh * GROUP + r // W, token r % W
    head = kh * GROUP + rows // W
    tok = rows % W
    real = rows < GROUP * W
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + tok[:, None] * s_qw + d[None, :],
                mask=real[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_Q], MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    end = length + W
    for start in range(0, end, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        kv_mask = (t[:, None] < end) & (d[None, :] < D)
        k = tl.load(k_ptr + b * s_kb + kh * s_kh + t[:, None] * s_kt + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        s = s * scale  # [BLOCK_Q, BLOCK_T]
        rel = t[None, :] - length
        is_new = (rel >= 0) & (rel < W)
        if HAS_TREE:
            allowed = tl.load(tree_ptr + tok[:, None] * W + rel, mask=real[:, None] & is_new, other=0) != 0
        else:
            allowed = rel <= tok[:, None]
        visible = (t[None, :] < length) | (is_new & allowed)
        s = tl.where(visible & real[:, None], s, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * s_vb + kh * s_vh + t[:, None] * s_vt + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * s_ob + head[:, None] * s_oh + tok[:, None] * s_ow + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=real[:, None] & (d[None, :] < D))


def tree_attention_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                          tree: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    b, hq, w, dim = query.shape
    hkv = keys.shape[1]
    if hq % hkv or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("tree_attention: query heads must be a multiple of key/value heads, last dims contiguous")
    group = hq // hkv
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty_like(query)
    tree_arg = tree.contiguous() if tree is not None else lengths  # any pointer when unused
    block_q = min(64, max(16, triton.next_power_of_2(group * w)))
    tree_attention_kernel[(b, hkv, triton.cdiv(group * w, block_q))](
        query, keys, values, out, lengths, tree_arg, float(scale), w, dim,
        query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, HAS_TREE=tree is not None, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_Q=block_q, BLOCK_T=32,
        BLOCK_D=max(16, triton.next_power_of_2(dim)))
    return out

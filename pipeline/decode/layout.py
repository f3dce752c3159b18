"""Small-batch linear layers for decoding on CPU.

A decode step multiplies one to a few token rows by every weight matrix: it streams the
weights from memory once and does little arithmetic, so a step of 5 rows should cost about
what a step of 1 row costs. On CPU it does not with nn.Linear: x @ W.T goes to MKL's
small-M GEMM, which on our 2-core CPU costs about linearly in the rows (a 1536x576 fp32
weight: 410 µs at 1 row, 690 at 2, 1040 at 3), so verifying k draft tokens cost 1.5-1.8
target forwards and ate most of the speculative gain. The same product computed as
(W @ x.T).T, with W in its usual [out, in] layout, takes MKL's kernel for a wide matrix
times a few columns, which streams W once: 300-470 µs for 1 to 5 rows. One row is run as
two (the single-column kernel is slower than the two-column one).

`decode_layout` switches a model's CPU nn.Linear modules to that product for inputs of at
most MAX_ROWS rows; longer inputs (prompt prefill, training batches) and other devices
keep F.linear. Weights, modules, state dicts and ties are untouched: the model computes the
same function, and outputs differ from plain nn.Linear by float rounding alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 64


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear whose forward runs few-row CPU inputs as (W @ x.T).T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 0 < rows <= MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = (self.weight @ flat.t())[:, :rows].t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def decode_layout(model: torch.nn.Module) -> int:
    """Switch every plain CPU nn.Linear of `model` to SmallBatchLinear, in place. Returns how
    many changed (0 on GPU, or when already done)."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = SmallBatchLinear
            changed += 1
    return changed


def is_decode_layout(model: torch.nn.Module) -> bool:
    return not any(type(m) is torch.nn.Linear and m.weight.device.type == "cpu" for m in model.modules())

"""Small-batch linear layers for decoding on CPU.

A decode step multiplies one to a few token rows by every weight matrix: it streams the
weights from memory once and does little arithmetic, so a step of 5 rows should cost about
what a step of 1 row costs. On CPU it does not with nn.Linear: x @ W.T goes to MKL's
small-M GEMM, whose cost grows about linearly in the rows on small CPUs, so verifying k
draft tokens costs several target forwards and eats the speculative gain.

`decode_layout` switches a model's CPU nn.Linear modules to SmallBatchLinear, which runs
inputs of at most MAX_ROWS rows through one of two products:

- One or two rows: (W @ x.T).T, with W in its usual [out, in] layout: MKL's kernel for a
  wide matrix times a few columns, which streams W once. One row is run as two (the
  single-column kernel is slower).
- ONEDNN_MIN_ROWS (3) rows and more, for fp32 weights where PyTorch has oneDNN (and bf16
  weights where the CPU has bf16 instructions, see onednn_dtypes):
  oneDNN's linear on a copy of the weight reordered once into its blocked layout (the
  kernel inductor uses for frozen CPU linears). Its cost is nearly flat in the rows, but
  each call costs more to set up, so it loses below 3 rows. `make bench-verify` measures a
  forward's cost by tokens verified for each of these products (its table is in docs/).
  Each such layer keeps the reordered copy beside its weight (the model's linear weights
  once more in memory), made on the first call and again whenever the weight changes (its
  version or storage). Calls that need gradients use the first product.

Longer inputs (prompt prefill, training batches) and other devices keep F.linear. Weights,
modules, state dicts and ties are untouched: the model computes the same function, and
outputs differ from plain nn.Linear by float rounding alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MAX_ROWS = 64
ONEDNN_MIN_ROWS = 3


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN's linear takes on this CPU: bf16 only where it has the
    instructions for it (AVX512 BW/VL/DQ or AVX-NE-CONVERT); an AVX2 CPU refuses the bf16
    reorder."""
    if not onednn_available():
        return ()
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear whose forward runs few-row CPU inputs through a small-batch product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 0 < rows <= MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        packed = self._onednn_weight(x) if rows >= ONEDNN_MIN_ROWS else None
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = (self.weight @ flat.t())[:, :rows].t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _onednn_weight(self, x: torch.Tensor):
        """The weight in oneDNN's layout, reordered again if the weight changed; None where the
        oneDNN product does not apply (gradients, other dtypes, no oneDNN)."""
        w = self.weight
        if (x.dtype != w.dtype or w.dtype not in onednn_dtypes()
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return None
        key = (w.data_ptr(), w._version, w.dtype)
        cached = self.__dict__.get("_onednn")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
            self.__dict__["_onednn"] = cached
        return cached[1]

    def __getstate__(self):  # copies and pickles leave the opaque oneDNN copy behind
        state = dict(super().__getstate__())
        state.pop("_onednn", None)
        return state


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


def int8_linears(model: torch.nn.Module) -> int:
    """Quantize every plain CPU nn.Linear of a draft to int8, in place: weights per output
    channel, activations per call (torch.ao.quantization.quantize_dynamic, PyTorch's x86 /
    fbgemm int8 kernels). Returns how many changed (0 on GPU, or where PyTorch has no int8 CPU
    engine or no longer ships quantize_dynamic).

    For drafts only: the target's outputs must stay exact, a draft's need only be close. A
    decode step streams each weight once, so reading a quarter of the bytes pays: on our
    2-core AVX2 CPU a 1536x576 product of 1 or 2 rows took 65 µs against 155 µs with
    SmallBatchLinear in fp32, the recipe draft's 8192x576 LM head 130 against 650 µs. The
    draft proposes nearly the same tokens, and the target still verifies every one of them.
    Run it before decode_layout (which would turn the same layers into SmallBatchLinear).
    """
    import warnings

    quantization = getattr(torch.ao, "quantization", None)
    engines = torch.backends.quantized.supported_engines
    if quantization is None or not hasattr(quantization, "quantize_dynamic") \
            or not any(e in engines for e in ("x86", "fbgemm")):
        return 0
    names = {name for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"}
    if names:
        with warnings.catch_warnings():  # torch.ao's eager quantization warns that it is deprecated
            warnings.simplefilter("ignore")
            quantization.quantize_dynamic(model, {name: quantization.per_channel_dynamic_qconfig for name in names},
                                          dtype=torch.qint8, inplace=True)
    return len(names)


def is_int8(model: torch.nn.Module) -> bool:
    """Whether int8_linears quantized any of `model`'s layers."""
    return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules())

"""Small-batch linear layers for decoding on CPU.

A decode step multiplies one to a few token rows by every weight matrix: it streams the
weights from memory once and does little arithmetic, so a step of 5 rows should cost about
what a step of 1 row costs. Which CPU product does that best depends on the CPU: on a 2-core
AVX2 EPYC, nn.Linear (MKL's small-M GEMM) grows about linearly in the rows and (W @ x.T).T
is 1.4x faster at one row; on a 2-core AMX Xeon nn.Linear is 2x faster than (W @ x.T).T at one
row and oneDNN's blocked product is fastest from 9 rows (`make bench-verify`, docs/).

So `decode_layout` switches a model's CPU nn.Linear modules to SmallBatchLinear, which runs
inputs of at most MAX_ROWS rows through whichever of three products measured fastest on this
machine for that weight's shape and that many rows:

- `linear`: F.linear, as nn.Linear does;
- `columns`: (W @ x.T).T, with W in its usual [out, in] layout: MKL's kernel for a wide
  matrix times a few columns, which streams W once (one row is run as two: the
  single-column kernel is slower);
- `onednn`: oneDNN's linear on a copy of the weight reordered once into its blocked layout
  (the kernel inductor uses for frozen CPU linears), for fp32 weights where PyTorch has
  oneDNN and bf16 weights where the CPU has bf16 instructions (onednn_dtypes). A layer that
  uses it keeps the reordered copy beside its weight (the weights once more in memory), made
  on first use and again whenever the weight changes (its version or storage).

The choice is measured once per (shape, dtype, threads) at the first call, for row counts
ROW_BUCKETS (a call takes the next bucket up): interleaved medians, and another product
replaces F.linear only where it takes at most WIN of its time, so timing noise between
near-equal products leaves F.linear in place. `FORCE` pins one product (benchmarks, tests).
Longer inputs (prompt prefill, training batches), calls that need gradients and other
devices keep F.linear. Weights, modules, state dicts and ties are untouched: the model
computes the same function, and outputs differ from plain nn.Linear by float rounding alone.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch
import torch.nn.functional as F

MAX_ROWS = 64
ROW_BUCKETS = (1, 2, 3, 5, 9, 17, 33, MAX_ROWS)
WIN = 0.9
FORCE: Optional[str] = None
"""linear, columns or onednn: every small-batch call takes that product (None: the measured one)."""
_CHOICES: dict[tuple, tuple[str, ...]] = {}  # (out, in, dtype, threads) -> a product per bucket


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


def columns_product(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(W @ x.T).T for x2d [R, in] -> [R, out]."""
    rows = x2d.shape[0]
    if rows == 1:
        x2d = torch.cat([x2d, x2d])
    out = (weight @ x2d.t())[:, :rows].t().contiguous()
    if bias is not None:
        out += bias
    return out


def onednn_product(x2d: torch.Tensor, packed, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")


@torch.inference_mode()
def measure_products(weight: torch.Tensor, reps: int = 7) -> tuple[str, ...]:
    """The product to use at each of ROW_BUCKETS for a weight of this shape and dtype: medians
    of interleaved timings; F.linear unless another takes at most WIN of its time."""
    w = torch.randn_like(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None) if w.dtype in onednn_dtypes() else None
    chosen = []
    for rows in ROW_BUCKETS:
        x = torch.randn((rows, w.shape[1]), dtype=w.dtype)
        calls = {"linear": lambda: F.linear(x, w), "columns": lambda: columns_product(x, w, None)}
        if packed is not None:
            calls["onednn"] = lambda: onednn_product(x, packed, None)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for rep in range(reps + 1):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                if rep:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        best = min(median, key=median.get)
        chosen.append(best if median[best] <= WIN * median["linear"] else "linear")
    return tuple(chosen)


def product_for(weight: torch.Tensor, rows: int) -> str:
    if FORCE is not None:
        return FORCE
    key = (*weight.shape, weight.dtype, torch.get_num_threads())
    if key not in _CHOICES:
        _CHOICES[key] = measure_products(weight.detach())
    return _CHOICES[key][next(i for i, b in enumerate(ROW_BUCKETS) if rows <= b)]


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear whose forward runs few-row CPU inputs through the product measured fastest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (not 0 < rows <= MAX_ROWS or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        product = product_for(self.weight, rows)
        packed = self._onednn_weight(x) if product == "onednn" else None
        if product == "linear" or (product == "onednn" and packed is None):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        out = onednn_product(flat, packed, self.bias) if packed is not None else columns_product(flat, self.weight,
                                                                                                   self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def _onednn_weight(self, x: torch.Tensor):
        """The weight in oneDNN's layout, reordered again if the weight changed; None where the
        oneDNN product does not apply (other dtypes, no oneDNN)."""
        w = self.weight
        if x.dtype != w.dtype or w.dtype not in onednn_dtypes():
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

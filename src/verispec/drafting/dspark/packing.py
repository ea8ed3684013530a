"""The DSpark drafter's CPU speed-up: each linear layer's weight pre-packed for oneDNN, or,
where it measures faster, quantized to q8_0 for verispec's int8-activation kernel.

MKL's small-row matmuls read weights at about half the speed of oneDNN's packed layout
(models/linear.py measured it for the target; bench/dspark_cost.py for the drafter: a
round fell from 23% to 18% of a target step). The dense weights stay, so the state dict
and checkpoints are unchanged; a packed layer falls back to the dense weight whenever its
input dtype differs or gradients flow through it, so a packed drafter is still exact.
Checked by tests/test_dspark.py (the fixture's greedy traces run on the packed drafter)
and tests/test_dspark_families.py (training and decoding views agree).

`int8="auto"` (what serving and `dspark measure` ask for) deviates from the exact drafter on
purpose: each linear whose input width is a multiple of 32 is timed at 1 row and at the
block's rows as oneDNN-packed float and as q8_0 weights x int8 activations
(kernels/qlinear.cpp, `q8_0-i8`), and keeps the faster (`"on"`: q8_0 wherever it
runs). On the served SmolLM2 plan the float round cost about a target step (6.9 ms against
6.9-7.6), most of it the 16,384-row draft head and the Markov head's W2 read in float32;
in q8_0 it is 3.6 ms. The drafts change only where quantization flips a near-tie; what
the target accepts is verified as always, so output stays lossless.
tests/test_dspark.py checks that an int8 drafter's logits are the float drafter's within
int8 rounding and that speculation with it equals plain decoding.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from verispec.models.linear import kernel_runs, pack_weight, packed_linear, packing_enabled


INT8_CHOICES = ("off", "auto", "on")


def pack_linears(module: nn.Module, int8: str = "off", rows: tuple[int, ...] = (1, 8)) -> str:
    """Turn every nn.Linear under `module` into a PackedLinear (no-op off CPU or with
    VERISPEC_NO_PACK=1) or into an Int8Linear: with int8 "auto" where that measures faster
    at `rows`, with "on" wherever the kernel runs. Its weight must not change afterwards:
    train an unpacked drafter. Returns a line saying what was chosen."""
    if int8 not in INT8_CHOICES:
        raise ValueError(f"int8 must be one of {INT8_CHOICES}, not {int8!r}")
    device = next(module.parameters()).device
    if not packing_enabled(device):
        return "PyTorch's linears (no packing here)"
    measure = int8 == "auto"
    use_int8 = int8 != "off" and kernel_runs("q8_0-i8", torch.float32)
    chosen = {"oneDNN": 0, "int8": 0}
    saved = 0.0
    for sub in list(module.modules()):
        if not isinstance(sub, nn.Linear) or isinstance(sub, (PackedLinear, Int8Linear)):
            continue
        quantized = _quantized(sub) if use_int8 else None
        packed = pack_weight(sub.weight) if quantized is None or measure else None  # "on" needs no float copy
        if quantized is not None:
            dense_t = int8_t = 0.0
            if measure:
                dense_t = _time(lambda x: packed_linear(x, packed, sub.bias) if packed is not None
                                else nn.functional.linear(x, sub.weight, sub.bias), sub, rows)
                int8_t = _time(lambda x: _int8_call(quantized, sub, x), sub, rows)
            if int8_t <= dense_t:
                sub.__class__ = Int8Linear
                sub.blocks = quantized
                chosen["int8"] += 1
                saved += dense_t - int8_t
                continue
        if packed is not None:
            sub.__class__ = PackedLinear
            sub.packed = packed
            chosen["oneDNN"] += 1
    note = f"{chosen['oneDNN']} linears oneDNN-packed"
    if use_int8:
        note += f", {chosen['int8']} q8_0 x int8"
        note += f" (measured {saved * 1e3:.2f} ms faster over rows {rows})" if measure else " (asked for)"
    return note


def _quantized(layer: nn.Linear) -> torch.Tensor | None:
    if layer.in_features % 32 or layer.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    from verispec.models.quant import interleave16_blocks, quantize

    return interleave16_blocks(quantize(layer.weight, "q8_0"), "q8_0")


def _int8_call(blocks: torch.Tensor, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from verispec import kernels

    y = kernels.load().qlinear16(x.float(), blocks, layer.bias, kernels.FORMATS["q8_0"], layer.out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _time(call, layer: nn.Linear, rows: tuple[int, ...], repeats: int = 5) -> float:
    """Seconds of `call` summed over the row counts, best of `repeats` each."""
    total = 0.0
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, layer.in_features, dtype=layer.weight.dtype)
            call(x)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                call(x)
                best = min(best, time.perf_counter() - t)
            total += best
    return total


def _over_rows(call, x: torch.Tensor) -> torch.Tensor:
    """`call` on x's rows as a 2-D [rows, in] tensor, the result in x's leading shape."""
    if x.dim() == 2:
        return call(x)
    return call(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses a oneDNN-packed copy of its (kept) weight."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)
        return _over_rows(lambda rows: packed_linear(rows, self.packed, self.bias), x)


class Int8Linear(nn.Linear):
    """An nn.Linear whose forward is its weight in q8_0 times int8-rounded activations
    (the dense weight is kept: the state dict is unchanged)."""

    blocks: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)
        return _over_rows(lambda rows: _int8_call(self.blocks, self, rows), x)

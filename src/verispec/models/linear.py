"""Linear layers and the kernels that compute them on CPU.

A `Linear` keeps nn.Linear's parameters and state-dict names, and computes with one of
these kernels (models/kernel_plan.py chooses per weight shape, by measurement on the
machine it runs on, and caches the choice):

* `aten`      F.linear on the dense weight (MKL / oneDNN as PyTorch dispatches);
* `onednn`    the weight pre-packed once for oneDNN (`mkldnn._reorder_linear_weight`):
              on a 2-core Zen 4 MKL's gemv read weights at ~11 GB/s fp32, oneDNN's packed
              layout ~21 GB/s fp32 / ~15 GB/s bf16, nearly flat from 1 to 16 rows;
* `onednn:C`  the same, called on at most C rows at a time: oneDNN picks its blocking by
              the row count, and on some shapes more rows change a row's result (bf16,
              K = 1536: from 15 rows on, here), so a batch-invariant plan cuts calls below
              the row count its invariance probe found safe;
* `bf16dot`   verispec's AVX512-BF16 kernel (kernels/qlinear.cpp): bf16 x bf16 with
              float32 sums, batch-invariant by construction;
* `bf16amx`   verispec's AMX-BF16 kernel (Intel AMX tiles, kernels/qlinear.cpp): the
              same bf16 x bf16 model with float32 sums, one tile instruction per 16 rows,
              so a verify block costs about what one row does; batch-invariant by
              construction (its sums associate differently from bf16dot's);
* `bf16rows`  verispec's float kernel over bf16 weight rows for a bf16 model on a CPU
              without AVX512-BF16 (AVX2 or AVX-512F): activations widened to float32
              (exact), products and sums in float32, batch-invariant by construction;
* `bf16cols`  the same products on AVX-512F or AVX2 (the same bits on both), the
              weights in 16-column tiles and each row's activation broadcast, so an
              output is one fused multiply-add per weight in k order and no horizontal
              sum (another summation order than bf16rows: another float32 model of the
              same bf16 model; batch-invariant by construction); on the Xeon without
              AVX512-BF16 it took a 9-row call of Gemma-3's gate_up from 506 to 378 us
              and one row from 190 to 124 us, on an AVX2 EPYC 764 to 577 and 318 to 211;
* `q8_0`, `q4_1` (+ `-i8`): verispec's weight-only kernels over GGUF's blocks, float32
              activations, or int8 activations (llama.cpp's arithmetic; AVX-512 VNNI or
              AVX2, the same bits on both);
              fewer bytes per weight, batch-invariant by construction;
* `q8_0-i8:R`, `q4_1-i8:R`: the same kernel, its integer dots on AMX-INT8 tiles for calls
              of R rows or more (whole 16-row chunks; a long call's partial last chunk by
              VNNI), bit-equal to the VNNI path, so the model does not change (a tile
              instruction serves up to 16 rows: on the Intel AMX host the 262144 x 640
              Gemma-3 lm_head at 9 rows took 16 ms against VNNI's 20.6);
              R is measured per role by models/kernel_plan.py where AMX-INT8 runs.

Results of the float kernels differ from F.linear only by float rounding (tests compare
against transformers with tolerances); the quantized ones compute a quantized model
(bench/quant_quality.py reports its perplexity against float32).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("aten", "onednn", "bf16dot", "bf16amx", "bf16rows", "bf16cols", "q8_0", "q4_1", "q8_0-i8", "q4_1-i8")  # + "onednn:C", "-i8:R"
QUANT_FORMATS = ("q8_0", "q4_1")
BF16_KERNELS = ("bf16dot", "bf16amx", "bf16rows", "bf16cols")  # verispec's kernels over the model's own bf16 weights


def packing_enabled(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and os.environ.get("VERISPEC_NO_PACK") != "1"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a [out, in] weight, or None where unsupported."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, NotImplementedError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def amx_allowed() -> bool:
    """Whether plans may use AMX tiles (VERISPEC_NO_AMX=1 keeps them to AVX-512: a
    machine's AVX-512 plan, to compare against, or to rule AMX out)."""
    return os.environ.get("VERISPEC_NO_AMX") != "1"


def kernel_runs(kernel: str, dtype: torch.dtype) -> bool:
    """Whether `kernel` can compute a `dtype` model on this machine."""
    base = kernel.split(":")[0]
    if base == "aten":
        return True
    if base == "onednn":
        return packing_enabled(torch.device("cpu"))
    from verispec import kernels

    if not kernels.available():
        return False
    mod = kernels.load()
    if base == "bf16dot":
        return dtype == torch.bfloat16 and bool(mod.bf16dot())
    if base == "bf16amx":
        return dtype == torch.bfloat16 and amx_allowed() and bool(mod.bf16amx())
    if base == "bf16rows":
        return dtype == torch.bfloat16
    if base == "bf16cols":
        return dtype == torch.bfloat16 and mod.isa() >= 1  # AVX-512F + BW, or AVX2 + FMA
    if base.endswith("-i8"):
        return bool(mod.int8dot())
    return base in QUANT_FORMATS


class Linear(nn.Module):
    """nn.Linear's parameters and state-dict names, computed by a chosen kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = "aten"
        self.chunk = 0  # onednn:C -> C rows per call
        self.packed: torch.Tensor | None = None  # oneDNN's packed weight
        self.blocks: torch.Tensor | None = None  # uint8 rows for verispec's kernels
        self._fmt = -1
        self._isa = -1
        self.amx_from = 0  # -i8 kernels: calls of this many rows or more run on AMX-INT8 tiles (0: none)
        self._call = None  # verispec's kernels: the bound call (linear_forward)
        # verispec's kernels sum in float32: give that back as is, not rounded to the input's
        # dtype (the lm_head, whose logits are wanted in float32 anyway)
        self.float_out = False

    def use(self, kernel: str) -> bool:
        """Switch to `kernel` (False, and unchanged, where it cannot run). The dense weight
        is dropped once a kernel keeps its own copy, so the choice is made once."""
        base, _, chunk = kernel.partition(":")
        dense = self.weight
        if base == "aten":
            self.kernel = "aten"
            return True
        if base == "onednn":
            packed = pack_weight(dense)
            if packed is None:
                return False
            self.packed, self.chunk = packed, int(chunk or 0)
        else:
            from verispec import kernels
            from verispec.models.quant import interleave4, interleave16_blocks, interleave16_bf16, interleave_amx, quantize

            if not kernel_runs(base, dense.dtype) or dense.shape[1] % 32:
                return False
            fmt = "bf16" if base in BF16_KERNELS else base.removesuffix("-i8")
            if base == "bf16dot":
                self.blocks = interleave4(dense)
            elif base == "bf16amx":
                self.blocks = interleave_amx(dense)
            elif base == "bf16cols":
                self.blocks = interleave16_bf16(dense)
            elif base.endswith("-i8"):
                self.blocks = interleave16_blocks(quantize(dense, fmt), fmt)
            else:
                self.blocks = quantize(dense, fmt)
            self._fmt = kernels.FORMATS[fmt]
            self._isa = 3 if base.endswith("-i8") else -1  # 3: qlinear16 (int8 activations)
            if base.endswith("-i8") and chunk and amx_allowed() and kernels.load().amx_int8():
                self.amx_from = int(chunk)
        self.kernel = base if base != "onednn" or not chunk else kernel
        self._dtype = dense.dtype
        self._call = _kernel_call(self) if self.blocks is not None else None
        self.weight = nn.Parameter(torch.empty(0, dtype=dense.dtype), requires_grad=False)
        return True

    def run_on_amx_from(self, rows: int) -> None:
        """An -i8 layer's calls of `rows` rows or more on AMX-INT8 tiles (0: never): the same
        bits either way, so only a benchmark comparing the two paths has reason to call this."""
        if self._isa != 3:
            raise ValueError(f"only int8-activation kernels have an AMX path, not {self.kernel}")
        self.amx_from = rows
        self._call = _kernel_call(self)

    def pack(self) -> bool:
        """oneDNN-pack the weight (the kernel PyTorch-only plans use)."""
        return self.use("onednn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)


def linear_forward(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    call = layer._call
    if call is not None:
        return call(x)
    kernel = layer.kernel
    if kernel == "aten":
        return F.linear(x, layer.weight, layer.bias)
    c = layer.chunk
    if not c or x.shape[0] <= c:
        return packed_linear(x, layer.packed, layer.bias)
    return torch.cat([packed_linear(x[i : i + c], layer.packed, layer.bias) for i in range(0, x.shape[0], c)])


def _kernel_call(layer: Linear):
    """verispec's kernel for this layer as one closure (no per-call lookups)."""
    from verispec import kernels

    mod = kernels.load()
    blocks, bias, n, fmt = layer.blocks, layer.bias, layer.out_features, layer._fmt
    float_out = layer.float_out
    if layer.kernel in ("bf16dot", "bf16amx", "bf16cols"):
        fn = {"bf16dot": mod.bf16_linear, "bf16amx": mod.bf16amx_linear, "bf16cols": mod.bf16cols_linear}[layer.kernel]
        return lambda x: fn(x, blocks, bias, n, float_out)
    if layer._isa == 3:
        fn, amx_from = mod.qlinear16, layer.amx_from
        isa = 4 if amx_from else -1  # 4: calls of amx_from rows or more on AMX-INT8 tiles

        def int8(x):
            y = fn(x if x.dtype == torch.float32 else x.float(), blocks, bias, fmt, n, isa, amx_from)
            return y if float_out or x.dtype == torch.float32 else y.to(x.dtype)

        return int8
    fn, isa = mod.qlinear, layer._isa
    if float_out:
        return lambda x: fn(x.float(), blocks, bias, fmt, n, isa)
    return lambda x: fn(x.float(), blocks, bias, fmt, n, isa).to(x.dtype)

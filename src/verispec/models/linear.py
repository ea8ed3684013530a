"""Linear layers whose weights are pre-packed for oneDNN on CPU.

Why: on this machine (2-core Zen 4, AVX-512 + AVX512-BF16, no AMX) PyTorch's default
F.linear for a single decode row goes to MKL's gemv, which reads weights at ~11 GB/s
(fp32) against ~26-31 GB/s of memory bandwidth. The same matrix-vector product with the
weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`,
what torch.compile's CPU backend uses) reads at ~21 GB/s in fp32 and ~15 GB/s in bf16
(half the bytes, so bf16 is fastest per token), and stays nearly flat from 1 to 16 rows,
which is what speculative verification needs. Measured by /bench/decode.py (packing
on vs VERISPEC_NO_PACK=1).

Packing replaces the dense weight (the packed copy is the only one kept, so memory does
not double); a packed layer is inference-only. Anywhere oneDNN is missing or refuses a
shape/dtype, the layer silently stays on F.linear. Results differ from F.linear only by
float rounding (tests compare against transformers with tolerances, packed and not).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


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


class Linear(nn.Module):
    """nn.Linear's parameters and state-dict names, plus optional oneDNN packing."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> bool:
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        # drop the dense copy: the packed one is all forward needs
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

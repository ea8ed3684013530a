"""The DSpark drafter's CPU speed-up: every linear layer's weight pre-packed for oneDNN.

MKL's small-row matmuls read weights at about half the speed of oneDNN's packed layout
(models/linear.py measured it for the target; bench/dspark_cost.py for the drafter: a
round fell from 23% to 18% of a target step). The dense weights stay, so the state dict
and checkpoints are unchanged; a packed layer falls back to the dense weight whenever its
input dtype differs or gradients flow through it, so a packed drafter is still exact.
Checked by tests/test_dspark.py (the fixture's greedy traces run on the packed drafter)
and tests/test_dspark_families.py (training and decoding views agree).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.models.linear import pack_weight, packed_linear, packing_enabled


def pack_linears(module: nn.Module) -> None:
    """Turn every nn.Linear under `module` into a PackedLinear (no-op off CPU or with
    VERISPEC_NO_PACK=1). Its weight must not change afterwards: train an unpacked drafter."""
    device = next(module.parameters()).device
    if not packing_enabled(device):
        return
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and not isinstance(sub, PackedLinear):
            packed = pack_weight(sub.weight)
            if packed is not None:
                sub.__class__ = PackedLinear
                sub.packed = packed


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses a oneDNN-packed copy of its (kept) weight."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)
        if x.dim() == 2:
            return packed_linear(x, self.packed, self.bias)
        return packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias).view(*x.shape[:-1], -1)

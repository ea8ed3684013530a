"""How a features folder stores its tapped hidden states: `bf16` as computed, or `fp8` in 59% of the disk.

fp8 keeps `taps` as float8 e4m3 values with one float32 scale per row of each tap
(`taps_scale` [T, m]): scale = the row's absolute maximum / 448 (e4m3's largest value), so
every element is rounded to e4m3's 3-bit mantissa relative to itself, not to its row's maximum.
Reading a sample multiplies back and rounds to bf16, so training sees the same Sample either way.
`last_hidden` (the teacher's distribution) stays bf16 in both stores.

Why e4m3 and not int8: gemma3's residual stream holds outlier channels (absolute maxima of
5e3-1e5 against medians of 0.7-134 over its five taps, one shard of the served features), so
one int8 scale per row and tap rounds the ordinary channels away: the drafter's `fc` output
moved by 9.1% (relative norm) with int8 against 1.4% with e4m3, whose exponent keeps small
values; the drafter's cross-entropy on the answer tokens moved by 0.0006 (2.1256 -> 2.1262,
the shipped drafter's first training step on the same 16 sequences). Why not the final
hidden state too: in e4m3 it moved the target's draft-vocabulary probabilities by 0.11-0.16
(L1, three sequences; logits by up to 1.2) and the first step's L1 loss from 0.862 to 0.967:
a noisier teacher, which 100 steps did not show in held-out tau but a campaign would train
towards. Campaign stage 28; bench/dspark_feature_source.py --features measures the choice.

Why bother: ~7.5 KiB a token in bf16 (gemma3, five taps of 640) outgrew this machine's memory
at 3.3M tokens (23.6-25.2 GiB, so no epoch is served from the page cache) and its free disk
is what bounds the next data; fp8 taps make it ~4.4 KiB a token.

Oracle: tests/test_dspark_train.py::test_fp8_features_* -- every tap element within e4m3's
half step of the bf16 features of the same records, everything else bit-equal, a bf16 folder
recast to fp8 equal to fp8 features computed directly, and training runs on an fp8 folder.
"""

from __future__ import annotations

import torch

STORES = ("bf16", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
STORED = ("taps",)  # the fields a store changes; the rest are kept as they are


def _quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups * H] -> e4m3 values [T, groups * H] and float32 scales [T, groups]."""
    rows = x.float().view(x.shape[0], groups, -1)
    peak = rows.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(peak > 0, peak / FP8_MAX, torch.ones_like(peak))
    values = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.view(x.shape), scale.squeeze(-1)


def _dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    groups = scale.shape[-1]
    rows = values.float().view(values.shape[0], groups, -1) * scale.unsqueeze(-1)
    return rows.view(values.shape).to(torch.bfloat16)


def encode(tensors: dict, store: str, num_taps: int) -> dict:
    """A shard's tensors (bf16 `taps` [T, m*H] among them) as `store` keeps them."""
    if store == "bf16":
        return tensors
    out = {k: v for k, v in tensors.items() if k not in STORED}
    out["taps"], out["taps_scale"] = _quantize(tensors["taps"], num_taps)
    return out


def decode(handle) -> dict:
    """A whole shard from an open handle as `encode` took it: the stored fields as bf16, their
    scales dropped, everything else as it is."""
    tensors = {k: handle.get_tensor(k) for k in handle.keys() if not k.endswith("_scale")}
    for name in STORED:
        if tensors[name].dtype == FP8:
            tensors[name] = _dequantize(tensors[name], handle.get_tensor(name + "_scale"))
    return tensors


def read_rows(handle, name: str, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of `taps` or `last_hidden` from an open shard, as bf16 whatever the store."""
    values = handle.get_slice(name)[a:b]
    if values.dtype != FP8:
        return values
    return _dequantize(values, handle.get_slice(name + "_scale")[a:b])


def store_of(manifest: dict) -> str:
    """The store a folder was written in (folders made before fp8 existed are bf16)."""
    return manifest.get("store", "bf16")

"""Weight formats the CPU kernels read: GGUF's q4_1 and q8_0 blocks, and bf16 rows.

A matrix [N, K] (N outputs, K inputs) is stored row by row, each row as K / 32 blocks
along K, exactly as llama.cpp stores these types (so a GGUF's own q4_1 / q8_0 tensors are
used byte for byte, without requantizing):

* q4_1: fp16 d, fp16 m, then 16 bytes; byte j holds element j (low nibble) and element
  j + 16 (high nibble); w = d * q + m, q in 0..15. 20 bytes per 32 weights (5 bits each).
* q8_0: fp16 d, then 32 int8; w = d * q. 34 bytes per 32 weights.
* bf16: the bfloat16 values themselves, 2 bytes each.

`quantize_*` make these blocks from float weights the way llama.cpp's reference
quantizers do (q4_1: min and (max - min) / 15 per block, rounded to nearest; q8_0:
absmax / 127, rounded to nearest), `dequantize` turns any of them back into float32,
which is what the tests compare the kernels against. A quantized model is a different
model from its float original: bench/quant_quality.py reports the perplexity delta.

Checked by tests/test_qlinear.py (round trips, a GGUF's q4_1 tensor dequantized here
equals the same tensor dequantized by models/gguf/dequant.py).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
FORMAT_BYTES = {"q4_1": 20, "q8_0": 34, "bf16": 64}  # bytes per 32 weights


def row_bytes(fmt: str, k: int) -> int:
    return k // BLOCK * FORMAT_BYTES[fmt]


def _bf16_rows_padded(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """[N, K] as bf16 with zero rows added up to a multiple of `multiple` (whole column tiles)."""
    w = weight.detach().to(torch.bfloat16)
    pad = (-w.shape[0]) % multiple
    return torch.cat([w, torch.zeros(pad, w.shape[1], dtype=torch.bfloat16)]) if pad else w


def interleave4(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> uint8 in the bf16dot kernel's layout: columns in tiles of four (N
    padded with zero rows to a multiple of 4), each tile stored block by block (32
    values of column 0, of column 1, 2, 3, then the next block), so four columns are
    read strictly in memory order."""
    k = weight.shape[1]
    w = _bf16_rows_padded(weight, 4)
    tiles = w.reshape(-1, 4, k // BLOCK, BLOCK).permute(0, 2, 1, 3).contiguous()
    return tiles.view(torch.uint8).reshape(-1)


def interleave16_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> uint8 in the bf16cols kernel's layout: columns in tiles of sixteen (N
    padded with zero rows to a multiple of 16), each tile stored k by k (the sixteen
    columns' weights at k, then at k + 1), so one 32-byte load gives a tile's weights at k."""
    k = weight.shape[1]
    w = _bf16_rows_padded(weight, 16)
    return w.reshape(-1, 16, k).transpose(1, 2).contiguous().view(torch.uint8).reshape(-1)


def deinterleave16_bf16(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    tiles = blocks.view(torch.bfloat16).reshape(-1, k, 16).transpose(1, 2)
    return tiles.reshape(-1, k)[:n].float()


def interleave_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> uint8 in the bf16amx kernel's layout: columns in groups of 64 (N
    padded with zero rows to a multiple of 64), each group stored K block by K block as
    four 16-column tiles; tile row p holds, for each of its columns, the block's values
    at 2p and 2p + 1 (AMX's pair layout for the weight operand)."""
    k = weight.shape[1]
    if k % BLOCK:
        raise ValueError(f"the AMX layout needs inputs in blocks of {BLOCK}, got {k}")
    w = _bf16_rows_padded(weight, 64)
    # [group, tile, column, block, pair, 2] -> [group, block, tile, pair, column, 2]
    groups = w.reshape(-1, 4, 16, k // BLOCK, BLOCK // 2, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return groups.view(torch.uint8).reshape(-1)


def deinterleave_amx(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    groups = blocks.view(torch.bfloat16).reshape(-1, k // BLOCK, 4, BLOCK // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    return groups.reshape(-1, k)[:n].float()


def deinterleave4(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    tiles = blocks.view(torch.bfloat16).reshape(-1, k // BLOCK, 4, BLOCK).permute(0, 2, 1, 3)
    return tiles.reshape(-1, k)[:n].float()


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K] float -> [N, row_bytes] uint8 blocks of `fmt`."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"quantize needs a 2-D weight whose inputs are a multiple of {BLOCK}, got {tuple(weight.shape)}")
    if fmt == "bf16":
        return weight.detach().to(torch.bfloat16).contiguous().view(torch.uint8).reshape(weight.shape[0], -1)
    w = weight.detach().float().cpu().numpy().reshape(weight.shape[0], -1, BLOCK)
    if fmt == "q4_1":
        return torch.from_numpy(_q4_1(w))
    if fmt == "q8_0":
        return torch.from_numpy(_q8_0(w))
    raise ValueError(f"unknown weight format {fmt!r}")


def _q4_1(w: np.ndarray) -> np.ndarray:
    n, nb, _ = w.shape
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    d = (hi - lo) / 15.0
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0)
    q = np.clip(np.floor((w - lo[..., None]) * inv[..., None] + 0.5), 0, 15).astype(np.uint8)
    out = np.empty((n, nb, 20), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    out[..., 2:4] = lo.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, nb * 20)


def _q8_0(w: np.ndarray) -> np.ndarray:
    n, nb, _ = w.shape
    amax = np.abs(w).max(axis=-1)
    d = amax / 127.0
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0)
    q = np.clip(np.round(w * inv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((n, nb, 34), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, nb * 34)


def dequantize(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """[N, row_bytes] uint8 -> [N, K] float32."""
    n = blocks.shape[0]
    if fmt == "bf16":
        return blocks.contiguous().view(torch.bfloat16).reshape(n, k).float()
    b = blocks.cpu().numpy().reshape(n, k // BLOCK, FORMAT_BYTES[fmt])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if fmt == "q4_1":
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([b[..., 4:] & 0x0F, b[..., 4:] >> 4], axis=-1).astype(np.float32)
        w = q * d + m
    elif fmt == "q8_0":
        w = b[..., 2:].copy().view(np.int8).astype(np.float32) * d
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    return torch.from_numpy(w.reshape(n, k))


def interleave16_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, row_bytes] q4_1 / q8_0 rows -> the int8 kernel's tiles of sixteen columns, block
    by block (N padded with zero rows to a multiple of 16); in each block's 64-byte groups
    lane c holds four consecutive weights of column c:
    q4_1 [16 x d][16 x m][group g = 0..3: nibble bytes 4g..4g+3 of each column],
    q8_0 [16 x d][group g = 0..7: weights 4g..4g+3 of each column, as q + 128]."""
    n = blocks.shape[0]
    size = FORMAT_BYTES[fmt]
    pad = (-n) % 16
    b = blocks.cpu().numpy().reshape(n, -1, size)
    if pad:
        b = np.concatenate([b, np.zeros((pad, b.shape[1], size), dtype=np.uint8)])
    nb = b.shape[1]
    t = b.reshape(-1, 16, nb, size).transpose(0, 2, 1, 3)  # [tiles, blocks, 16 columns, block bytes]
    lead = t.shape[:2]
    d = t[..., 0:2].reshape(*lead, 32)
    if fmt == "q4_1":
        groups = t[..., 4:].reshape(*lead, 16, 4, 4).transpose(0, 1, 3, 2, 4).reshape(*lead, 256)
        out = np.concatenate([d, t[..., 2:4].reshape(*lead, 32), groups], axis=-1)
    else:
        q = t[..., 2:] ^ np.uint8(0x80)  # int8 q as the unsigned byte q + 128
        out = np.concatenate([d, q.reshape(*lead, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(*lead, 512)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(-1)

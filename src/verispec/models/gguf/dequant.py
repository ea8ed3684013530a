"""ggml block dequantizers: raw GGUF tensor bytes -> float32 torch tensors.

``dequantize`` / ``dequantize_tensor`` turn the raw ggml block bytes of F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors into float32 torch tensors with
vectorized tensor ops (no python loop per block). ``SUPPORTED_TYPES`` names them.

Block layouts follow ggml's definitions (llama.cpp ggml-quants.c); the code is ours.

What it is checked against (tests/test_gguf.py): for every supported type, our
``dequantize`` equals gguf-py's numpy ``gguf.quants.dequantize`` bit for bit on valid random
blocks (from gguf-py's quantizer where it has one, and random bytes with finite fp16
scales), also when big tensors are decoded in chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor

__all__ = ["SUPPORTED_TYPES", "dequantize", "dequantize_tensor", "torch_shape"]

Decoder = Callable[[torch.Tensor], torch.Tensor]
"""Maps uint8 blocks of shape (n_blocks, type_size) to float32 values (n_blocks, block_size)."""


@dataclass(frozen=True)
class BlockFormat:
    block_size: int  # values per block
    type_size: int  # bytes per block
    decode: Decoder


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``offset`` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles of all bytes first, then all high nibbles: the 32-value ggml block order."""
    # One broadcast shift instead of two ops and a cat: this is the hot path of Q4/Q5.
    return ((qs.unsqueeze(-2) >> _NIBBLE_SHIFTS) & 0x0F).flatten(-2)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bits of the bytes in ``packed`` (…, n) as (…, 8 * n), byte 0 bit 0 first.

    Reading bytes rather than a uint32 keeps this independent of the host's endianness.
    """
    return ((packed.unsqueeze(-1) >> _BIT_SHIFTS) & 1).flatten(-2)


def _decode_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _decode_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _decode_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qs: 32 x int8
    d = _f16_field(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qs: 16 bytes of two 4-bit values; value = d * (q - 8)
    d = _f16_field(blocks, 0)
    q = _nibbles(blocks[:, 2:]).float() - 8
    return d * q


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | m: fp16 | qs: 16 bytes; value = d * q + m
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return d * q + m


def _five_bit_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants: nibble from ``qs`` plus the fifth bit from the 32-bit ``qh``."""
    return _nibbles(qs) | (_bits(qh) << 4)


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | qh: 4 bytes of fifth bits | qs: 16 bytes; value = d * (q - 16)
    d = _f16_field(blocks, 0)
    q = _five_bit_values(blocks[:, 2:6], blocks[:, 6:]).float() - 16
    return d * q


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | m: fp16 | qh: 4 bytes | qs: 16 bytes; value = d * q + m
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _five_bit_values(blocks[:, 4:8], blocks[:, 8:]).float()
    return d * q + m


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte field of Q4_K/Q5_K into eight 6-bit scales and eight 6-bit mins.

    Bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; their top 2 bits
    are the high bits of scales/mins 4-7, whose low 4 bits sit in the nibbles of bytes 8-11.
    """
    lo_scales, lo_mins, tails = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((lo_scales & 0x3F, (tails & 0x0F) | ((lo_scales >> 6) << 4)), dim=-1)
    mins = torch.cat((lo_mins & 0x3F, (tails >> 4) | ((lo_mins >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _k_sub_block_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 128 ``qs`` bytes of a K super-block as (n, 8, 32) 4-bit values per sub-block.

    Each 32-byte run gives two sub-blocks: its low nibbles, then its high nibbles.
    """
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _apply_k_scales(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """value = (d * scale) * q - (dmin * min) per 32-value sub-block, as ggml computes it."""
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    sub_scale = (d * scales).unsqueeze(-1)
    sub_min = (dmin * mins).unsqueeze(-1)
    return (sub_scale * q.float() - sub_min).reshape(-1, 256)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | dmin: fp16 | scales: 12 bytes | qs: 128 bytes
    return _apply_k_scales(blocks, _k_sub_block_nibbles(blocks[:, 16:144]))


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # d: fp16 | dmin: fp16 | scales: 12 bytes | qh: 32 bytes | qs: 128 bytes.
    # Bit k of qh[l] is the fifth bit of value l of sub-block k.
    qh = blocks[:, 16:48]
    fifth_bits = (qh.unsqueeze(1) >> _BIT_SHIFTS.reshape(8, 1)) & 1
    q = _k_sub_block_nibbles(blocks[:, 48:176]) | (fifth_bits << 4)
    return _apply_k_scales(blocks, q)


_BIT_PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql: 128 bytes (low 4 bits) | qh: 64 bytes (high 2 bits) | scales: 16 x int8 | d: fp16.
    # Each 128-value half uses 64 ql bytes and 32 qh bytes: value p < 64 takes the low nibble
    # of ql[p], value 64 + p the high nibble; qh[l] holds the top bits of values l, l+32,
    # l+64, l+96 in its bit pairs 0-1, 2-3, 4-5, 6-7.
    low = _nibbles(blocks[:, 0:128].reshape(-1, 2, 64))
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = ((qh >> _BIT_PAIR_SHIFTS) & 0x03).reshape(-1, 2, 128)
    q = ((low | (high << 4)).float() - 32).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16_field(blocks, 208)
    return ((d * scales).unsqueeze(-1) * q).reshape(-1, 256)


_T = GGMLQuantizationType
_BLOCK_FORMATS: dict[GGMLQuantizationType, BlockFormat] = {
    _T.F32: BlockFormat(1, 4, _decode_f32),
    _T.F16: BlockFormat(1, 2, _decode_f16),
    _T.BF16: BlockFormat(1, 2, _decode_bf16),
    _T.Q8_0: BlockFormat(32, 34, _decode_q8_0),
    _T.Q4_0: BlockFormat(32, 18, _decode_q4_0),
    _T.Q4_1: BlockFormat(32, 20, _decode_q4_1),
    _T.Q5_0: BlockFormat(32, 22, _decode_q5_0),
    _T.Q5_1: BlockFormat(32, 24, _decode_q5_1),
    _T.Q4_K: BlockFormat(256, 144, _decode_q4_k),
    _T.Q5_K: BlockFormat(256, 176, _decode_q5_k),
    _T.Q6_K: BlockFormat(256, 210, _decode_q6_k),
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in _BLOCK_FORMATS)

# Blocks decoded per step: bounds the temporaries (a few bytes per value) for big tensors.
_CHUNK_VALUES = 1 << 22


def _type_name(ggml_type: GGMLQuantizationType | int) -> str:
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"unknown ggml type {int(ggml_type)}"


def _block_format(ggml_type: GGMLQuantizationType | int, name: str) -> BlockFormat:
    try:
        return _BLOCK_FORMATS[GGMLQuantizationType(int(ggml_type))]
    except (KeyError, ValueError):
        raise ValueError(
            f"GGUF tensor {name!r} has ggml type {_type_name(ggml_type)}, which verispec cannot "
            f"dequantize; supported types: {', '.join(SUPPORTED_TYPES)}"
        ) from None


def _as_byte_array(raw: np.ndarray | torch.Tensor | bytes | bytearray | memoryview) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def dequantize(
    raw: np.ndarray | torch.Tensor | bytes | bytearray | memoryview,
    ggml_type: GGMLQuantizationType | int,
    shape: Sequence[int],
    *,
    name: str = "<tensor>",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize the raw ggml bytes of one tensor into a new tensor of ``shape``.

    ``shape`` is in PyTorch (row-major) order, i.e. the reverse of GGUF's ``ne`` order.
    Values are computed in float32 exactly as ggml does, then cast to ``out_dtype``.
    Raises ValueError for an unsupported type or a byte count that does not fit ``shape``.
    """
    fmt = _block_format(ggml_type, name)
    data = _as_byte_array(raw)
    n_values = int(np.prod(shape, dtype=np.int64))
    if n_values % fmt.block_size:
        raise ValueError(
            f"GGUF tensor {name!r}: {n_values} values is not a multiple of the "
            f"{_type_name(ggml_type)} block size {fmt.block_size}"
        )
    n_blocks = n_values // fmt.block_size
    if data.size != n_blocks * fmt.type_size:
        raise ValueError(
            f"GGUF tensor {name!r}: expected {n_blocks * fmt.type_size} bytes of "
            f"{_type_name(ggml_type)} for shape {tuple(shape)}, got {data.size}"
        )
    blocks = data.reshape(n_blocks, fmt.type_size)
    out = torch.empty(n_blocks, fmt.block_size, dtype=out_dtype)
    step = max(1, _CHUNK_VALUES // fmt.block_size)
    for start in range(0, n_blocks, step):
        # np.array copies the (possibly read-only, memory-mapped) bytes into owned memory
        chunk = torch.from_numpy(np.array(blocks[start : start + step]))
        out[start : start + step] = fmt.decode(chunk)
    return out.reshape(tuple(int(s) for s in shape))


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in PyTorch order."""
    # GGUF lists dimensions fastest-varying first (ggml ne); PyTorch wants the reverse.
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def dequantize_tensor(tensor: ReaderTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one tensor of a ``GGUFReader`` into PyTorch layout (GGUF shape reversed)."""
    return dequantize(
        tensor.data, tensor.tensor_type, torch_shape(tensor), name=tensor.name, out_dtype=out_dtype
    )

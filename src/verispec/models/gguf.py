"""GGUF checkpoints -> Hugging Face layout, dequantized by our own PyTorch code.

What this module does:

* ``dequantize`` / ``dequantize_tensor`` turn the raw ggml block bytes of F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors into float32 torch tensors with
  vectorized tensor ops (no python loop per block).
* ``gguf_config`` builds an HF ``config.json`` dict from GGUF metadata for the llama, qwen2,
  qwen3 and gemma3 architectures.
* ``hf_tensor_name`` / ``iter_hf_tensors`` rename GGUF tensors to HF names and undo the
  layout changes llama.cpp's converter made (llama Q/K rope permutation, gemma's +1 norms).
* ``convert_gguf_to_hf`` writes a complete HF folder (config, safetensors, generation config,
  tokenizer) atomically.

The ``gguf`` package is used only to parse the file (metadata, tensor infos, memory-mapped
bytes). Block layouts follow ggml's definitions (llama.cpp ggml-quants.c); the code is ours.

What it is checked against (tests/test_gguf.py):

* every supported type: our ``dequantize`` equals gguf-py's numpy ``gguf.quants.dequantize``
  bit for bit on valid random blocks;
* tiny random GGUF files written with ``gguf.GGUFWriter`` (llama, qwen2, qwen3, gemma3; every
  supported type among their tensors): our config and every tensor equal transformers' own
  GGUF loader (``AutoConfig`` and ``load_gguf_checkpoint``, which ``from_pretrained`` uses);
* real models (``real_model`` marker): SmolLM2-135M-Instruct Q4_1 (llama) and gemma-3-270m
  Q4_K_M (gemma3, also ``slow``) converted by ``convert_gguf_to_hf`` equal transformers' GGUF
  load field by field and tensor by tensor, and the tokenizer keeps the GGUF chat template.

Where we knowingly differ from transformers (both only on files the tests do not have): llama3
rope scaling is recovered from the ``rope_freqs`` tensor (transformers drops it), and qwen3's
head_dim comes from ``attention.key_length`` (transformers keeps Qwen3Config's default 128).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from tqdm.auto import tqdm

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "convert_gguf_to_hf",
    "dequantize",
    "dequantize_tensor",
    "gguf_config",
    "gguf_metadata",
    "hf_tensor_name",
    "iter_hf_tensors",
]

# --------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------

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


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first (ggml ne); PyTorch wants the reverse.
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def dequantize_tensor(tensor: ReaderTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one tensor of a ``GGUFReader`` into PyTorch layout (GGUF shape reversed)."""
    return dequantize(
        tensor.data, tensor.tensor_type, _torch_shape(tensor), name=tensor.name, out_dtype=out_dtype
    )


# --------------------------------------------------------------------------------------
# Metadata and config.json
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hf_class: str
    default_rope_theta: float


SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", 10000.0),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", 10000.0),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", 10000.0),
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", 1_000_000.0),
}

# HF Gemma3's defaults for what GGUF does not store.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_WINDOW_PATTERN = 6


def _field_item(field: ReaderField, index: int, value_type: GGUFValueType) -> Any:
    part = field.parts[index]
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def _field_value(field: ReaderField) -> Any:
    item_type = field.types[-1]
    items = [_field_item(field, i, item_type) for i in field.data]
    return items if field.types[0] == GGUFValueType.ARRAY else items[0]


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain python values (lists for arrays)."""
    return {key: _field_value(field) for key, field in reader.fields.items()}


def _scalar_per_model(value: Any, key: str) -> Any:
    """Some GGUF keys may be per-layer arrays; the supported HF configs need one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF key {key!r} varies per layer ({value}); not supported")
        return value[0]
    return value


def _llama3_rope_scaling(rope_freqs: Sequence[float], head_dim: int, theta: float) -> dict | None:
    """Recover HF's llama3 rope scaling from llama.cpp's precomputed ``rope_freqs`` tensor.

    llama.cpp stores only the per-frequency divisors: 1 for high frequencies, ``factor`` for
    low ones, and ``1 / ((1 - s) / factor + s)`` in between, where
    ``s = (L / wavelen - low) / (high - low)``. Those middle values pin down
    ``L / (high - low)`` and ``low / (high - low)``; with Llama 3's ``low_freq_factor = 1``
    (every Llama 3.x release) that gives ``high_freq_factor`` and ``L``.
    """
    divisors = np.asarray(rope_freqs, dtype=np.float64)
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq[: divisors.size]
    middle = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0}
    if middle.sum() >= 2:
        smooth = (1.0 / divisors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelen[middle], smooth, 1)
        low_over_span = -intercept
        span = 1.0 / low_over_span  # high - low, with low = 1
        scaling["high_freq_factor"] = round(1.0 + span, 4)
        scaling["original_max_position_embeddings"] = int(round(slope * span))
    else:
        # Too few transition frequencies to solve for them: Llama 3.x's published values.
        scaling.update(high_freq_factor=4.0, original_max_position_embeddings=8192)
    return scaling


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original and kind == "yarn":
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _gemma3_attention_pattern(meta: Mapping[str, Any], n_layers: int) -> dict:
    """layer_types (and the period, when there is one) of Gemma 3's local/global layers.

    Newer llama.cpp files may store the pattern: a per-layer bool list (True = sliding) or a
    period. Otherwise Gemma 3's fixed rule applies: every 6th layer attends globally.
    """
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):
        kinds = ["sliding_attention" if s else "full_attention" for s in pattern[:n_layers]]
        return {"layer_types": kinds}
    kinds = [
        "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    return {"sliding_window_pattern": int(pattern), "layer_types": kinds}


def _gemma3_fields(meta: Mapping[str, Any], config: dict) -> dict:
    n_layers = config["num_hidden_layers"]
    # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 62-layer 27B model and by
    # 1/sqrt(head_dim) otherwise (as do HF's released configs); GGUF stores no scalar.
    if n_layers == 62:
        query_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_scalar = config["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": float(
            meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)
        ),
        "sliding_window": int(meta.get("gemma3.attention.sliding_window", 4096)),
        **_gemma3_attention_pattern(meta, n_layers),
        "query_pre_attn_scalar": query_scalar,
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
    }


def _vocab_size(meta: Mapping[str, Any], arch: str) -> int:
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
    return len(tokens)


def _head_dim(meta: Mapping[str, Any], arch: str, hidden: int, heads: int) -> int:
    if f"{arch}.attention.key_length" in meta:
        return int(meta[f"{arch}.attention.key_length"])
    # llama.cpp's llama writer stores the head size only as the (full) rope dimension.
    if arch == "llama" and f"{arch}.rope.dimension_count" in meta:
        return int(meta[f"{arch}.rope.dimension_count"])
    return hidden // heads


def _token_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    ids = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            ids[hf_key] = int(meta[gguf_key])
    return ids


def _architecture(meta: Mapping[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return arch


def _attention_bias_fields(arch: str, tensor_names: set[str]) -> dict:
    has_qkv_bias = "blk.0.attn_q.bias" in tensor_names
    if arch == "llama":
        return {"attention_bias": has_qkv_bias, "mlp_bias": "blk.0.ffn_up.bias" in tensor_names}
    if arch == "qwen3":
        return {"attention_bias": has_qkv_bias}
    return {}  # qwen2 always has q/k/v biases; gemma3 never


def _rope_freqs(reader: GGUFReader) -> list[float] | None:
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if tensor is None else dequantize_tensor(tensor).tolist()


def gguf_config(
    reader_or_metadata: GGUFReader | Mapping[str, Any],
    *,
    tensor_names: Iterable[str] | None = None,
    rope_freqs: Sequence[float] | None = None,
) -> dict[str, Any]:
    """An HF ``config.json`` dict for a GGUF file, from its metadata.

    Pass a ``GGUFReader`` (tensor names and llama3 ``rope_freqs`` are read from it), or a
    metadata mapping as returned by ``gguf_metadata`` together with the file's
    ``tensor_names`` (without them the embeddings are taken as tied) and ``rope_freqs``.
    Rope settings use the legacy keys (``rope_theta``, ``rope_scaling``,
    ``rope_local_base_freq``) that transformers 4.x reads and 5.x converts.
    Raises ValueError for an architecture other than llama, qwen2, qwen3 and gemma3.
    """
    if isinstance(reader_or_metadata, GGUFReader):
        reader = reader_or_metadata
        meta = gguf_metadata(reader)
        tensor_names = [t.name for t in reader.tensors]
        rope_freqs = _rope_freqs(reader)
    else:
        meta = reader_or_metadata
    names = set(tensor_names or ())
    arch = _architecture(meta)
    spec = SUPPORTED_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return _scalar_per_model(meta.get(f"{arch}.{key}", default), f"{arch}.{key}")

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "vocab_size": _vocab_size(meta, arch),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": _head_dim(meta, arch, hidden, heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", spec.default_rope_theta)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        **_token_ids(meta),
        **_attention_bias_fields(arch, names),
    }
    if arch != "gemma3":
        config["hidden_act"] = "silu"
    if arch == "gemma3":
        config.update(_gemma3_fields(meta, config))
    scaling = _rope_scaling(meta, arch)
    if scaling is None and rope_freqs is not None and arch == "llama":
        scaling = _llama3_rope_scaling(rope_freqs, config["head_dim"], config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


# --------------------------------------------------------------------------------------
# Tensor names and layouts
# --------------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    # llama/qwen: the one norm before the MLP is HF's post_attention_layernorm
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp calls the pre-MLP one ffn_norm as well.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Present in GGUF files but carried by config.json in HF (llama3 rope scaling).
_TENSORS_NOT_IN_HF = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str, architecture: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors HF does not keep.

    Raises ValueError for a name this converter does not know, so nothing is dropped silently.
    """
    if gguf_name in _TENSORS_NOT_IN_HF:
        return None
    stem, dot, suffix = gguf_name.rpartition(".")
    if dot and suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        table = _GEMMA3_LAYER_TENSORS if architecture == "gemma3" else _LAYER_TENSORS
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name for {architecture!r}")


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's llama Q/K row permutation.

    HF keeps each head's rotary pairs as (first half, second half); llama.cpp's converter
    interleaves them (row 2i, 2i+1 = pair i) for ggml's rope, per head.
    """
    rows_per_head = weight.shape[0] // n_heads
    per_head = weight.reshape(n_heads, rows_per_head // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def _to_hf_layout(gguf_name: str, weight: torch.Tensor, config: Mapping[str, Any]) -> torch.Tensor:
    """Undo the layout changes llama.cpp's converter applied to this tensor."""
    model_type = config["model_type"]
    if model_type == "llama" and ".attn_q." in gguf_name:
        return _unpermute_rope_rows(weight, config["num_attention_heads"])
    if model_type == "llama" and ".attn_k." in gguf_name:
        return _unpermute_rope_rows(weight, config["num_key_value_heads"])
    if model_type == "gemma3_text" and gguf_name.endswith("norm.weight"):
        # llama.cpp stores gemma norms as 1 + w (it multiplies by the stored value); HF's
        # Gemma3RMSNorm multiplies by (1 + w) itself.
        return weight - 1.0
    return weight


@dataclass(frozen=True)
class _PlannedTensor:
    source: ReaderTensor
    hf_name: str
    shape: tuple[int, ...]


def _reader_architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    return _architecture({"general.architecture": None if field is None else _field_value(field)})


def _plan(reader: GGUFReader, config: Mapping[str, Any]) -> list[_PlannedTensor]:
    arch = _reader_architecture(reader)
    plan = []
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name, arch)
        if hf_name is None:
            continue
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        plan.append(_PlannedTensor(tensor, hf_name, _torch_shape(tensor)))
    return plan


def _convert_planned(item: _PlannedTensor, config: Mapping[str, Any], dtype: torch.dtype) -> torch.Tensor:
    # Layout fixes happen in float32 so the result equals transformers' float32 path.
    weight = _to_hf_layout(item.source.name, dequantize_tensor(item.source), config)
    return weight.to(dtype).contiguous()


def iter_hf_tensors(
    reader: GGUFReader,
    config: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the file, in HF layout and ``dtype``.

    One tensor is materialized at a time. ``config`` defaults to ``gguf_config(reader)``.
    """
    config = gguf_config(reader) if config is None else config
    for item in _plan(reader, config):
        yield item.hf_name, _convert_planned(item, config, dtype)


# --------------------------------------------------------------------------------------
# Writing an HF folder
# --------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _safetensors_header(plan: list[_PlannedTensor], dtype: torch.dtype) -> bytes:
    item_size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan:
        size = int(np.prod(item.shape, dtype=np.int64)) * item_size
        header[item.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # safetensors wants the data to start 8-byte aligned; the spec pads with spaces.
    return encoded + b" " * (-len(encoded) % 8)


def _write_safetensors(
    path: Path,
    plan: list[_PlannedTensor],
    config: Mapping[str, Any],
    dtype: torch.dtype,
    progress: bool,
) -> None:
    """Stream tensors into one safetensors file, so only one tensor is in memory at a time.

    The header is known up front because dequantization does not change shapes.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this host is not")
    header = _safetensors_header(plan, dtype)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for item in tqdm(plan, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
            weight = _convert_planned(item, config, dtype)
            f.write(weight.reshape(-1).view(torch.uint8).numpy().data)


def _stop_token_ids(meta: Mapping[str, Any], config: Mapping[str, Any]) -> list[int]:
    """eos plus the end-of-turn tokens a chat model stops on (llama.cpp treats them as EOG)."""
    ids = [config["eos_token_id"]] if "eos_token_id" in config else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta:
            ids.append(int(meta[key]))
    if config["model_type"] == "gemma3_text":
        # Google's gemma-3 generation_config stops on <end_of_turn> as well as <eos>.
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens:
            ids.append(tokens.index("<end_of_turn>"))
    return list(dict.fromkeys(ids))


def _write_generation_config(out: Path, meta: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    stops = _stop_token_ids(meta, config)
    generation: dict[str, Any] = {
        key: config[key] for key in ("bos_token_id", "pad_token_id") if key in config
    }
    if stops:
        generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _write_tokenizer(out: Path, gguf_path: Path, meta: Mapping[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = meta.get("tokenizer.chat_template")
    if template is not None and tokenizer.chat_template != template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))


def _install_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` folder to ``out`` (renames on one filesystem)."""
    if out.exists():
        if not overwrite and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True)")
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def _single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one thread for the duration of a conversion.

    Dequantization is a stream of cheap memory-bound ops on modest chunks. On a shared,
    oversubscribed machine torch's worker threads mostly wait on each other: measured on 2
    busy cores, 2 threads were 20x slower than 1, and 1 thread keeps pace with gguf-py's
    numpy. The previous setting is restored afterwards.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    *,
    overwrite: bool = False,
) -> Path:
    """Convert a GGUF file into an HF model folder and return the folder's path.

    Writes config.json, model.safetensors (dequantized, HF names and layout, in ``dtype``;
    no lm_head when tied), generation_config.json and the tokenizer files (with the GGUF chat
    template). Everything is written into a temporary sibling folder that is renamed into
    place at the end, so an interrupted conversion never leaves a partial ``out_dir``.
    An existing non-empty ``out_dir`` is replaced only with ``overwrite=True``.
    No pickle is loaded and no remote code is run.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    gguf_path = Path(gguf_path)
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True)")
    reader = GGUFReader(gguf_path)
    meta = gguf_metadata(reader)
    config = gguf_config(
        meta, tensor_names=[t.name for t in reader.tensors], rope_freqs=_rope_freqs(reader)
    )
    plan = _plan(reader, config)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        hf_config = {**config, "dtype": str(dtype).removeprefix("torch.")}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _write_generation_config(tmp, meta, config)
        with _single_threaded_torch():
            _write_safetensors(tmp / "model.safetensors", plan, config, dtype, progress)
        _write_tokenizer(tmp, gguf_path, meta)
        _install_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

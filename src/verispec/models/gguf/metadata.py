"""GGUF metadata -> a Hugging Face ``config.json`` dict.

``gguf_metadata`` reads a file's key/value metadata as plain python values; ``gguf_config``
builds an HF ``config.json`` dict from it for the llama, qwen2, qwen3 and gemma3
architectures (``SUPPORTED_ARCHITECTURES``, read off models/families.py).

What it is checked against (tests/test_gguf.py):

* tiny random GGUF files written with ``gguf.GGUFWriter`` (llama, qwen2, qwen3, gemma3): our
  config, read back by ``AutoConfig``, equals transformers' own GGUF ``AutoConfig``;
* real models (``real_model`` marker): the config.json converted from SmolLM2-135M-Instruct
  Q4_1 (llama) and gemma-3-270m Q4_K_M (gemma3, also ``slow``) equals transformers' GGUF
  config field by field.

Where we knowingly differ from transformers (both only on files the tests do not have): llama3
rope scaling is recovered from the ``rope_freqs`` tensor (transformers drops it), and qwen3's
head_dim comes from ``attention.key_length`` (transformers keeps Qwen3Config's default 128).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

from verispec.models.families import FAMILIES, gguf_family
from verispec.models.gguf.dequant import dequantize_tensor

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "gguf_config",
    "gguf_metadata",
    "read_rope_freqs",
    "reader_architecture",
]


SUPPORTED_ARCHITECTURES = tuple(sorted(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch))

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


# config fields a family stores under its own GGUF keys (the others only need hidden_act)
_FAMILY_FIELDS = {"gemma3_text": _gemma3_fields}


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
    if gguf_family(arch).gguf_head_dim_from_rope and f"{arch}.rope.dimension_count" in meta:
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
    gguf_family(arch)  # UnsupportedModelError (a ValueError) naming the supported ones
    return arch


def reader_architecture(reader: GGUFReader) -> str:
    """The file's supported architecture, read without converting all of its metadata."""
    field = reader.fields.get("general.architecture")
    return _architecture({"general.architecture": None if field is None else _field_value(field)})


_BIAS_TENSORS = {"attention_bias": "blk.0.attn_q.bias", "mlp_bias": "blk.0.ffn_up.bias"}


def _attention_bias_fields(arch: str, tensor_names: set[str]) -> dict:
    """The bias flags a family reads off the file's tensors (qwen2 always has q/k/v
    biases, gemma3 never: their configs need no flag)."""
    return {flag: _BIAS_TENSORS[flag] in tensor_names for flag in gguf_family(arch).gguf_bias_from_tensors}


def read_rope_freqs(reader: GGUFReader) -> list[float] | None:
    """llama3's ``rope_freqs`` tensor as a list, or None when the file has none."""
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
        rope_freqs = read_rope_freqs(reader)
    else:
        meta = reader_or_metadata
    names = set(tensor_names or ())
    arch = _architecture(meta)
    fam = gguf_family(arch)

    def get(key: str, default: Any = None) -> Any:
        return _scalar_per_model(meta.get(f"{arch}.{key}", default), f"{arch}.{key}")

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [fam.hf_class],
        "model_type": fam.name,
        "vocab_size": _vocab_size(meta, arch),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": _head_dim(meta, arch, hidden, heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", fam.gguf_rope_theta)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        **_token_ids(meta),
        **_attention_bias_fields(arch, names),
    }
    extra = _FAMILY_FIELDS.get(fam.name)
    config.update(extra(meta, config) if extra else {"hidden_act": "silu"})
    scaling = _rope_scaling(meta, arch)
    if scaling is None and rope_freqs is not None and fam.gguf_rope_freqs:
        scaling = _llama3_rope_scaling(rope_freqs, config["head_dim"], config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config

"""GGUF tensors -> Hugging Face tensors: names and layouts.

``hf_tensor_name`` / ``iter_hf_tensors`` rename GGUF tensors to HF names and undo the
layout changes llama.cpp's converter made: the llama Q/K rope row permutation and gemma's
norms stored as ``1 + w``. ``plan_tensors`` / ``convert_planned`` are the same steps one
tensor at a time, for the streaming writer in ``convert``.

What it is checked against (tests/test_gguf.py):

* tiny random GGUF files written with ``gguf.GGUFWriter`` (llama, qwen2, qwen3, gemma3; every
  supported type among their tensors): every tensor of ``iter_hf_tensors`` equals
  transformers' own GGUF loader (``load_gguf_checkpoint``, which ``from_pretrained`` uses),
  names included;
* real models (``real_model`` marker): SmolLM2-135M-Instruct Q4_1 (llama) and gemma-3-270m
  Q4_K_M (gemma3, also ``slow``) equal transformers' GGUF load tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGUFReader, ReaderTensor

from verispec.models.families import family, gguf_family
from verispec.models.gguf.dequant import dequantize_tensor, torch_shape
from verispec.models.gguf.metadata import gguf_config, reader_architecture

__all__ = ["PlannedTensor", "convert_planned", "hf_tensor_name", "iter_hf_tensors", "plan_tensors"]

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
        table = _GEMMA3_LAYER_TENSORS if gguf_family(architecture).gemma_layers else _LAYER_TENSORS
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
    fam = family(config["model_type"])
    if fam.gguf_permuted_qk and ".attn_q." in gguf_name:
        return _unpermute_rope_rows(weight, config["num_attention_heads"])
    if fam.gguf_permuted_qk and ".attn_k." in gguf_name:
        return _unpermute_rope_rows(weight, config["num_key_value_heads"])
    if fam.gguf_norms_plus_one and gguf_name.endswith("norm.weight"):
        # llama.cpp stores gemma norms as 1 + w (it multiplies by the stored value); HF's
        # Gemma3RMSNorm multiplies by (1 + w) itself.
        return weight - 1.0
    return weight


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor that goes into the HF folder, under ``hf_name`` with ``shape``."""

    source: ReaderTensor
    hf_name: str
    shape: tuple[int, ...]


def plan_tensors(reader: GGUFReader, config: Mapping[str, Any]) -> list[PlannedTensor]:
    """The tensors HF keeps, in file order (no lm_head when tied, no rope_freqs)."""
    arch = reader_architecture(reader)
    plan = []
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name, arch)
        if hf_name is None:
            continue
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        plan.append(PlannedTensor(tensor, hf_name, torch_shape(tensor)))
    return plan


def convert_planned(item: PlannedTensor, config: Mapping[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one planned tensor into HF layout and ``dtype``."""
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
    for item in plan_tensors(reader, config):
        yield item.hf_name, convert_planned(item, config, dtype)

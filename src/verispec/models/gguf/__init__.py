"""GGUF checkpoints -> Hugging Face layout, dequantized by our own PyTorch code.

One module per step, each saying what it is checked against (tests/test_gguf.py):

* ``dequant``: ``dequantize`` / ``dequantize_tensor`` turn the raw ggml block bytes of F32,
  F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors into float32 torch
  tensors with vectorized tensor ops (no python loop per block).
* ``metadata``: ``gguf_config`` builds an HF ``config.json`` dict from GGUF metadata for the
  llama, qwen2, qwen3 and gemma3 architectures.
* ``tensor_mapping``: ``hf_tensor_name`` / ``iter_hf_tensors`` rename GGUF tensors to HF
  names and undo the layout changes llama.cpp's converter made (llama Q/K rope permutation,
  gemma's +1 norms).
* ``convert``: ``convert_gguf_to_hf`` writes a complete HF folder (config, safetensors,
  generation config, tokenizer) atomically.

The ``gguf`` package is used only to parse the file (metadata, tensor infos, memory-mapped
bytes). Block layouts follow ggml's definitions (llama.cpp ggml-quants.c); the code is ours.
"""

from verispec.models.gguf.convert import convert_gguf_to_hf
from verispec.models.gguf.dequant import SUPPORTED_TYPES, dequantize, dequantize_tensor
from verispec.models.gguf.metadata import SUPPORTED_ARCHITECTURES, gguf_config, gguf_metadata
from verispec.models.gguf.tensor_mapping import hf_tensor_name, iter_hf_tensors

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

"""The model families verispec runs, as one table of facts.

Everything that differs between llama, qwen2, qwen3, gemma3 and gemma4 and is not a number in
the checkpoint's config lives here: how config.json names the family, what it defaults,
which layer flavour it has, how llama.cpp's GGUF converter changed its tensors, what
DeepSpec calls its DSpark drafter. The readers consult this table instead of testing
family names: models/config.py (ModelArgs), models/loader.py (through ModelArgs),
models/gguf/ (metadata, tensor names and layouts, stop tokens), drafting/dspark/config.py.

Adding a family: docs/architecture.md, "Adding a model family", has the checklist; the
test to copy is the family's entry in tests/tiny_models.py (a tiny random transformers
config), which tests/test_models_vs_transformers.py, tests/test_spec.py and
tests/test_dspark_families.py then run against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is not implemented."""


@dataclass(frozen=True)
class Family:
    name: str  # ModelArgs.model_type: transformers' text model_type
    config_types: tuple[str, ...]  # config.json model_type values read as this family
    hf_class: str  # `architectures` of a config.json written from a GGUF
    dspark_class: str  # DeepSpec's `architectures` for a DSpark drafter of this target
    rope_theta: float = 10000.0  # when config.json gives none
    # layer flavour
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    qkv_bias: bool = False  # q/k/v always biased, o_proj never (qwen2); else config's attention_bias on all four
    gemma_layers: bool = False  # (1 + w) float32 norms, sandwich norms, sqrt(hidden) embedding scale,
    # query_pre_attn_scalar, final-logit soft-cap, gelu-tanh, tied embeddings by default
    gemma4_layers: bool = False  # on top of gemma_layers: x * w norms (no + 1), a scale-less v-norm,
    # attention scale 1, per-layer-type head size and KV heads (K = V on global layers), per-layer
    # scalars, KV sharing, per-layer embeddings, MoE (config.py _gemma4_fields)
    sliding: Literal["none", "opt_in", "interleaved"] = "none"  # opt_in: qwen's use_sliding_window;
    # interleaved: gemma3's local/global layer pattern (layer_types or sliding_window_pattern)
    default_sliding_window: int = 4096  # when an interleaved config names none
    # GGUF (llama.cpp's converter)
    gguf_arch: str | None = None  # general.architecture
    gguf_rope_theta: float = 10000.0  # when the GGUF stores no rope.freq_base
    gguf_permuted_qk: bool = False  # q/k rows interleaved for ggml's rope (llama)
    gguf_norms_plus_one: bool = False  # norm weights stored as 1 + w (gemma)
    gguf_bias_from_tensors: tuple[str, ...] = ()  # config flags read off which bias tensors exist
    gguf_rope_freqs: bool = False  # llama3 rope scaling stored as a rope_freqs tensor
    gguf_head_dim_from_rope: bool = False  # head size stored only as the rope dimension
    extra_stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens its generation config stops on


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama", "mistral"), "LlamaForCausalLM", "LlamaDSparkModel",
           gguf_arch="llama", gguf_permuted_qk=True, gguf_bias_from_tensors=("attention_bias", "mlp_bias"),
           gguf_rope_freqs=True, gguf_head_dim_from_rope=True),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", "Qwen2DSparkModel", qkv_bias=True, sliding="opt_in",
           gguf_arch="qwen2"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", "Qwen3DSparkModel", rope_theta=1e6, qk_norm=True,
           sliding="opt_in", gguf_arch="qwen3", gguf_bias_from_tensors=("attention_bias",)),
    Family("gemma3_text", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM", "Gemma3DSparkModel", qk_norm=True,
           gemma_layers=True, sliding="interleaved", gguf_arch="gemma3", gguf_rope_theta=1_000_000.0,
           gguf_norms_plus_one=True, extra_stop_tokens=("<end_of_turn>",)),
    Family("gemma4_text", ("gemma4_text", "gemma4"), "Gemma4ForCausalLM", "Gemma4DSparkModel", qk_norm=True,
           gemma_layers=True, gemma4_layers=True, sliding="interleaved", default_sliding_window=512),
)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_BY_CONFIG_TYPE = {t: f for f in FAMILIES.values() for t in f.config_types}
_BY_GGUF_ARCH = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}


def family(model_type: str | None) -> Family:
    """The family a config.json `model_type` (or ModelArgs.model_type) names."""
    found = _BY_CONFIG_TYPE.get(model_type or "")
    if found is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return found


def is_family(model_type: str | None) -> bool:
    return (model_type or "") in _BY_CONFIG_TYPE


def gguf_family(arch: str | None) -> Family:
    """The family of a GGUF `general.architecture`."""
    found = _BY_GGUF_ARCH.get(arch or "")
    if found is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_BY_GGUF_ARCH))}")
    return found

"""ModelArgs: one dataclass describing every decoder family we run.

Family differences are *data* here (norm flavour, activation, biases, QK-norm, sliding
layers, embedding scale, soft-caps), so `decoder.py` stays one decoder. `from_hf_config`
reads a Hugging Face `config.json` dict — both the transformers 4.x spelling
(`rope_theta`, `rope_scaling`) and the 5.x spelling (`rope_parameters`, per layer type for
gemma3). Checked by tests/test_models_vs_transformers.py: for each family a config built
by transformers itself is read here and the resulting model matches transformers' logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from verispec.models.families import SUPPORTED_MODEL_TYPES, Family, UnsupportedModelError, family

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "ModelFilesError", "RopeArgs", "UnsupportedModelError",
           "from_hf_config", "read_config"]


class ModelFilesError(FileNotFoundError):
    """A model folder is missing files we need."""


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFilesError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class RopeArgs:
    """Rotary embedding of one layer type: base and frequency scaling."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | proportional
    factor: float = 1.0
    partial: float = 1.0  # proportional (gemma4): share of head_dim that rotates, the rest has frequency 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, head_dim: int) -> "torch.Tensor":  # noqa: F821
        import torch

        if self.kind == "proportional":  # gemma4's global layers: the first partial * head_dim / 2 angles
            angles = int(self.partial * head_dim // 2)  # rotate at the full-width frequencies, the rest not at all
            rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
            return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / self.factor
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "default":
            return inv
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            return _llama3_scaled(inv, self)
        raise UnsupportedModelError(
            f"rope scaling type {self.kind!r} is not supported (default, linear, llama3, proportional)")


def _llama3_scaled(inv_freq, rope: RopeArgs):
    """Llama 3.1 frequency-dependent rescaling: long wavelengths slowed by `factor`,
    short ones untouched, a smooth blend in between (Meta's reference formula)."""
    import torch

    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


@dataclass(frozen=True)
class MoEArgs:
    """gemma4's mixture-of-experts block beside the dense MLP of every layer."""

    num_experts: int
    top_k: int
    intermediate_size: int


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v
    o_proj_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # silu | gelu_tanh
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over head_dim before RoPE
    # gemma: weight applied as (1 + w), and the product is cast to the input dtype
    # after multiplying (llama casts before). Matters only in bf16, but it is cheap to
    # be exact.
    norm_offset: float = 0.0
    norm_in_f32: bool = False  # gemma3, gemma4: the weight multiplies in float32, the product is cast once
    sandwich_norms: bool = False  # gemma3: extra post-attention / pre+post-FFN norms
    embed_scale: float = 1.0  # gemma: sqrt(hidden_size)
    attn_scale: float | None = None  # None = head_dim ** -0.5
    # No attention-logit soft-cap: gemma3 checkpoints set it to null, and transformers'
    # Gemma3 ignores the field even when set (tests/tiny_models.py "gemma3-softcap").
    final_logit_softcap: float | None = None
    # one entry per layer: None for global attention, else the sliding window size
    layer_windows: tuple[int | None, ...] = ()
    rope_global: RopeArgs = field(default_factory=RopeArgs)
    rope_local: RopeArgs = field(default_factory=RopeArgs)
    # gemma4. Attention geometry per layer (empty: head_dim / num_kv_heads everywhere): its
    # global layers have their own head size and KV heads, and may take V = the raw k_proj
    # output (attention_k_eq_v: no v_proj).
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_k_eq_v: tuple[bool, ...] = ()
    # KV sharing: layer i attends over the keys/values of layer kv_source[i] (== i: its own; < 0:
    # layer -1 - kv_source of another model, the gemma4 assistant's target); a sharing layer has
    # no k/v projections and no cache of its own
    kv_source: tuple[int, ...] = ()
    layer_intermediate: tuple[int, ...] = ()  # MLP width per layer (double-wide MLPs on sharing layers)
    v_norm: bool = False  # scale-less RMSNorm over head_dim on values
    layer_scalar: bool = False  # each layer's output multiplied by a stored scalar
    per_layer_input: int = 0  # per-layer embeddings (PLE) width, 0 = none
    per_layer_vocab: int = 0
    moe: MoEArgs | None = None

    def head_dim_at(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_at(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def k_eq_v_at(self, layer: int) -> bool:
        return bool(self.layer_k_eq_v) and self.layer_k_eq_v[layer]

    def kv_source_at(self, layer: int) -> int:
        return self.kv_source[layer] if self.kv_source else layer

    def intermediate_at(self, layer: int) -> int:
        return self.layer_intermediate[layer] if self.layer_intermediate else self.intermediate_size

    @property
    def uniform_attention(self) -> bool:
        """Every layer has the same heads, head size and its own K and V (all but gemma4)."""
        return (len(set(self.layer_head_dims)) <= 1 and len(set(self.layer_kv_heads)) <= 1
                and not any(self.layer_k_eq_v) and not self.kv_source)


def _rope_from(params: dict | None, default_theta: float) -> RopeArgs:
    params = dict(params or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    return RopeArgs(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        partial=float(params.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _rope_settings(cfg: dict, fam: Family) -> tuple[RopeArgs, RopeArgs]:
    """(global, local) rope for the config, accepting both transformers spellings."""
    params = cfg.get("rope_parameters")
    theta = float(cfg.get("rope_theta", fam.rope_theta))
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope_from(params["full_attention"], theta)
        local = _rope_from(params.get("sliding_attention") or params["full_attention"], theta)
        return full, local
    if isinstance(params, dict) and params:
        full = _rope_from(params, theta)
    else:
        scaling = cfg.get("rope_scaling") or {}
        full = _rope_from({**scaling, "rope_theta": theta}, theta)
    local_theta = cfg.get("rope_local_base_freq")
    local = RopeArgs(theta=float(local_theta)) if local_theta is not None else full
    return full, local


def _layer_types(cfg: dict, fam: Family, num_layers: int) -> list[str]:
    """Interleaved families: the config's layer_types, else every `pattern`-th layer global."""
    layer_types = list(cfg.get("layer_types") or [])
    if not layer_types:
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if fam.gemma4_layers:  # transformers forces gemma4's last layer global
        layer_types[-1] = "full_attention"
    return layer_types


def _layer_windows(cfg: dict, fam: Family, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if fam.sliding == "interleaved":
        window = window if window is not None else fam.default_sliding_window
        return tuple(int(window) if t == "sliding_attention" else None for t in _layer_types(cfg, fam, num_layers))
    # qwen2/3 ship sliding_window in config but use it only when use_sliding_window is
    # true (and then only on layers >= max_window_layers).
    if fam.sliding == "opt_in" and cfg.get("use_sliding_window") and window:
        if layer_types:
            return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


GEMMA4_ROPE = {  # transformers' Gemma4TextConfig default rope_parameters
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _gemma4_fields(cfg: dict, fam: Family, num_layers: int, head_dim: int, kv_heads: int, intermediate: int) -> dict:
    """The ModelArgs fields only gemma4 sets, with transformers' Gemma4TextConfig defaults
    for what config.json leaves out."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("gemma4 with use_bidirectional_attention 'all' (an encoder) is not a decoder we run")
    types = _layer_types(cfg, fam, num_layers)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = cfg.get("per_layer_config")  # transformers >= 5.2x writes this instead of the global_* fields
    if not isinstance(overrides, dict):
        global_kv = cfg.get("num_global_key_value_heads")
        full = {"head_dim": int(cfg.get("global_head_dim", 512))}
        if k_eq_v and global_kv is not None:
            full["num_key_value_heads"] = int(global_kv)
        overrides = {"full_attention": full}

    def override(i: int, field: str, default: int) -> int:
        found = overrides.get(str(i), overrides.get(i)) or overrides.get(types[i]) or {}
        return int(found.get(field, default))
    shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
    first_shared = num_layers - shared
    if shared and not 0 < first_shared:
        raise UnsupportedModelError("a gemma4 target whose every layer shares another's KV (an assistant) "
                                    "is a draft source, not a model to serve")
    producers = {t: max(j for j in range(first_shared) if types[j] == t) for t in set(types[:first_shared])}
    if shared and set(producers) != set(types):
        raise UnsupportedModelError("gemma4 KV sharing: a layer type that shares KV has no earlier layer to share")
    source = tuple(i if i < first_shared else producers[types[i]] for i in range(num_layers))
    double = bool(cfg.get("use_double_wide_mlp", False))
    moe = None
    if cfg.get("enable_moe_block"):
        moe = MoEArgs(int(cfg["num_experts"]), int(cfg["top_k_experts"]), int(cfg["moe_intermediate_size"]))
    ple = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    return dict(
        layer_head_dims=tuple(override(i, "head_dim", head_dim) for i in range(num_layers)),
        layer_kv_heads=tuple(override(i, "num_key_value_heads", kv_heads) for i in range(num_layers)),
        layer_k_eq_v=tuple(k_eq_v and t == "full_attention" for t in types),
        kv_source=source if shared else (),
        layer_intermediate=tuple(intermediate * (2 if double and source[i] != i else 1) for i in range(num_layers)),
        v_norm=True,
        layer_scalar=True,
        per_layer_input=ple,
        per_layer_vocab=int(cfg.get("vocab_size_per_layer_input", 262_144) or 0) if ple else 0,
        moe=moe,
        attn_scale=1.0,  # gemma4 relies on its q/k norms instead of 1/sqrt(d)
        norm_offset=0.0,  # Gemma4RMSNorm multiplies by w itself (float32), not by 1 + w
    )


def from_hf_config(cfg: dict) -> ModelArgs:
    """Translate a Hugging Face config.json dict into ModelArgs."""
    if "text_config" in cfg and cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        # multimodal checkpoints nest the text model; we serve the text part only
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    fam = family(cfg.get("model_type"))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(cfg["num_hidden_layers"])
    if fam.gemma4_layers and not cfg.get("rope_parameters"):
        cfg = {**cfg, "rope_parameters": GEMMA4_ROPE}
    rope_global, rope_local = _rope_settings(cfg, fam)
    gemma = fam.gemma_layers
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        act = "gelu_tanh"
    elif act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    qpas = cfg.get("query_pre_attn_scalar")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    extra = _gemma4_fields(cfg, fam, num_layers, head_dim, kv_heads, int(cfg["intermediate_size"])) \
        if fam.gemma4_layers else {}
    fields = dict(
        model_type=fam.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        # qwen2 hard-wires bias on q/k/v only; the others put attention_bias on all four
        attention_bias=fam.qkv_bias or bool(cfg.get("attention_bias", False)),
        o_proj_bias=not fam.qkv_bias and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        activation=act,
        qk_norm=fam.qk_norm,
        norm_offset=1.0 if gemma else 0.0,
        norm_in_f32=gemma,
        sandwich_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        attn_scale=float(qpas) ** -0.5 if (gemma and qpas) else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        layer_windows=_layer_windows(cfg, fam, num_layers),
        rope_global=rope_global,
        rope_local=rope_local,
    )
    fields.update(extra)
    return ModelArgs(**fields)

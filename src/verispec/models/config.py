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
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, head_dim: int) -> "torch.Tensor":  # noqa: F821
        import torch

        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "default":
            return inv
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            return _llama3_scaled(inv, self)
        raise UnsupportedModelError(f"rope scaling type {self.kind!r} is not supported (default, linear, llama3)")


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


def _rope_from(params: dict | None, default_theta: float) -> RopeArgs:
    params = dict(params or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    return RopeArgs(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
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


def _layer_windows(cfg: dict, fam: Family, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if fam.sliding == "interleaved":
        if not layer_types:
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    # qwen2/3 ship sliding_window in config but use it only when use_sliding_window is
    # true (and then only on layers >= max_window_layers).
    if fam.sliding == "opt_in" and cfg.get("use_sliding_window") and window:
        if layer_types:
            return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


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
    rope_global, rope_local = _rope_settings(cfg, fam)
    gemma = fam.gemma_layers
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        act = "gelu_tanh"
    elif act != "silu":
        raise UnsupportedModelError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    qpas = cfg.get("query_pre_attn_scalar")
    return ModelArgs(
        model_type=fam.name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
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
        sandwich_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        attn_scale=float(qpas) ** -0.5 if (gemma and qpas) else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        layer_windows=_layer_windows(cfg, fam, num_layers),
        rope_global=rope_global,
        rope_local=rope_local,
    )

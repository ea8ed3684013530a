"""DSpark drafter configuration, read from and written to DeepSpec's `config.json`.

DeepSpec builds a drafter's config by copying the target's config and overriding a few
fields (dspark-spec.md §2.1): `architectures = ["Qwen3DSparkModel"]`, `num_hidden_layers` (draft
layers), `block_size` (gamma), `mask_token_id`, `target_layer_ids`, `num_target_layers`,
`num_anchors`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `layer_types` all full attention, `tie_word_embeddings`
false. Every width is the target's, so the draft layers follow the target family's
attention flavour; `ModelArgs` (models/config.py) reads that flavour from the same dict.

DeepSpec ships Qwen3 (and Gemma4) drafters; for our other families the architecture is
named the same way (`LlamaDSparkModel`, `Qwen2DSparkModel`, `Gemma3DSparkModel`) and the
file is otherwise identical. One extension of ours: `draft_vocab_size` (with a
`draft_vocab_ids` tensor in the weights) restricts the draft head and the Markov output
to the most frequent target tokens, which on a CPU is most of the drafting cost
(bench/dspark_cost.py); DeepSpec's files never set it and are read as full-vocabulary.
A second, `markov_vocab = "draft"` (only with a draft vocabulary), gives the Markov head's
previous-token embedding one row per draft-vocabulary token plus one shared row for every
other token, instead of one row per target token: on a 262,144-token vocabulary (Gemma)
that embedding alone is 16.8M parameters at rank 64. Absent, it is "full" (DeepSpec's).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from verispec.models.config import ModelArgs, from_hf_config
from verispec.models.families import FAMILIES, family, is_family

ARCHITECTURES = {name: f.dspark_class for name, f in FAMILIES.items()}  # target family -> DeepSpec's class
SEQUENTIAL_HEADS = ("vanilla", "gated", "rnn")


def _threshold(value) -> float | list[float]:
    if isinstance(value, list):
        return [float(v) for v in value]
    return float(value or 0.0)


def _temperatures(value, block_size: int) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != block_size or not all(
            isinstance(v, (int, float)) and v > 0 and math.isfinite(v) for v in value):
        raise DraftCheckpointError(f"confidence_temperature must be {block_size} positive numbers (one per draft "
                                   f"position), got {value!r}")
    return [float(v) for v in value]


def _gemma4_draft_base(target: dict) -> dict:
    """DeepSpec's Gemma4 builder: the target's text config (a multimodal target's `text_config`),
    the target types recorded, dense draft layers without per-layer embeddings. The global
    layers' head size and KV heads are written as `global_head_dim` / `num_global_key_value_heads`
    (transformers >= 5.2x writes them per target layer index, which the draft stack does not share)."""
    text = copy.deepcopy(target.get("text_config") or target)
    target_args = from_hf_config(target)
    full = next((i for i, w in enumerate(target_args.layer_windows) if w is None), 0)
    text.pop("per_layer_config", None)
    text.update(target_model_type=str(target.get("model_type")), target_text_model_type=str(text.get("model_type")),
                model_type=text.get("model_type", "gemma4_text"), global_head_dim=target_args.head_dim_at(full),
                num_global_key_value_heads=target_args.kv_heads_at(full), enable_moe_block=False,
                hidden_size_per_layer_input=0)
    return text


def _draft_layer_fields(raw: dict) -> dict:
    """The drafter config as ModelArgs should read it for the draft layers: they are all global
    layers of their own (gemma4: no KV sharing, whatever the target had; per-index overrides
    written for the target's layers read as the global layers' geometry)."""
    if not (is_family(raw.get("model_type")) and family(raw.get("model_type")).gemma4_layers):
        return raw
    fields = dict(raw, num_kv_shared_layers=0)
    overrides = fields.pop("per_layer_config", None)
    if isinstance(overrides, dict) and overrides and "global_head_dim" not in fields:
        first = next(iter(overrides.values()))
        fields["per_layer_config"] = {"full_attention": first}
    return fields


class DraftCheckpointError(ValueError):
    """A draft checkpoint we cannot use, with the reason in one line."""


@dataclass
class DSparkConfig:
    raw: dict  # the whole config.json (target fields + DSpark fields), written back as is
    args: ModelArgs  # the draft layers' widths and flavour
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    num_anchors: int
    draft_vocab_size: int | None = None
    markov_vocab: str = "full"  # "draft": the Markov embedding's rows are the draft vocabulary + one shared row
    confidence_threshold: float | list[float] = 0.0  # 0: keep every drafted position (DeepSpec's default)
    # STS (`verispec dspark calibrate`): c_k = sigmoid(logit_k / T_k); None (DeepSpec's checkpoints): T = 1
    confidence_temperature: list[float] | None = None

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def architecture(self) -> str:
        return self.raw["architectures"][0]

    @classmethod
    def from_dict(cls, raw: dict) -> "DSparkConfig":
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES.values():
            raise DraftCheckpointError(
                f"not a DSpark drafter config (architectures {raw.get('architectures')!r}; "
                f"expected one of {', '.join(ARCHITECTURES.values())})"
            )
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids", "num_hidden_layers") if k not in raw]
        if missing:
            raise DraftCheckpointError(f"DSpark config lacks {', '.join(missing)}")
        # the draft stack is all full attention whatever the target's layer types
        args = dataclasses.replace(from_hf_config(_draft_layer_fields(raw)),
                                   layer_windows=(None,) * int(raw["num_hidden_layers"]))
        rank = int(raw.get("markov_rank", 0) or 0)
        head = raw.get("markov_head_type", "vanilla") if rank else "none"
        if rank and head not in SEQUENTIAL_HEADS:
            raise DraftCheckpointError(f"unknown markov_head_type {head!r} (known: {', '.join(SEQUENTIAL_HEADS)})")
        confidence = bool(raw.get("enable_confidence_head", False))
        with_markov = confidence and bool(raw.get("confidence_head_with_markov", False))
        if with_markov and not rank:
            raise DraftCheckpointError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        markov_vocab = raw.get("markov_vocab", "full")
        if markov_vocab not in ("full", "draft"):
            raise DraftCheckpointError(f"unknown markov_vocab {markov_vocab!r} (known: full, draft)")
        if markov_vocab == "draft" and not raw.get("draft_vocab_size"):
            raise DraftCheckpointError('markov_vocab "draft" needs a draft vocabulary (draft_vocab_size)')
        layer_ids = [int(i) for i in raw["target_layer_ids"]]
        num_target = int(raw.get("num_target_layers", max(layer_ids) + 2))
        if not layer_ids or any(b <= a for a, b in zip(layer_ids, layer_ids[1:])) or not all(
            i == -1 or 0 <= i < num_target for i in layer_ids
        ):
            raise DraftCheckpointError(
                f"target_layer_ids {layer_ids} must be strictly increasing, each -1 (embeddings) or in [0, {num_target})"
            )
        return cls(
            raw=raw,
            args=args,
            block_size=int(raw["block_size"]),
            mask_token_id=int(raw["mask_token_id"]),
            target_layer_ids=layer_ids,
            num_target_layers=num_target,
            markov_rank=rank,
            markov_head_type=head,
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
            num_anchors=int(raw.get("num_anchors", 512)),
            draft_vocab_size=int(raw["draft_vocab_size"]) if raw.get("draft_vocab_size") else None,
            markov_vocab=markov_vocab,
            confidence_threshold=_threshold(raw.get("confidence_threshold")),
            confidence_temperature=_temperatures(raw.get("confidence_temperature"), int(raw["block_size"])),
        )

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        num_draft_layers: int,
        block_size: int,
        target_layer_ids: list[int],
        mask_token_id: int,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        num_anchors: int = 512,
        draft_vocab_size: int | None = None,
        markov_vocab: str = "full",
    ) -> "DSparkConfig":
        """DeepSpec's build_draft_config: the target's config with the DSpark fields set."""
        raw = copy.deepcopy(target_config)
        model_type = raw.get("model_type")
        if not is_family(model_type):
            raise DraftCheckpointError(f"no DSpark drafter for target model_type {model_type!r}")
        arch = family(model_type).dspark_class
        if family(model_type).gemma4_layers:
            raw = _gemma4_draft_base(raw)
        raw.update(
            architectures=[arch],
            num_target_layers=int(raw["num_hidden_layers"]),
            num_hidden_layers=int(num_draft_layers),
            block_size=int(block_size),
            tie_word_embeddings=False,
            layer_types=["full_attention"] * int(num_draft_layers),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_anchors=int(num_anchors),
            enable_confidence_head=bool(enable_confidence_head),
            confidence_head_with_markov=bool(confidence_head_with_markov and enable_confidence_head),
            markov_rank=int(markov_rank),
            markov_head_type=markov_head_type,
        )
        for key in ("sliding_window_pattern", "_sliding_window_pattern"):
            raw.pop(key, None)
        if draft_vocab_size:
            raw["draft_vocab_size"] = int(draft_vocab_size)
            if markov_vocab == "draft" and markov_rank:
                raw["markov_vocab"] = "draft"
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        raw = dict(self.raw)
        if self.confidence_threshold:
            raw["confidence_threshold"] = self.confidence_threshold
        if self.confidence_temperature is not None:
            raw["confidence_temperature"] = self.confidence_temperature
        return raw

    def save(self, folder: Path) -> None:
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

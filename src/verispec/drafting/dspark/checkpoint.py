"""DSpark checkpoints in DeepSpec's format, both ways, and telling draft checkpoints apart.

DeepSpec saves a drafter with `save_pretrained` of its whole state dict: `config.json`
(the target's config plus the DSpark fields, dspark-spec.md §2.1/2.6) and `model.safetensors`
with the names of dspark-spec.md §2.6 in bfloat16, including frozen copies of the target's input
embedding and output head. We read exactly that (local folders, or hub ids such as
`deepseek-ai/dspark_qwen3_4b_block7` through the hub code, safetensors only) and write
it back the same way, so DeepSpec's evaluator can load a Qwen3 drafter trained here. A
file may leave the frozen copies out (`include_frozen=False`, how the shipped default
drafter stays small): they are then taken from the target at load time.

`draft_kind(folder)` says what a `--draft-model` folder is: a DSpark drafter
(architectures `*DSparkModel`), an ordinary causal LM (drafted for by the two-model
source), or something we refuse with a reason: EAGLE heads, z-lab DFlash files, pickled
weights, a DSpark config whose tensors do not match (an older or foreign layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.models.loader import read_config, read_tensors, safetensor_files
from verispec.drafting.dspark.config import ARCHITECTURES, DraftCheckpointError, DSparkConfig
from verispec.drafting.dspark.model import DSparkDrafter

FROZEN = ("embed_tokens.weight", "lm_head.weight")


def latest_in_run(run: Path) -> Path | None:
    """The checkpoint a `verispec dspark train` run folder's `latest` file names, if any."""
    pointer = Path(run) / "latest"
    return Path(run) / pointer.read_text().strip() if pointer.is_file() else None


def newest_checkpoint(folder: Path) -> Path:
    """A `verispec dspark train` run folder stands for its newest checkpoint; any other
    folder is itself."""
    folder = Path(folder)
    newest = None if (folder / "config.json").is_file() else latest_in_run(folder)
    return newest if newest is not None and (newest / "config.json").is_file() else folder


def draft_kind(folder: Path) -> str:
    """'dspark', 'gemma4_assistant' or 'model' for a resolved model folder; DraftCheckpointError otherwise."""
    config = read_config(Path(folder))
    arch = " ".join(config.get("architectures") or [])
    if config.get("model_type") == "gemma4_assistant" or "Gemma4Assistant" in arch:
        return "gemma4_assistant"
    if any(name in arch for name in ARCHITECTURES.values()):
        return "dspark"
    if "eagle" in arch.lower():
        raise DraftCheckpointError(f"{folder}: an EAGLE draft head ({arch}) is not supported; use a DSpark drafter, "
                                   "a smaller model with the same tokenizer, or --speculate ngram")
    if "DFlash" in arch:
        raise DraftCheckpointError(f"{folder}: a z-lab DFlash checkpoint ({arch}) is not supported; DeepSpec-format "
                                   "DFlash drafters (Qwen3DSparkModel with markov_rank 0) are")
    if "DSpark" in arch or "block_size" in config and "target_layer_ids" in config:
        raise DraftCheckpointError(f"{folder}: a DSpark-like config with architectures {arch!r}, which is not a "
                                   f"layout we know ({', '.join(ARCHITECTURES.values())})")
    return "model"


def load_dspark(folder: Path, target=None, dtype: torch.dtype = torch.float32, device="cpu",
                prepare: bool = True, int8: str = "off") -> DSparkDrafter:
    """A drafter from a DeepSpec-format folder. `target` (a LoadedModel) is checked for
    compatibility and supplies the frozen embedding/head when the file leaves them out.
    `prepare`: ready for decoding (packed weights); False for training or editing.
    `int8`: "auto" puts linears in q8_0 where that measures faster (serving; not the
    exact drafter), "on" wherever the kernel runs, "off" (the default) keeps the exact drafter."""
    folder = Path(folder)
    config = DSparkConfig.from_dict(read_config(folder))
    if target is not None:
        check_compatible(config, target.model.args)
    tensors = read_tensors(folder)
    for name in FROZEN:
        if name not in tensors:
            if target is None:
                raise DraftCheckpointError(f"{folder}: {name} is not in the checkpoint and no target supplies it")
            tensors[name] = frozen_from_target(target, name, tensors)
    with torch.device("meta"):
        drafter = DSparkDrafter(config)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        detail = "; ".join(s for s in (f"missing {', '.join(missing[:6])}" if missing else "",
                                       f"unexpected {', '.join(unexpected[:6])}" if unexpected else "") if s)
        raise DraftCheckpointError(f"{folder}: not a DeepSpec DSpark checkpoint for this config ({detail})")
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter = drafter.to(device)
    return drafter.prepare_for_inference(int8=int8) if prepare else drafter


def check_compatible(config: DSparkConfig, target_args) -> None:
    a = config.args
    problems = []
    if a.model_type != target_args.model_type:
        problems.append(f"it is a {config.architecture} (for {a.model_type} targets), "
                        f"the target is {target_args.model_type}")
    if a.vocab_size != target_args.vocab_size:
        problems.append(f"vocabulary {a.vocab_size} vs the target's {target_args.vocab_size}")
    if a.hidden_size != target_args.hidden_size:
        problems.append(f"hidden size {a.hidden_size} vs {target_args.hidden_size}")
    if config.num_target_layers != target_args.num_layers:
        problems.append(f"built for a {config.num_target_layers}-layer target, this one has {target_args.num_layers}")
    if max(config.target_layer_ids) >= target_args.num_layers:
        problems.append(f"taps layer {max(config.target_layer_ids)}, beyond the target's layers")
    if problems:
        raise DraftCheckpointError("this DSpark drafter does not fit the target: " + "; ".join(problems))


_TARGET_NAMES = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"),
    "lm_head.weight": ("lm_head.weight",),
}


def frozen_from_target(target, name: str, tensors: dict) -> torch.Tensor:
    """The target's input embedding or output head (rows of the draft vocabulary, when the
    drafter has one), read from the target's own files: the loaded target may hold its
    head only in a packed form."""
    source = "embed_tokens.weight" if name == "embed_tokens.weight" or target.model.args.tie_word_embeddings else name
    for file in safetensor_files(Path(target.folder)):
        with safe_open(str(file), framework="pt") as f:
            key = next((k for k in _TARGET_NAMES[source] if k in f.keys()), None)
            if key is not None:
                tensor = f.get_tensor(key)
                if name == "lm_head.weight" and "draft_vocab_ids" in tensors:
                    tensor = tensor[tensors["draft_vocab_ids"]]
                return tensor
    raise DraftCheckpointError(f"the target folder {target.folder} has no {source}")


def save_dspark(drafter: DSparkDrafter, folder: Path, include_frozen: bool = True,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors the way DeepSpec's checkpoint manager does."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if not include_frozen and name in FROZEN:
            continue
        tensor = tensor.detach().to("cpu")
        state[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    raw = drafter.config.to_dict()
    raw["dtype"] = str(dtype).removeprefix("torch.")
    tmp = folder / "model.safetensors.partial"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return folder

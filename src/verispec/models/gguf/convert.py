"""GGUF file -> a complete Hugging Face model folder, written atomically.

``convert_gguf_to_hf`` writes config.json, model.safetensors (streamed one tensor at a
time), generation_config.json and the tokenizer files (keeping the GGUF chat template) into
a temporary sibling folder that is renamed into place at the end.

What it is checked against (tests/test_gguf.py):

* tiny random GGUF files: transformers' ``AutoModelForCausalLM.from_pretrained`` loads the
  folder, in float32 and bfloat16, with exactly the tensors ``iter_hf_tensors`` gives; an
  interrupted conversion leaves nothing behind; a non-empty folder is replaced only with
  ``overwrite=True``;
* real models (``real_model`` marker): SmolLM2-135M-Instruct Q4_1 (llama) and gemma-3-270m
  Q4_K_M (gemma3, also ``slow``) converted by ``convert_gguf_to_hf`` equal transformers' GGUF
  load field by field and tensor by tensor, and the tokenizer keeps the GGUF chat template.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from tqdm.auto import tqdm

from verispec.models.families import family
from verispec.models.gguf.metadata import gguf_config, gguf_metadata, read_rope_freqs
from verispec.models.gguf.tensor_mapping import PlannedTensor, convert_planned, plan_tensors

__all__ = ["convert_gguf_to_hf"]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _safetensors_header(plan: list[PlannedTensor], dtype: torch.dtype) -> bytes:
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
    plan: list[PlannedTensor],
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
            weight = convert_planned(item, config, dtype)
            f.write(weight.reshape(-1).view(torch.uint8).numpy().data)


def _stop_token_ids(meta: Mapping[str, Any], config: Mapping[str, Any]) -> list[int]:
    """eos plus the end-of-turn tokens a chat model stops on (llama.cpp treats them as EOG)."""
    ids = [config["eos_token_id"]] if "eos_token_id" in config else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta:
            ids.append(int(meta[key]))
    # e.g. Google's gemma-3 generation_config stops on <end_of_turn> as well as <eos>
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for name in family(config["model_type"]).extra_stop_tokens:
        if name in tokens:
            ids.append(tokens.index(name))
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
        meta, tensor_names=[t.name for t in reader.tensors], rope_freqs=read_rope_freqs(reader)
    )
    plan = plan_tensors(reader, config)

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

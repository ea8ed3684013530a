"""Loading Hugging Face folders: sharded safetensors, refusal of pickles, clear errors."""

from __future__ import annotations

import json
import platform

import pytest
import torch

from tests.tiny_models import build_reference, extend_logits, family_configs, reference_logits
from verispec.models.kv_cache import KVCache
from verispec.models.config import UnsupportedModelError, from_hf_config
from verispec.models.loader import ModelFilesError, load_folder, resolve_dtype


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    reference = build_reference(family_configs()["qwen3"], tmp_path / "single")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = list((tmp_path / "sharded").glob("*.safetensors"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file() and len(shards) > 1
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = load_folder(tmp_path / "sharded")
    got = extend_logits(ours, KVCache(ours.args).allocate(len(ids)), ids)
    torch.testing.assert_close(got, reference_logits(reference, ids), rtol=1e-4, atol=1e-4)


def test_missing_shard_is_named(tmp_path):
    reference = build_reference(family_configs()["llama"], tmp_path)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / missing).unlink()
    with pytest.raises(ModelFilesError, match=missing):
        load_folder(tmp_path)


def test_pickle_checkpoints_are_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(family_configs()["llama"].to_dict()))
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelFilesError, match="pickles never are"):
        load_folder(tmp_path)


def test_unsupported_model_type_lists_supported():
    with pytest.raises(UnsupportedModelError, match="'mamba'.*llama.*qwen2.*qwen3.*gemma3_text"):
        from_hf_config({"model_type": "mamba"})


def test_legacy_rope_spelling_equals_transformers_5_spelling():
    """transformers 4.x wrote rope_theta / rope_scaling at top level; 5.x writes
    rope_parameters. Both must give the same rotary frequencies."""
    new = family_configs()["llama3-rope-scaling"].to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = dict(new["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    a, b = from_hf_config(new), from_hf_config(old)
    assert a.rope_global == b.rope_global and a.rope_global.kind == "llama3"
    torch.testing.assert_close(a.rope_global.inv_freq(16), b.rope_global.inv_freq(16))


def test_dtype_names():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


def _cpuinfo_flags() -> set[str] | None:
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU flags are the oracle")
def test_auto_dtype_is_bf16_only_on_native_bf16_cpus():
    """The oracle is the kernel's own CPU flags: 'auto' picks bfloat16 exactly where the CPU
    does bf16 arithmetic (avx512_bf16 or AMX). oneDNN reports bf16 support on every AVX512
    CPU and emulates it there (3x slower than float32 on a Xeon without AVX512-BF16)."""
    flags = _cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags line")
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert resolve_dtype("auto") is (torch.bfloat16 if native else torch.float32)

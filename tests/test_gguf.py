"""Tests for verispec.models.gguf.

Oracles: gguf-py's numpy ``gguf.quants.dequantize`` for every block type, and transformers'
own GGUF loader (AutoConfig / its GGUF state dict / AutoTokenizer) for the real models.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from verispec.models.gguf import (
    SUPPORTED_TYPES,
    convert_gguf_to_hf,
    dequantize,
    gguf_config,
    hf_tensor_name,
)

ROWS, COLS = 6, 1024  # 4 K-quant super-blocks or 32 small blocks per row

# Byte offsets of the fp16 scale fields per block; random bytes there could be inf/nan.
FP16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for (ROWS, COLS) values of ``qtype``, with finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in FP16_FIELDS.get(qtype.name, ()):
        scales = rng.uniform(-2, 2, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    if qtype.name in ("F16", "BF16"):
        raw = random_floats(rng).astype(np.float16 if qtype.name == "F16" else np.float32)
        if qtype.name == "BF16":
            raw = (raw.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype.name == "F32":
        raw = random_floats(rng)
    return raw


def random_floats(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((ROWS, COLS)) * 0.1).astype(np.float32)


def quantized_blocks(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray | None:
    """Blocks from gguf-py's own quantizer, or None where it has none (the K-quants)."""
    try:
        return gguf.quants.quantize(random_floats(rng), qtype)
    except NotImplementedError:
        return None


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_matches_gguf_numpy(type_name: str) -> None:
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(qtype.value)
    for raw in (quantized_blocks(qtype, rng), random_blocks(qtype, rng)):
        if raw is None:
            continue
        expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
        ours = dequantize(raw, qtype, (ROWS, COLS))
        assert ours.dtype == torch.float32 and ours.shape == (ROWS, COLS)
        assert torch.equal(ours, expected), f"{type_name}: max diff {(ours - expected).abs().max()}"


def test_dequantize_is_bounded_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked decoding (used for big tensors) gives the same values as one pass."""
    from verispec.models.gguf import dequant as module

    qtype = GGMLQuantizationType.Q6_K
    raw = random_blocks(qtype, np.random.default_rng(1))
    whole = dequantize(raw, qtype, (ROWS, COLS))
    monkeypatch.setattr(module, "_CHUNK_VALUES", 256 * 3)
    assert torch.equal(dequantize(raw, qtype, (ROWS, COLS)), whole)


def test_dequantize_casts_to_out_dtype() -> None:
    raw = gguf.quants.quantize(random_floats(np.random.default_rng(2)), GGMLQuantizationType.Q8_0)
    full = dequantize(raw, GGMLQuantizationType.Q8_0, (ROWS, COLS))
    half = dequantize(raw, GGMLQuantizationType.Q8_0, (ROWS, COLS), out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))


def test_unsupported_type_names_type_and_tensor() -> None:
    raw = np.zeros(84 * 4, dtype=np.uint8)  # four Q2_K blocks
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up\.weight'.*Q2_K.*supported types: F32"):
        dequantize(raw, GGMLQuantizationType.Q2_K, (4, 256), name="blk.3.ffn_up.weight")


def test_wrong_byte_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected 68 bytes"):
        dequantize(np.zeros(34, dtype=np.uint8), GGMLQuantizationType.Q8_0, (2, 32), name="t")


# --- config from metadata -----------------------------------------------------------------

LLAMA_META = {
    "general.architecture": "llama",
    "llama.vocab_size": 32000,
    "llama.embedding_length": 512,
    "llama.feed_forward_length": 1024,
    "llama.block_count": 4,
    "llama.attention.head_count": 8,
    "llama.attention.head_count_kv": 2,
    "llama.rope.dimension_count": 64,
    "llama.rope.freq_base": 500000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.context_length": 131072,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def test_llama_config_from_metadata() -> None:
    config = gguf_config(LLAMA_META, tensor_names=["token_embd.weight", "output.weight"])
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 64
    assert config["rope_theta"] == 500000.0 and config["max_position_embeddings"] == 131072
    assert config["tie_word_embeddings"] is False
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert "rope_scaling" not in config


def test_linear_rope_scaling_from_metadata() -> None:
    meta = {**LLAMA_META, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert gguf_config(meta)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, ctx: int):
    """The divisors llama.cpp's converter stores as rope_freqs.weight for llama3 scaling."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < ctx / high:
            divisors.append(1.0)
        elif wavelen > ctx / low:
            divisors.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs() -> None:
    freqs = llama3_rope_freqs(64, 500000.0, factor=32.0, low=1.0, high=4.0, ctx=8192)
    config = gguf_config(LLAMA_META, rope_freqs=freqs)
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


GEMMA3_META = {
    "general.architecture": "gemma3",
    "gemma3.embedding_length": 640,
    "gemma3.feed_forward_length": 2048,
    "gemma3.block_count": 12,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma3.context_length": 32768,
    "gemma3.attention.sliding_window": 512,
    "tokenizer.ggml.tokens": ["<pad>"] * 100,
}


def test_gemma3_layer_types_every_sixth_global() -> None:
    config = gguf_config(GEMMA3_META)
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == 100
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11]
    assert config["rope_theta"] == 1_000_000.0 and config["rope_local_base_freq"] == 10000.0
    assert config["query_pre_attn_scalar"] == 256 and config["sliding_window"] == 512


def test_gemma3_linear_rope_scaling_applies_to_global_layers(tmp_path: Path) -> None:
    import transformers

    meta = {**GEMMA3_META, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(gguf_config(meta)))
    rope = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ValueError, match=r"'falcon'.*gemma3, llama, qwen2, qwen3"):
        gguf_config({"general.architecture": "falcon"})


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight", "qwen3") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.bias", "qwen2") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.2.attn_k_norm.weight", "qwen3") == "model.layers.2.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.0.post_attention_norm.weight", "gemma3") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("rope_freqs.weight", "llama") is None
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        hf_tensor_name("blk.0.ssm_conv1d.weight", "llama")


# --- tiny synthetic GGUF files against transformers' GGUF loader -----------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 64

TINY_ARCHS = {
    # arch: (head_dim, extra per-layer tensors, has output.weight)
    "llama": (64, (), False),
    "qwen2": (64, ("attn_q.bias", "attn_k.bias", "attn_v.bias"), True),
    # 128 = every Qwen3's head size, which transformers assumes (it ignores key_length for qwen3);
    # it differs from hidden/heads here, so key_length is what gives it.
    "qwen3": (128, ("attn_q_norm.weight", "attn_k_norm.weight"), False),
    "gemma3": (
        256,  # Gemma 3's head size: transformers then defaults query_pre_attn_scalar to it too
        ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
        False,
    ),
}


def tiny_tensor_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names and their PyTorch-order shapes for a tiny model."""
    head_dim, extras, has_output = TINY_ARCHS[arch]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if has_output:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    per_layer = {
        "attn_q.weight": (HEADS * head_dim, HIDDEN),
        "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "attn_output.weight": (HIDDEN, HEADS * head_dim),
        "ffn_gate.weight": (FFN, HIDDEN),
        "ffn_up.weight": (FFN, HIDDEN),
        "ffn_down.weight": (HIDDEN, FFN),
        "attn_norm.weight": (HIDDEN,),
        "ffn_norm.weight": (HIDDEN,),
        "attn_q.bias": (HEADS * head_dim,),
        "attn_k.bias": (KV_HEADS * head_dim,),
        "attn_v.bias": (KV_HEADS * head_dim,),
        "attn_q_norm.weight": (head_dim,),
        "attn_k_norm.weight": (head_dim,),
        "post_attention_norm.weight": (HIDDEN,),
        "post_ffw_norm.weight": (HIDDEN,),
    }
    base = [n for n in list(per_layer)[:9]]
    for layer in range(LAYERS):
        for name in (*base, *extras):
            shapes[f"blk.{layer}.{name}"] = per_layer[name]
    return shapes


def encode(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """ggml bytes for ``values`` in ``qtype`` (random valid blocks where gguf-py cannot quantize)."""
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
        for offset in FP16_FIELDS[qtype.name]:
            scales = rng.uniform(-0.01, 0.01, (raw.size // type_size, 1)).astype(np.float16)
            raw.reshape(-1, type_size)[:, offset : offset + 2] = scales.view(np.uint8)
        return raw


def write_tiny_gguf(path: Path, arch: str) -> Path:
    """A small random model that uses every supported type across its 2-D tensors."""
    rng = np.random.default_rng(len(arch))
    head_dim = TINY_ARCHS[arch][0]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(128)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    types = [GGMLQuantizationType[name] for name in SUPPORTED_TYPES]
    for index, (name, shape) in enumerate(tiny_tensor_shapes(arch).items()):
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, values + (1.0 if name.endswith("norm.weight") else 0.0))
            continue
        qtype = types[index % len(types)]
        writer.add_tensor(name, encode(values, qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_model_matches_transformers(arch: str, tmp_path: Path) -> None:
    """Config and every tensor (names, Q/K permutation, norm shift) against transformers."""
    import transformers

    from verispec.models.gguf import iter_hf_tensors

    gguf_path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    oracle_config, oracle_tensors = transformers_gguf_state_dict(gguf_path)

    reader = gguf.GGUFReader(gguf_path)
    config = gguf_config(reader)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours_config = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    fields = CONFIG_FIELDS + (GEMMA3_FIELDS if arch == "gemma3" else [])
    for field in fields:
        if field == "head_dim" and arch == "qwen2":  # Qwen2Config has none: hidden // heads
            assert ours_config[field] == HIDDEN // HEADS
            continue
        assert ours_config[field] == oracle_config[field], field

    ours = dict(iter_hf_tensors(reader, config))
    expected_names = set(oracle_tensors) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert torch.equal(tensor, oracle_tensors[name]), name


def no_tokenizer(out: Path, gguf_path: Path, meta: dict) -> None:
    """Stands in for the tokenizer step: the tiny files carry no real vocabulary."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convert_writes_a_folder_transformers_loads(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from verispec.models.gguf import convert as module
    from verispec.models.gguf import iter_hf_tensors

    monkeypatch.setattr(module, "_write_tokenizer", no_tokenizer)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    folder = convert_gguf_to_hf(gguf_path, tmp_path / "out", dtype=dtype, progress=False)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no temp left
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    expected = dict(iter_hf_tensors(gguf.GGUFReader(gguf_path), dtype=dtype))
    assert "lm_head.weight" not in expected  # tied: no output.weight in the file
    # Our streamed safetensors file, read by transformers into a real model.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == dtype and model.config.tie_word_embeddings
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["lm_head.weight"], expected["model.embed_tokens.weight"])


def test_interrupted_convert_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.models.gguf import convert as module

    def interrupted(out: Path, gguf_path: Path, meta: dict) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_write_tokenizer", interrupted)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3")
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf(gguf_path, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_convert_refuses_to_clobber_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.models.gguf import convert as module

    monkeypatch.setattr(module, "_write_tokenizer", no_tokenizer)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(gguf_path, out, progress=False)
    assert (out / "keep.txt").exists()
    convert_gguf_to_hf(gguf_path, out, progress=False, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


# --- real models against transformers' GGUF loader ------------------------------------------


def transformers_gguf_state_dict(gguf_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' config and float32 state dict for a GGUF file: the oracle.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` gets its weights from
    ``load_gguf_checkpoint``; calling that directly on a meta-device model skips building a
    real model (and needs no accelerate).
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    return config.to_dict(), loaded["tensors"]


CONFIG_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]
GEMMA3_FIELDS = [
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "hidden_activation",
]


def check_against_transformers(gguf_path: Path, out_dir: Path, fields: list[str]) -> Path:
    import transformers
    from safetensors import safe_open

    started = time.perf_counter()
    folder = convert_gguf_to_hf(gguf_path, out_dir, progress=False)
    print(f"converted {gguf_path.name} in {time.perf_counter() - started:.1f} s")

    oracle_config, oracle_tensors = transformers_gguf_state_dict(gguf_path)
    # Our config.json as transformers reads it (legacy rope keys become rope_parameters).
    ours_config = transformers.AutoConfig.from_pretrained(folder).to_dict()
    for field in fields:
        assert ours_config[field] == oracle_config[field], field

    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        expected_names = set(oracle_tensors)
        if oracle_config["tie_word_embeddings"]:
            expected_names.discard("lm_head.weight")
        assert names == expected_names
        for name in sorted(names):
            ours, expected = weights.get_tensor(name), oracle_tensors[name]
            assert ours.dtype == torch.float32 and ours.shape == expected.shape, name
            assert torch.equal(ours, expected), f"{name}: max diff {(ours - expected).abs().max()}"
    return folder


@pytest.mark.real_model
def test_smollm2_q4_1_matches_transformers(tmp_path: Path) -> None:
    import transformers

    from verispec.models.registry import model_gguf_path

    gguf_path = Path(model_gguf_path("smollm2-135m-instruct", progress=False))
    folder = check_against_transformers(gguf_path, tmp_path / "smollm2", CONFIG_FIELDS)

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields["tokenizer.chat_template"]
    gguf_template = bytes(field.parts[field.data[0]]).decode("utf-8")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == gguf_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert not list(tmp_path.glob(".smollm2.tmp-*")), "temporary folder left behind"


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_q4_k_m_matches_transformers(tmp_path: Path) -> None:
    """Q4_K/Q5_0/Q6_K/Q8_0 tensors, gemma's +1 norms and gemma3 config fields.

    Slow (about 2 min on 2 loaded cores): gguf-py parses the 262k-token vocabulary once per
    reader, and ours, transformers' tokenizer and the oracle each open one.
    """
    from verispec.models.registry import model_gguf_path

    gguf_path = Path(model_gguf_path("gemma3-270m", progress=False))
    folder = check_against_transformers(
        gguf_path, tmp_path / "gemma3", CONFIG_FIELDS + GEMMA3_FIELDS
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["rope_local_base_freq"] == 10000.0 and config["rope_theta"] == 1_000_000.0
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>

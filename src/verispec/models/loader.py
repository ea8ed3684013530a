"""Load a Hugging Face model folder (config.json + *.safetensors) into our Decoder.

Only safetensors are read (never pickles, never remote code). Sharded checkpoints are
found through `model.safetensors.index.json`. Weights are renamed from transformers'
names and fused as decoder.py expects (q/k/v -> qkv, gate/up -> gate_up, q_norm/k_norm
-> one per-head table, gemma's (1 + w) folded into the stored norm weights).

`load_model(name)` accepts a registry name, a folder, a .gguf file or a hub id; see
registry.resolve_model. Checked by tests/test_models_vs_transformers.py, which saves a
transformers model with save_pretrained and loads it back through here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from verispec.models.config import ModelArgs, ModelFilesError, from_hf_config, read_config  # noqa: F401 - re-exported
from verispec.models.decoder import Decoder


def safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        what = ", ".join(missing) if missing else "no *.safetensors files"
        raise ModelFilesError(f"{folder}: {what} (only safetensors weights are loaded; pickles never are)")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensor_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors




def _strip_prefix(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _gemma_norm(w: torch.Tensor) -> torch.Tensor:
    # transformers' Gemma3RMSNorm multiplies by (1 + w) in float32: fold the 1 in once.
    return w.float() + 1.0


def convert_state_dict(args: ModelArgs, hf: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' tensor names -> Decoder state dict (fused, renamed, cast).
    Empties `hf` as it goes."""
    norm = _gemma_norm if args.norm_offset else (lambda w: w)
    # gemma keeps norm weights in float32 (the multiply happens there); others in dtype
    norm_dtype = torch.float32 if args.norm_in_f32 else dtype
    # consume the input: each source tensor is freed once it has been fused/cast, so
    # loading peaks near one copy of the model rather than two
    names = {_strip_prefix(k): hf.pop(k) for k in list(hf)}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return names.pop(name)
        except KeyError:
            raise ModelFilesError(f"checkpoint has no tensor {name!r}") from None

    out["embed"] = take("embed_tokens.weight").to(dtype)
    out["final_norm"] = norm(take("norm.weight")).to(norm_dtype)
    lm_head = names.pop("lm_head.weight", None)
    if not args.tie_word_embeddings:
        if lm_head is None:
            raise ModelFilesError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        out["lm_head"] = lm_head.to(dtype)

    for i in range(args.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[p + "attn_norm"] = norm(take(p + "input_layernorm.weight")).to(norm_dtype)
        if args.sandwich_norms:
            out[p + "post_attn_norm"] = norm(take(p + "post_attention_layernorm.weight")).to(norm_dtype)
            out[p + "mlp_norm"] = norm(take(p + "pre_feedforward_layernorm.weight")).to(norm_dtype)
            out[p + "post_mlp_norm"] = norm(take(p + "post_feedforward_layernorm.weight")).to(norm_dtype)
        else:
            out[p + "mlp_norm"] = norm(take(p + "post_attention_layernorm.weight")).to(norm_dtype)
        own = args.kv_source_at(i) == i  # gemma4: a KV-sharing layer has no k/v (transformers ignores any)
        projections = "qkv"[: 1 if not own else 2 if args.k_eq_v_at(i) else 3]
        for dropped in ("k_proj.weight", "v_proj.weight", "k_norm.weight") if not own else ():
            names.pop(a + dropped, None)
        out[p + "qkv.weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in projections]).to(dtype)
        if args.attention_bias:
            out[p + "qkv.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in projections]).to(dtype)
        out[p + "o_proj.weight"] = take(a + "o_proj.weight").to(dtype)
        if args.o_proj_bias:
            out[p + "o_proj.bias"] = take(a + "o_proj.bias").to(dtype)
        if args.qk_norm:
            qn = norm(take(a + "q_norm.weight")).to(norm_dtype)
            parts = [qn.expand(args.num_heads, -1)]
            if own:
                parts.append(norm(take(a + "k_norm.weight")).to(norm_dtype).expand(args.kv_heads_at(i), -1))
            out[p + "qk_norm"] = torch.cat(parts)
        out[p + "gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]).to(dtype)
        out[p + "down.weight"] = take(m + "down_proj.weight").to(dtype)
        if args.mlp_bias:
            out[p + "gate_up.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")]).to(dtype)
            out[p + "down.bias"] = take(m + "down_proj.bias").to(dtype)
        if args.layer_scalar:
            out[p + "layer_scalar"] = take(p + "layer_scalar").reshape(1).to(dtype)
        if args.per_layer_input:
            out[p + "ple_gate.weight"] = take(p + "per_layer_input_gate.weight").to(dtype)
            out[p + "ple_proj.weight"] = take(p + "per_layer_projection.weight").to(dtype)
            out[p + "ple_norm"] = norm(take(p + "post_per_layer_input_norm.weight")).to(norm_dtype)
        if args.moe is not None:
            out[p + "router.weight"] = take(p + "router.proj.weight").to(dtype)
            out[p + "router_scale"] = take(p + "router.scale").to(dtype)
            out[p + "expert_scale"] = take(p + "router.per_expert_scale").to(dtype)
            out[p + "experts_gate_up"] = take(p + "experts.gate_up_proj").to(dtype)
            out[p + "experts_down"] = take(p + "experts.down_proj").to(dtype)
            out[p + "post_mlp_norm_1"] = norm(take(p + "post_feedforward_layernorm_1.weight")).to(norm_dtype)
            out[p + "pre_moe_norm"] = norm(take(p + "pre_feedforward_layernorm_2.weight")).to(norm_dtype)
            out[p + "post_moe_norm"] = norm(take(p + "post_feedforward_layernorm_2.weight")).to(norm_dtype)
    if args.per_layer_input:
        out["ple_embed"] = take("embed_tokens_per_layer.weight").to(dtype)
        out["ple_model_proj.weight"] = take("per_layer_model_projection.weight").to(dtype)
        out["ple_proj_norm"] = norm(take("per_layer_projection_norm.weight")).to(norm_dtype)
    return out


def build_model(
    args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu", pack: bool = True
) -> Decoder:
    """A ready inference model; `pack` pre-packs weights for oneDNN on CPU (linear.py)."""
    with torch.device("meta"):
        model = Decoder(args)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    model.eval().requires_grad_(False)
    if pack:
        model.pack_for_cpu()
    return model


def load_folder(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu", pack: bool = True,
                kernels: str | None = None, quant: str = "auto", progress: bool = False) -> Decoder:
    """`kernels` None: PyTorch's kernels (oneDNN-packed with `pack`), as the tests and the
    drafters use; else a kernel plan mode (models/kernel_plan.py: measured once per machine
    and cached), with `quant` its weight formats."""
    folder = Path(folder)
    args = from_hf_config(read_config(folder))
    if kernels is None or torch.device(device).type != "cpu":
        state = convert_state_dict(args, read_tensors(folder), dtype)
        return build_model(args, state, dtype, device, pack)
    # float32 first: lossless quantization is judged, and quantized weights made, from it
    state = convert_state_dict(args, read_tensors(folder), torch.float32)
    model = build_model(args, state, torch.float32, device, pack=False)
    apply_plan(model, plan_model(model, dtype, quant, kernels, progress), dtype)
    return model


def plan_model(model: Decoder, dtype: torch.dtype, quant: str, kernels: str, progress: bool = False):
    from verispec.models.kernel_plan import plan_for

    model.ensure_lm()
    return plan_for(model, dtype, quant, kernels, progress=progress)


def apply_plan(model: Decoder, plan, dtype: torch.dtype) -> None:
    """Quantized roles take their weights from float32, then the rest is cast to `dtype`
    and takes its kernels."""
    quantized = {role for role, kernel in plan.linear.items() if kernel.startswith(("q8_0", "q4_1"))}
    model.prepare(plan.linear, plan.attention, roles=quantized)
    model.cast(dtype)
    model.prepare(plan.linear, plan.attention)
    model.kernel_plan = plan
    release_freed_memory()


@dataclass
class LoadedModel:
    """A ready model: weights, tokenizer, stop ids and where it came from."""

    model: Decoder
    tokenizer: object
    folder: Path
    stop_ids: list[int]
    name: str


def load_model(
    name: str, dtype: torch.dtype = torch.float32, device="cpu", progress: bool = True, pack: bool = True,
    kernels: str | None = None, quant: str = "auto",
) -> LoadedModel:
    """Registry name, HF folder, .gguf file or hub id -> LoadedModel (`kernels`, `quant`:
    load_folder)."""
    from verispec.models.registry import resolve_model
    from verispec.models.tokenizer import load_tokenizer, stop_token_ids

    folder = resolve_model(name, progress=progress)
    model = load_folder(folder, dtype=dtype, device=device, pack=pack, kernels=kernels, quant=quant, progress=progress)
    release_freed_memory()
    tokenizer = load_tokenizer(folder)
    return LoadedModel(model, tokenizer, folder, stop_token_ids(folder, tokenizer), name)


def release_freed_memory() -> None:
    """Hand the float32 staging tensors freed during loading back to the OS. glibc keeps
    freed heap in its arenas; trimming took a served SmolLM2 (bf16) from 819 to 646 MB RSS.
    A no-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cpu_has_native_bf16() -> bool:
    """bf16 arithmetic in hardware: AVX512-BF16 or AMX tiles on x86; elsewhere (Arm) oneDNN's
    own check, which there means the BF16 instructions."""
    import platform

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_for_serving(name: str, dtype: str = "auto", kernels: str = "auto", quant: str = "auto",
                     progress: bool = True) -> LoadedModel:
    """What `verispec serve` / `generate` load: the kernel plan measured for this machine
    (models/kernel_plan.py). `dtype="auto"` on a CPU is the dtype whose plan is
    batch-invariant, and of those (or of none) the one that measures faster (both plans are
    cached); elsewhere resolve_dtype's rule."""
    if dtype == "auto" and torch.cuda.is_available():
        return load_model(name, dtype=resolve_dtype("auto", "cuda"), device="cuda", progress=progress)
    if dtype != "auto":
        return load_model(name, dtype=resolve_dtype(dtype), progress=progress, kernels=kernels, quant=quant)
    from verispec.models.kernel_plan import plan_for, preferred_dtype
    from verispec.models.registry import resolve_model

    folder = resolve_model(name, progress=progress)
    args = from_hf_config(read_config(folder))
    model = build_model(args, convert_state_dict(args, read_tensors(folder), torch.float32), torch.float32, pack=False)
    model.ensure_lm()
    plans = {}
    for candidate in (torch.bfloat16, torch.float32):
        plans[candidate] = plan_for(model, candidate, quant, kernels, progress=progress)
    chosen = preferred_dtype(plans)
    apply_plan(model, plans[chosen], chosen)
    from verispec.models.tokenizer import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(folder)
    return LoadedModel(model, tokenizer, folder, stop_token_ids(folder, tokenizer), name)


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' -> bfloat16 where the hardware runs it natively (a CUDA GPU with bf16, or a CPU
    with bf16 arithmetic: AVX512-BF16 or AMX on x86; 1.6x faster decode than float32 on such a
    host, see bench/decode.py), else float32. oneDNN alone is not the test: it reports bf16
    support on any AVX512 x86 CPU and emulates it there, and a gemma3-270m forward of 400
    tokens took 4.1 s in bf16 against 1.3 s in float32 on such a host (Xeon without
    AVX512-BF16, docs/dspark-campaign.md stage 21). Anything else must name a dtype."""
    if name == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]

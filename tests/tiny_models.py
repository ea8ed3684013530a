"""Tiny random-weight transformers models of every family we implement (the oracle),
saved with save_pretrained so our loader reads them exactly as it reads real folders."""

from __future__ import annotations

import inspect

import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, Gemma4AssistantConfig, Gemma4TextConfig, LlamaConfig,
                          Qwen2Config, Qwen3Config)

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    # a wide init makes logits spread out, so greedy comparisons are not decided by ties
    initializer_range=0.2,
)


class CharTokenizer:
    """Tiny models have no tokenizer: one character per id is all the engine's text path
    (detokenizer, stop strings) needs."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + i) for i in ids)


def family_configs() -> dict:
    gemma_layers = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama3-rope-scaling": LlamaConfig(
            **COMMON,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "qwen2": Qwen2Config(**COMMON),
        "qwen3": Qwen3Config(**COMMON, tie_word_embeddings=False),
        "gemma3": Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            sliding_window=8,
            layer_types=gemma_layers,
            query_pre_attn_scalar=24,
        ),
        "gemma3-softcap": Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            sliding_window=6,
            layer_types=gemma_layers,
            query_pre_attn_scalar=16,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,  # set, yet ignored by transformers and by us
        ),
        **gemma4_configs(),
    }


def gemma4_configs() -> dict:
    """Every switch of transformers' Gemma 4 text model, over two configs: sliding/global layers
    with their own head size, KV heads and RoPE (proportional, partial 0.25), K = V on global
    layers and a final soft-cap in one; KV sharing with double-wide MLPs, per-layer embeddings
    (as the E models have them), mixture-of-experts and attention bias in the other. (Layer
    scalars and the MoE scales are made non-trivial by build_reference. transformers 5.24 cannot
    run KV sharing without per-layer embeddings: its slicing before the shared layers indexes
    them unconditionally.)"""
    base = dict(COMMON, num_hidden_layers=5, head_dim=16, global_head_dim=32, sliding_window=6,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                             "full_attention"])
    return {
        "gemma4": Gemma4TextConfig(
            **base, attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
            final_logit_softcapping=5.0,
        ),
        "gemma4-shared-moe": Gemma4TextConfig(
            **base, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=24, attention_bias=True,
        ),
    }


TINY_VOCAB = 6


def tiny_vocab_pair(folder):
    """A target and a drafter on a 6-token vocabulary (statistical tests enumerate every
    continuation): (transformers target, our target, our drafter)."""
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False)
    from verispec.models.loader import load_folder

    reference = build_reference(config, folder / "target", seed=10)
    build_reference(config, folder / "draft", seed=11)
    return reference, load_folder(folder / "target"), load_folder(folder / "draft")


def build_reference(config, folder, seed: int = 0):
    """A transformers model with random weights (norm weights too, so the (1 + w)
    convention is exercised), saved to `folder`; returned in eval mode, eager attention."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("scale"):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # gemma4: a stored per-layer output scale
                buffer.uniform_(0.7, 1.3)
    model.save_pretrained(folder)
    return model


def extend_logits(model, seq, tokens) -> torch.Tensor:
    """Append `tokens` to one sequence's cache in a single forward of our model;
    logits at every new position (what the oracles below are compared with)."""
    from verispec.models.decoder import BatchKV

    ids = torch.as_tensor(tokens, dtype=torch.long)
    return model(ids, BatchKV([seq], [len(ids)]), logits_at=torch.arange(len(ids))).logits


def exact_continuations(model, prompt: list[int], params, n: int) -> dict[tuple[int, ...], float]:
    """P(the first n sampled tokens) after `prompt` under plain sampling with `params`, by
    enumerating every prefix with our model (the oracle of the chi-square tests)."""
    from verispec.engine.sampling import process_logits, sampling_probs

    dist = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, mass in dist.items():
            seq = model.new_cache().allocate(len(prompt) + n + 1)
            logits = extend_logits(model, seq, prompt + list(prefix))[-1:]
            for token, p in enumerate(sampling_probs(process_logits(logits, [params]), [params])[0].tolist()):
                if p > 0:
                    grown[prefix + (token,)] = mass * p
        dist = grown
    return dist


def sample_continuations(engine, prompt: list[int], params, requests: int, n: int = 3) -> dict[tuple[int, ...], int]:
    """How often each sequence of first n tokens came out of `requests` unseeded requests
    (seeded ones verify by matching) submitted to `engine` at once; each request's generator
    from a fixed stream of "entropy", so the test repeats itself. What the chi-square tests
    compare with `exact_continuations`."""
    import itertools
    from unittest import mock

    from verispec.engine import sampling
    from verispec.engine.request import Collector, GenerationRequest

    collectors = []
    with mock.patch.object(sampling.secrets, "randbits", side_effect=itertools.count(1)):
        for _ in range(requests):
            collectors.append(Collector())
            engine.submit(GenerationRequest(prompt, n + 1, params), collectors[-1])
        engine.run_until_idle()
    counts: dict[tuple[int, ...], int] = {}
    for c in collectors:
        key = tuple(c.result(0).token_ids[:n])
        counts[key] = counts.get(key, 0) + 1
    return counts


def track_sources(provider) -> dict[int, tuple[int, ...]]:
    """Record which prompt each draft source the provider mints serves: {id(source): prompt},
    filled as the engine admits rows (for tests that read a provider's per-source trace)."""
    owner: dict[int, tuple[int, ...]] = {}
    new_source = provider.new_source

    def tracking(context):
        source = new_source(context)
        owner[id(source)] = tuple(context.prompt)
        return source

    provider.new_source = tracking
    return owner


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_greedy(model, ids: list[int], n: int, stop_ids=()) -> list[int]:
    """transformers' forward with its own KV cache, argmax each step. A hand loop rather
    than generate(): generate's min_new_tokens would mask EOS and change the argmax."""
    # transformers renamed past_key_values to cache (5.x); accept either spelling
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            if token in stop_ids:
                break
            out.append(token)
            step = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: getattr(step, cache_arg)})
    return out


# -- a Gemma 4 target and its assistant drafter (tests/test_gemma4_assistant.py, bench/gemma4_assistant.py)

GEMMA4_VOCAB = 96
GEMMA4_PAIRS = ["random", "ordered-embeddings", "agreeing"]


def gemma4_target_config(**overrides) -> Gemma4TextConfig:
    fields = dict(vocab_size=GEMMA4_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, attention_k_eq_v=True,
                  num_global_key_value_heads=1, sliding_window=96, max_position_embeddings=256,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                  hidden_size_per_layer_input=0, initializer_range=0.2, eos_token_id=1, final_logit_softcapping=8.0)
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def gemma4_assistant_config(ordered: bool, wide: bool = False) -> Gemma4AssistantConfig:
    text = Gemma4TextConfig(vocab_size=GEMMA4_VOCAB, hidden_size=64 if wide else 32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            global_head_dim=32,
                            attention_k_eq_v=True, num_global_key_value_heads=1,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=0.2,
                            max_position_embeddings=256)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=ordered,
                                 num_centroids=8, centroid_intermediate_top_k=3)


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.7, 1.3, generator=g)
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=g))


def _agreeing(target, assistant) -> None:
    """Make the pair agree often: the target's head turned into "the token after the input
    token" (head row k = embedding row k - 1), so the target mostly counts up and sometimes
    (its layers' say) does not; the assistant reads the token's embedding (pre_projection =
    [I 0]) through the target's final norm and head."""
    with torch.no_grad():
        target.lm_head.weight.copy_(torch.roll(target.model.embed_tokens.weight, 1, dims=0))
        hidden = target.config.hidden_size
        assistant.pre_projection.weight.zero_()
        assistant.pre_projection.weight[:, :hidden].copy_(torch.eye(hidden))
        assistant.model.norm.weight.copy_(target.model.norm.weight)
        assistant.lm_head.weight.copy_(target.lm_head.weight)


def build_gemma4_pair(folder, kind: str, drafts: int = 4):
    """A tiny random Gemma 4 target and assistant saved to folder/target and folder/assistant
    (transformers models returned, eval mode, eager attention). `kind`: "random" (independent:
    every first draft rejected), "ordered-embeddings" (the centroid-masked head), "agreeing"
    (made to agree often: rounds that keep some or all drafts)."""
    torch.manual_seed(3)
    config = gemma4_target_config(tie_word_embeddings=kind != "agreeing")
    config._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_config(config).eval()
    _randomize(target, 1)
    assistant_cfg = gemma4_assistant_config(kind == "ordered-embeddings", kind == "agreeing")
    assistant_cfg._attn_implementation = "eager"
    assistant = AutoModelForCausalLM.from_config(assistant_cfg).eval()
    _randomize(assistant, 2)
    if kind == "agreeing":
        _agreeing(target, assistant)
    assistant.generation_config.num_assistant_tokens = drafts
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    target.save_pretrained(folder / "target")
    assistant.save_pretrained(folder / "assistant")
    return target, assistant

"""Tiny random-weight transformers models of every family we implement (the oracle),
saved with save_pretrained so our loader reads them exactly as it reads real folders."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

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
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
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

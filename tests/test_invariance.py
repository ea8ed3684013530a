"""Speculation is token-identical to plain decoding in the default dtype, on the default
model as served (the kernel plan measured for this machine), not only in float32.

Oracle: the same engine without speculation, on the same prompts, greedy. With PyTorch's
kernels a verify block rounds differently from a single row (oneDNN's bf16 linear changed
a row's result from 15 rows on for K = 1536, and its float32 SDPA by ~1e-7 between 1 and
9 queries), so in bf16 most n-gram and DSpark outputs diverged from plain decoding; under
a batch-invariant plan every one must match. bench/spec.py counts the same over the 48
shared eval prompts.
"""

from __future__ import annotations

import pytest
import torch

from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import GenerationRequest

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog near the river bank.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "What is the capital of France, and what is it famous for?",
    "List the planets of the solar system in order from the sun.",
    "Fix the typos in this text: Teh cat sat on teh mat and looked at teh dog.",
    "Explain in three sentences why the sky is blue.",
]


# the default plan (dtype auto, lossless formats), bf16 without quantization on the
# invariant kernels (forced: measured, they may cost more than the 5% auto allows), q8_0 (lossy)
PLANS = {"default": ("auto", "auto", "auto"), "bf16": ("bfloat16", "none", "invariant"), "q8_0": ("auto", "q8_0", "auto")}


@pytest.fixture(scope="module", params=list(PLANS))
def served(smollm2_folder, request):
    from verispec import kernels
    from verispec.models.loader import load_for_serving

    if not kernels.available():
        pytest.skip("verispec's kernels could not be built here: no batch-invariant plan")
    dtype, quant, mode = PLANS[request.param]
    loaded = load_for_serving("smollm2-135m-instruct", dtype=dtype, kernels=mode, quant=quant, progress=False)
    if not loaded.model.kernel_plan.invariant:
        pytest.skip(f"the measured plan is not batch-invariant here: {loaded.model.kernel_plan.note}")
    return loaded


def _outputs(loaded, drafter, max_tokens=64):
    from verispec.models.tokenizer import encode_chat

    engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(kv_budget=2**30), drafter=drafter)
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = [engine.generate(GenerationRequest(p, max_tokens)).token_ids for p in prompts]
    return outs, engine


def test_speculation_is_token_identical_in_the_default_dtype(served):
    from verispec.drafting.factory import shipped_dspark
    from verispec.drafting.ngram import NgramProvider

    plain, _ = _outputs(served, None)
    ngram, engine = _outputs(served, NgramProvider())
    assert engine.drafting.totals.accepted > 0
    dspark_provider = shipped_dspark(served, torch.bfloat16)
    dspark, engine = _outputs(served, dspark_provider)
    assert engine.drafting.totals.accepted > 0
    print(f"default plan: {served.model.dtype}, {served.model.kernel_plan.describe()}")
    assert ngram == plain
    assert dspark == plain


def test_rows_batched_together_give_what_they_give_alone(served):
    from verispec.models.tokenizer import encode_chat

    alone, _ = _outputs(served, None, max_tokens=32)
    engine = Engine(served.model, served.tokenizer, served.stop_ids, EngineConfig(kv_budget=2**30))
    from verispec.engine.request import Collector

    collectors = []
    for p in PROMPTS:
        collectors.append(Collector())
        engine.submit(GenerationRequest(encode_chat(served.tokenizer, [{"role": "user", "content": p}]), 32),
                      collectors[-1])
        engine.step()  # staggered joins: prefill chunks beside decoding rows
    engine.run_until_idle()
    assert [c.result(0).token_ids for c in collectors] == alone


# a base model's raw completions (BOS + text), as /v1/completions serves them
GEMMA_PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
                 "Paris is the capital of France. Paris is the capital of"]


def test_gemma_serves_its_default_speculation_token_identical_to_plain(gemma_folder):
    """gemma3-270m speculates with n-gram by default (its catalog entry, measured by bench
    matrix); on its served plan that must not change a token. Oracle: the same engine and plan
    without speculation, greedy."""
    from verispec import kernels
    from verispec.drafting.factory import build_drafter
    from verispec.models.loader import load_for_serving
    from verispec.models.tokenizer import encode_prompt

    if not kernels.available():
        pytest.skip("verispec's kernels could not be built here: no batch-invariant plan")
    loaded = load_for_serving("gemma3-270m", progress=False)
    if not loaded.model.kernel_plan.invariant:
        pytest.skip(f"the measured plan is not batch-invariant here: {loaded.model.kernel_plan.note}")
    drafter = build_drafter(loaded, None, None, loaded.model.dtype)
    assert drafter is not None and type(drafter).__name__ == "NgramProvider", "gemma's default is n-gram"

    def outputs(provider):
        engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids, EngineConfig(kv_budget=2**30),
                        drafter=provider)
        outs = [engine.generate(GenerationRequest(encode_prompt(loaded.tokenizer, p), 40)).token_ids
                for p in GEMMA_PROMPTS]
        return outs, engine

    plain, _ = outputs(None)
    spec, engine = outputs(drafter)
    assert engine.drafting.totals.accepted > 0, "n-gram drafts were accepted"
    assert spec == plain

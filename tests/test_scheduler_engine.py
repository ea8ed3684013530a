"""The verify scheduler inside the engine (engine/verify_schedule.py through
engine/drafting.py): lossless, and the test that proves it can fail.

Oracles: transformers' greedy decode of each prompt alone (every family, n-gram and a
draft model, rows joining a speculating batch); plain greedy decoding for the DeepSpec
fixture's DSpark drafter; at temperature > 0, the exact joint distribution of the first
three tokens (tests/test_spec.py's enumeration) by chi-square, which passes with the
strict and production forms and fails for a scheduler that looks at c_{k+1} before
choosing whether to verify draft k (the paper's Appendix A).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.goodness_of_fit import chi_square_p
from tests.test_spec import (  # noqa: F401 - fixtures
    PROMPT, _repetitive_prompts, _run_staggered, exact_first_tokens, family, tiny_vocab_models)
from tests.tiny_models import CharTokenizer, reference_greedy, sample_continuations
from verispec.drafting.ngram import NgramProvider
from verispec.drafting.two_model import TwoModelProvider
from verispec.engine.draft import Draft, DraftProvider
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.engine.sampling import SamplingParams
from verispec.engine.step_costs import StepCosts

CPU_LIKE = StepCosts({1: 1.0, 2: 1.15, 4: 1.21, 8: 1.33, 16: 1.62, 32: 2.2})  # a 2-core CPU's shape


@pytest.mark.parametrize("mode", ["strict", "production"])
@pytest.mark.parametrize("source", ["ngram", "draft-model"])
def test_greedy_output_with_the_scheduler_equals_plain_greedy(family, source, mode):
    reference, target, drafter_model = family
    drafter = NgramProvider() if source == "ngram" else TwoModelProvider(drafter_model, max_draft=63)
    prompts = _repetitive_prompts(4, seed=3)
    limits = [30, 12, 24, 18]
    expected = [reference_greedy(reference, p, n) for p, n in zip(prompts, limits)]
    # the verify schedule prices steps with a fixed CPU-like table, not this machine's timing
    # of the tiny target: on an AVX2 EPYC that timing (4 tokens 1.5 steps, 3 tokens 1.2) made
    # verifying any n-gram draft a loss for three rows, and the check below failed
    engine = Engine(target, CharTokenizer(), stop_ids=(), step_costs=CPU_LIKE,
                    config=EngineConfig(kv_budget=2**30, num_draft_tokens=5, adaptive_draft=False,
                                        prefill_chunk=8, verify_schedule=mode), drafter=drafter)
    results = _run_staggered(engine, prompts, limits)
    assert [r.token_ids for r in results] == expected
    assert sum(r.speculation["drafted"] for r in results) > 0, "speculation was exercised"
    assert engine.cache.bytes_in_use == 0
    assert engine.stats()["speculation"]["verify_schedule"] == mode
    assert engine.stats()["sps_table"][0]["tokens"] == 1


@pytest.mark.parametrize("mode", ["strict", "production"])
def test_dspark_with_the_scheduler_equals_plain_decoding(mode):
    from tests.fixtures import oracle
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.models.loader import load_model

    root = oracle()
    target = load_model(str(root / "target"), dtype=torch.float32)
    drafter = load_dspark(root / "drafter", dtype=torch.float32)
    prompts = [json.loads(line)["prompt_ids"] for line in (root / "prompts.jsonl").read_text().splitlines()][:6]
    plain = Engine(target.model, CharTokenizer(), target.stop_ids, EngineConfig(kv_budget=2**30))
    expected = [plain.generate(GenerationRequest(p, 40)).token_ids for p in prompts]
    spec = Engine(target.model, CharTokenizer(), target.stop_ids,
                  EngineConfig(kv_budget=2**30, verify_schedule=mode, adaptive_draft=False),
                  drafter=DSparkProvider(drafter))
    collectors = []
    for i, prompt in enumerate(prompts):  # staggered joins into one batch
        collectors.append(Collector())
        spec.submit(GenerationRequest(prompt, 40), collectors[-1])
        for _ in range(i):
            spec.step()
    spec.run_until_idle()
    assert [c.result(0).token_ids for c in collectors] == expected
    totals = spec.drafting.totals
    # the scheduler chose every verify length (on a model this small verification is nearly
    # free, so it sends most of what is offered)
    assert totals.accepted > 50 and totals.offered >= totals.drafted > 0


# -- temperature > 0 ---------------------------------------------------------------------------


class TokenDependentConfidence(DraftProvider):
    """A draft model whose confidence for draft j + 1 depends on the token drafted at j (as
    DSpark's head does through its Markov feature): c_1 = 0.8, c_2 = 0.9 after `favourite`
    and 0 otherwise, c_3 = 0."""

    def __init__(self, inner: TwoModelProvider, favourite: int):
        self.inner, self.favourite = inner, favourite
        self.max_draft = inner.max_draft
        self.name = "token-dependent"

    def new_source(self, context):
        return self.inner.new_source(context)

    def kv_bytes(self, capacity):
        return self.inner.kv_bytes(capacity)

    def draft_batch(self, requests):
        out = []
        for d in self.inner.draft_batch(requests):
            conf = [0.8] + [0.9 if d.tokens[j - 1] == self.favourite else 0.0 for j in range(1, len(d))]
            out.append(Draft(d.tokens, d.q, confidence=conf[:1] + conf[1:2] + [0.0] * max(0, len(d) - 2)))
        return out


def _sample(target, provider, n, mode, sps, max_rows, recalibrate=True):
    engine = Engine(target, CharTokenizer(), (), EngineConfig(kv_budget=2**31, max_rows=max_rows, num_draft_tokens=3,
                                                              max_waiting=n + 1, adaptive_draft=False,
                                                              verify_schedule=mode, recalibrate_heads=recalibrate),
                    drafter=provider)
    engine.drafting.schedule.sps = sps
    counts = sample_continuations(engine, PROMPT, SamplingParams(temperature=0.8, top_k=5), n)
    return counts, engine.drafting.totals


def _favourite(target, draft) -> int:
    """The token F whose admission bias is most visible. The first output token is sampled
    at prefill, so drafting starts at the second: given the first token t, verifying x_1
    only when it is F makes P(second = F | t) = min(q, p) + (1 - q) p instead of p (q, p:
    the draft's and the target's conditional probabilities of F); F maximizes that
    deviation's chi-square weight over t."""
    p2, q2 = exact_first_tokens(target, 2), exact_first_tokens(draft, 2)
    p1, q1 = exact_first_tokens(target, 1), exact_first_tokens(draft, 1)

    def weight(f):
        total = 0.0
        for (t,), pt in p1.items():
            p = p2.get((t, f), 0.0) / pt
            q = q2.get((t, f), 0.0) / q1[(t,)] if q1.get((t,)) else 0.0
            if p > 0:
                total += pt * (min(q, p) - q * p) ** 2 / p
        return total

    return max({k[1] for k in q2}, key=weight)


def _one_row_table(*values):
    return lambda b, rows=1: values[min(b, len(values)) - 1]


@pytest.mark.parametrize("mode", ["strict", "production"])
def test_sampling_with_the_scheduler_keeps_the_target_distribution(tiny_vocab_models, mode):
    target, draft = tiny_vocab_models
    exact = exact_first_tokens(target, 3)
    provider = TokenDependentConfidence(TwoModelProvider(draft, max_draft=63), _favourite(target, draft))
    # batched: a forward's per-token throughput grows with its size, so high survival pays
    counts, totals = _sample(target, provider, 5000, mode, lambda b, rows=1: b ** -0.6, max_rows=64)
    assert 0 < totals.accepted < totals.drafted < totals.offered, "drafts verified, rejected and cut"
    assert chi_square_p(counts, exact) > 1e-3
    # one row at a time: verify 2 drafts after the favourite, 1 otherwise (a choice that
    # depends on the drafted token, but only for the draft after it: a stopping rule)
    counts, totals = _sample(target, provider, 3000, mode, _one_row_table(1.0, 0.9, 0.7, 0.3), max_rows=1)
    assert 0 < totals.drafted < totals.offered
    assert chi_square_p(counts, exact) > 1e-3


def test_an_anticipating_scheduler_is_caught(tiny_vocab_models):
    """Appendix A: SPS(1, 2, 3) = 1, 0.5, 0.45 and a_1 = 0.8: verifying draft 1 alone does
    not pay, both do when c_2 = 0.9. Looking at c_2 (which depends on x_1) before deciding
    on x_1 verifies x_1 only when it is the favourite F (see `_favourite`). The same
    chi-square test, on the joint of the first two tokens (the bias sits in the second,
    the first drafted one; three tokens spread it over 100 cells), rejects it with the same
    3,000 requests the strict form passes with. The head's confidences are taken as given
    (no online recalibration): the numbers above are the point."""
    target, draft = tiny_vocab_models
    provider = TokenDependentConfidence(TwoModelProvider(draft, max_draft=63), _favourite(target, draft))
    exact = exact_first_tokens(target, 2)
    counts, totals = _sample(target, provider, 3000, "anticipating", _one_row_table(1.0, 0.5, 0.45, 0.3), max_rows=1,
                             recalibrate=False)
    assert totals.drafted > 0
    assert chi_square_p(_first_two(counts), exact) < 1e-6
    # and the strict form, same table and requests: never verifies (Theta_1 < Theta_0), exact
    counts, totals = _sample(target, provider, 3000, "strict", _one_row_table(1.0, 0.5, 0.45, 0.3), max_rows=1,
                             recalibrate=False)
    assert totals.drafted == 0 and chi_square_p(_first_two(counts), exact) > 1e-3


def _first_two(counts):
    out: dict[tuple[int, ...], int] = {}
    for key, n in counts.items():
        out[key[:2]] = out.get(key[:2], 0) + n
    return out


def test_a_costly_source_whose_drafts_are_never_sent_backs_off(family):
    """Where verification is too dear for any draft, the scheduler sends none, and a draft
    model (whose drafting costs) stops drafting every step: it probes, ever more rarely."""
    _, target, drafter_model = family
    inner = TwoModelProvider(drafter_model, max_draft=63)
    calls = []

    class Counting(TokenDependentConfidence):
        def draft_batch(self, requests):
            calls.append(len(requests))
            return inner.draft_batch(requests)

    provider = Counting(inner, favourite=0)
    provider.draft_costs = lambda costs: (0.0, 0.3)  # as a draft model's forwards cost
    engine = Engine(target, CharTokenizer(), (), EngineConfig(kv_budget=2**30, num_draft_tokens=4,
                                                              verify_schedule="strict"), drafter=provider)
    engine.drafting.schedule.sps = lambda b, rows=1: 1.0 / b ** 3  # every extra token costs more than it can give
    result = engine.generate(GenerationRequest(_repetitive_prompts(1, seed=9)[0], 60))
    assert result.speculation["drafted"] == 0 and result.speculation["offered"] > 0
    assert 2 <= len(calls) <= 10, calls  # two cut rounds, then probes after 8, 16, 32 steps

"""Speculative decoding is lossless, inside continuous batching.

Oracles:
* greedy: transformers' own greedy decode of each prompt alone (tests/tiny_models.py), for
  every family and every source, with rows joining mid-decode and accepting different
  numbers of drafts in the same verify step;
* seeded sampling with n-gram drafts: exactly the tokens of plain seeded sampling (the
  generator is rewound so each emitted token uses the same random number);
* sampling with a draft model (q): the joint distribution of the first three tokens over
  thousands of requests against the exact distribution computed from the target model,
  chi-square; the same test fails when verification skips the residual resample;
* verify() on synthetic p and q: the first emitted token has distribution p exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.goodness_of_fit import chi_square_p, chi_square_p_of_arrays
from tests.tiny_models import (
    CharTokenizer, build_reference, family_configs, reference_greedy, sample_continuations, tiny_vocab_pair)
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.engine.sampling import SamplingParams, make_generator, process_logits, sampling_probs
from verispec.models.loader import load_folder
from verispec.engine import verify as verify_module
from verispec.drafting.ngram import NgramProvider
from verispec.engine.draft_length import AcceptanceEstimate, CostPolicy, DraftLength, expected_tokens
from verispec.engine.step_costs import StepCosts
from verispec.drafting.two_model import TwoModelProvider
from verispec.engine.verify import VerifyRow, verify

FAMILIES = ["llama", "qwen3", "gemma3", "gemma4-shared-moe"]



@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(transformers reference, our target, a differently seeded drafter of the same shape)."""
    config = family_configs()[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(config, folder / "target", seed=0)
    build_reference(config, folder / "draft", seed=1)
    return reference, load_folder(folder / "target"), load_folder(folder / "draft")


def _engine(model, drafter, k=4, **config):
    cfg = EngineConfig(kv_budget=2**30, num_draft_tokens=k, adaptive_draft=False, **config)
    return Engine(model, CharTokenizer(), stop_ids=(), config=cfg, drafter=drafter)


def _repetitive_prompts(n, seed=0):
    """Prompts that repeat a phrase, so n-gram lookup has something to propose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(0, 97, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        out.append(phrase * 4 + phrase[:2])
    return out


def _run_staggered(engine, prompts, limits, params=None):
    collectors = []
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, n, params or SamplingParams()), collectors[-1])
        for _ in range(1 + 2 * i):  # later rows join a batch that is already speculating
            engine.step()
    engine.run_until_idle()
    return [c.result(0) for c in collectors]


@pytest.mark.parametrize("source", ["ngram", "draft-model", "self-draft"])
def test_greedy_speculation_equals_plain_greedy(family, source):
    reference, target, drafter_model = family
    drafter = {"ngram": lambda: NgramProvider(),
               "draft-model": lambda: TwoModelProvider(drafter_model, max_draft=63),
               "self-draft": lambda: TwoModelProvider(target, max_draft=63)}[source]()
    prompts = _repetitive_prompts(4, seed=3)
    limits = [30, 12, 24, 18]
    expected = [reference_greedy(reference, p, n) for p, n in zip(prompts, limits)]
    engine = _engine(target, drafter, k=5, prefill_chunk=8)
    results = _run_staggered(engine, prompts, limits)
    assert [r.token_ids for r in results] == expected
    drafted = sum(r.speculation["drafted"] for r in results)
    accepted = sum(r.speculation["accepted"] for r in results)
    assert drafted > 0, "speculation was exercised"
    if source == "self-draft":
        assert accepted == drafted, "a model drafting for itself is always right"
    if source == "draft-model":
        assert 0 <= accepted < drafted, "a different drafter gets rejections, which are rolled back"
    assert engine.cache.bytes_in_use == 0


def test_seeded_ngram_sampling_equals_plain_seeded_sampling(family):
    _, target, _ = family
    params = SamplingParams(temperature=0.9, top_k=30, seed=2024, repetition_penalty=1.1)
    prompts = _repetitive_prompts(3, seed=5)
    plain = _run_staggered(_engine(target, None), prompts, [25, 25, 25], params)
    spec = _run_staggered(_engine(target, NgramProvider(min_ngram=1), k=4), prompts, [25, 25, 25], params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.speculation["drafted"] for r in spec) > 0


def test_speculation_off_by_environment(family, monkeypatch):
    _, target, _ = family
    monkeypatch.setenv("VERISPEC_SPEC", "0")
    engine = _engine(target, NgramProvider())
    assert not engine.drafting.active
    assert engine.generate(GenerationRequest([1, 2, 3], 4)).speculation is None


# -- temperature > 0 with a draft distribution: a statistical test --------------------------

@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory):
    _, target, draft = tiny_vocab_pair(tmp_path_factory.mktemp("tiny-vocab"))
    return target, draft


PROMPT = [1, 4, 2]
PARAMS = SamplingParams(temperature=0.8, top_k=5)


def exact_first_tokens(model, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under plain sampling with PARAMS, by enumerating prefixes."""
    from tests.tiny_models import extend_logits

    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, mass in dist.items():
            cache = model.new_cache()
            seq = cache.allocate(len(PROMPT) + n + 1)
            logits = extend_logits(model, seq, PROMPT + list(prefix))[-1:]
            probs = sampling_probs(process_logits(logits, [PARAMS]), [PARAMS])[0]
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    nxt[prefix + (token,)] = mass * p
        dist = nxt
    return dist


def sample_first_tokens(target, drafter, n_requests: int, n: int = 3) -> dict[tuple[int, ...], int]:
    engine = Engine(target, CharTokenizer(), (), EngineConfig(kv_budget=2**31, max_rows=512, num_draft_tokens=3,
                                                              max_waiting=n_requests + 1,
                                                              adaptive_draft=False), drafter=drafter)
    counts = sample_continuations(engine, PROMPT, SamplingParams(temperature=0.8, top_k=5), n_requests, n)
    spec = engine.drafting.totals
    assert spec.drafted > 0 and 0 < spec.accepted < spec.drafted, "both acceptances and rejections happened"
    return counts


N_SAMPLES = 6000


def test_sampling_with_a_draft_model_keeps_the_target_distribution(tiny_vocab_models):
    target, draft = tiny_vocab_models
    exact = exact_first_tokens(target, 3)
    counts = sample_first_tokens(target, TwoModelProvider(draft, max_draft=63), N_SAMPLES)
    assert chi_square_p(counts, exact) > 1e-3


def test_skipping_the_residual_resample_is_caught(tiny_vocab_models, monkeypatch):
    """The power check: resampling a rejection from p instead of normalize(max(0, p - q))
    biases the output, and the same test with the same number of samples sees it."""
    target, draft = tiny_vocab_models
    exact = exact_first_tokens(target, 3)
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)
    counts = sample_first_tokens(target, TwoModelProvider(draft, max_draft=63), N_SAMPLES)
    assert chi_square_p(counts, exact) < 1e-6


# -- verify() itself, on synthetic distributions ----------------------------------------------


def _synthetic(seed: int, vocab: int = 8, k: int = 3):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(k + 1, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 2, dim=-1)
    return p_logits, q


def test_verify_first_token_has_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    p_logits, q = _synthetic(0)
    p0 = torch.softmax(p_logits[0], dim=-1)
    draws = 20000
    gen = make_generator(7)
    draft_gen = make_generator(8)
    counts = torch.zeros(p0.shape[0])
    kept_total = 0
    for _ in range(draws):
        drafts = [int(torch.multinomial(q[j], 1, generator=draft_gen)) for j in range(q.shape[0])]
        (n, nxt), = verify(p_logits, [VerifyRow(params, gen, drafts, q)])
        first = drafts[0] if n > 0 else nxt
        counts[first] += 1
        kept_total += n
    assert 0 < kept_total < draws * q.shape[0]
    assert chi_square_p_of_arrays(counts.tolist(), p0.tolist()) > 1e-3


def test_verify_greedy_keeps_the_matching_prefix():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    greedy = SamplingParams()
    assert verify(logits, [VerifyRow(greedy, None, [1, 2])]) == [(2, 0)]  # all kept + bonus
    assert verify(logits, [VerifyRow(greedy, None, [1, 0])]) == [(1, 2)]  # second rejected: correction
    assert verify(logits[:1], [VerifyRow(greedy, None, [])]) == [(0, 1)]  # no drafts: plain argmax


# -- the draft length policy ------------------------------------------------------------------


def test_policy_drafts_what_pays_and_probes_when_idle():
    cpu_like = StepCosts({1: 1.0, 2: 1.15, 4: 1.21, 8: 1.33, 16: 1.62, 32: 2.2})
    policy = CostPolicy(max_draft=8, costs=cpu_like)
    good = AcceptanceEstimate(accepted=90, rejected=10)
    bad = AcceptanceEstimate(accepted=1, rejected=30)
    assert policy.choose(good, batch_tokens=1, limit=8) >= 4
    assert policy.choose(good, batch_tokens=1, limit=2) <= 2
    choices = [policy.choose(bad, batch_tokens=1, limit=8) for _ in range(8 + 16 + 32)]
    probes = [i for i, k in enumerate(choices) if k]
    assert probes == [7, 23, 55] and max(choices) == 1, "a hopeless row probes with one token, ever more rarely"
    assert policy.choose(good, batch_tokens=1, limit=0) == 0
    flat = CostPolicy(max_draft=8, costs=StepCosts.flat())
    assert flat.choose(AcceptanceEstimate(accepted=5, rejected=5), batch_tokens=1, limit=8) == 8, \
        "when extra tokens are free, drafting the most always pays"
    assert math.isclose(expected_tokens(0.5, 2), 1.75) and expected_tokens(1.0, 3) == 4.0


def test_a_sampled_row_is_charged_its_own_round_price(family):
    """A sampled row's drafting round can cost more than a greedy one's (a DSpark round draws
    and keeps q per slot: 7-8 ms against 3.5 on gemma3-270m). The policy charges each row its
    own price (served sampled rounds' mean once timed): the same acceptance that pays for a
    cheap greedy round does not pay for a dear sampled one, and the engine hands the
    provider's prices to the policy."""
    from types import SimpleNamespace

    cpu_like = StepCosts({1: 1.0, 2: 1.15, 4: 1.21, 8: 1.33, 16: 1.62, 32: 2.2})
    length = DraftLength(8, 7, cpu_like, draft_costs=(0.15, 0.0), sampled_round=0.6)

    def row(params):
        return SimpleNamespace(request=SimpleNamespace(max_tokens=100), output=[], params=params,
                               draft_stats=SimpleNamespace(estimate=AcceptanceEstimate(accepted=4, rejected=6)))

    assert length.for_row(row(SamplingParams()), batch_tokens=1) > 0, "a = 0.4 pays for a round of 0.15 steps"
    assert length.for_row(row(SamplingParams(temperature=1.0)), batch_tokens=1) == 0, "... not for one of 0.6"
    unpriced = DraftLength(8, 7, cpu_like, draft_costs=(0.15, 0.0))
    assert unpriced.for_row(row(SamplingParams(temperature=1.0)), batch_tokens=1) > 0, "no sampled price: the greedy one"
    # once served sampled rounds are timed, their mean is the price, not the start-up timing
    served = DraftLength(8, 7, cpu_like, draft_costs=(0.15, 0.0), sampled_round=0.1,
                         served_round=lambda greedy: None if greedy else 0.6 * cpu_like.base_seconds)
    assert served.for_row(row(SamplingParams(temperature=1.0)), batch_tokens=1) == 0
    assert served.for_row(row(SamplingParams()), batch_tokens=1) > 0, "a greedy row keeps the greedy price"

    class PricedLookup(NgramProvider):
        def draft_costs(self, target_costs):
            return 0.1, 0.0

        def sampled_draft_costs(self, target_costs):
            return 0.7, 0.0

    _, target, _ = family
    engine = Engine(target, CharTokenizer(), stop_ids=(), config=EngineConfig(kv_budget=2**30, adaptive_draft=True),
                    drafter=PricedLookup())
    assert engine.drafting.length.sampled_round == 0.7
    assert engine.drafting.length.policy.draft_fixed == 0.1
    assert engine.drafting.length.sampled_price() == 0.7, "no served rounds timed yet: the start-up price"


def test_a_paid_source_that_proposes_nothing_stops_being_asked(family, monkeypatch):
    """A paid round that comes back empty (a DSpark drafter's confidence cut at its first
    slot) cost its price for nothing; the row's estimate counts it as a draft rejected at
    once, so a source that never proposes is soon asked only as a probe. Uncounted, the
    estimate stayed at its prior and the round was paid every step."""
    from verispec.engine import engine as engine_module
    from verispec.engine.draft import Draft, DraftProvider, DraftSource

    class Silent(DraftSource):
        def draft(self, pending, max_n):
            return Draft()

    class PaidAndSilent(DraftProvider):
        name = "silent"
        max_draft = 7
        asked = 0

        def new_source(self, context):
            return Silent()

        def draft_costs(self, target_costs):
            return 0.5, 0.0

        def draft_batch(self, requests):
            self.asked += sum(1 for _, _, n in requests if n > 0)
            return [Draft() for _ in requests]

    # flat step costs: at the prior acceptance (0.5) a round of 0.5 steps pays for 7 drafts
    monkeypatch.setattr(engine_module, "step_costs_for", lambda model: (StepCosts.flat(), {}))
    _, target, _ = family
    provider = PaidAndSilent()
    engine = Engine(target, CharTokenizer(), stop_ids=(), drafter=provider,
                    config=EngineConfig(kv_budget=2**30, adaptive_draft=True, num_draft_tokens=7))
    collector = Collector()
    engine.submit(GenerationRequest([5, 6, 7, 8], 60, SamplingParams()), collector)
    engine.run_until_idle()
    assert collector.result(0).completion_tokens == 60
    assert 0 < provider.asked <= 12, f"asked {provider.asked} times in 59 decode steps"


def test_a_paid_source_is_judged_by_what_its_rounds_kept(tmp_path, monkeypatch):
    """The engine records what each paid round delivered: a source that proposes one token
    a round, right on two rounds of five, asked under the verify scheduler. The recorded
    yields over all rows equal what the request's usage says (tokens kept over rounds
    asked), and every output equals plain greedy decoding of the same prompt. Greedy rows
    are sized by the rate model, which reads a = 0.4 as E(7) - 1 = 0.67 tokens a round and
    pays a round of 0.5 steps for it (flat step costs) though the rounds keep 0.4: the
    source is asked nearly every step whichever way sampled rows are judged."""
    from verispec.engine import engine as engine_module
    from verispec.engine.draft import Draft, DraftProvider, DraftSource

    monkeypatch.setattr(engine_module, "step_costs_for", lambda model: (StepCosts.flat(), {}))
    build_reference(family_configs()["llama"], tmp_path)
    target = load_folder(tmp_path)
    prompt, n_tokens = [5, 6, 7, 8], 60
    plain = Engine(target, CharTokenizer(), stop_ids=(), config=EngineConfig(kv_budget=2**30)).generate(
        GenerationRequest(prompt, n_tokens)).token_ids

    class OneToken(DraftSource):
        def __init__(self, context):
            self.context, self.rounds = context, 0

        def draft(self, pending, max_n):
            at = len(self.context.output)  # the token after `pending` (the last one emitted)
            self.rounds += 1
            right = self.rounds % 5 < 2
            return Draft([plain[at] if right else (plain[at] + 1) % 97], confidence=[0.9])

    class PaidOneToken(DraftProvider):
        name = "paid one-token"
        max_draft = 7
        asked = 0

        def new_source(self, context):
            return OneToken(context)

        def draft_costs(self, target_costs):
            return 0.5, 0.0

        def draft_batch(self, requests):
            self.asked += sum(1 for _, _, n in requests if n > 0)
            return [source.draft(pending, n) for source, pending, n in requests]

    for judge in (True, False):
        provider = PaidOneToken()
        engine = Engine(target, CharTokenizer(), stop_ids=(), drafter=provider, config=EngineConfig(
            kv_budget=2**30, num_draft_tokens=7, verify_schedule="strict", judge_paid_by_yield=judge,
            recalibrate_heads=False))
        result = engine.generate(GenerationRequest(prompt, n_tokens))
        assert result.token_ids == plain, "lossless whatever the policy drafts"
        usage = result.speculation
        assert provider.asked >= usage["rounds"] - 2, f"asked {provider.asked} of {usage['rounds']} steps"
        recorded = engine.drafting.stats()["paid_rounds"]["greedy"]
        assert recorded["rounds"] == provider.asked <= 64, "every asked round recorded (no decay yet)"
        assert recorded["mean_kept"] == pytest.approx(usage["accepted"] / provider.asked, abs=1e-3)
        assert 0.3 < recorded["mean_kept"] < 0.5, "two of five one-token drafts kept"
        assert recorded["mean_verified"] == pytest.approx(1.0), "its one draft sent every round"


def test_a_sampled_row_drafts_where_its_rounds_yields_pay():
    """A sampled row asking a paid source under the scheduler drafts where what its rounds
    kept pays for the round, whatever the rate model reads; a greedy row, and any row with
    judge_by_yield off, is sized by the rate model."""
    from types import SimpleNamespace

    from verispec.engine.draft_length import RoundYield

    def row(params, kept):
        estimate = AcceptanceEstimate(accepted=4, rejected=6, paid=RoundYield(rounds=6, kept=6 * kept, verified=6))
        return SimpleNamespace(request=SimpleNamespace(max_tokens=100), output=[], params=params,
                               draft_stats=SimpleNamespace(estimate=estimate))

    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams()
    judged = DraftLength(8, 7, StepCosts.flat(), draft_costs=(0.5, 0.0), ask_all=True)
    rate_only = DraftLength(8, 7, StepCosts.flat(), draft_costs=(0.5, 0.0), ask_all=True, judge_by_yield=False)
    # a = 0.4: E(7) - 1 = 0.67 tokens for a round of 0.5 steps pays in the rate model ...
    assert rate_only.for_row(row(sampled, kept=0.4), batch_tokens=1) == 7
    assert judged.for_row(row(greedy, kept=0.4), batch_tokens=1) == 7
    # ... 0.4 kept a round does not (1.4 tokens for 1.5 steps), 0.7 does (1.7 for 1.5)
    assert judged.for_row(row(sampled, kept=0.4), batch_tokens=1) == 0
    assert judged.for_row(row(sampled, kept=0.7), batch_tokens=1) == 7
    # too few rounds seen: the rate model decides
    thin = row(sampled, kept=0.0)
    thin.draft_stats.estimate.paid = RoundYield(rounds=1, kept=0, verified=1)
    assert judged.for_row(thin, batch_tokens=1) == 7


def test_round_yield_decays_to_its_memory_and_a_prior_keeps_its_means():
    from verispec.engine.draft_length import RoundYield

    y = RoundYield()
    for kept in (3, 3, 0, 0):
        y.update(verified=4, kept=kept, memory=3.0)
    # after 4 rounds the sums were scaled to 3 rounds each time they passed it
    assert y.rounds == pytest.approx(3.0)
    assert y.mean_verified == pytest.approx(4.0)
    assert y.mean_kept == pytest.approx(((3 + 3 + 0) * 0.75 + 0) / 3)
    prior = y.prior(weight=1.0)
    assert prior.rounds == pytest.approx(1.0)
    assert (prior.mean_kept, prior.mean_verified) == pytest.approx((y.mean_kept, y.mean_verified))
    assert RoundYield().prior().rounds == 0, "no rounds seen: no prior"
    # pays: 1 + kept per round against the verify and the round's price (flat steps: 1 each)
    policy = CostPolicy(7, StepCosts.flat(), draft_cost_fixed=0.5)
    assert policy.pays(RoundYield(1, 0.6, 2), batch_tokens=1, drafts=7)
    assert not policy.pays(RoundYield(1, 0.4, 2), batch_tokens=1, drafts=7)
    # a step of 4 rows: the round delays all four, so the same yield pays less
    assert not policy.pays(RoundYield(1, 0.6, 2), batch_tokens=4, drafts=7)


def test_a_stop_string_inside_an_accepted_burst_ends_the_output_there(tmp_path):
    """Self-drafting accepts all 8 drafts, so output tokens 1..9 arrive in one burst; a stop
    string made of two tokens in the middle of it must end the output right before them,
    as plain decoding does (the stop string's first occurrence decides). The mechanism is
    the engine's, not a family's: the tiny llama is used (random gemma3 weights repeat one
    token forever, which leaves no pair whose first occurrence is mid-burst)."""
    reference = build_reference(family_configs()["llama"], tmp_path)
    target = load_folder(tmp_path)
    text = CharTokenizer().decode
    for seed in range(40):  # a greedy continuation whose stop pair first occurs mid-burst
        prompt = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens = reference_greedy(reference, prompt, 12)
        cut = next((j for j in range(2, 7) if text(tokens).find(text(tokens[j:j + 2])) == j), None)
        if cut is not None:
            break
    assert cut is not None, "test premise: some continuation has a non-repeating pair mid-burst"
    engine = _engine(target, TwoModelProvider(target, max_draft=63), k=8)
    result = engine.generate(GenerationRequest(prompt, 12, stop=(text(tokens[cut:cut + 2]),)))
    assert result.text == text(tokens[:cut]) and result.finish_reason == "stop"
    assert result.speculation["rounds"] == 1 and result.speculation["accepted"] == 8, "the stop came mid-burst"

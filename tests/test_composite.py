"""Composite drafting (drafting/composite.py): a DSpark drafter and n-gram lookup per row.

Oracles: plain greedy decoding (the DeepSpec fixture's target and drafter, prompts that
repeat themselves so both sources win rounds, rows joining a batch); at temperature > 0
the exact joint distribution of the first three tokens (tests/test_dspark.py's setting),
chi-square.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures import oracle
from tests.goodness_of_fit import chi_square_p
from tests.tiny_models import CharTokenizer, exact_continuations, sample_continuations
from verispec.drafting.composite import CompositeProvider
from verispec.drafting.dspark.checkpoint import load_dspark
from verispec.drafting.dspark.source import DSparkProvider
from verispec.drafting.ngram import NgramProvider
from verispec.engine.draft import Draft, DraftProvider, DraftSource, SourceContext
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.engine.sampling import SamplingParams
from verispec.models.loader import load_model

ROOT = oracle()


@pytest.fixture(scope="module")
def models():
    return load_model(str(ROOT / "target"), dtype=torch.float32), load_dspark(ROOT / "drafter", dtype=torch.float32)


def _prompts():
    return [json.loads(line)["prompt_ids"] for line in (ROOT / "prompts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["cost", "production"])
def test_composite_greedy_equals_plain_decoding(models, schedule):
    target, drafter = models
    prompts = [p + p[-12:] * 2 for p in _prompts()[:5]]  # a repeated tail gives n-gram lookups
    plain = Engine(target.model, CharTokenizer(), target.stop_ids, EngineConfig(kv_budget=2**30))
    expected = [plain.generate(GenerationRequest(p, 40)).token_ids for p in prompts]
    provider = CompositeProvider([DSparkProvider(drafter), NgramProvider()])
    engine = Engine(target.model, CharTokenizer(), target.stop_ids,
                    EngineConfig(kv_budget=2**30, adaptive_draft=False, verify_schedule=schedule), drafter=provider)
    collectors = []
    for i, prompt in enumerate(prompts):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, 40), collectors[-1])
        for _ in range(i):
            engine.step()
    engine.run_until_idle()
    assert [c.result(0).token_ids for c in collectors] == expected
    assert engine.drafting.totals.accepted > 30 and engine.cache.bytes_in_use == 0
    assert all(n > 0 for n in provider.chosen), provider.chosen  # each source won rounds
    # /stats shows the sources: the free lookup is asked on every drafting row, the drafter on
    # some, and the candidates verified are the rounds that kept or tested a draft
    sources = engine.stats()["speculation"]["sources"]
    assert sources["asked"]["ngram"] == sources["rows"] >= sources["asked"]["dspark"] > 0
    assert sum(sources["chosen"].values()) <= engine.drafting.totals.rounds


def test_composite_sampling_keeps_the_target_distribution(models):
    target, drafter = models
    prompt = _prompts()[4]  # one whose first tokens n-gram lookup often finds in the prompt
    params = SamplingParams(temperature=2.5, top_k=4)
    exact = exact_continuations(target.model, prompt, params, 3)
    n = 6000
    provider = CompositeProvider([DSparkProvider(drafter), NgramProvider(min_ngram=1)])
    engine = Engine(target.model, CharTokenizer(), (), EngineConfig(kv_budget=2**31, max_rows=500, max_waiting=n + 1,
                                                                   num_draft_tokens=3, adaptive_draft=False,
                                                                   verify_schedule="production"), drafter=provider)
    counts = sample_continuations(engine, prompt, params, n)
    totals = engine.drafting.totals
    assert 0 < totals.accepted < totals.drafted and all(n > 0 for n in provider.chosen), provider.chosen
    assert chi_square_p(counts, exact) > 1e-3


def test_composite_needs_two_sources_reading_the_same_layers(models):
    _, drafter = models
    with pytest.raises(ValueError, match="at least two"):
        CompositeProvider([NgramProvider()])
    assert CompositeProvider([DSparkProvider(drafter), NgramProvider()]).taps == DSparkProvider(drafter).taps


class _Scripted(DraftProvider):
    """A source whose drafts are scripted per row (by the row's prompt[0]), counting the rows
    it is asked for; its rounds cost `cost` single-token target steps."""

    def __init__(self, name: str, free: bool, drafts: dict[int, Draft], cost: float = 0.0,
                 sampled_cost: float | None = None, served: float | None = None):
        self.name, self.free, self.drafts, self.asked, self.cost = name, free, drafts, [], cost
        self.sampled_cost, self.served = sampled_cost, served

    def draft_costs(self, target_costs):
        return self.cost, 0.0

    def served_round_seconds(self, greedy):
        return self.served

    def sampled_draft_costs(self, target_costs):
        return None if self.sampled_cost is None else (self.sampled_cost, 0.0)

    def new_source(self, context: SourceContext) -> DraftSource:
        source = DraftSource()
        source.row = context.prompt[0]
        return source

    def draft_batch(self, requests):
        self.asked += [s.row for s, _, n in requests]
        return [self.drafts.get(s.row, Draft()) if n > 0 else Draft() for s, _, n in requests]


def test_a_paid_source_is_asked_only_where_the_free_candidates_offer_less_than_it_gains():
    """The lazy rule (greedy rows, the gain = the sum of survival products): after the
    first round, which asks everyone and so measures the model source, row 0, where the
    lookup offers a sure long draft, never pays for the model's round; row 1, offered only
    a weak lookup draft, and row 2, offered none, ask it every round; the 33rd step would
    probe one row. The larger gain is verified, except that every 8th round verifies
    a draft whose estimate is learnt online (no confidences of its own: row 1's lookup
    draft) when one is offered."""
    sure, weak, model = Draft([1, 2, 3], confidence=[0.9, 0.9, 0.9]), Draft([4]), \
        Draft([5, 6], confidence=[0.6, 0.5])  # gains 2.439, 0.5 (no confidences: 1/2 each) and 0.9
    free = _Scripted("lookup", True, {0: sure, 1: weak})
    paid = _Scripted("model", False, {0: model, 1: model, 2: model})
    provider = CompositeProvider([paid, free])
    sources = [provider.new_source(SourceContext([row], [], SamplingParams(), 64)) for row in range(3)]
    picked = [provider.draft_batch([(s, 0, 4) for s in sources]) for _ in range(16)]
    assert sorted(free.asked) == sorted([0, 1, 2] * 16)
    assert paid.asked.count(0) == 1 and paid.asked.count(1) == 16 and paid.asked.count(2) == 16
    assert provider.stats()["asked"] == {"model": 33, "lookup": 48} and provider.stats()["rows"] == 48
    for k, drafts in enumerate(picked):
        explore = k % 8 == 0
        assert [d.tokens for d in drafts] == [sure.tokens, (weak if explore else model).tokens, model.tokens]
    # a row that asks for nothing costs nothing
    before = len(paid.asked), len(free.asked)
    assert provider.draft_batch([(sources[2], 0, 0)]) == [Draft()]
    assert (len(paid.asked), len(free.asked)) == before


def test_a_paid_source_is_asked_only_where_it_gains_more_than_its_round_costs():
    """The model's drafts are expected to gain G = 0.9; its round costs c = 0.3 target steps.
    In a step of B = 2 drafting rows asking it pays where G > O + c (B + O), O the lookup's
    offer: not on row 1 (O = 0.5 needs G > 1.25), on row 2 (nothing offered: G > 0.6). Row 1
    asks it only on the first step, which measures the model (the 33rd step probes row
    2, which asks anyway), and the engine's draft length policy is charged only the
    lookup's (nothing), not the model's round."""
    weak, model = Draft([4]), Draft([5, 6], confidence=[0.6, 0.5])
    free = _Scripted("lookup", True, {1: weak})
    paid = _Scripted("model", False, {1: model, 2: model}, cost=0.3)
    provider = CompositeProvider([paid, free])
    assert provider.draft_costs(None) == (0.0, 0.0)
    sources = [provider.new_source(SourceContext([row], [], SamplingParams(), 64)) for row in (1, 2)]
    picked = [provider.draft_batch([(s, 0, 4) for s in sources]) for _ in range(40)]
    assert paid.asked.count(1) == 1 and paid.asked.count(2) == 40
    # row 1 verifies the lookup's draft except where the model was asked (and not exploring)
    assert [d[0].tokens for d in picked[1:32]] == [weak.tokens] * 31
    assert all(d[1].tokens == model.tokens for d in picked)
    # where verifying costs: with a forward of 2 tokens 1.5x one of 1 and 3 tokens 2x, the
    # model's drafts (G = 0.9, so about 1.9 verified) would emit 1.9 tokens in a step of
    # ~1.95: not asked even where nothing else is offered, round cost or not
    from verispec.engine.step_costs import StepCosts

    steep = CompositeProvider([_Scripted("model", False, {2: model}), _Scripted("lookup", True, {})])
    steep.draft_costs(StepCosts({1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}))
    row = steep.new_source(SourceContext([2], [], SamplingParams(), 64))
    for _ in range(8):
        steep.draft_batch([(row, 0, 4)])
    assert steep.providers[0].asked == [2] and steep.stats()["asked"]["model"] == 1
    # the same round in a step of 8 drafting rows delays 8 tokens: G = 0.9 < c B = 2.4, so
    # after the first step (no estimate yet: every row asks) only the probe of the 33rd step
    # asks it, on one row (per row, probes asked 2 x 8: a round delays the whole step)
    crowd_paid = _Scripted("model", False, {2: model}, cost=0.3)
    crowd = CompositeProvider([crowd_paid, _Scripted("lookup", True, {})])
    crowd.draft_costs(None)
    rows = [crowd.new_source(SourceContext([2], [], SamplingParams(), 64)) for _ in range(8)]
    for _ in range(40):
        crowd.draft_batch([(r, 0, 4) for r in rows])
    assert crowd.stats()["asked"]["model"] == 8 + 1
    alone = CompositeProvider([_Scripted("model", False, {2: model}, cost=0.3), _Scripted("lookup", True, {})])
    alone.draft_costs(None)
    row = alone.new_source(SourceContext([2], [], SamplingParams(), 64))
    for _ in range(40):
        alone.draft_batch([(row, 0, 4)])
    assert alone.stats()["asked"]["model"] == 40  # alone: 0.9 > 0.3
    # a sampled row weighs the source's sampled round (a draw and q per slot): at 1.0 step
    # G = 0.9 no longer pays there, while a greedy row, charged 0.3, asks every round
    dearer = _Scripted("model", False, {2: model}, cost=0.3, sampled_cost=1.0)
    by_mode = CompositeProvider([dearer, _Scripted("lookup", True, {})])
    by_mode.draft_costs(None)
    greedy_row = by_mode.new_source(SourceContext([2], [], SamplingParams(), 64))
    sampled_row = by_mode.new_source(SourceContext([2], [], SamplingParams(temperature=1.0), 64))
    for _ in range(40):
        by_mode.draft_batch([(greedy_row, 0, 4)])
        by_mode.draft_batch([(sampled_row, 0, 4)])
    # the sampled row: its first round alone (no sampled estimate yet; the probe steps, the
    # 1st, 33rd and 65th calls, are the greedy row's)
    assert by_mode.stats()["asked"]["model"] == 40 + 1
    # what served rounds cost, once the source has timed some, replaces its start-up figure:
    # alone on its row G = 0.9 pays for 0.3 steps but not for rounds that took 1.2 (seconds,
    # against base_seconds 1.0 here); after its first round no other is asked but the probes'
    # (the 1st, 33rd, 65th calls... of 40: two)
    dear = CompositeProvider([_Scripted("model", False, {2: model}, cost=0.3, served=1.2),
                              _Scripted("lookup", True, {})])
    dear.draft_costs(None)
    row = dear.new_source(SourceContext([2], [], SamplingParams(), 64))
    for _ in range(40):
        dear.draft_batch([(row, 0, 4)])
    assert dear.stats()["asked"]["model"] == 2
    # free-only composites are charged nothing; paid-only ones their sources' sum
    both_paid = CompositeProvider([_Scripted("a", False, {}, cost=0.5), _Scripted("b", False, {}, cost=0.25)])
    assert both_paid.draft_costs(None) == (0.75, 0.0)


def test_a_sampled_row_weighs_a_paid_source_by_what_its_verified_candidates_kept():
    """Alone on its row the model's drafts promise G = 0.9 (confidences 0.6, 0.5), which
    pays for a 0.3-step round every round (above). A sampled row's G is corrected by the
    drafts verification kept per draft promised over the source's verified sampled rounds
    (the verify scheduler sends a prefix; a sampled pick favours high first confidences).
    Kept nothing: after the KEPT_AT_LEAST = 8 rounds that ratio waits for, only the 33rd
    step's probe asks it. Kept one draft a round (1.11 per promised): asked every round.
    Greedy rows are not corrected (their recalibrated confidences kept what they promised),
    and without the correction the sampled row asks every round too."""
    model = Draft([5, 6], confidence=[0.6, 0.5])
    for kept, judge, asks, ratio in ((0, True, 8 + 1, 0.0), (1, True, 40, round(1 / 0.9, 3)), (0, False, 40, 0.0)):
        paid = _Scripted("model", False, {2: model}, cost=0.3)
        provider = CompositeProvider([paid, _Scripted("lookup", True, {})])
        provider.judge_by_kept = judge
        provider.draft_costs(None)
        row = provider.new_source(SourceContext([2], [], SamplingParams(temperature=1.0), 64))
        for _ in range(40):
            (draft,) = provider.draft_batch([(row, 0, 4)])
            row.commit([0, *draft.tokens[:kept]], 7, None)  # the pending token, then what was kept
        assert paid.asked.count(2) == asks, (kept, judge)
        assert provider.stats()["kept_per_promised"] == {"model": {"sampled": ratio}}
        greedy = provider.new_source(SourceContext([2], [], SamplingParams(), 64))
        for _ in range(12):
            (draft,) = provider.draft_batch([(greedy, 0, 4)])
            greedy.commit([0], 7, None)  # kept nothing, and still asked
        assert paid.asked.count(2) == asks + 12

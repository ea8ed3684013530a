"""The verify scheduler (engine/verify_schedule.py) and the online acceptance model
(engine/acceptance.py), as pure functions.

Oracles: brute force over every vector of verify lengths (the best Theta = tau * SPS(B));
the paper's Appendix A numbers; a simulation with known per-cell acceptance rates.
"""

from __future__ import annotations

import itertools
import random

import pytest

from verispec.engine.acceptance import HeadRecalibration, OnlineAcceptance, survival
from verispec.engine.verify_schedule import VerifySchedule, anticipating, best_count, strict, top_k


def _theta(surv, lengths, base, rows, sps):
    tau = rows + sum(sum(s[:n]) for s, n in zip(surv, lengths))
    return tau * sps(base + sum(lengths))


def _brute(surv, base, rows, sps):
    best = max(itertools.product(*[range(len(s) + 1) for s in surv]),
               key=lambda ls: (_theta(surv, ls, base, rows, sps), -sum(ls)))
    return list(best)


def _random_case(rng):
    rows = rng.randint(1, 3)
    surv = [survival([rng.random() ** 0.5 for _ in range(rng.randint(0, 4))]) for _ in range(rows)]
    base = rows + rng.choice([0, 0, 5])  # sometimes a prefill chunk shares the forward
    slope, curve = rng.uniform(0.02, 0.6), rng.uniform(1.0, 1.6)

    def sps(b):
        return 1.0 / (1.0 + slope * (b - 1) ** curve)

    return surv, base, rows, sps


def test_the_global_search_is_the_brute_force_optimum_and_strict_finds_it_when_theta_is_unimodal():
    rng = random.Random(0)
    unimodal = 0
    for _ in range(400):
        surv, base, rows, sps = _random_case(rng)
        opt = _brute(surv, base, rows, sps)
        best = _theta(surv, opt, base, rows, sps)
        ls = top_k(surv, best_count(surv, base, rows, sps))
        assert _theta(surv, ls, base, rows, sps) == pytest.approx(best)
        # Theta along the sorted path
        flat = sorted((a for s in surv for a in s if a > 0), reverse=True)
        path = [(rows + sum(flat[:k])) * sps(base + k) for k in range(len(flat) + 1)]
        peak = path.index(max(path))
        if all(x < y for x, y in zip(path[:peak], path[1 : peak + 1])) and \
                all(x > y for x, y in zip(path[peak:], path[peak + 1 :])):
            unimodal += 1
            assert _theta(surv, strict(surv, base, rows, sps), base, rows, sps) == pytest.approx(best)
        s = strict(surv, base, rows, sps)
        assert all(0 <= n <= len(x) for n, x in zip(s, surv))
        assert _theta(surv, s, base, rows, sps) >= rows * sps(base) - 1e-12  # never worse than not speculating
    assert unimodal > 200


def test_appendix_a():
    """R = 1, a_1 = 0.8, SPS(1, 2, 3) = 1, 0.5, 0.45: the strict form stops at 0 before it
    sees c_2; a search past that takes 2 drafts when x_1 makes c_2 = 0.9 and none when it
    makes c_2 = 0, which is what biases the output."""
    table = {1: 1.0, 2: 0.5, 3: 0.45}
    good, bad = [survival([0.8, 0.9])], [survival([0.8, 0.0])]
    assert strict(good, 1, 1, table.get) == [0] and strict(bad, 1, 1, table.get) == [0]
    assert anticipating(good, 1, 1, table.get) == [2] and anticipating(bad, 1, 1, table.get) == [0]
    assert (1 + 0.8 + 0.72) * 0.45 == pytest.approx(1.134)


def test_prefixes_stay_contiguous_through_ties():
    surv = [[1.0, 1.0, 1.0], [1.0, 0.5], [0.9, 0.9]]
    for k in range(8):
        ls = top_k(surv, k)
        assert sum(ls) == min(k, 7)
    assert strict(surv, 3, 3, lambda b: 1.0) == [3, 2, 2]  # free verification: everything


def test_the_production_form_spends_the_budget_of_two_steps_ago():
    sps = {n: 1.0 / (1 + 0.2 * (n - 1)) for n in range(1, 40)}.get
    schedule = VerifySchedule("production", lambda b, rows: sps(b))
    steps = [[survival([0.9] * 4)], [survival([0.1] * 4)], [survival([0.5] * 4)], [survival([0.9] * 4)]]
    budgets = [best_count(s, 1, 1, sps) for s in steps]
    chosen = [schedule.choose(s, 1, 1) for s in steps]
    assert chosen[0] == strict(steps[0], 1, 1, sps) and chosen[1] == strict(steps[1], 1, 1, sps)
    assert chosen[2] == top_k(steps[2], budgets[0]) and chosen[3] == top_k(steps[3], budgets[1])
    assert budgets[0] > 0 and budgets[1] == 0 and chosen[3] == [0]
    with pytest.raises(ValueError, match="unknown verify schedule"):
        VerifySchedule("sometimes", lambda b, rows: sps(b))


def _simulated_head(recal: HeadRecalibration, truth, rounds: int, seed: int):
    """A head that claims raw confidences drawn at random; position j of a draft is really
    accepted with probability truth(j, claim). Rounds stop at the first rejection."""
    rng = random.Random(seed)
    for _ in range(rounds):
        claims = [rng.choice([0.15, 0.35, 0.55, 0.75, 0.95]) for _ in range(3)]
        kept = 0
        while kept < 3 and rng.random() < truth(kept, claims[kept]):
            kept += 1
        recal.update(claims, kept)


def test_a_heads_recalibrated_claims_converge_to_what_its_drafts_really_had():
    # an overclaiming head: every claim is worth 60% of itself at position 0, and 0.1 less
    # further on
    def truth(j, c):
        return max(0.0, 0.6 * c - (0.1 if j else 0.0))

    recal = HeadRecalibration(3)
    _simulated_head(recal, truth, 8000, seed=2)
    for j in range(3):
        for c in (0.35, 0.55, 0.75, 0.95):
            assert recal.corrected([c] * (j + 1))[j] == pytest.approx(truth(j, c), abs=0.06), (j, c)
    # a calibrated head's claims stay where they were
    honest = HeadRecalibration(3)
    _simulated_head(honest, lambda j, c: c, 8000, seed=3)
    for j in range(3):
        for c in (0.15, 0.55, 0.95):
            assert honest.corrected([c] * (j + 1))[j] == pytest.approx(c, abs=0.05), (j, c)
    # untested positions (every round rejected at position 0) and a fresh table: the raw claim
    # at first, then position 0's evidence only
    fresh = HeadRecalibration(3)
    assert fresh.corrected([0.9, 0.8, 0.7]) == [0.9, 0.8, 0.7]
    for _ in range(200):
        fresh.update([0.9, 0.9, 0.9], 0)
    first, second, third = fresh.corrected([0.9, 0.9, 0.9])
    assert first < 0.1 and second == third == pytest.approx(0.9)
    # an underclaiming head whose drafts are always kept is corrected up to 1, not past it
    sure = HeadRecalibration(3)
    _simulated_head(sure, lambda j, c: 1.0, 500, seed=4)
    corrected = sure.corrected([0.95, 0.75, 0.55])
    assert corrected[0] == 1.0 and all(0.99 <= c <= 1.0 for c in corrected)


def test_the_online_table_converges_to_each_cells_rate():
    rates = {(0, 2): 0.9, (0, 4): 0.4, (1, 2): 0.7, (1, 4): 0.2, (2, 2): 0.5, (2, 4): 0.1}
    model = OnlineAcceptance(3)
    rng = random.Random(1)
    for _ in range(6000):
        f = rng.choice([2, 4])
        kept = 0
        while kept < 3 and rng.random() < rates[(kept, f)]:
            kept += 1
        model.update([f, f, f], kept)
    for (j, f), rate in rates.items():
        assert model.conditional(j, f) == pytest.approx(rate, abs=0.06), (j, f)
    # rounds rejected at position 0 test nothing further: positions 1 and 2 have no
    # evidence of their own and are assumed as good as position 0 (their prior chain)
    fresh = OnlineAcceptance(3)
    for _ in range(50):
        fresh.update([3, 3, 3], 0)
    assert fresh.cells.keys() == {(0, 3)} and fresh.conditional(0, 3) < 0.1
    assert fresh.conditional(2, 3) <= fresh.conditional(1, 3) <= 0.1
    # a position never tested yet starts from the one before it, not from 1/2
    good = OnlineAcceptance(3)
    for _ in range(50):
        good.update([2, 2, 2], 1)  # position 0 accepted, position 1 rejected
    assert good.conditional(0, 2) > 0.9 and good.conditional(1, 2) < 0.2


def test_lookup_drafts_learn_their_acceptance_apart_for_greedy_and_sampled_rows(tmp_path):
    """A sampled row keeps a lookup's draft only where its own draw matches it, far less often
    than a greedy row keeps it (gemma3-270m at T=1: tau 1.1-1.2 against 2.0). The engine
    learns the two apart: sampled rounds leave the confidences the scheduler gives greedy
    rows' drafts where they were, and greedy rounds then teach the greedy table."""
    import torch

    from tests.tiny_models import CharTokenizer, build_reference, family_configs
    from verispec.drafting.ngram import NgramProvider
    from verispec.engine.draft import Draft
    from verispec.engine.engine import Engine, EngineConfig
    from verispec.engine.request import GenerationRequest
    from verispec.engine.sampling import SamplingParams
    from verispec.models.loader import load_folder

    build_reference(family_configs()["llama"], tmp_path)
    model = load_folder(tmp_path, dtype=torch.float32)
    engine = Engine(model, CharTokenizer(), stop_ids=(), config=EngineConfig(kv_budget=2**30, adaptive_draft=False),
                    drafter=NgramProvider(min_ngram=1))
    prompt = [5, 6, 7, 8, 9] * 8  # the lookup always finds a continuation
    drafts = [Draft([5, 6, 7], feature=[f] * 3) for f in (1, 2, 3, 4)]

    def confidences(greedy: bool) -> list[list[float]]:
        return [engine.drafting.conditionals(d, greedy) for d in drafts]

    greedy_before, sampled_before = confidences(True), confidences(False)
    for seed in range(6):
        engine.generate(GenerationRequest(prompt, 24, SamplingParams(temperature=1.5, seed=seed)))
    assert engine.drafting.totals.rounds > 0
    assert confidences(True) == greedy_before, "sampled rounds moved the greedy rows' estimate"
    assert confidences(False) != sampled_before
    sampled_after = confidences(False)
    engine.generate(GenerationRequest(prompt, 24))
    assert confidences(True) != greedy_before and confidences(False) == sampled_after

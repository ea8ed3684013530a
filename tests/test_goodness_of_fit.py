"""The chi-square helper itself: it must pass a fair sample, fail a biased one, and not
care how the expected values are scaled (scipy >= 1.17 refuses mismatched totals)."""

import random

import numpy as np

from tests.goodness_of_fit import chi_square_p, chi_square_p_of_arrays


def _rolls(weights, n, seed):
    rng = random.Random(seed)
    counts = {}
    for face in rng.choices(range(len(weights)), weights=weights, k=n):
        counts[face] = counts.get(face, 0) + 1
    return counts


def test_a_fair_die_passes_and_a_loaded_one_fails():
    fair = {face: 1 / 6 for face in range(6)}
    assert chi_square_p(_rolls([1] * 6, 6000, 1), fair) > 1e-3
    assert chi_square_p(_rolls([1, 1, 1, 1, 1, 1.3], 6000, 1), fair) < 1e-6


def test_expected_values_are_rescaled_to_the_observed_total():
    counts = _rolls([1] * 6, 6000, 2)
    # probabilities whose float sum is not exactly 1, weights, and counts for another n
    probs = {face: 1 / 6 + 2e-7 if face == 0 else 1 / 6 for face in range(6)}
    p = chi_square_p(counts, probs)
    assert p > 1e-3
    np.testing.assert_allclose(p, chi_square_p(counts, {f: v * 1234.5 for f, v in probs.items()}), rtol=1e-9)
    np.testing.assert_allclose(p, chi_square_p_of_arrays([counts.get(f, 0) for f in range(6)],
                                                         [probs[f] for f in range(6)]))


def test_rare_cells_are_pooled_and_impossible_outcomes_fail():
    probs = {0: 0.5, 1: 0.4999, 2: 0.0001}
    counts = {0: 2510, 1: 2489, 2: 1}
    assert chi_square_p(counts, probs) > 1e-3  # cell 2 (expected 0.5) pooled, not a divide by ~0
    assert chi_square_p({0: 10, 1: 10, 7: 1}, {0: 0.5, 1: 0.5}) == 0.0  # 7 has no mass at all

"""One chi-square goodness-of-fit helper for every statistical test in the suite.

Expected counts are always rescaled to the observed total: scipy >= 1.17's `chisquare`
refuses expected counts whose sum differs from the observed sum (it used to accept a
2e-7 relative difference, which is what `probabilities * n` gives in floating point),
and a test that passes only on one scipy release is lucky, not right. Cells whose
expected count is below `min_expected` are pooled into one cell (Pearson's rule of
thumb), together with every observation outside the reference support; an observation
where the reference puts no mass at all gives p = 0.

Checked by tests/test_goodness_of_fit.py (a fair die passes, a loaded one fails, and the
rescaling makes the answer independent of how the expected values are scaled).
"""

from __future__ import annotations

from collections.abc import Mapping

from scipy import stats

MIN_EXPECTED = 5.0


def chi_square_p(counts: Mapping, probs: Mapping, min_expected: float = MIN_EXPECTED) -> float:
    """p-value of observed `counts` (cell -> count) under the reference `probs` (cell ->
    probability or any non-negative weight; normalized here)."""
    n = sum(counts.values())
    total = float(sum(probs.values()))
    if n <= 0 or total <= 0:
        raise ValueError("chi_square_p needs observations and a reference with positive mass")
    observed, expected = [], []
    rest_o, rest_e = 0, 0.0
    for cell, p in probs.items():
        e = p / total * n
        if e >= min_expected:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    rest_o += sum(c for cell, c in counts.items() if cell not in probs)
    if rest_o and rest_e <= 0:
        return 0.0  # seen where the reference has no mass: no distribution test can pass that
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    if len(observed) < 2:
        return 1.0  # one cell holds everything: nothing to test
    scale = sum(observed) / sum(expected)  # exact totals, whatever the floating point did
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def chi_square_p_of_arrays(counts, probs, min_expected: float = MIN_EXPECTED) -> float:
    """The same over aligned sequences (index = cell), e.g. a bincount and a softmax."""
    return chi_square_p({i: int(c) for i, c in enumerate(counts) if c},
                        {i: float(p) for i, p in enumerate(probs) if p > 0}, min_expected)

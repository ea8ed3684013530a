"""A calibrated confidence for every draft source, so one verify scheduler serves all.

The scheduler (engine/verify_schedule.py) needs, for every drafted position j of a row,
c_j = P(draft j accepted | drafts before it accepted). Where they come from:

* a DSpark drafter: its confidence head, STS-calibrated on held-out training data
  (`Draft.confidence`), and recalibrated online by `HeadRecalibration` against what
  verification kept on served traffic, greedy and sampled rows apart (the head predicts
  the analytic acceptance at temperature 1; greedy acceptance is another quantity, and
  served text is not the training data: on gemma3-270m's eval prompts the shipped head
  claimed more than its drafts delivered);
* grammar-forced tokens: 1 (the grammar allows nothing else, and the target's masked
  distribution puts all its mass there);
* every other source (n-gram lookup, a draft model): `OnlineAcceptance`, a table fitted
  online from served traffic (one for greedy rows and one for sampled rows, which keep far
  fewer of the same drafts), keyed by (draft position, the source's feature): n-gram's
  match length, a draft model's probability for its own token in tenths
  (`Draft.feature`, one per position). Each cell is a Beta posterior worth `PRIOR_WEIGHT`
  rounds of prior: at position 0 the pooled rate of position 0, further on the estimate
  of the same feature one position earlier. A position nobody has tested yet is thus
  assumed as good as the one before it (the geometric assumption of the cost policy), so
  the scheduler tries it when that pays and learns its real rate; with a prior of 1/2 it
  would never be tried and never learnt. Counts decay (`MEMORY` rounds per cell) so the
  table follows the traffic.

Only rounds that tested a position count for it (every draft before it was kept), which
is what makes the estimate conditional.

Oracle: tests/test_verify_schedule.py (the table converges to known per-cell rates drawn
from a simulation; untested positions do not move it; a head's recalibrated confidences
converge to the rates a simulated head's miscalibrated claims really had, and a
calibrated head's stay where they were).
"""

from __future__ import annotations

PRIOR_WEIGHT = 4.0
MEMORY = 512.0
START_RATE = 0.5


def _observe(counts: list[float], value: float, memory: float) -> None:
    """Add one tested position's value to a cell's [sum, tested], decaying both so that the
    cell rests on about its last `memory` positions."""
    counts[0] += value
    counts[1] += 1.0
    if counts[1] > memory:
        scale = memory / counts[1]
        counts[0] *= scale
        counts[1] *= scale


class OnlineAcceptance:
    def __init__(self, positions: int):
        self.positions = max(1, positions)
        self.pooled = [[START_RATE * PRIOR_WEIGHT, PRIOR_WEIGHT] for _ in range(self.positions)]  # [accepted, tested]
        self.cells: dict[tuple[int, int], list[float]] = {}

    def conditional(self, j: int, feature: int) -> float:
        acc, n = self.pooled[0]
        rate = acc / n
        for p in range(min(j, self.positions - 1) + 1):
            acc, n = self.cells.get((p, feature), (0.0, 0.0))
            rate = (acc + rate * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
        return rate

    def confidences(self, features: list[int]) -> list[float]:
        return [self.conditional(j, f) for j, f in enumerate(features)]

    def update(self, features: list[int], kept: int) -> None:
        """A verified draft with these per-position features of which the first `kept`
        were accepted: positions 0..kept were tested, the first `kept` of them passed."""
        for j, f in enumerate(features[: kept + 1]):
            hit = 1.0 if j < kept else 0.0
            p = min(j, self.positions - 1)
            _observe(self.cells.setdefault((p, f), [0.0, 0.0]), hit, MEMORY)
            _observe(self.pooled[p], hit, 4 * MEMORY)

    def table(self) -> list[dict]:
        return [{"position": p, "feature": f, "tested": round(n, 1), "rate": round(self.conditional(p, f), 4)}
                for (p, f), (_, n) in sorted(self.cells.items())]


RECAL_PRIOR = 8.0  # tested positions before a cell's own residual outweighs its parent's
RECAL_BUCKETS = 10  # raw confidences are grouped in tenths


class HeadRecalibration:
    """A confidence head's claims, corrected by what verification kept: per (draft position,
    tenth of the raw claim) the mean residual (kept - claimed) over the positions tested,
    shrunk towards the position's residual, which is shrunk towards zero (a head is trusted
    until served rounds say otherwise). The corrected claim is raw + residual, clamped to
    [0, 1]: within a tenth the head's ranking is kept, between tenths the served rates rule.
    Counts decay (`MEMORY` per cell) so the correction follows the traffic."""

    def __init__(self, positions: int):
        self.positions = max(1, positions)
        self.pooled = [[0.0, 0.0] for _ in range(self.positions)]  # per position: [sum residual, tested]
        self.cells: dict[tuple[int, int], list[float]] = {}

    @staticmethod
    def _bucket(c: float) -> int:
        return min(RECAL_BUCKETS - 1, max(0, int(c * RECAL_BUCKETS)))

    def shift(self, j: int, claim: float) -> float:
        p = min(j, self.positions - 1)
        res, n = self.pooled[p]
        parent = res / (n + RECAL_PRIOR)
        res, n = self.cells.get((p, self._bucket(claim)), (0.0, 0.0))
        return (res + parent * RECAL_PRIOR) / (n + RECAL_PRIOR)

    def corrected(self, claims: list[float]) -> list[float]:
        return [min(1.0, max(0.0, c + self.shift(j, c))) for j, c in enumerate(claims)]

    def update(self, claims: list[float], kept: int) -> None:
        """A verified draft whose raw per-position claims were `claims`, of which the first
        `kept` were accepted (positions 0..kept tested)."""
        for j, c in enumerate(claims[: kept + 1]):
            residual = (1.0 if j < kept else 0.0) - c
            p = min(j, self.positions - 1)
            _observe(self.cells.setdefault((p, self._bucket(c)), [0.0, 0.0]), residual, MEMORY)
            _observe(self.pooled[p], residual, 4 * MEMORY)

    def table(self) -> list[dict]:
        """Per position: tested positions and the mean correction applied to them."""
        return [{"position": p, "tested": round(n, 1), "shift": round(res / (n + RECAL_PRIOR), 4)}
                for p, (res, n) in enumerate(self.pooled) if n]


def survival(conditionals: list[float]) -> list[float]:
    """a_j = prod_{i<=j} c_i (clamped to [0, 1])."""
    out, a = [], 1.0
    for c in conditionals:
        a *= min(1.0, max(0.0, c))
        out.append(a)
    return out

"""How many of its drafted tokens each row sends to verification this step: DSpark's
hardware-aware prefix scheduler (paper §3.2.2, Algorithm 1; §5.2 for the production form).

Every drafting row r offers its drafts with survival probabilities a_{r,j} = P(the first
j drafts are all accepted) = prod_{i<=j} c_{r,i}, non-increasing in j (the c's are the
calibrated conditional confidences of engine/acceptance.py). Verifying the first l_r
drafts of every row puts B = base + sum_r l_r tokens into the target's forward (base: one
pending token per decoding row, plus any prefill chunk in the same forward) and yields
tau = R + sum_r sum_{j<=l_r} a_{r,j} expected tokens (R: the decoding rows' own bonus
tokens). The step's expected throughput is Theta = tau * SPS(B), SPS the measured steps
per second (engine/step_costs.py).

* `strict` (Algorithm 1 as printed): all (r, j) sorted by a descending (ties by j, so a
  row's prefix stays contiguous), taken one by one while Theta improves, stopping at the
  first that does not. Whether (r, j) is verified depends only on entries ranked above it,
  never on a_{r,j+1}, which depends on the drafted token x_{r,j} itself: the choice is a
  stopping rule, and speculative sampling stays exact (Appendix A).
* `production` (§5.2): the number of draft tokens K is the best prefix of the sorted list
  by a global search (no early stop) over the candidates of two steps ago; this step's
  candidates, sorted by their own current survival, take the top K. K is fixed before this
  step's tokens are drafted, so the choice is again non-anticipating. Until two steps of
  history exist it is `strict`.
* `anticipating` exists only to be caught by the tests: the global search over this
  step's own candidates, which looks past a draft before deciding on it (Appendix A's
  counterexample: it biases sampled output).

Oracle: tests/test_verify_schedule.py (the strict form equals a brute-force search over
every length vector where Theta is unimodal along the sorted path; the production budget
is the brute-force best count; prefixes stay contiguous; Appendix A's numbers) and, through
the engine, tests/test_scheduler_engine.py (greedy identical to plain decoding, a
chi-square test at T > 0 that passes for strict and production and fails for
anticipating).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

MODES = ("cost", "strict", "production")  # cost: engine/draft_length.py's per-row policy alone
SERVED = "strict"  # what `verispec serve` / `generate` / `dspark measure` decide with unless told


def _entries(survival: list[list[float]]) -> list[tuple[float, int, int]]:
    """(a, j, r) for every offered draft with a > 0, best first; ties keep prefix order."""
    out = [(a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row, 1) if a > 0]
    out.sort(key=lambda e: (-e[0], e[1], e[2]))
    return out


def strict(survival: list[list[float]], base_tokens: int, tau0: float, sps: Callable[[int], float]) -> list[int]:
    lengths = [0] * len(survival)
    b, tau = base_tokens, float(tau0)
    best = tau * sps(b)
    for a, j, r in _entries(survival):
        theta = (tau + a) * sps(b + 1)
        if theta <= best:
            break
        assert j == lengths[r] + 1, "survival must be non-increasing along a row"
        b, tau, best = b + 1, tau + a, theta
        lengths[r] = j
    return lengths


def best_count(survival: list[list[float]], base_tokens: int, tau0: float, sps: Callable[[int], float]) -> int:
    """The number of sorted entries whose prefix maximizes Theta (global search, no early stop)."""
    b, tau = base_tokens, float(tau0)
    best, best_k = tau * sps(b), 0
    for k, (a, _, _) in enumerate(_entries(survival), 1):
        b, tau = b + 1, tau + a
        theta = tau * sps(b)
        if theta > best:
            best, best_k = theta, k
    return best_k


def top_k(survival: list[list[float]], k: int) -> list[int]:
    lengths = [0] * len(survival)
    for a, j, r in _entries(survival)[:k]:
        lengths[r] = max(lengths[r], j)
    return lengths


def anticipating(survival: list[list[float]], base_tokens: int, tau0: float,
                 sps: Callable[[int], float]) -> list[int]:
    """NOT lossless at T > 0 (the tests' negative control): this step's own global search."""
    return top_k(survival, best_count(survival, base_tokens, tau0, sps))


class VerifySchedule:
    """The engine's scheduler state (the production form's history). `sps(B, rows)` is the
    SPS table (engine/step_costs.py StepCosts.sps); a step's row count is fixed while its
    lengths are chosen."""

    def __init__(self, mode: str, sps: Callable[[int, int], float]):
        if mode not in MODES and mode != "anticipating":
            raise ValueError(f"unknown verify schedule {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.sps = sps
        self.history: deque[int] = deque(maxlen=2)  # the best counts of the last two steps
        self.chosen = 0  # tokens sent to verification by the last step

    @property
    def active(self) -> bool:
        return self.mode != "cost"

    def choose(self, survival: list[list[float]], base_tokens: int, tau0: float, rows: int = 1) -> list[int]:
        """Lengths for the offered rows: `base_tokens` in the forward without their drafts,
        `tau0` the tokens it yields for sure (one per decoding row, plus the expectation of
        drafts that are not the scheduler's to cut), `rows` the rows it spans."""
        def sps(b: int) -> float:
            return self.sps(b, rows)

        if self.mode == "strict":
            lengths = strict(survival, base_tokens, tau0, sps)
        elif self.mode == "anticipating":
            lengths = anticipating(survival, base_tokens, tau0, sps)
        else:  # production: the budget two steps old, this step's ranking
            budget = self.history[0] if len(self.history) == 2 else None
            self.history.append(best_count(survival, base_tokens, tau0, sps))
            lengths = strict(survival, base_tokens, tau0, sps) if budget is None else top_k(survival, budget)
        self.chosen = sum(lengths)
        return lengths

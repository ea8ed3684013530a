"""Counters and latency histograms the engine keeps (plain numbers, no exporter here).

The engine thread writes; the server renders them (server/metrics.py, Prometheus text
format) and /stats reads them. Single writer, and every update is one attribute or list
item assignment under the GIL, so a reader sees each number whole.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# seconds; CPU decode steps are tens of ms, prefill of long prompts seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: above the largest bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations <= it) pairs, Prometheus' `le` convention."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class EngineMetrics:
    requests_finished: Counter = field(default_factory=Counter)  # by finish reason
    requests_rejected: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (the prefix cache's hits are not)
    generation_tokens: int = 0
    steps: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS + (60.0, 120.0, 300.0)))

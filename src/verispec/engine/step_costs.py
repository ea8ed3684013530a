"""The SPS table: what one target forward of B tokens costs on this machine.

DSpark's scheduler (paper §3.2.2) weighs expected accepted tokens against SPS(B), the
engine's steps per second at a forward of B tokens, profiled once and kept as a lookup
table. Here the table is measured at engine start for the token counts the engine issues
(a decode step of 1 to 64 tokens: rows x (1 + drafts)), each point the median of several
timed forwards after a short context, made monotone (a forward of more tokens never costs
less; timing noise can say otherwise), and cached in the user cache per (model shapes and
kernel plan, dtype, device, CPU, torch, threads) so restarts reuse it. An entry older than
`MAX_AGE_DAYS`, or measured for another key, is measured again; `verispec profile
--refresh` forces it. `verispec profile` and `/stats` show it.

A table measured beside other work can be wrong for days: on a 2-core VM, with training
running, a tiny model's table read a 2-token forward at 3.8-4.7x a 1-token one, and the
scheduler, trusting it, stopped verifying anything. So a table must be sub-additive where
a forward is bound by reading the weights (up to `SUBADDITIVE_UPTO` tokens, a verify block):
one forward of a + b tokens may not cost more than a forward of a and one of b (x `SLACK`
for timing noise), as every token shares the weights read once. Past that a forward turns
compute-bound and real tables are not sub-additive (on this VM SmolLM2's 64 tokens read
1.8-2.9x two forwards of 32, run after run), so they are not checked. A table that fails
the check is measured again (up to `ATTEMPTS` in all, each size keeping its fastest
reading: other work only adds time), and one that stays implausible is used but not
cached, so the next start measures afresh; `verispec profile` says so.

A table can also be consistent and wrong: measured while other work held the cores, every
size reads slow alike (on the 2-core Xeon a cached gemma3 table read 146 ms from 1 to 9
tokens, written while a test suite ran beside it; alone a token took 25 ms and 9 took 48).
Flat, it told the scheduler that verifying 9 tokens costs what 1 does. So a cached table
is checked against one forward timed now (`one_token_seconds`, ~3 forwards after a short
context): a cached single token more than `BUSY_RATIO` times slower than now means it was
measured at a busy moment, and the table is measured again. Less disturbed tables are wrong
too: on that Xeon the cached tables read 12.6 ms a SmolLM2 token against 8.6-10.3 timed now,
and 23.5 ms a gemma3 token against 17.9-21.8. Relative costs survive that, but a paid
drafter's round, priced in single-token steps, read 1.3-1.4x cheaper than it was, and DSpark
alone drafted where it lost (0.93x plain on SmolLM2; stage 24 of docs/dspark-campaign.md). Five
timings "now" of one model spread by 10-20%, so the ratio is 1.25, not the 2.0 it was.

The rows a forward spans matter too: on a 2-core Zen 5 with the default SmolLM2 plan, 8
tokens as one row's verify block took 19.8 ms and as 8 rows of one token 28.4 ms (each
row has its own attention and plan; `verispec profile` prints both). So the table also
holds a per-row overhead o(R) = t(R rows of 1 token) - t(one row of R tokens), measured
for R up to 16 and interpolated, and a forward of B tokens over R rows costs
t(B) + o(R). Within a step R is fixed; the scheduler compares lengths at that R.

Oracle: tests/test_step_costs.py (monotone, median, interpolation against the measured
points, the cache reused and invalidated by its key and age, an implausible table measured
again and never cached, a table cached at a busy moment measured again).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from verispec.models.profiles import save_profile

SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32, 48, 64)
ROWS = (1, 2, 4, 8, 16)
REPEATS = 5
CONTEXT = 64
MAX_AGE_DAYS = 7
VERSION = 4  # 4: sizes timed in rounds (a table measured beside other work had 2 tokens at 1.43x one)
ATTEMPTS = 3  # measurements of a table that is not sub-additive, in all
SLACK = 1.25  # timing noise allowed by the sub-additivity check
SUBADDITIVE_UPTO = 9  # the largest forward (one row's verify block) the check covers
BUSY_RATIO = 1.25  # a cached 1-token forward this many times slower than one now: measured beside other work


class StepCosts:
    """Relative cost of a target forward over n tokens (n = 1 costs 1.0), interpolated
    between measured points; beyond the last point, linear. `seconds` keeps the measured
    times (the SPS table is their inverse)."""

    def __init__(self, points: dict[int, float], row_overhead: dict[int, float] | None = None):
        self.seconds = {int(n): float(s) for n, s in sorted(points.items())}
        self.n = list(self.seconds)
        self.base_seconds = self.seconds[self.n[0]]  # the smallest measured forward, in seconds
        self.cost = [self.seconds[n] / self.base_seconds for n in self.n]
        # seconds a forward spends per extra row, by row count (1 row: none)
        self.row_overhead = {int(r): max(0.0, float(o)) for r, o in sorted((row_overhead or {1: 0.0}).items())}

    def __call__(self, n: float) -> float:
        ns, cs = self.n, self.cost
        if n <= ns[0]:
            return cs[0]
        for (n0, c0), (n1, c1) in zip(zip(ns, cs), zip(ns[1:], cs[1:])):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        slope = (cs[-1] - cs[-2]) / (ns[-1] - ns[-2])
        return cs[-1] + slope * (n - ns[-1])

    def overhead(self, rows: int) -> float:
        rs = list(self.row_overhead)
        if rows <= rs[0]:
            return self.row_overhead[rs[0]]
        for r0, r1 in zip(rs, rs[1:]):
            if rows <= r1:
                o0, o1 = self.row_overhead[r0], self.row_overhead[r1]
                return o0 + (o1 - o0) * (rows - r0) / (r1 - r0)
        if len(rs) == 1:
            return self.row_overhead[rs[0]]
        slope = (self.row_overhead[rs[-1]] - self.row_overhead[rs[-2]]) / (rs[-1] - rs[-2])
        return self.row_overhead[rs[-1]] + slope * (rows - rs[-1])

    def sps(self, n: int, rows: int = 1) -> float:
        """Steps per second of a forward of n tokens spanning `rows` rows."""
        return 1.0 / (self(n) * self.base_seconds + self.overhead(rows))

    def table(self) -> list[dict]:
        return [{"tokens": n, "ms": round(s * 1e3, 3), "steps_per_s": round(1.0 / s, 1), "relative": round(c, 3)}
                for (n, s), c in zip(self.seconds.items(), self.cost)]

    def row_table(self) -> list[dict]:
        return [{"rows": r, "overhead_ms": round(o * 1e3, 3)} for r, o in self.row_overhead.items()]

    @classmethod
    def flat(cls) -> "StepCosts":
        return cls({1: 1.0, 2: 1.0})


def monotone(points: dict[int, float]) -> dict[int, float]:
    running, out = 0.0, {}
    for n in sorted(points):
        running = out[n] = max(points[n], running)
    return out


@torch.inference_mode()
def measure(model, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS, rows: int = 1) -> dict[int, float]:
    """Seconds of a target forward of n tokens after `context` tokens, the median of
    `repeats` taken in rounds over the sizes, for each n: as one row (`rows=1`, a verify
    block) or spread over `rows` rows of n / rows tokens each (n divisible by rows)."""
    from verispec.models.decoder import BatchKV

    cache = model.new_cache()
    seqs = [cache.allocate(context + max(sizes) + 1) for _ in range(rows)]
    ids = torch.randint(0, model.args.vocab_size, (context + max(sizes),), device=model.device)
    for seq in seqs:
        model(ids[:context], BatchKV([seq], [context]))
    times: dict[int, list[float]] = {n: [] for n in sizes if n % rows == 0}
    for _ in range(repeats):  # in rounds over the sizes: a burst of other work skews every size alike
        for n in times:
            each = n // rows
            batch = torch.cat([ids[context : context + each]] * rows)
            t = time.perf_counter()
            model(batch, BatchKV(seqs, [each] * rows), logits_at=torch.arange(n, device=model.device))
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t)
            for seq in seqs:
                seq.rollback(each)
    points = {n: statistics.median(ts) for n, ts in times.items()}
    for seq in seqs:
        cache.release(seq)
    return points


@torch.inference_mode()
def _row_overhead_samples(model, rows: int, context: int, pairs: int) -> list[float]:
    """t(rows rows of 1 token) - t(one row of `rows` tokens), timed back to back."""
    from verispec.models.decoder import BatchKV

    cache = model.new_cache()
    seqs = [cache.allocate(context + rows + 1) for _ in range(rows + 1)]
    ids = torch.randint(0, model.args.vocab_size, (context + rows,), device=model.device)
    for seq in seqs:
        model(ids[:context], BatchKV([seq], [context]))
    at = torch.arange(rows, device=model.device)

    def timed(batch, kv, used):
        t = time.perf_counter()
        model(batch, kv, logits_at=at)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        for seq, n in used:
            seq.rollback(n)
        return elapsed

    out = []
    for _ in range(pairs):
        block = timed(ids[context : context + rows], BatchKV([seqs[0]], [rows]), [(seqs[0], rows)])
        spread = timed(ids[context : context + 1].repeat(rows), BatchKV(seqs[1:], [1] * rows),
                       [(seq, 1) for seq in seqs[1:]])
        out.append(spread - block)
    for seq in seqs:
        cache.release(seq)
    return out


def measure_step_costs(model, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS,
                       rows=ROWS) -> StepCosts:
    """A few seconds on a 2-core CPU for a 135M model."""
    points = monotone(measure(model, sizes, context, repeats))
    overhead = {1: 0.0}
    for r in rows:
        if r > 1:
            # interleaved pairs, the median difference: this machine's noise is of the order
            # of the overhead itself, and drifts between one series and the next
            diffs = _row_overhead_samples(model, r, context, max(repeats, 7))
            overhead[r] = max(0.0, statistics.median(diffs))
    running = 0.0
    for r in sorted(overhead):  # more rows never cost less
        running = overhead[r] = max(overhead[r], running)
    return StepCosts(points, overhead)


def violations(seconds: dict[int, float], slack: float = SLACK,
               upto: int = SUBADDITIVE_UPTO) -> list[tuple[int, int, int]]:
    """The (a, b, a + b) among the measured sizes, a + b <= `upto`, where one forward of
    a + b tokens cost more than a forward of a plus one of b (beyond `slack`): not what a
    forward bound by reading its weights does, so a sign the timing was disturbed."""
    t = {int(n): float(s) for n, s in seconds.items()}
    return [(a, b, a + b) for a in sorted(t) for b in sorted(t)
            if a <= b and a + b <= upto and a + b in t and t[a + b] > slack * (t[a] + t[b])]


def fastest(first: StepCosts, second: StepCosts) -> StepCosts:
    """Each size's and each row count's smaller reading of two measurements (other work on
    the machine only adds time; the pointwise minimum of monotone tables stays monotone)."""
    return StepCosts({n: min(s, second.seconds.get(n, s)) for n, s in first.seconds.items()},
                     {r: min(o, second.row_overhead.get(r, o)) for r, o in first.row_overhead.items()})


def one_token_seconds(model) -> float:
    """A single-token forward's seconds now: the median of 3 after a short context."""
    return measure(model, sizes=(1,), context=16, repeats=3)[1]


def measured_while_busy(model, costs: StepCosts) -> bool:
    """Whether a cached table's single token is over BUSY_RATIO times what one costs now."""
    if 1 not in costs.seconds:
        return False
    return costs.seconds[1] > BUSY_RATIO * one_token_seconds(model)


def cache_key(model, sizes=SIZES, rows=ROWS) -> dict:
    from verispec.models.kernel_plan import cpu_name

    plan = getattr(model, "kernel_plan", None)
    a = model.args
    return {"version": VERSION, "cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "shapes": [a.num_layers, a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim,
                       a.vocab_size],
            "plan": None if plan is None else {"linear": plan.linear, "key": plan.key},
            "sizes": list(sizes), "rows": list(rows), "context": CONTEXT}


def cache_path(key: dict) -> Path:
    from verispec.models.profiles import profile_path

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return profile_path(f"sps-{digest}.json")


def step_costs_for(model, refresh: bool = False, sizes=SIZES, rows=ROWS) -> tuple[StepCosts, dict]:
    """The cached SPS table for this model on this machine, measured when missing, stale
    or asked to (`refresh`); also what happened (`source`: cache or measured, `path`,
    `attempts`, and `implausible`: the sub-additivity violations of a table that stayed
    implausible and so was not cached)."""
    key = cache_key(model, sizes, rows)
    path = cache_path(key)
    if not refresh and path.is_file():
        try:
            saved = json.loads(path.read_text())
            fresh = time.time() - saved["measured_at"] < MAX_AGE_DAYS * 86400
            plausible = not violations(saved["seconds"])  # one cached before the check
            if saved["key"] == json.loads(json.dumps(key, default=str)) and fresh and plausible:
                costs = StepCosts({int(n): s for n, s in saved["seconds"].items()},
                                  {int(r): o for r, o in saved["row_overhead"].items()})
                if not measured_while_busy(model, costs):
                    return costs, {"source": "cache", "path": str(path), "measured_at": saved["measured_at"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    costs = measure_step_costs(model, sizes, rows=rows)
    attempts, bad = 1, violations(costs.seconds)
    while bad and attempts < ATTEMPTS:
        costs = fastest(costs, measure_step_costs(model, sizes, rows=rows))
        attempts, bad = attempts + 1, violations(costs.seconds)
    record = {"key": key, "measured_at": time.time(), "seconds": costs.seconds, "row_overhead": costs.row_overhead}
    if not bad:
        try:
            save_profile(path, record, indent=1)
        except OSError:
            pass  # a read-only cache still serves
    info = {"source": "measured", "path": str(path), "measured_at": record["measured_at"], "attempts": attempts}
    if bad:
        info["implausible"] = bad
    return costs, info

"""How many tokens each decoding row drafts this step: the one owner of that number.

`DraftLength` holds every rule: the engine's cap (`--num-draft-tokens`), the provider's
own maximum (a DSpark drafter's block size), what is left of the row's `max_tokens`
(a row always emits one token after its drafts), the seeded-row rule (a seeded row
drafts its whole allowance: the cost policy's choice depends on timings, and so would
the verify forwards' shapes and, in bf16, the sampled tokens), the cap on grammar-forced
drafts, and, for everything else, the cost policy below (`--fixed-draft` turns it off).

The cost policy: only as many as are expected to pay.

A row whose drafts are accepted with probability `a` each (given the ones before were)
emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per step with k drafts. The step costs more:
the target forward grows from the batch's `n` decode tokens to n + k (the SPS table of
engine/step_costs.py, measured once per machine and cached), plus whatever producing the drafts costs
(`draft_cost_fixed` per drafting round, as a DSpark backbone pass, a sampled row's own
price where the provider times its rounds apart, `sampled_draft_costs`, and
`draft_cost_per_token`, as a draft model's forwards; in single-token target steps; 0 for
n-gram lookup), and that slows down every row of the batch. The policy picks the k that maximizes the step's
throughput, (n - 1 + E(k)) / n / slowdown(k), and drafts nothing when no k beats plain
decoding, which is what keeps speculation from slowing down text it cannot predict.

`a` is estimated per row from its own history (accepted / (accepted + rejected)), starting
from what the drafter has recently achieved on all rows (worth a few rounds), so a drafter
that is useless on this traffic does not cost every new request a few failed rounds. A row that stopped drafting probes with one token now and
then, so it notices when its text turns predictable (a quote, code being repeated): first
after `PROBE_EVERY` steps, and after each probe that changes nothing twice as long, up to
`MAX_PROBE_EVERY` (a hopeless draft model then costs almost nothing: bench/spec.py).

A sampled row asking a paid source under the verify scheduler (a DSpark drafter alone,
served, at T > 0) is judged by what its rounds have delivered instead, once there are some
(`RoundYield`): the tokens a round kept and the drafts it sent to verification, per round,
the row's own decayed over its last `ROW_YIELD_MEMORY` rounds on a prior from all sampled
rows' recent rounds. The rate model above assumes the k drafts asked for are all verified;
under the scheduler a row asks for its whole allowance and the drafter's confidence cut and
the scheduler verify fewer (on gemma3 at T=1, 15% of DSpark's rounds came back empty), so it
read a round as worth more than it was and DSpark alone drafted where it lost. The row drafts
where a step that keeps what its rounds have kept, verifying what they have verified, beats
a plain step with the round's price paid; elsewhere it probes as above. Greedy rows keep the
rate model: judged by yields they drafted less on gemma3 at one stream (tau 1.52 -> 1.42) and
ran no faster, where sampled rows went from 0.91x to 0.96x plain (stage 25 of
docs/dspark-campaign.md, bench/scheduler.py's dspark-strict against dspark-strict-rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.step_costs import StepCosts

PRIOR_ACCEPT = 0.5  # the estimate a row starts from ...
PRIOR_WEIGHT = 4.0  # ... worth this many drafted tokens of evidence
PROBE_EVERY = 8
MAX_PROBE_EVERY = 256
UNSENT_BEFORE_BACKOFF = 2  # rounds whose draft the verify scheduler sent none of
ROW_YIELD_MEMORY = 12.0  # paid rounds a row's own yield keeps (text changes what pays)
POOL_YIELD_MEMORY = 64.0  # paid rounds the yield over all rows keeps
YIELD_PRIOR_ROUNDS = 3.0  # what a new row's yield starts from the pool's, in rounds
MIN_YIELD_ROUNDS = 2.0  # rounds of evidence before yields, not the rate model, decide


@dataclass
class RoundYield:
    """What a paid source's rounds delivered: rounds, tokens kept (drafts accepted, the
    bonus token not counted) and drafts sent to verification, decayed sums."""
    rounds: float = 0.0
    kept: float = 0.0
    verified: float = 0.0

    def update(self, verified: int, kept: int, memory: float) -> None:
        self.rounds += 1
        self.kept += kept
        self.verified += verified
        if self.rounds > memory:
            scale = memory / self.rounds
            self.rounds, self.kept, self.verified = memory, self.kept * scale, self.verified * scale

    def prior(self, weight: float = YIELD_PRIOR_ROUNDS) -> "RoundYield":
        """A row's starting yield: this one's means, worth `weight` rounds (none if empty)."""
        if self.rounds <= 0:
            return RoundYield()
        scale = min(weight, self.rounds) / self.rounds
        return RoundYield(self.rounds * scale, self.kept * scale, self.verified * scale)

    @property
    def mean_kept(self) -> float:
        return self.kept / self.rounds if self.rounds else 0.0

    @property
    def mean_verified(self) -> float:
        return self.verified / self.rounds if self.rounds else 0.0


@dataclass
class AcceptanceEstimate:
    accepted: float = PRIOR_ACCEPT * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_ACCEPT) * PRIOR_WEIGHT
    idle_steps: int = 0  # steps without drafting since the last draft or probe
    probe_every: int = PROBE_EVERY
    unsent: int = 0  # rounds in a row whose whole draft the verify scheduler cut
    paid: RoundYield | None = None  # a paid source's rounds for this row (RoundYield)
    asked: bool = False  # this step asked a paid source: commit records the round's yield

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, kept: int, memory: float | None = None) -> None:
        """A round with `drafted` proposals of which the first `kept` were accepted. With
        `memory`, older evidence is discounted so the estimate follows recent rounds."""
        if drafted == 0:
            return
        self.accepted += kept
        self.rejected += 1 if kept < drafted else 0
        if memory is not None and self.accepted + self.rejected > memory:
            scale = memory / (self.accepted + self.rejected)
            self.accepted *= scale
            self.rejected *= scale

    def prior(self) -> "AcceptanceEstimate":
        """A fresh estimate that starts from this one's rate, worth PRIOR_WEIGHT tokens."""
        rate = self.rate
        return AcceptanceEstimate(accepted=rate * PRIOR_WEIGHT, rejected=(1 - rate) * PRIOR_WEIGHT)


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


class CostPolicy:
    def __init__(self, max_draft: int, costs: StepCosts, draft_cost_fixed: float = 0.0, draft_cost_per_token: float = 0.0):
        self.max_draft = max_draft
        self.costs = costs
        self.draft_fixed = draft_cost_fixed  # a round that drafts at all (a DSpark backbone pass)
        self.draft_per_token = draft_cost_per_token  # each drafted token (a draft model's forward)

    def choose(self, estimate: AcceptanceEstimate, batch_tokens: int, limit: int,
               draft_fixed: float | None = None) -> int:
        """Drafts for one row, given the step's other decode tokens (`batch_tokens`,
        this row's pending token included) and the most the row may take (`limit`);
        `draft_fixed`: this round's price where it differs from the policy's own (a sampled
        row's, or what served rounds have cost lately: `DraftLength`)."""
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return 0
        a = estimate.rate
        base = self.costs(batch_tokens)
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            # the whole step's throughput: this row's extra tokens slow every row down
            slowdown = (self.costs(batch_tokens + k) + self.round_price(k, draft_fixed)) / base
            value = (batch_tokens - 1 + expected_tokens(a, k)) / batch_tokens / slowdown
            if value > best:
                best_k, best = k, value
        return self.idle_or(estimate, best_k, probe=1)

    def round_price(self, drafts: int, draft_fixed: float | None = None) -> float:
        """A round of `drafts` drafts, in single-token steps (`draft_fixed`: see choose)."""
        return (self.draft_fixed if draft_fixed is None else draft_fixed) + self.draft_per_token * drafts

    def pays(self, paid: RoundYield, batch_tokens: int, drafts: int, draft_fixed: float | None = None) -> bool:
        """Whether a step whose row keeps and verifies what its paid rounds have (means of
        `paid`), a round of `drafts` paid (`draft_fixed`: see choose), emits more per second
        than a plain one. The step's other rows count: the round delays their tokens too."""
        base = self.costs(batch_tokens)
        # the SPS table interpolates between its sizes: a mean of 1.27 verified drafts is priced so
        slowdown = (self.costs(batch_tokens + paid.mean_verified) + self.round_price(drafts, draft_fixed)) / base
        return (batch_tokens + paid.mean_kept) / batch_tokens / slowdown > 1.0

    @staticmethod
    def idle_or(estimate: AcceptanceEstimate, k: int, probe: int) -> int:
        """`k` drafts, or, where that is none, none but a probe of `probe` drafts every
        `probe_every` idle steps, each probe that changes nothing doubling the wait."""
        if k > 0:
            estimate.idle_steps = 0
            estimate.probe_every = PROBE_EVERY
            return k
        estimate.idle_steps += 1
        if estimate.idle_steps >= estimate.probe_every:
            estimate.idle_steps = 0
            estimate.probe_every = min(2 * estimate.probe_every, MAX_PROBE_EVERY)
            return probe
        return 0


class DraftLength:
    def __init__(self, cap: int, provider_max: int, costs: StepCosts | None = None, adaptive: bool = True,
                 draft_costs: tuple[float, float] = (0.0, 0.0), ask_all: bool = False,
                 sampled_round: float | None = None, served_round=None, judge_by_yield: bool = True):
        self.cap = cap  # the engine's --num-draft-tokens: forced drafts too
        self.max_draft = max(0, min(cap, provider_max))  # what the provider may be asked for
        self.adaptive = adaptive and costs is not None
        self.policy = CostPolicy(self.max_draft, costs or StepCosts.flat(), *draft_costs)
        # a sampled row's round can cost more than a greedy one's (a DSpark round on
        # gemma3-270m draws and keeps q per slot, 7-8 ms with Gemma's top-k and top-p against
        # 3.5): `sampled_round` (single-token steps, timed at start without the request's
        # warpers), then, once the provider has timed served rounds with a sampled row
        # (`served_round(greedy) -> seconds or None`, DraftProvider.served_round_seconds),
        # their running mean. Charged the greedy price, DSpark alone drafted where it lost,
        # 0.92x plain at T=1 on gemma3 (stage 24 of docs/dspark-campaign.md).
        self.sampled_round = sampled_round
        self.served_round = served_round
        # under the verify scheduler (engine/verify_schedule.py) a row asks for its whole
        # allowance and the scheduler chooses how many to verify; a source whose drafting
        # costs (a DSpark pass, a draft model) still drafts only where the policy says it pays
        self.ask_all = ask_all
        self.free_drafts = draft_costs == (0.0, 0.0)
        # a sampled row asking a paid source under the scheduler drafts where its rounds'
        # yields pay (RoundYield); False: the rate model alone (bench/scheduler.py's
        # dspark-strict-rate)
        self.judge_by_yield = judge_by_yield and ask_all and not self.free_drafts

    @staticmethod
    def room(row) -> int:
        """Drafts the row can still use: it emits one more token after them."""
        return row.request.max_tokens - len(row.output) - 1

    def forced(self, row) -> int:
        """How many grammar-forced tokens the row may verify this step."""
        return max(0, min(self.cap, self.room(row)))

    def for_row(self, row, batch_tokens: int) -> int:
        """How many tokens the row's source is asked for (`batch_tokens`: the step's
        decode tokens, this row's pending token included)."""
        limit = min(self.max_draft, self.room(row))
        if limit <= 0:
            return 0
        if not self.adaptive or row.params.seed is not None:
            return limit
        if self.ask_all and self.free_drafts:
            return limit
        estimate = row.draft_stats.estimate
        if self.ask_all and estimate.unsent >= UNSENT_BEFORE_BACKOFF:
            # the scheduler has been cutting this row's whole (costly) draft: draft only
            # as a probe, ever more rarely, instead of paying for drafts nobody verifies
            return self.policy.idle_or(estimate, 0, probe=limit)
        paid = estimate.paid
        if self.judge_by_yield and not row.params.is_greedy and paid is not None \
                and paid.rounds >= MIN_YIELD_ROUNDS:
            pays = self.policy.pays(paid, batch_tokens, limit, self.sampled_price())
            return self.policy.idle_or(estimate, limit if pays else 0, probe=limit)
        k = self.policy.choose(estimate, batch_tokens, limit, None if row.params.is_greedy else self.sampled_price())
        return limit if self.ask_all and k > 0 else k

    @property
    def pays_per_round(self) -> bool:
        """Rounds asked of the source are paid for, and their yields recorded (Drafting)."""
        return self.adaptive and not self.free_drafts

    def sampled_price(self) -> float | None:
        """A sampled row's round, in single-token steps (None: the greedy price)."""
        served = self.served_round(False) if self.served_round is not None else None
        return served / self.policy.costs.base_seconds if served is not None else self.sampled_round

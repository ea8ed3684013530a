"""Composite drafting: a row with two draft sources (a model-based drafter and n-gram
lookup) verifies, each round, the candidate with the larger expected gain.

Both sources follow the row all along (prefill and commit go to both, so either can
propose at any step). Each round the sources asked (below: the lookup always, the
model where it may gain more) propose; the engine's confidences (engine/acceptance.py
through `Drafting.conditionals`, bound at engine start) give each candidate's survival
products, and the row takes:

* greedy rows: the candidate with the larger expected number of accepted drafts, the
  sum of its survival products (any choice is lossless at temperature 0: verification
  keeps exactly the drafts that equal the target's argmax);
* sampled rows: the candidate with the larger confidence for its *first* draft only.
  Speculative sampling needs the verified draft to be distributed as its q; choosing a
  sampled draft because of what it sampled would condition that (the paper's Appendix A
  bias). A DSpark head's first confidence depends only on the anchor and the target's
  state, not on the token it drafts there, and an n-gram draft is a function of the text,
  so this choice is made before any draft token is seen.

A row's first round, and every `EXPLORE_EVERY`-th after it, verifies the candidate of the
source verified least often over all rows among those whose confidences are learnt from
verification (engine/acceptance.py's online table: drafts without confidences of their
own): an estimate that is never tested never learns, and a rule driven by counters cannot
bias the output. A DSpark head's calibrated confidences need no such rounds, and verifying
its short draft instead of the lookup's long sure one on looping text cost every 8th round.

Free sources (a lookup: `DraftProvider.free`) propose first. A paid source (a model
drafter, whose round costs a backbone pass) is then asked only for the rows where it is
expected to pay. G: its candidates' recent expected gain (`RunningMean`, a running mean of
the sums of their survival products, greedy and sampled rows apart, on the engine's
confidences, which the engine recalibrates online against what verification kept). O: the
best free candidate's. Each is weighed against what its step would cost: the target
forward over the step's B rows plus about one draft more than the candidate is expected
to keep (the first rejected one), from the engine's measured step costs s, plus the paid
round's own cost c (single-token target steps; a sampled row's round is timed apart, a draw
and q per slot made it 5.2 ms against a greedy round's 4 on gemma3; once the source has timed
a few served rounds, `DraftProvider.served_round_seconds`, their running mean: served rounds
bring the context rows of every step since the row's last round and share calls, and on
gemma3 at 4 streams they took 5-11 ms against the 3.3 the start-up timing charged, stage 18
of docs/dspark-campaign.md). The source is asked where

    (B + G) / (s(B + m_G) + c)  >  (B + O) / s(B + m_O),   m = min(draft length, gain + 1)

(the step's tokens per unit of time: each of its B rows emits one, this row its gain on
top; the other rows' gains are left out, which leans towards asking). For a sampled row G
is first scaled by the drafts verification kept per draft promised over the source's
recent verified sampled rounds (`kept_ratio`): its confidences promised gemma3-270m 0.44
drafts a round at T=1 where 0.32 were kept, and the source was asked where it lost
(stage 26 of docs/dspark-campaign.md). And, so that G keeps
learning, until it has a first estimate and on one row of every `PROBE_EVERY`-th step (per
step, not per row: a probe delays the whole step, and when every new row's first round
was one, 16 streams paid a whole-prompt backbone pass each time a request joined). With
flat step costs that is G > O + c (B + O): a round that pays on one row must gain B times
as much on B, since it delays every row's token. Counting this row's tokens alone (the rule
before stage 10 of docs/dspark-campaign.md) asked the drafter on most rows of a 4-16-row
batch, where bench/scheduler.py measured the composite at 0.62-0.92x no speculation on
gemma3-270m. The engine's draft length policy is charged the free sources only
(`draft_costs`): a paid round's cost is this rule's to weigh, not a reason to shorten the
lookup's drafts on rows where the model is never asked. On text that repeats itself the
lookup's long, sure drafts win and the model's round is not paid.

The choice reads the free drafts (functions of the text) and past rounds only, never
this round's sampled drafts, so it is lossless as the choice between candidates is. A
source not asked this round keeps its context: the next round it drafts in takes every
committed row since (a DSpark backbone pass over more new context rows).

Oracle: tests/test_composite.py (greedy identical to plain decoding on the DeepSpec
fixture; at T > 0 the chi-square test of tests/test_dspark.py's setting passes; scripted
sources for exactly which rows pay for the model's round, with and without step costs, and
where a sampled row's verified candidates kept less than they promised).
"""

from __future__ import annotations

from verispec.engine.acceptance import survival
from verispec.engine.draft import Draft, DraftProvider, DraftSource, RunningMean, SourceContext
from verispec.engine.step_costs import StepCosts

EXPLORE_EVERY = 8  # every 8th round of a row verifies its least-chosen source's candidate
PROBE_EVERY = 32  # every 32nd step one row asks every paid source, whatever it is expected to gain
GAIN_MEMORY = 32  # drafts a paid source's running mean gain mostly rests on
KEPT_MEMORY = 64  # verified rounds a paid source's kept-per-promised ratio mostly rests on
KEPT_AT_LEAST = 8  # verified rounds before that ratio corrects its gain


class CompositeSource(DraftSource):
    def __init__(self, sources: list[DraftSource], context: SourceContext, owner: "CompositeProvider"):
        self.sources = sources
        self.context = context
        self.owner = owner
        self.chosen: list[int] = [0] * len(sources)  # rounds each source's candidate was verified
        self.rounds = 0
        self.pending_paid: tuple[int, float] | None = None  # (paid source, its gain) this round verifies

    def prefill(self, tokens, hidden) -> None:
        for s in self.sources:
            s.prefill(tokens, hidden)

    def commit(self, kept, next_token, hidden) -> None:
        # kept = the pending token + the drafts verification kept (none where the verify
        # scheduler cut the candidate to nothing: the round was paid all the same)
        if self.pending_paid is not None:
            i, promised = self.pending_paid
            self.owner.settle(i, self.context.params.is_greedy, promised, len(kept) - 1)
        self.pending_paid = None
        for s in self.sources:
            s.commit(kept, next_token, hidden)

    def draft(self, pending: int, max_n: int) -> Draft:
        raise NotImplementedError("CompositeProvider drafts through draft_batch")

    def close(self) -> None:
        for s in self.sources:
            s.close()


class CompositeProvider(DraftProvider):
    name = "composite"

    def __init__(self, providers: list[DraftProvider], label: str | None = None):
        if len(providers) < 2:
            raise ValueError("a composite drafter needs at least two sources")
        self.providers = providers
        taps = [p.taps for p in providers if p.taps]
        if len(taps) > 1 and any(t != taps[0] for t in taps):
            raise ValueError("the sources of a composite drafter must read the same target layers")
        self.taps = taps[0] if taps else ()
        self.max_draft = max(p.max_draft for p in providers)
        self.label = label or " + ".join(p.describe() for p in providers)
        self.conditionals = None  # the engine binds its confidence estimate (Drafting.conditionals)
        self.chosen = [0] * len(providers)  # rounds each source's candidate was verified, all rows
        self.gains = [RunningMean(GAIN_MEMORY) for _ in providers]
        # per paid source, over the rounds its candidate was verified: the gain its
        # confidences promised and the drafts verification kept (see `kept_ratio`)
        self.promised = [RunningMean(KEPT_MEMORY) for _ in providers]
        self.kept = [RunningMean(KEPT_MEMORY) for _ in providers]
        # sampled rows' gains corrected by that ratio (False: bench/scheduler.py's
        # composite-strict-promised arm). Greedy rows' are not: their confidences, recalibrated
        # online, kept what they promised (0.45 against 0.44 on gemma3-270m), and a ratio read
        # low early stopped the asks that would have raised it (192 -> 77 asks, tau 2.22 -> 2.08)
        self.judge_by_kept = True
        self.asked = [0] * len(providers)  # rows each source was asked to draft for
        self.costs = [(0.0, 0.0)] * len(providers)  # each source's (per round, per token), once measured
        self.sampled_costs = list(self.costs)  # the same for sampled rows (a draw and q per slot)
        self.step_costs = StepCosts.flat()  # the engine's measured target step costs, once bound
        self.rows = 0  # rows that asked the composite for a draft
        self.steps = 0  # steps with a drafting row (the probe cadence)
        # free sources first: what they offer decides whether a paid one is asked
        self.order = sorted(range(len(providers)), key=lambda i: not providers[i].free)

    def bind_confidences(self, conditionals) -> None:
        self.conditionals = conditionals

    def new_source(self, context: SourceContext) -> CompositeSource:
        return CompositeSource([p.new_source(context) for p in self.providers], context, self)

    def describe(self) -> str:
        return f"composite ({self.label})"

    def stats(self) -> dict:
        names = [p.name for p in self.providers]
        # where enough verified rounds stand behind it (a ratio of exactly 1 is shown too)
        ratios = {p.name: {mode: round(self.kept_ratio(i, greedy), 3)
                           for mode, greedy in (("greedy", True), ("sampled", False))
                           if self.kept[i].get(greedy, KEPT_AT_LEAST) is not None}
                  for i, p in enumerate(self.providers) if not p.free}
        return {"chosen": dict(zip(names, self.chosen)), "asked": dict(zip(names, self.asked)), "rows": self.rows,
                "kept_per_promised": ratios}

    def draft_costs(self, target_costs) -> tuple[float, float]:
        """What the draft length policy is charged: the free sources' costs where there are
        any (a paid source's round is weighed per row by `_worth_asking`), else all."""
        self.step_costs = target_costs or StepCosts.flat()
        self.costs = [p.draft_costs(target_costs) for p in self.providers]
        self.sampled_costs = [c if p.free else p.sampled_draft_costs(target_costs) or c
                              for p, c in zip(self.providers, self.costs)]
        charged = [c for p, c in zip(self.providers, self.costs) if p.free] or self.costs
        return sum(f for f, _ in charged), sum(t for _, t in charged)

    def kv_bytes(self, capacity: int) -> int:
        return sum(p.kv_bytes(capacity) for p in self.providers)

    def draft_batch(self, requests: list[tuple[DraftSource, int, int]]) -> list[Draft]:
        options = [[Draft() for _ in self.providers] for _ in requests]
        picks = [[-1.0] * len(self.providers) for _ in requests]  # each offered draft's pick key, once
        offered_gain = [[0.0] * len(self.providers) for _ in requests]
        best = [(0.0, 0)] * len(requests)  # per row: (the largest expected gain offered so far, its length)
        drafting = [r for r, (_, _, n) in enumerate(requests) if n > 0]
        batch = len(drafting)  # rows drafting: one pending token each
        explore = []
        for source, _, n in requests:
            source.rounds += 1
            explore.append(source.rounds % EXPLORE_EVERY == 1)
        probe = [False] * len(requests)
        if drafting:
            # one row of every PROBE_EVERY-th step, in turn: a probe's round delays the whole
            # step's tokens, so the cadence is per step, not per row
            self.steps += 1
            if self.steps % PROBE_EVERY == 1:
                probe[drafting[(self.steps // PROBE_EVERY) % batch]] = True
        self.rows += batch
        for i in self.order:
            p = self.providers[i]
            rows = [r for r, (source, _, n) in enumerate(requests) if n > 0 and (
                p.free or probe[r] or self._worth_asking(i, best[r], source, min(n, p.max_draft), batch))]
            if not rows:
                continue
            self.asked[i] += len(rows)
            drafts = p.draft_batch([(requests[r][0].sources[i], requests[r][1], min(requests[r][2], p.max_draft))
                                    for r in rows])
            for r, d in zip(rows, drafts):
                options[r][i] = d
                if d.tokens:
                    source = requests[r][0]
                    gain, picks[r][i] = self._gain(d, source)
                    offered_gain[r][i] = gain
                    self.gains[i].add(source.context.params.is_greedy, gain)
                    best[r] = max(best[r], (gain, len(d)))
        out = []
        for r, (source, _, n) in enumerate(requests):
            if n <= 0:
                out.append(Draft())
                continue
            row = options[r]
            pick = max(range(len(row)), key=lambda i: (picks[r][i], -i))
            if explore[r]:
                # a row's first round and every 8th after it: of the sources whose estimate is
                # learnt online, the one verified least often over all rows, so every estimate
                # keeps learning (counters, not this round's drafts, decide: lossless at any
                # temperature)
                offered = [i for i, d in enumerate(row) if d.tokens and d.confidence is None]
                if offered:
                    pick = min(offered, key=lambda i: (self.chosen[i], i))
            if row[pick].tokens:
                source.chosen[pick] += 1
                self.chosen[pick] += 1
                if not self.providers[pick].free:
                    source.pending_paid = (pick, offered_gain[r][pick])
            out.append(row[pick])
        return out

    def _worth_asking(self, i: int, offered: tuple[float, int], source: CompositeSource, n: int, batch: int) -> bool:
        """Ask paid source i for n drafts on this row if a step verifying drafts like its
        recent ones is expected to emit more per second, its round included, than one
        verifying what is already offered (`offered`: expected gain, length). The step's
        other rows count in both: the round delays their tokens too."""
        greedy = source.context.params.is_greedy
        expected = self.gains[i].get(greedy)
        if expected is None:
            return True
        if not greedy and self.judge_by_kept:
            expected *= self.kept_ratio(i, greedy)
        fixed, per_token = (self.costs if greedy else self.sampled_costs)[i]
        s = self.step_costs
        served = self.providers[i].served_round_seconds(greedy)
        if served is not None:  # what its rounds have cost lately, in single-token steps
            fixed, per_token = served / s.base_seconds, 0.0
        base = s(batch)  # the step's forward without drafts; this row's share of what drafts add:

        def step(drafts: float, paid: float = 0.0) -> float:
            return (s(batch + drafts) + paid) / base

        gain, length = offered
        # the step's tokens: one from each of its rows, plus this row's expected gain
        return (batch + expected) / step(min(n, expected + 1.0), fixed + per_token * n) > \
            (batch + gain) / step(min(length, gain + 1.0))

    def settle(self, i: int, greedy: bool, promised: float, kept: int) -> None:
        """After a round that verified paid source i's candidate: what it promised, what was kept."""
        self.promised[i].add(greedy, promised)
        self.kept[i].add(greedy, float(kept))

    def kept_ratio(self, i: int, greedy: bool) -> float:
        """Drafts kept per draft promised by paid source i's verified candidates lately
        (1 until KEPT_AT_LEAST were verified). Its gain is an expectation on confidences
        that can promise more than verification keeps: the verify scheduler sends only a
        prefix, and a sampled row's pick favours candidates whose first confidence came out
        high. On gemma3-270m at T=1, one stream, the composite's verified DSpark candidates
        promised 0.44 drafts and kept 0.32 (first confidence 0.33, first draft kept 0.26);
        at T=0 0.44 and 0.45 (campaign stage 26)."""
        kept, promised = self.kept[i].get(greedy, KEPT_AT_LEAST), self.promised[i].get(greedy, KEPT_AT_LEAST)
        return 1.0 if kept is None or not promised else kept / promised

    def _gain(self, draft: Draft, source: CompositeSource) -> tuple[float, float]:
        """(the draft's expected number of accepted tokens, its key in the pick): the same for
        greedy rows; for sampled rows the key is its first draft's confidence, decided before
        any sampled token is looked at."""
        greedy = source.context.params.is_greedy
        conditionals = self.conditionals(draft, greedy) if self.conditionals else (draft.confidence or [0.5] * len(draft))
        gain = sum(survival(conditionals))
        return gain, gain if greedy else conditionals[0]

"""The engine's side of drafting: each row's source, its draft every step, what came of it.

The engine owns one `Drafting`, whatever its provider (`NoDrafter` when there is no
speculation). Per step it gives each decoding row its draft: the tokens its grammar
forces (forced-token drafts: verified like any draft, so the output is the same, in
fewer steps), else what its source proposes, as many as engine/draft_length.py says,
batched through the provider; after verification it tells each source what was kept and
records the round in the row's DraftStats and the totals (forced drafts counted there,
and only there). Drafting is an optimization and never a reason for a request to fail: a
source that raises is switched off for its row, which carries on decoding plainly.

`VERISPEC_SPEC=0` in the environment turns speculation off for the whole engine (A/B
runs without restarting anything else).

Checked by tests/test_spec.py, tests/test_dspark.py and tests/test_grammar_engine.py
(every source and forced drafts greedy-identical to plain decoding, alone and batched;
the usage counts; a failing source leaves its row decoding).
"""

from __future__ import annotations

import logging
import os

from verispec.engine.acceptance import HeadRecalibration, OnlineAcceptance, survival
from verispec.engine.draft import Draft, DraftProvider, DraftStats, Hidden, NoDrafter, SourceContext
from verispec.engine.draft_length import (POOL_YIELD_MEMORY, PROBE_EVERY, ROW_YIELD_MEMORY, AcceptanceEstimate,
                                          DraftLength, RoundYield)
from verispec.engine.metrics import Histogram
from verispec.engine.verify_schedule import VerifySchedule

log = logging.getLogger("verispec.drafting")

POOL_MEMORY = 256  # drafted-token evidence the pooled acceptance estimate keeps


def _padded(counts: list[int], width: int) -> list[int]:
    return list(counts[:width]) + [0] * max(0, width - len(counts))


def speculation_enabled() -> bool:
    return os.environ.get("VERISPEC_SPEC", "1").strip().lower() not in ("0", "false", "off", "no")


class Drafting:
    def __init__(self, provider: DraftProvider, length: DraftLength, forced_drafts: bool = True,
                 schedule: VerifySchedule | None = None, recalibrate_heads: bool = True):
        self.provider = provider
        self.active = not isinstance(provider, NoDrafter)  # a real source drafts
        self.length = length
        self.forced_drafts = forced_drafts
        # Algorithm 1 across the step's rows (None or mode "cost": each row's cost policy alone)
        self.schedule = schedule if schedule is not None and schedule.active else None
        # confidences for sources without a head, greedy (True) and sampled (False) rows apart:
        # a sampled row keeps a lookup's draft only where its draw matches it (gemma3 at T=1
        # with top-k 64 / top-p 0.95: tau 1.1-1.2 against 2.0 greedy), so one table for both
        # sent sampled rows' drafts to verification on greedy rows' rates
        self.online = {g: OnlineAcceptance(max(1, length.cap)) for g in (True, False)}
        # a head's claims corrected by served rounds, greedy (True) and sampled (False) rows apart
        self.recalibration = {g: HeadRecalibration(max(1, length.cap)) for g in (True, False)} \
            if recalibrate_heads else None
        bind = getattr(provider, "bind_confidences", None)  # a composite source chooses by them
        if bind is not None:
            bind(self.conditionals)
        # per draft position j, over all rows: rounds that proposed a token there (the
        # rounds that tested and kept it are the totals' tested_at / kept_at)
        self.width = width = max(1, length.max_draft)
        self.drafted_at = [0] * width
        self.totals = DraftStats()  # over all rows (Prometheus counters, /stats)
        self.pool = AcceptanceEstimate()  # recent acceptance over all rows: new rows start from it
        # a paid source's recent rounds over all rows, greedy (True) and sampled (False) rows
        # apart: what a new row's yield starts from (engine/draft_length.py, RoundYield)
        self.paid_pool = {g: RoundYield() for g in (True, False)}
        # drafted tokens each speculating row sent to verification per step (/metrics)
        self.verify_lengths = Histogram(tuple(float(n) for n in range(0, width + 1)))

    @property
    def reached_at(self) -> list[int]:
        """Per draft position, over all rows: rounds that tested it (the drafts before it kept)."""
        return _padded(self.totals.tested_at, self.width)

    @property
    def accepted_at(self) -> list[int]:
        """Per draft position, over all rows: rounds that kept it."""
        return _padded(self.totals.kept_at, self.width)

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.provider.taps)

    @property
    def max_draft(self) -> int:
        return self.length.max_draft

    # -- a row's life --------------------------------------------------------------------

    def attach(self, row) -> None:
        """Give an admitted row its source and stats."""
        row.draft_stats = DraftStats(estimate=self.pool.prior())
        if self.length.pays_per_round:
            row.draft_stats.estimate.paid = self.paid_pool[row.params.is_greedy].prior()
        if not self.active or not row.request.speculation:
            return  # no source: the row decodes plainly (its grammar may still force tokens)
        try:
            row.source = self.provider.new_source(
                SourceContext(row.request.prompt_ids, row.output, row.params, row.request.max_tokens, row.kv))
            row.source_needs_hidden = bool(self.provider.taps)
        except Exception as e:  # noqa: BLE001 - the row decodes without speculation
            log.warning("draft source for %s failed to start (%s); decoding without speculation", row.id, e)
            row.source = None

    def prefill(self, row, tokens: list[int], hidden: Hidden | None) -> None:
        self._call(row, "prefill", tokens, hidden)

    def drafts(self, rows, batch_tokens: int, batch_rows: int | None = None) -> list[Draft]:
        """Each decoding row's draft this step (an empty Draft where it drafts nothing).
        `batch_tokens` / `batch_rows`: the forward's tokens and rows before drafts (the
        decoding rows' pending tokens and any prefill chunks)."""
        drafts = [self._forced(row) for row in rows]
        asks = [0 if d is not None or row.source is None else self.length.for_row(row, batch_tokens)
                for row, d in zip(rows, drafts)]
        wanted = [(row.source, row.pending, k) for row, k in zip(rows, asks) if k > 0]
        proposed = iter(self._propose(wanted) if wanted else ())
        out = []
        for row, forced, k in zip(rows, drafts, asks):
            # a paid round's yield is recorded at commit, empty or cut by the scheduler too
            row.draft_stats.estimate.asked = forced is None and k > 0 and self.length.pays_per_round
            if forced is not None:
                out.append(forced)
            elif k > 0:
                draft = self._checked(row, next(proposed), k)
                if not draft.tokens and not self.length.free_drafts:
                    # a paid round that proposed nothing (a DSpark drafter's confidence cut at
                    # its first slot: 15% of gemma3's rounds at T=1) cost its price for no
                    # token; counted as a draft rejected at once, the policy's estimate of what
                    # a round yields includes it (commit never sees an empty draft)
                    row.draft_stats.estimate.update(1, 0)
                out.append(draft)
            else:
                out.append(Draft())
        if self.schedule is not None:
            out = self._scheduled(rows, out, batch_tokens, batch_rows or len(rows))
        return out

    def conditionals(self, draft: Draft, greedy: bool = True) -> list[float]:
        """P(draft j accepted | the drafts before it accepted), per position, for a greedy
        or a sampled row."""
        if draft.forced:
            return [1.0] * len(draft)
        if draft.confidence is not None:
            if self.recalibration is None:
                return list(draft.confidence)
            return self.recalibration[greedy].corrected(draft.confidence)
        return self.online[greedy].confidences(draft.feature or [0] * len(draft))

    def _scheduled(self, rows, drafts: list[Draft], batch_tokens: int, batch_rows: int) -> list[Draft]:
        """Algorithm 1 over the step: how many of its drafts each row verifies. A seeded
        row keeps its whole draft (its tokens must not depend on timings), counted as fixed."""
        base, tau0 = batch_tokens, float(len(rows))
        offered, index = [], []
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            if not draft.tokens:
                continue
            surv = survival(self.conditionals(draft, row.params.is_greedy))
            if row.params.seed is not None:
                base += len(draft)
                tau0 += sum(surv)
                continue
            offered.append(surv)
            index.append(i)
        if not offered:
            return drafts
        lengths = self.schedule.choose(offered, base, tau0, batch_rows)
        out = list(drafts)
        for i, n in zip(index, lengths):
            stats = rows[i].draft_stats
            stats.offered += len(drafts[i])
            self.totals.offered += len(drafts[i])
            if not drafts[i].forced:  # draft_length.py backs a costly source off when nothing is sent
                if n == 0:
                    stats.estimate.unsent += 1
                else:
                    stats.estimate.unsent = 0
                    stats.estimate.probe_every = PROBE_EVERY
            out[i] = drafts[i].truncated(n)
        return out

    def commit(self, row, draft: Draft, emitted: list[int], hidden: Hidden | None) -> None:
        """After verification: `emitted` = the kept drafts + the token after them."""
        kept = len(emitted) - 1
        for stats in (row.draft_stats, self.totals):
            stats.record(draft, len(emitted))
        if row.source is not None:
            self.verify_lengths.observe(float(len(draft)))
        # forced drafts say nothing about the source: its acceptance estimate (which sizes
        # its drafts) and the per-position curve count only what it proposed
        if draft.tokens and not draft.forced:
            if draft.confidence is None:
                self.online[row.params.is_greedy].update(draft.feature or [0] * len(draft), kept)
            elif self.recalibration is not None:
                self.recalibration[row.params.is_greedy].update(draft.confidence, kept)
            for stats in (row.draft_stats, self.totals):
                stats.record_positions(len(draft), kept)
            row.draft_stats.estimate.update(len(draft), kept)
            self.pool.update(len(draft), kept, memory=POOL_MEMORY)
            for j in range(len(draft)):
                self.drafted_at[j] += 1
        estimate = row.draft_stats.estimate
        if estimate.asked:
            estimate.asked = False
            if estimate.paid is not None:  # (asked: the source's draft, never a forced one)
                estimate.paid.update(len(draft), kept, ROW_YIELD_MEMORY)
            self.paid_pool[row.params.is_greedy].update(len(draft), kept, POOL_YIELD_MEMORY)
        fed_and_kept = [row.pending, *emitted[:-1]]
        self._call(row, "commit", fed_and_kept, emitted[-1],
                   None if hidden is None else tuple(h[: len(fed_and_kept)] for h in hidden))

    def detach(self, row) -> None:
        if row.source is not None:
            try:
                row.source.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the draft source of %s failed: %s", row.id, e)
            row.source = None
            row.source_needs_hidden = False

    def usage(self, row) -> dict | None:
        """The usage block's `speculation` for a finished row: with a drafter, or when its
        grammar drafted forced tokens."""
        stats = row.draft_stats
        if stats is None:
            return None
        if self.active or (row.grammar is not None and self.forced_drafts and stats.rounds):
            return stats.usage()
        return None

    def stats(self) -> dict | None:
        if not self.active:
            return None
        return {
            "provider": self.provider.describe(),
            "max_draft_tokens": self.length.max_draft,
            "adaptive": self.length.adaptive,
            "verify_schedule": "cost" if self.schedule is None else self.schedule.mode,
            # (the totals' acceptance_by_position is per_position_acceptance below, without
            # the positions nothing tested)
            **{k: v for k, v in self.totals.usage().items() if k != "acceptance_by_position"},
            # P(draft j kept | drafts before it kept): the paper's conditional acceptance
            "per_position_acceptance": [round(a / r, 4) if r else None for a, r in zip(self.accepted_at, self.reached_at)],
            "drafted_at": list(self.drafted_at),
            # a paid source's recent rounds (what its draft length is judged by): per round,
            # the drafts verified and the tokens kept
            **({"paid_rounds": {("greedy" if g else "sampled"): {
                "rounds": round(y.rounds, 1), "mean_verified": round(y.mean_verified, 3),
                "mean_kept": round(y.mean_kept, 3)} for g, y in self.paid_pool.items() if y.rounds}}
               if self.length.pays_per_round else {}),
            **({"head_recalibration": {("greedy" if g else "sampled"): table
                                       for g, r in self.recalibration.items() if (table := r.table())}}
               if self.recalibration is not None else {}),
            # a provider with sources of its own (the composite): the rows that asked it, the
            # rows each source was asked for, whose candidates were verified, and a paid
            # source's drafts kept per draft promised
            **({"sources": self.provider.stats()} if callable(getattr(self.provider, "stats", None)) else {}),
        }

    # -- inside ----------------------------------------------------------------------------

    def _forced(self, row) -> Draft | None:
        if row.grammar is None or not self.forced_drafts:
            return None
        limit = self.length.forced(row)
        tokens = row.grammar.forced(limit) if limit > 0 else []
        return Draft(tokens, forced=True) if tokens else None

    def _propose(self, wanted) -> list[Draft | None]:
        try:
            return self.provider.draft_batch(wanted)
        except Exception as e:  # noqa: BLE001
            log.warning("batched drafting failed (%s); drafting row by row", e)
        out = []
        for source, pending, k in wanted:
            try:
                out.append(self.provider.draft_batch([(source, pending, k)])[0])
            except Exception as e:  # noqa: BLE001
                log.warning("drafting failed (%s); that row decodes without speculation", e)
                out.append(None)
        return out

    def _checked(self, row, draft: Draft | None, k: int) -> Draft:
        if draft is None:  # its source failed
            self.detach(row)
            return Draft()
        if len(draft) > k:  # a source may return fewer tokens, never more
            draft = Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k])
        return draft

    def _call(self, row, method: str, *args) -> None:
        if row.source is None:
            return
        try:
            getattr(row.source, method)(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("draft source %s of %s failed (%s); decoding without speculation", method, row.id, e)
            self.detach(row)

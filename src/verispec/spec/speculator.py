"""Speculation inside the engine's step: sources per row, how much each drafts, stats.

The engine owns one `Speculator` when it has a draft provider. Per step it asks the
policy how many tokens each decoding row should draft (spec/policy.py), has the provider
propose them (batched), and after verification tells each source what was kept. Drafting
is an optimization and never a reason for a request to fail: a source that raises is
switched off for its row, which carries on decoding plainly.

`VERISPEC_SPEC=0` in the environment turns speculation off for the whole engine (A/B
runs without restarting anything else).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from verispec.spec.policy import AcceptanceEstimate, DraftPolicy, StepCosts
from verispec.spec.source import Draft, DraftProvider, Hidden, SourceContext

log = logging.getLogger("verispec.spec")

POOL_MEMORY = 256  # drafted-token evidence the pooled acceptance estimate keeps


def speculation_enabled() -> bool:
    return os.environ.get("VERISPEC_SPEC", "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass
class RowSpecStats:
    drafted: int = 0  # by the source and by the grammar (forced-token drafts)
    accepted: int = 0
    forced_drafted: int = 0  # of which the grammar forced
    forced_accepted: int = 0
    rounds: int = 0  # decode steps (target forwards) of this row
    emitted: int = 0  # tokens those steps produced (kept drafts + the token after them)
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    def record(self, draft: Draft, n_emitted: int) -> None:
        """One decode round: `draft` was verified and `n_emitted` tokens came out."""
        self.rounds += 1
        self.emitted += n_emitted
        self.drafted += len(draft)
        self.accepted += n_emitted - 1
        if draft.forced:
            self.forced_drafted += len(draft)
            self.forced_accepted += n_emitted - 1

    def usage(self) -> dict:
        forced = {"forced_drafted": self.forced_drafted, "forced_accepted": self.forced_accepted} \
            if self.forced_drafted else {}
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            **forced,
            "rounds": self.rounds,
            # tokens per target forward, the bonus token included (DeepSpec's tau)
            "mean_accepted_length": round(self.emitted / self.rounds, 3) if self.rounds else 0.0,
        }


class Speculator:
    def __init__(self, provider: DraftProvider, max_draft: int, costs: StepCosts, adaptive: bool = True,
                 draft_costs: tuple[float, float] = (0.0, 0.0)):
        self.provider = provider
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.policy = DraftPolicy(max_draft, costs, *draft_costs)
        # per draft position j, over all rows: rounds that proposed a token there, that
        # tested it (every draft before it was kept), and that kept it
        self.drafted_at = [0] * max_draft
        self.reached_at = [0] * max_draft
        self.accepted_at = [0] * max_draft
        self.totals = RowSpecStats()  # over all rows (Prometheus counters, /stats)
        self.pool = AcceptanceEstimate()  # recent acceptance over all rows: new rows start from it

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.provider.taps)

    def attach(self, row) -> None:
        """Give an admitted row its source."""
        try:
            row.source = self.provider.new_source(
                SourceContext(row.request.prompt_ids, row.output, row.params, row.request.max_tokens))
            row.source_needs_hidden = bool(self.provider.taps)
        except Exception as e:  # noqa: BLE001 - the row decodes without speculation
            log.warning("draft source for %s failed to start (%s); decoding without speculation", row.id, e)
            row.source = None
        row.spec = RowSpecStats(estimate=self.pool.prior())

    def propose(self, rows, batch_tokens: int) -> list[Draft]:
        """Drafts for the step's decoding rows (an empty Draft where a row drafts nothing)."""
        asks = []
        for row in rows:
            if row.source is None:
                asks.append(0)
                continue
            limit = min(self.max_draft, row.request.max_tokens - len(row.output) - 1)
            # a seeded row drafts its whole budget: the policy's choice depends on timings, and
            # so would the verify forwards' shapes and, in bf16, the sampled tokens
            adaptive = self.adaptive and row.params.seed is None
            asks.append(self.policy.choose(row.spec.estimate, batch_tokens, limit) if adaptive else max(0, limit))
        wanted = [(row.source, row.pending, k) for row, k in zip(rows, asks) if k > 0]
        if not wanted:
            return [Draft() for _ in rows]
        try:
            proposed = iter(self.provider.draft_batch(wanted))
        except Exception as e:  # noqa: BLE001
            log.warning("batched drafting failed (%s); drafting row by row", e)
            proposed = iter(self._draft_each(wanted))
        drafts = []
        for row, k in zip(rows, asks):
            draft = next(proposed) if k > 0 else Draft()
            drafts.append(self._checked(row, draft, k))
        return drafts

    def _draft_each(self, wanted) -> list[Draft]:
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

    def prefill(self, row, tokens: list[int], hidden: Hidden | None) -> None:
        self._call(row, "prefill", tokens, hidden)

    def commit(self, row, draft: Draft, emitted: list[int], hidden: Hidden | None) -> None:
        """After verification: `emitted` = the kept drafts + the token after them."""
        stats = row.spec
        kept = len(emitted) - 1
        for s in (stats, self.totals):
            s.record(draft, len(emitted))
        # forced drafts say nothing about the source: its acceptance estimate (which sizes
        # its drafts) and the per-position curve count only what it proposed
        if draft.tokens and not draft.forced:
            stats.estimate.update(len(draft), kept)
            self.pool.update(len(draft), kept, memory=POOL_MEMORY)
            for j in range(len(draft)):
                self.drafted_at[j] += 1
                self.reached_at[j] += j <= kept
                self.accepted_at[j] += j < kept
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

    def _call(self, row, method: str, *args) -> None:
        if row.source is None:
            return
        try:
            getattr(row.source, method)(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("draft source %s of %s failed (%s); decoding without speculation", method, row.id, e)
            self.detach(row)

    def stats(self) -> dict:
        return {
            "provider": self.provider.describe(),
            "max_draft_tokens": self.max_draft,
            "adaptive": self.adaptive,
            **self.totals.usage(),
            # P(draft j kept | drafts before it kept): the paper's conditional acceptance
            "per_position_acceptance": [round(a / r, 4) if r else None for a, r in zip(self.accepted_at, self.reached_at)],
            "drafted_at": list(self.drafted_at),
        }

"""Composite drafting: a row with two draft sources (a model-based drafter and n-gram
lookup) verifies, each round, the candidate with the larger expected gain.

Both sources follow the row all along (prefill and commit go to both, so either can
propose at any step). Each round both propose; the engine's confidences
(engine/acceptance.py through `Drafting.conditionals`, bound at engine start) give each
candidate's survival products, and the row takes:

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
source verified least often over all rows (if it proposed anything): an estimate that is
never tested never learns, and a rule driven by counters cannot bias the output.

The model-based drafter's round is paid whenever the row drafts (its cost is the
composite's); the lookup is free. Oracle: tests/test_composite.py (greedy identical to
plain decoding on the DeepSpec fixture; at T > 0 the chi-square test of
tests/test_dspark.py's setting passes).
"""

from __future__ import annotations

from verispec.engine.acceptance import survival
from verispec.engine.draft import Draft, DraftProvider, DraftSource, SourceContext

EXPLORE_EVERY = 8  # every 8th round of a row verifies its least-chosen source's candidate


class CompositeSource(DraftSource):
    def __init__(self, sources: list[DraftSource], context: SourceContext):
        self.sources = sources
        self.context = context
        self.chosen: list[int] = [0] * len(sources)  # rounds each source's candidate was verified
        self.rounds = 0

    def prefill(self, tokens, hidden) -> None:
        for s in self.sources:
            s.prefill(tokens, hidden)

    def commit(self, kept, next_token, hidden) -> None:
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

    def bind_confidences(self, conditionals) -> None:
        self.conditionals = conditionals

    def new_source(self, context: SourceContext) -> CompositeSource:
        return CompositeSource([p.new_source(context) for p in self.providers], context)

    def describe(self) -> str:
        return f"composite ({self.label})"

    def stats(self) -> dict:
        return {"chosen": dict(zip((p.name for p in self.providers), self.chosen))}

    def draft_costs(self, target_costs) -> tuple[float, float]:
        fixed = per = 0.0
        for p in self.providers:
            f, t = p.draft_costs(target_costs)
            fixed, per = fixed + f, per + t
        return fixed, per

    def kv_bytes(self, capacity: int) -> int:
        return sum(p.kv_bytes(capacity) for p in self.providers)

    def draft_batch(self, requests: list[tuple[DraftSource, int, int]]) -> list[Draft]:
        candidates = [p.draft_batch([(s.sources[i], pending, min(n, p.max_draft)) for s, pending, n in requests])
                      for i, p in enumerate(self.providers)]
        out = []
        for r, (source, _, n) in enumerate(requests):
            options = [c[r] for c in candidates]
            best = max(range(len(options)), key=lambda i: (self._gain(options[i], source), -i))
            source.rounds += 1
            if source.rounds % EXPLORE_EVERY == 1:
                # a row's first round and every 8th after it: the source verified least often
                # over all rows, so every estimate keeps learning (counters, not this round's
                # drafts, decide: lossless at any temperature)
                offered = [i for i, d in enumerate(options) if d.tokens]
                if offered:
                    best = min(offered, key=lambda i: (self.chosen[i], i))
            if n > 0 and options[best].tokens:
                source.chosen[best] += 1
                self.chosen[best] += 1
            out.append(options[best] if n > 0 else Draft())
        return out

    def _gain(self, draft: Draft, source: CompositeSource) -> float:
        if not draft.tokens:
            return -1.0
        conditionals = self.conditionals(draft) if self.conditionals else (draft.confidence or [0.5] * len(draft))
        if source.context.params.is_greedy:
            return sum(survival(conditionals))
        return conditionals[0]  # decided before any sampled token is looked at

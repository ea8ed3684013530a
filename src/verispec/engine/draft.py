"""Drafts: what one row verifies in a step, the seam through which the engine asks for
them, and what each row's drafting came to.

Every decoding row verifies a draft each step: the tokens its grammar forces, or what
its draft source proposed, or nothing (a row without a drafter has `NoDrafter`'s empty
draft; verifying k = 0 drafts is plain sampling). A `DraftProvider` lives as long as the
server and owns whatever is shared (a draft model's weights); it mints one `DraftSource`
per request. The engine talks to sources in the order tokens move through a row:

    prefill(tokens, hidden)          a chunk of the prompt entered the target's KV cache
    draft(pending, max_n) -> Draft   propose up to max_n tokens to follow `pending` (the
                                     last sampled token, about to be fed); the returned
                                     length is authoritative, 0 is fine
    commit(kept, next, hidden)       `kept` = [pending, the accepted drafts]: the tokens that
                                     entered the target's cache this step; `next` was sampled
                                     after them (the new pending); `hidden` are the target's
                                     tapped states at those positions. Called after every
                                     decode step, drafted or not.
    close()                          the request ended; free what the source holds

`hidden` is a tuple with one [n, hidden_size] tensor per layer in the provider's `taps`
(layer ids as models/decoder.py counts them: -1 = embeddings, i = output of layer i), or
None when the provider asks for none; the target computes them in the same forward, so a
source that needs none costs nothing.

A `Draft` carries the proposed tokens, what engine/acceptance.py needs to estimate each
one's acceptance (the source's own calibrated confidence, or a feature), and, when the source sampled them from a
distribution, that distribution `q` per position, processed by the request's own
processors (temperature, top-k/p, min-p, penalties) exactly as the target's `p` is, so
speculative sampling can use min(1, p/q). A source without `q` (n-gram) proposes tokens
deterministically; verification then samples from `p` and keeps drafts while they match.

`draft_batch` lets a provider propose for all rows of a step at once (a draft model runs
one batched forward per draft position instead of one per row); the default asks each
source in turn. `max_draft` is the most a provider can propose in one round (a DSpark
drafter: its block size); how many a row actually drafts is engine/draft_length.py's.

Checked through the engine by tests/test_spec.py and tests/test_dspark.py (every source
greedy-identical to plain decoding; the usage block's counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.engine.draft_length import AcceptanceEstimate
from verispec.engine.sampling import SamplingParams
from verispec.models.kv_cache import DEFAULT_MAX_ROLLBACK

Hidden = tuple[torch.Tensor, ...]

# A step feeds [pending, d_1 .. d_k] and rolls back what verification rejected, so k is
# bounded by what the KV cache can roll back (sliding-window rings keep that margin).
MAX_DRAFT_TOKENS = DEFAULT_MAX_ROLLBACK - 1


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), V] float32 probabilities each token was drawn from
    forced: bool = False  # the row's grammar forced these tokens; no source drafted them
    # per position P(accepted | the drafts before it accepted), where the source knows it
    # (a DSpark confidence head, calibrated); else engine/acceptance.py estimates it
    confidence: list[float] | None = None
    # per position, what engine/acceptance.py keys its estimate by (n-gram: the match
    # length; a draft model: its own probability in tenths)
    feature: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Draft":
        """The first n drafts (what the verify scheduler sends)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], self.forced,
                     None if self.confidence is None else self.confidence[:n],
                     None if self.feature is None else self.feature[:n])


@dataclass
class SourceContext:
    """What a source may read about its request: the prompt, the output so far (a live
    list: it grows as tokens are accepted; its last item is the pending token), the
    sampling parameters, the request's token limit and the row's target KV cache (read only:
    the gemma4 assistant attends over it instead of keeping a cache of its own)."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    max_tokens: int
    kv: object | None = None  # models.kv_cache.SequenceKV


class RunningMean:
    """A running mean kept for greedy and sampled rows apart, resting mostly on the last
    `memory` values: what a composite expects a paid source to gain, what a provider's
    served rounds cost. None until `at_least` values were added."""

    def __init__(self, memory: int):
        self.memory = memory
        self.mean: dict[bool, float] = {}
        self.count: dict[bool, int] = {}

    def get(self, greedy: bool, at_least: int = 1) -> float | None:
        return self.mean.get(greedy) if self.count.get(greedy, 0) >= at_least else None

    def add(self, greedy: bool, value: float) -> None:
        n = self.count[greedy] = self.count.get(greedy, 0) + 1
        mean = self.mean.get(greedy, value)
        self.mean[greedy] = mean + (value - mean) / min(n, self.memory)


class DraftSource:
    def prefill(self, tokens: list[int], hidden: Hidden | None) -> None:
        pass

    def draft(self, pending: int, max_n: int) -> Draft:
        raise NotImplementedError

    def commit(self, kept: list[int], next_token: int, hidden: Hidden | None) -> None:
        pass

    def close(self) -> None:
        pass


class DraftProvider:
    name = "none"
    taps: tuple[int, ...] = ()  # target layers whose hidden states every source needs
    max_draft: int = MAX_DRAFT_TOKENS  # the most one round can propose
    free = False  # True: a round costs nothing worth counting (a lookup), so a composite asks it first

    def new_source(self, context: SourceContext) -> DraftSource:
        raise NotImplementedError

    def draft_batch(self, requests: list[tuple[DraftSource, int, int]]) -> list[Draft]:
        """One Draft per (source, pending, max_n)."""
        return [source.draft(pending, max_n) if max_n > 0 else Draft() for source, pending, max_n in requests]

    def describe(self) -> str:
        return self.name

    def draft_costs(self, target_costs) -> tuple[float, float]:
        """What drafting costs, in single-token target steps: (per round that drafts at all,
        per drafted token), for the draft length policy; free unless the provider says so."""
        return 0.0, 0.0

    def sampled_draft_costs(self, target_costs) -> tuple[float, float] | None:
        """`draft_costs` for a sampled row's round where it differs (None: the same): the
        draft length policy charges it to sampled rows, a composite weighs it per row."""
        return None

    def served_round_seconds(self, greedy: bool) -> float | None:
        """What this provider's rounds (one `draft_batch` call) have cost lately on served
        traffic, greedy calls and calls with a sampled row apart: a running mean in
        seconds where the provider times them, else None (its `draft_costs` stand). Only a
        composite, which weighs each row's round, asks."""
        return None

    def kv_bytes(self, capacity: int) -> int:
        """Bytes one request's source reserves for a target row of `capacity` tokens
        (counted against the engine's KV budget)."""
        return 0


class _NoSource(DraftSource):
    def draft(self, pending: int, max_n: int) -> Draft:
        return Draft()


class NoDrafter(DraftProvider):
    """The provider of an engine without speculation: every row's draft is empty (its
    grammar may still force tokens)."""

    name = "no drafter"
    max_draft = 0

    def new_source(self, context: SourceContext) -> DraftSource:
        return _NoSource()


@dataclass
class DraftStats:
    """What one row's (or, summed, every row's) drafts came to."""

    drafted: int = 0  # by the source and by the grammar (forced-token drafts)
    accepted: int = 0
    forced_drafted: int = 0  # of which the grammar forced
    forced_accepted: int = 0
    rounds: int = 0  # decode steps (target forwards) of this row
    emitted: int = 0  # tokens those steps produced (kept drafts + the token after them)
    offered: int = 0  # drafts the source proposed where the verify scheduler chose how many to send
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # per draft position: rounds that tested it (the drafts before it kept), and kept it
    tested_at: list[int] = field(default_factory=list)
    kept_at: list[int] = field(default_factory=list)

    def record_positions(self, drafted: int, kept: int) -> None:
        need = min(drafted, kept + 1)
        while len(self.tested_at) < need:
            self.tested_at.append(0)
            self.kept_at.append(0)
        for j in range(need):
            self.tested_at[j] += 1
            self.kept_at[j] += j < kept

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
        scheduled = {"offered": self.offered} if self.offered else {}
        return {
            "drafted": self.drafted,  # the tokens sent to verification
            "accepted": self.accepted,
            **forced,
            **scheduled,
            "acceptance_by_position": [round(k / t, 4) for k, t in zip(self.kept_at, self.tested_at)],
            "rounds": self.rounds,
            # tokens per target forward, the bonus token included (DeepSpec's tau)
            "mean_accepted_length": round(self.emitted / self.rounds, 3) if self.rounds else 0.0,
        }

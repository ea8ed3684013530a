"""Two-model drafting: a smaller model with the same tokenizer proposes, the target verifies.

The provider owns the draft model's weights and KV cache allocator; each request's source
owns one draft KV sequence. Invariant: the draft cache holds a prefix of the tokens in the
target's cache; `unfed` is what it still lacks. A round feeds `unfed + [pending]` in one
forward, then one token per further position, sampling each draft from the request's own
processed distribution (q), which the verifier needs for min(1, p/q). On commit the draft
cache rolls back to the longest prefix it shares with the target (O(1)), and whatever the
target kept beyond it becomes `unfed`.

`draft_batch` drafts every row of a step together: one batched draft forward per draft
position, rows packed as the target's are.

A drafter whose vocabulary differs from the target's is refused when it is loaded: the
same ids must mean the same tokens or every proposal is noise (or worse, out of range).
"""

from __future__ import annotations

import torch

from verispec.engine.sampling import make_generator, process_logits, sample, sampling_probs
from verispec.models.decoder import BatchKV, Decoder
from verispec.models.kv_cache import DEFAULT_MAX_ROLLBACK
from verispec.engine.draft import Draft, DraftProvider, DraftSource, SourceContext

CATCH_UP_CHUNK = 512


class DrafterMismatchError(ValueError):
    """The draft model cannot serve this target (tokenizer or vocabulary differ)."""


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise DrafterMismatchError(
            "the draft model's tokenizer differs from the target's (the same ids must mean the same tokens); "
            "use a drafter from the same model family"
        )
    if draft_vocab != target_vocab:
        raise DrafterMismatchError(f"the draft model's output layer has {draft_vocab} entries, the target's {target_vocab}")


class TwoModelSource(DraftSource):
    def __init__(self, provider: "TwoModelProvider", context: SourceContext):
        self.provider = provider
        self.context = context
        capacity = len(context.prompt) + context.max_tokens + provider.max_draft + 1
        self.kv = provider.cache.allocate(capacity)
        self.fed: list[int] = []  # tokens in the draft cache, in order
        self.unfed: list[int] = []  # tokens in the target's cache the draft cache lacks
        self.round_base: list[int] | None = None  # the target's cache when this step's round began
        seed = context.params.seed
        # its own stream: drafting never disturbs the request's sampling generator
        self.generator = None if context.params.is_greedy else make_generator(
            None if seed is None else (seed ^ 0x5EED) & (2**63 - 1))

    def prefill(self, tokens, hidden) -> None:
        self.unfed.extend(tokens)

    def commit(self, kept: list[int], next_token: int, hidden) -> None:
        if self.round_base is None:  # nothing drafted this step: the draft cache just lags more
            self.unfed.extend(kept)
            return
        base, self.round_base = self.round_base, None
        target = base + kept  # what the target's cache holds now
        common = 0
        for a, b in zip(self.fed[len(base) :], kept):
            if a != b:
                break
            common += 1
        keep = len(base) + common
        self.kv.rollback(len(self.fed) - keep)
        self.fed = self.fed[:keep]
        self.unfed = target[keep:]

    def begin_round(self, pending: int) -> list[int]:
        """Tokens to feed in the round's first draft forward (all the target has, then pending)."""
        self.round_base = self.fed + self.unfed
        feed = self.unfed + [pending]
        self.unfed = []
        return feed

    def close(self) -> None:
        if self.kv is not None:
            self.provider.cache.release(self.kv)
            self.kv = None

    def draft(self, pending: int, max_n: int) -> Draft:
        return self.provider.draft_batch([(self, pending, max_n)])[0]


class TwoModelProvider(DraftProvider):
    name = "draft-model"

    def __init__(self, model: Decoder, max_draft: int, label: str = "draft model"):
        self.model = model
        self.max_draft = max_draft
        self.cache = model.new_cache(max_rollback=max(DEFAULT_MAX_ROLLBACK, max_draft + 1))
        self.label = label

    def new_source(self, context: SourceContext) -> TwoModelSource:
        return TwoModelSource(self, context)

    def draft_costs(self, target_costs) -> tuple[float, float]:
        from verispec.engine.step_costs import measure_step_costs

        return 0.0, measure_step_costs(self.model, sizes=(1, 2), rows=(1,)).base_seconds / target_costs.base_seconds

    def kv_bytes(self, capacity: int) -> int:
        return self.cache.bytes_for(capacity + self.max_draft + 1)

    def describe(self) -> str:
        return f"{self.label} ({self.model.args.num_layers} layers, hidden {self.model.args.hidden_size})"

    @torch.inference_mode()
    def draft_batch(self, requests: list[tuple[DraftSource, int, int]]) -> list[Draft]:
        active = [(s, p, n) for s, p, n in requests if n > 0]
        drafts: dict[int, list[int]] = {id(s): [] for s, _, _ in active}
        dists: dict[int, list[torch.Tensor]] = {id(s): [] for s, _, _ in active}
        feeds = {id(s): s.begin_round(p) for s, p, _ in active}
        for source, _, _ in active:  # a long backlog (the prompt) goes in chunks first
            feeds[id(source)] = self._catch_up(source, feeds[id(source)])
        rounds = max((n for _, _, n in active), default=0)
        for step in range(rounds):
            live = [(s, n) for s, _, n in active if n > step]
            tokens = [feeds[id(s)] for s, _ in live]
            ids = torch.tensor([t for feed in tokens for t in feed], dtype=torch.long, device=self.model.device)
            logits = self.model(ids, BatchKV([s.kv for s, _ in live], [len(f) for f in tokens])).logits
            for source, _ in live:
                source.fed.extend(feeds[id(source)])
            chosen = self._choose(logits, [s for s, _ in live], drafts)
            for (source, _), (token, dist) in zip(live, chosen):
                drafts[id(source)].append(token)
                dists[id(source)].append(dist)
                feeds[id(source)] = [token]
        out = []
        for source, _, n in requests:
            if n <= 0:
                out.append(Draft())
                continue
            # the last drafted token was never fed: the draft cache holds pending + drafts[:-1]
            q = torch.stack(dists[id(source)])
            tokens = drafts[id(source)]
            own = q[torch.arange(len(tokens), device=q.device), torch.tensor(tokens, device=q.device)].tolist()  # own pick
            out.append(Draft(tokens, q, feature=[min(9, int(p * 10)) for p in own]))
        return out

    def _catch_up(self, source: TwoModelSource, feed: list[int]) -> list[int]:
        """Feed all but the last CATCH_UP_CHUNK tokens of a long backlog in chunks (one huge
        forward is slower than several: attention over a square mask); return the rest."""
        while len(feed) > CATCH_UP_CHUNK:
            piece, feed = feed[:CATCH_UP_CHUNK], feed[CATCH_UP_CHUNK:]
            ids = torch.tensor(piece, dtype=torch.long, device=self.model.device)
            self.model(ids, BatchKV([source.kv], [len(piece)]))
            source.fed.extend(piece)
        return feed

    def _choose(self, logits, sources: list[TwoModelSource], drafts) -> list[tuple[int, torch.Tensor]]:
        """Each row's next draft token, sampled from the request's processed distribution."""
        params = [s.context.params for s in sources]
        penalties = any(p.has_penalties for p in params)
        histories = [s.context.output + drafts[id(s)] for s in sources] if penalties else None
        prompts = [s.context.prompt for s in sources] if penalties else None
        processed = process_logits(logits, params, prompts, histories)
        tokens = sample(processed, params, [s.generator for s in sources]).tolist()
        probs = sampling_probs(processed, params)
        return list(zip(tokens, probs))

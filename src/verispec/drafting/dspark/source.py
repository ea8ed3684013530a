"""DSpark as a draft source in the engine (engine/draft.py's seam), as DeepSpec decodes.

Per request, the source keeps a `ContextCache` of the drafter's projected context K/V
and the target features not yet in it. Features arrive with every forward that puts
tokens into the target's cache: the prompt's chunks at prefill, then each step's
[pending, accepted drafts] from the verify forward (the target is asked for the hidden
states of `target_layer_ids` on every forward; other sources pay nothing for that).
A round is one backbone pass over [new context rows, anchor, MASK x (gamma - 1)] for all
drafting rows at once, then the sequential head slot by slot, each slot's token chosen
from the request's own processed distribution (greedy: argmax; sampled: drawn with the
source's generator, block_size uniforms a round drawn up front, and that distribution is
the q verification needs; over the draft vocabulary alone when the request has no bias or
penalties, checked by a chi-square test in tests/test_dspark.py), and the
confidence cut: the proposal ends before the first slot whose sigmoid(confidence) is
below the threshold (DeepSpec's rule; an empty proposal is a plain decode step), the
confidence divided by the slot's STS temperature first where calibrate fitted one. A
slot's confidence reads only its hidden state and the token before it, so the head stops
at the slot that cuts the last row's proposal (or at the rows' length limits) instead of
drafting the whole block as DeepSpec does: the same proposals, for less.

`trace`, when a list, receives one record per proposal and per commit (what DeepSpec's
evaluator logs), which is how tests/test_dspark.py compares rounds with its traces.
"""

from __future__ import annotations

import time

import torch

from verispec.engine.sampling import (greedy_tokens, inverse_cdf_draw, make_generator, process_logits,
                                      sampling_probs)
from verispec.drafting.dspark.model import DSparkDrafter, calibrated_confidences, first_below, slot_thresholds
from verispec.engine.draft import Draft, DraftProvider, DraftSource, RunningMean, SourceContext


SERVED_MEMORY = 32  # calls a served round's running mean cost mostly rests on
SERVED_MIN = 4  # calls timed before that mean is offered


class DSparkSource(DraftSource):
    def __init__(self, provider: "DSparkProvider", context: SourceContext):
        self.provider = provider
        self.context = context
        g = provider.drafter.block_size
        self.cache = provider.drafter.new_cache(len(context.prompt) + context.max_tokens + g + 1)
        self.pending: list[torch.Tensor] = []  # feature rows [n, m*H] not yet in the cache
        seed = context.params.seed
        self.generator = None if context.params.is_greedy else make_generator(
            None if seed is None else (seed ^ 0xD5A7) & (2**63 - 1))

    def prefill(self, tokens, hidden) -> None:
        self.pending.append(torch.cat(hidden, dim=-1))

    def commit(self, kept, next_token, hidden) -> None:
        self.pending.append(torch.cat(hidden, dim=-1))
        if self.provider.trace is not None:
            self.provider.trace.append({"event": "commit", "source": id(self), "kept": list(kept), "next": next_token})

    def take_pending(self) -> torch.Tensor | None:
        rows, self.pending = self.pending, []
        return torch.cat(rows) if len(rows) > 1 else (rows[0] if rows else None)

    def draft(self, pending: int, max_n: int) -> Draft:
        return self.provider.draft_batch([(self, pending, max_n)])[0]

    def close(self) -> None:
        self.cache = None
        self.pending = []


class DSparkProvider(DraftProvider):
    name = "dspark"

    def __init__(self, drafter: DSparkDrafter, label: str = "DSpark drafter", confidence_threshold=None):
        self.drafter = drafter
        self.label = label
        config = drafter.config
        self.taps = tuple(config.target_layer_ids)
        self.block_size = config.block_size
        self.max_draft = config.block_size  # a round proposes at most one block
        self.threshold = config.confidence_threshold if confidence_threshold is None else confidence_threshold
        self.temperatures = config.confidence_temperature  # STS; None: raw sigmoids
        self.trace: list | None = None
        self.served = RunningMean(SERVED_MEMORY)  # seconds of served rounds, greedy calls and the rest apart
        vocab = drafter.draft_vocab_ids
        self._to_draft = None
        if vocab is not None:  # target id -> draft-head row, for processors over the full vocabulary
            self._to_draft = torch.full((config.args.vocab_size,), -1, dtype=torch.long)
            self._to_draft[vocab.cpu()] = torch.arange(len(vocab))

    def new_source(self, context: SourceContext) -> DSparkSource:
        return DSparkSource(self, context)

    def describe(self) -> str:
        c = self.drafter.config
        head = f"{c.markov_head_type} head r={c.markov_rank}" if c.has_markov else "no sequential head (DFlash)"
        return (f"{self.label}: {c.args.num_layers} layers, block {c.block_size}, {head}, taps {list(self.taps)}"
                + (f", confidence threshold {self.threshold}" if self.threshold else ""))

    def kv_bytes(self, capacity: int) -> int:
        a = self.drafter.config.args
        element = torch.finfo(self.drafter.kv_dtype()).bits // 8
        return 2 * a.num_layers * a.kv_heads_at(0) * a.head_dim_at(0) * element * (capacity + self.block_size + 1)

    def draft_costs(self, target_costs) -> tuple[float, float]:
        """(per round, per token) in single-token target steps: one backbone pass and the
        sequential head for a whole block, whatever its length."""
        from verispec.engine.sampling import SamplingParams

        return self._round_seconds(SamplingParams()) / target_costs.base_seconds, 0.0

    def sampled_draft_costs(self, target_costs) -> tuple[float, float]:
        """A sampled round costs more (a draw and q per slot): timed apart."""
        from verispec.engine.sampling import SamplingParams

        return self._round_seconds(SamplingParams(temperature=1.0)) / target_costs.base_seconds, 0.0

    def served_round_seconds(self, greedy: bool) -> float | None:
        """A running mean of served rounds' seconds (over about the last SERVED_MEMORY calls),
        once SERVED_MIN calls have been timed. A served round costs more than the start-up
        timing's best of 5 of one row with 2 new context rows: rows asked rarely bring every
        context row since their last round, and several rows share a call. On gemma3-270m at
        4 streams rounds took 5-11 ms against the 3.3 charged, and the composite asked the
        drafter where it did not pay (campaign stage 18)."""
        return self.served.get(greedy, SERVED_MIN)

    def _round_seconds(self, params) -> float:
        """The best of 5 timed rounds of one row with these sampling settings, each drafting
        a whole block (no confidence cut: a round's price when it proposes)."""
        threshold, self.threshold = self.threshold, 0.0
        try:
            return self._time_rounds(params)
        finally:
            self.threshold = threshold

    def _time_rounds(self, params) -> float:
        from verispec.engine.draft import SourceContext as Ctx

        H = self.drafter.config.args.hidden_size
        source = self.new_source(Ctx([0] * 64, [0], params, 64))
        source.pending = [torch.zeros(64, H * len(self.taps), dtype=self.drafter.dtype, device=self.drafter.device)]
        self._draft_batch([(source, 1, self.block_size)])  # the start-up rounds, not served ones: untimed
        best = float("inf")
        for _ in range(5):
            source.pending = [torch.zeros(2, H * len(self.taps), dtype=self.drafter.dtype, device=self.drafter.device)]
            t = time.perf_counter()
            self._draft_batch([(source, 1, self.block_size)])
            best = min(best, time.perf_counter() - t)
        source.close()
        return best

    def draft_batch(self, requests) -> list[Draft]:
        start = time.perf_counter()
        drafts = self._draft_batch(requests)
        if any(n > 0 for _, _, n in requests):
            greedy = all(s.context.params.is_greedy for s, _, n in requests if n > 0)
            self.served.add(greedy, time.perf_counter() - start)
        return drafts

    @torch.inference_mode()
    def _draft_batch(self, requests) -> list[Draft]:
        active = [(s, p, n) for s, p, n in requests if n > 0]
        if not active:
            return [Draft() for _ in requests]
        sources = [s for s, _, _ in active]
        anchors = [p for _, p, _ in active]
        before = [(s.cache.length, sum(f.shape[0] for f in s.pending)) for s in sources]
        h = self.drafter.draft_hidden([s.cache for s in sources], [s.take_pending() for s in sources], anchors)
        chooser = _Chooser(self, sources)
        limits = [min(n, self.block_size) for _, _, n in active]
        # the block stops where every row's proposal has ended (its confidence cut or its
        # length limit); a sampled row's uniforms were drawn for the whole block (_Chooser)
        tokens, confidence = self.drafter.propose(h, anchors, chooser, self._ends(limits), max(limits))
        drafts = {}
        for r, (source, anchor, max_n) in enumerate(active):
            row_conf = None if confidence is None else confidence[r]
            # once per slot: the cut and the scheduler read the same (STS-calibrated) numbers
            conf = None if row_conf is None else calibrated_confidences(row_conf, self.temperatures)
            n = min(first_below(conf, self.threshold, tokens.shape[1]), max_n, tokens.shape[1])
            q = chooser.q(r, n)
            drafts[id(source)] = Draft(tokens[r, :n].tolist(), q, confidence=None if conf is None else conf[:n])
            if self.trace is not None:
                self.trace.append({
                    "event": "propose", "source": id(source), "anchor": anchor,
                    "cache_len_before": before[r][0], "num_new_context": before[r][1],
                    "draft_tokens": tokens[r].tolist(),
                    "confidence_logits": None if row_conf is None else row_conf.tolist(), "proposal_len": n,
                })
        return [drafts.get(id(s), Draft()) if n > 0 else Draft() for s, _, n in requests]

    def _ends(self, limits: list[int]):
        """`propose`'s stop test: a row's proposal ends before slot j at its length limit or
        where the slot's calibrated confidence is below its threshold (`first_below`'s rule,
        on the same numbers)."""
        per_slot = slot_thresholds(self.threshold, self.block_size)

        def ends(j: int, logits: torch.Tensor | None) -> list[bool]:
            out = [j >= limit for limit in limits]
            threshold = per_slot[j] if j < len(per_slot) else 0.0
            if logits is None or threshold <= 0:
                return out
            temperatures = None if self.temperatures is None else [self.temperatures[j]]
            conf = calibrated_confidences(logits[:, None], temperatures)
            return [e or c[0] < threshold for e, c in zip(out, conf)]

        return ends


class _Chooser:
    """Picks each slot's token for every row from its processed distribution (greedy rows:
    argmax; sampled rows: a draw with the source's generator) and keeps q for sampled rows."""

    def __init__(self, provider: DSparkProvider, sources: list[DSparkSource]):
        self.provider = provider
        self.sources = sources
        self.params = [s.context.params for s in sources]
        self.plain = all(p.is_noop for p in self.params)  # greedy, no bias or penalties: argmax as is
        # draw and keep q over the draft vocabulary (no bias or penalties index target ids)
        self.on_draft_vocab = provider.drafter.draft_vocab_ids is not None and not any(
            p.has_penalties or p.has_bias for p in self.params)
        self.drafted: list[list[int]] = [[] for _ in sources]
        self.probs: list[list[torch.Tensor]] = [[] for _ in sources]
        # a sampled row's uniforms for the whole block, drawn up front: its generator gives
        # block_size numbers a round wherever the block stops (a confidence cut, a length
        # limit, its batch mates), so its stream depends on nothing else
        self.uniforms = None
        if not all(p.is_greedy for p in self.params):
            self.uniforms = torch.full((len(sources), provider.block_size), 0.5, dtype=torch.float64)
            for r, source in enumerate(sources):
                if not source.context.params.is_greedy:
                    self.uniforms[r] = torch.rand(provider.block_size, generator=source.generator,
                                                  dtype=torch.float64, device=source.generator.device).cpu()

    def __call__(self, slot: int, logits: torch.Tensor) -> torch.Tensor:
        if self.plain:  # `drafted` feeds penalties only, which a plain row has none of
            return greedy_tokens(logits.float())  # bf16 argmax is ~5x slower on CPU; same first maximum
        params = self.params
        if self.on_draft_vocab:
            return self._choose_in_draft_vocab(slot, logits.float())
        full = self._full_vocab(logits.float())
        penalties = any(p.has_penalties for p in params)
        histories = [s.context.output + self.drafted[r] for r, s in enumerate(self.sources)] if penalties else None
        prompts = [s.context.prompt for s in self.sources] if penalties else None
        chosen = self._draw(slot, process_logits(full, params, prompts, histories))
        for r, t in enumerate(chosen.tolist()):
            self.drafted[r].append(t)
        return self._to_draft_index(chosen)

    def _draw(self, slot: int, processed: torch.Tensor) -> torch.Tensor:
        """Each row's token from its processed distribution (indices into its columns), keeping
        that distribution as q for the sampled rows: one softmax serves both (the draw is the
        inverse CDF of q itself, at the row's uniform for this slot; a greedy row's q is a
        point mass at its argmax, which any uniform picks)."""
        params = self.params
        if self.uniforms is None:
            return greedy_tokens(processed)
        probs = sampling_probs(processed, params)
        chosen = inverse_cdf_draw(probs, uniforms=self.uniforms[:, slot : slot + 1].to(probs.device))
        for r, p in enumerate(params):
            if not p.is_greedy:
                self.probs[r].append(probs[r])
        return chosen

    def _choose_in_draft_vocab(self, slot: int, logits: torch.Tensor) -> torch.Tensor:
        """The draw and q over the draft vocabulary alone: every other token's logit is -inf,
        so its probability is 0 under temperature, top-k, top-p and min-p alike, and the rows
        without bias or penalties (which index target ids) need not see the target's full
        vocabulary. On Gemma's 262,144 tokens against a 4,552-token draft vocabulary that was
        most of a sampled round's cost: a softmax and a cumsum per slot over the full width."""
        chosen = self._draw(slot, process_logits(logits, self.params))
        for r, t in enumerate(self.provider.drafter.to_target_ids(chosen).tolist()):
            self.drafted[r].append(t)
        return chosen

    def q(self, row: int, n: int) -> torch.Tensor | None:
        rows = self.probs[row]
        if not rows or not n:
            return None
        q = torch.stack(rows[:n])
        if not self.on_draft_vocab:  # drawn over the target's vocabulary already
            return q
        full = torch.zeros(n, self.provider.drafter.config.args.vocab_size, dtype=q.dtype, device=q.device)
        full[:, self.provider.drafter.draft_vocab_ids.to(q.device)] = q  # verification reads target ids
        return full

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = self.provider.drafter.draft_vocab_ids
        if vocab is None:
            return logits
        full = torch.full((logits.shape[0], self.provider.drafter.config.args.vocab_size), float("-inf"),
                          dtype=logits.dtype, device=logits.device)
        full[:, vocab] = logits
        return full

    def _to_draft_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        if self.provider._to_draft is None:
            return target_ids
        return self.provider._to_draft.to(target_ids.device)[target_ids]

"""The engine: one loop, continuous batching, every running row in one forward per step.

    step():  plan = scheduler.plan()            admit by KV budget, decode rows + prefill chunks
             drafts = drafting.drafts(...)      per decoding row, 0..k tokens: what its grammar
                                                forces, else what its source proposes, as many
                                                as engine/draft_length.py says (none without one)
             runner.forward(work)               one packed forward: [pending, drafts...] per
                                                decoding row, the next chunk per prompt
             runner.decide(work)                per-row params in one batched call; verify
                                                keeps each row's accepted drafts + 1 token
             accept(row, token) for each        detokenize, stop strings, finish, emit deltas

Rows join and leave between steps. Each row owns its KV (models/kv_cache.py), so joining or
leaving, or rolling back rejected drafts, never touches another row's cache. Callers talk
to the engine from any thread through `submit` / `cancel` (a thread-safe inbox, applied at
the start of the next step); the engine answers through each request's sink.
`run_forever()` runs the loop on the calling thread (the server's main thread), `start()`
in a background thread; `step()` / `run_until_idle()` drive it inline (CLI, tests).

Structured output: a row with a grammar (request.grammar) has its own matcher. Every
verify position is masked by the grammar's state there (engine/grammar_masks.py), the
matcher advances as tokens are accepted, and a complete grammar ends the row ("stop").
Where the grammar leaves only one way on (JSON punctuation, a fixed schema's property
names), those tokens are the row's draft for the step ("forced-token drafts", on by
default, with or without a drafter): verified like any draft, so the output is the same,
in fewer steps.

Failure stays local: a row whose forward or sampling raises is retried alone, and only
the rows that still fail finish with an error; the others carry on.

Checked by tests/test_engine.py (rows joining and leaving mid-decode produce, in float32,
the same greedy tokens as transformers on each request alone; the KV budget queues
requests instead of over-committing, nobody is starved, a cancelled row frees its memory
at once, a failing row fails alone) and tests/test_spec.py (the same with speculation).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.engine.metrics import EngineMetrics
from verispec.engine.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Collector,
    Completion,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    Sink,
    TokenInfo,
)
from verispec.engine import runner
from verispec.engine.draft import MAX_DRAFT_TOKENS, DraftProvider, NoDrafter
from verispec.engine.draft_length import DraftLength
from verispec.engine.step_costs import StepCosts, step_costs_for
from verispec.engine.verify_schedule import MODES as VERIFY_SCHEDULES, VerifySchedule
from verispec.engine.drafting import Drafting, speculation_enabled
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.row import Row, RowState
from verispec.engine.runner import Work
from verispec.engine.scheduler import Scheduler
from verispec.models.decoder import Decoder

log = logging.getLogger("verispec.engine")

DEFAULT_MAX_ROWS = 32
# Prefill tokens per step while other rows decode (bench/prefill_interleave.py, SmolLM2
# bf16, 2 cores, a 3,037-token prompt joining 4 streams): chunks of 64 / 128 / 256 / 512
# stall the streams by at most 135 / 248 / 419 / 752 ms per step (a decode step is ~24 ms)
# and give the long prompt its first token after 4.3 / 3.7 / 3.4 / 3.2 s; unchunked, the
# streams stop for 5.2 s (one 3k-token forward is slower than six 512-token ones).
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_IDLE_PREFILL_CHUNK = 512  # when nothing decodes, only time to first token matters
DEFAULT_MAX_WAITING = 1024
DEFAULT_NUM_DRAFT_TOKENS = 8
KV_BUDGET_FRACTION_CPU = 0.5  # of available RAM after the model is loaded
KV_BUDGET_FRACTION_GPU = 0.8  # of free device memory


@dataclass
class EngineConfig:
    kv_budget: int | None = None  # bytes of KV cache for all rows; None: from free memory
    max_rows: int = DEFAULT_MAX_ROWS
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    idle_prefill_chunk: int = DEFAULT_IDLE_PREFILL_CHUNK
    max_waiting: int = DEFAULT_MAX_WAITING
    max_model_len: int | None = None  # context cap; None: the model's own
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # most drafts a row verifies per step
    adaptive_draft: bool = True  # draft only as much as pays (engine/draft_length.py); False: always the most
    forced_drafts: bool = True  # a grammar row drafts the tokens its grammar forces (up to num_draft_tokens)
    # how many drafted tokens each row verifies: "cost" (each row's cost policy alone),
    # "strict" / "production" (DSpark's Algorithm 1 across the step: engine/verify_schedule.py)
    verify_schedule: str = "cost"
    # a head's confidences corrected online by what verification kept (engine/acceptance.py)
    recalibrate_heads: bool = True
    # a sampled row asking a paid source (DSpark alone) under a verify schedule drafts where
    # what its rounds have kept pays for them (engine/draft_length.py); False: the
    # acceptance-rate model alone, as greedy rows
    judge_paid_by_yield: bool = True
    prefix_cache: bool = True  # keep finished rows' KV for later prompts that start the same (prefix_cache.py)
    prefix_cache_bytes: int | None = None  # its cap; None: a quarter of the KV budget (it counts against it)

    def __post_init__(self):
        for name in ("max_rows", "prefill_chunk", "idle_prefill_chunk", "max_waiting", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens is at most {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")
        if self.kv_budget is not None and self.kv_budget <= 0:
            raise ValueError(f"kv_budget must be positive, got {self.kv_budget}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must not be negative, got {self.prefix_cache_bytes}")
        if self.verify_schedule not in VERIFY_SCHEDULES and self.verify_schedule != "anticipating":
            raise ValueError(f"verify_schedule is one of {', '.join(VERIFY_SCHEDULES)}, got {self.verify_schedule!r}")


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * KV_BUDGET_FRACTION_GPU)
    import psutil

    return int(psutil.virtual_memory().available * KV_BUDGET_FRACTION_CPU)


class Engine:
    def __init__(self, model: Decoder, tokenizer, stop_ids: Sequence[int], config: EngineConfig | None = None,
                 drafter: DraftProvider | None = None, step_costs: StepCosts | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.config = config or EngineConfig()
        self.cache = model.new_cache()
        context = model.args.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or context, context)
        self.kv_budget = self.config.kv_budget or default_kv_budget(model.device)
        prefix_bytes = self.config.prefix_cache_bytes
        self.prefix = PrefixCache(self.cache, self.kv_budget // 4 if prefix_bytes is None else prefix_bytes) \
            if self.config.prefix_cache and prefix_bytes != 0 else None
        self.scheduler = Scheduler(
            self.cache, self.kv_budget, self.config.max_rows, self.config.prefill_chunk, self.config.idle_prefill_chunk,
            self.prefix, self._restore_prefix if self.prefix is not None else None,
        )
        self.metrics = EngineMetrics()
        self.vocab_size = model.args.vocab_size
        self._rows: dict[str, Row] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_submits = 0  # submitted, not yet drained from the inbox (under _count_lock)
        self._count_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None  # set by start()
        self._loop_thread: threading.Thread | None = None  # whichever thread runs the loop
        self._stopping = False
        self.started_at = time.time()
        # `step_costs`: an SPS table the caller already holds for this model, so engines
        # compared in one run price their steps alike (each engine reading the cache on its
        # own may re-time a table when the machine is busy, and a verify schedule or draft
        # length decided on another table moves tau: `dspark measure --against`)
        self.drafting = self._drafting(drafter, step_costs)

    def _drafting(self, drafter: DraftProvider | None, shared_costs: StepCosts | None = None) -> Drafting:
        if drafter is not None and not speculation_enabled():
            log.warning("VERISPEC_SPEC=0: speculation is off (%s not used)", drafter.describe())
            drafter = None
        provider = drafter or NoDrafter()
        adaptive = self.config.adaptive_draft and drafter is not None
        scheduled = self.config.verify_schedule != "cost" and (drafter is not None or self.config.forced_drafts)
        self.step_costs = None
        if (adaptive or scheduled) and shared_costs is not None:
            self.step_costs = shared_costs
        elif adaptive or scheduled:
            self.step_costs, info = step_costs_for(self.model)
            if info.get("implausible"):
                log.warning("the SPS table stayed implausible after %d measurements (a forward of a + b tokens "
                            "cost more than two forwards: %s); other work on this machine? It serves this run "
                            "and is not cached", info["attempts"], info["implausible"][:3])
        costs = self.step_costs
        priced = costs is not None and drafter is not None
        sampled = provider.sampled_draft_costs(costs) if priced else None
        length = DraftLength(self.config.num_draft_tokens, provider.max_draft, costs, adaptive,
                             provider.draft_costs(costs) if priced else (0.0, 0.0), ask_all=scheduled,
                             sampled_round=None if sampled is None else sampled[0],
                             served_round=provider.served_round_seconds if priced else None,
                             judge_by_yield=self.config.judge_paid_by_yield)
        schedule = VerifySchedule(self.config.verify_schedule, costs.sps) if scheduled else None
        return Drafting(provider, length, self.config.forced_drafts, schedule, self.config.recalibrate_heads)

    # -- API (any thread) -----------------------------------------------------------

    def _reads_hidden(self, row: Row) -> bool:
        """A row whose draft source reads the target's hidden states: it restores a prefix
        only with the features of its positions, and keeps its own for the cache."""
        return self.drafting.active and row.request.speculation and bool(self.drafting.taps)

    def _restore_prefix(self, row: Row) -> None:
        """Before a row's first prefill chunk: the cached KV of the longest block prefix of
        its prompt (and its features, for a row whose source reads them)."""
        if row.reads_prefix_cache:
            row.restored, features = self.prefix.restore(row.kv, row.request.prompt_ids, row.features is not None)
            row.prefilled = row.restored
            if features is not None:
                row.restored_features = features
                row.features.append(features)

    @staticmethod
    def _keep_features(row: Row, hidden, positions: int) -> None:
        """Record the tapped hidden states of a forward's first `positions` rows for the
        prefix cache (a forward without them ends the record: no entry would be whole)."""
        if row.features is not None:
            if hidden is None:
                row.features = None
            else:
                row.features.append(tuple(h[:positions].clone() for h in hidden))  # not a view of the batch

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may ask for: what is left of the
        context window, and what the KV budget can hold for one row. A row's bytes grow
        monotonically with its capacity but not linearly (a draft source reserves a fixed
        part, sliding-window rings stop growing), so the fit is found by bisection."""
        lo, hi = 0, max(0, self.max_model_len - prompt_len)  # lo always fits (or is 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._row_bytes(prompt_len + mid) <= self.kv_budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _row_bytes(self, capacity: int) -> int:
        """KV a row of `capacity` tokens reserves: the target's, and its draft source's."""
        return self.cache.bytes_for(capacity) + self.drafting.provider.kv_bytes(capacity)

    def check(self, request: GenerationRequest) -> int:
        """Refuse what can never run (RequestRejected, naming the field); return the bytes
        of KV the request will reserve."""
        try:
            return self._check(request)
        except RequestRejected:
            self.metrics.requests_rejected += 1
            raise

    def _check(self, request: GenerationRequest) -> int:
        n_prompt = len(request.prompt_ids)
        if n_prompt == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {request.max_tokens!r}", "max_tokens")
        bias = request.params.logit_bias or {}
        if any(t >= self.vocab_size for t in bias):
            raise RequestRejected(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}", "logit_bias")
        if n_prompt >= self.max_model_len:
            raise RequestRejected(
                f"the prompt is {n_prompt} tokens; this model's maximum context length is {self.max_model_len} tokens, "
                "which must also hold at least one new token: shorten the prompt", "prompt")
        total = n_prompt + request.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs {total} "
                f"({n_prompt} in the prompt, {request.max_tokens} for the completion); shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        need = self._row_bytes(total)
        if need > self.kv_budget and self.max_new_tokens(n_prompt) == 0:
            raise RequestRejected(
                f"the prompt ({n_prompt} tokens) needs more KV cache than the server's whole KV budget of "
                f"{self.kv_budget / 2**20:.1f} MiB (--kv-budget): shorten it", "prompt")
        if need > self.kv_budget:
            raise RequestRejected(
                f"the request needs {need / 2**20:.1f} MiB of KV cache for {total} tokens, more than the server's whole "
                f"KV budget of {self.kv_budget / 2**20:.1f} MiB (--kv-budget); it can never run here: lower max_tokens "
                f"(at most {self.max_new_tokens(n_prompt)} with this prompt) or shorten the prompt",
                "max_tokens",
            )
        if self.scheduler.queue_depth + self._pending_submits >= self.config.max_waiting:
            raise RequestRejected(f"the server is busy ({self.config.max_waiting} requests waiting); retry later", None, 429)
        return need

    def submit(self, request: GenerationRequest, sink: Sink) -> str:
        """Queue a request (RequestRejected before any work if it can never run)."""
        if self._stopping:
            raise RequestRejected("the engine is shutting down", None, 503)
        kv_bytes = self.check(request)
        row = Row(request, sink, self.tokenizer, kv_bytes)
        row.reads_prefix_cache = self.prefix is not None
        row.features = [] if row.reads_prefix_cache and self._reads_hidden(row) else None
        with self._count_lock:
            self._pending_submits += 1
        self._inbox.put(("submit", row))
        self._wake.set()
        return request.request_id

    def cancel(self, request_id: str) -> None:
        """Stop a request and free its row and memory at the start of the next step."""
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Completion:
        """Submit and wait for the whole answer (drives the loop inline when no thread runs it)."""
        collector = Collector()
        self.submit(request, collector)
        if self._loop_thread is None:
            self.run_until_idle()
        return collector.result(timeout)

    def start(self) -> None:
        """Run the loop in a background thread. Prefer `run_forever()` on the thread that
        loaded the model where speed matters: libgomp throttles its worker spinning once a
        second thread has its own OpenMP team, and decode then runs at about 0.55x here."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run_forever, name="verispec-engine", daemon=True)
            self._thread.start()

    def run_forever(self, keep_running=lambda: True) -> None:
        """The engine loop, in the calling thread, until `stop()` (or `keep_running()` turns
        false, checked at least every half second)."""
        self._loop_thread = threading.current_thread()
        while not self._stopping and keep_running():
            try:
                worked = self.step()
            except Exception as e:  # noqa: BLE001 - the loop must survive anything a step does
                log.exception("engine step failed")
                for row in list(self._rows.values()):
                    self._finish(row, FINISH_ERROR, error=f"engine error: {e}")
                worked = False
            if not worked:
                self._wake.wait(0.5)
                self._wake.clear()

    def stop(self) -> None:
        """Ask the loop to return after the current step (any thread; signal-safe)."""
        self._stopping = True
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._drain_inbox()
        for row in list(self._rows.values()):
            self._finish(row, FINISH_ABORT, error="the server shut down")

    @property
    def alive(self) -> bool:
        """False once a loop that was running has stopped (what /health reports)."""
        return self._loop_thread is None or (self._loop_thread.is_alive() and not self._stopping)

    def stats(self) -> dict:
        m = self.metrics
        return {
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.queue_depth + self._pending_submits,
            "kv_bytes_in_use": self.cache.bytes_in_use,
            "kv_bytes_reserved": self.scheduler.reserved,
            "kv_budget_bytes": self.kv_budget,
            "max_rows": self.config.max_rows,
            "max_model_len": self.max_model_len,
            "requests_finished": dict(m.requests_finished),
            "requests_rejected": m.requests_rejected,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generation_tokens,
            "steps": m.steps,
            "uptime_s": round(time.time() - self.started_at, 1),
            "speculation": self.drafting.stats(),
            "sps_table": None if self.step_costs is None else self.step_costs.table(),
            "forced_drafts": {"enabled": self.config.forced_drafts, "drafted": self.drafting.totals.forced_drafted,
                              "accepted": self.drafting.totals.forced_accepted},
            "prefill_tokens": m.prefill_tokens,
            "prefix_cache": self.prefix.stats() if self.prefix is not None else None,
        }

    # -- the loop -------------------------------------------------------------------

    def run_until_idle(self) -> None:
        while self.step() or self._rows:
            pass

    def step(self) -> bool:
        """One engine step; False when there was nothing to do.

        Decoding rows feed [pending, drafts...], prompts feed their next chunk, all in one
        forward; then every emitting row keeps its verified drafts and samples the token
        after them (runner.py), and the tokens are accepted one at a time."""
        self._drain_inbox()
        plan = self.scheduler.plan()
        if not plan:
            return False
        drafting = self.drafting
        for row in plan.admitted:
            drafting.attach(row)
        for chunk in plan.prefill:
            if chunk.row.restored:  # restored from the prefix cache: the source still reads the tokens
                drafting.prefill(chunk.row, chunk.row.request.prompt_ids[: chunk.row.restored],
                                 chunk.row.restored_features)
                chunk.row.restored, chunk.row.restored_features = 0, None
        self.metrics.prefill_tokens += sum(c.stop - c.start for c in plan.prefill)
        batch_tokens = len(plan.decode) + sum(c.stop - c.start for c in plan.prefill)
        drafts = drafting.drafts(plan.decode, batch_tokens, len(plan.decode) + len(plan.prefill))
        work = [Work.decoding(row, draft) for row, draft in zip(plan.decode, drafts)]
        work += [Work.prefilling(chunk) for chunk in plan.prefill]
        done = runner.forward(self.model, work, drafting.taps, self._fail)
        self.metrics.steps += 1
        for item in done:
            if item.chunk is not None:
                item.row.prefilled = item.chunk.stop
                self._keep_features(item.row, item.hidden, len(item.tokens))
                if item.chunk.completes_prompt:
                    item.row.state = RowState.DECODE
                    if self.prefix is not None and self.scheduler.waits_on(item.row):  # n > 1: the twins reuse it
                        self.prefix.insert(item.row.request.prompt_ids, item.row.kv, item.row.features)
                drafting.prefill(item.row, item.tokens, item.hidden)
        emitting = [w for w in done if w.emits and w.row.state is not RowState.FINISHED]
        for item, infos in (runner.decide(emitting, self._fail) if emitting else []):
            self._advance(item, infos)
        return True

    def _advance(self, item: Work, infos: list[TokenInfo]) -> None:
        """A row's tokens of this step: roll back what verification rejected, tell its
        source, then accept the tokens one at a time (a stop inside a burst ends it there)."""
        row = item.row
        rejected = len(item.draft) - (len(infos) - 1)
        if rejected:
            row.kv.rollback(rejected)
        if item.decode:
            self.drafting.commit(row, item.draft, [i.token for i in infos], item.hidden)
            self._keep_features(row, item.hidden, len(infos))  # the pending token and the kept drafts
        self._observe_latency(row, len(infos))
        for info in infos:
            self._accept(row, info)
            if row.state is RowState.FINISHED:
                break

    def _fail(self, row: Row, error: Exception) -> None:
        self._finish(row, FINISH_ERROR, error=f"{type(error).__name__}: {error}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                with self._count_lock:
                    self._pending_submits -= 1
                self._rows[item.id] = item
                self.scheduler.add(item)
                self.metrics.prompt_tokens += item.prompt_len
            elif kind == "cancel":
                row = self._rows.get(item)
                if row is not None:
                    self._finish(row, FINISH_ABORT)

    # -- one new token for one row ----------------------------------------------------------

    def _observe_latency(self, row: Row, n_tokens: int) -> None:
        now = time.perf_counter()
        if row.first_token_at is None:
            row.first_token_at = now
            self.metrics.ttft.observe(now - row.arrival)
            n_tokens -= 1
        if n_tokens > 0:  # a burst of accepted drafts: each token waited its share
            self.metrics.inter_token.observe((now - row.last_token_at) / n_tokens, times=n_tokens)
        row.last_token_at = now

    def _accept(self, row: Row, info: TokenInfo) -> None:
        if info.token in self.stop_ids and not row.request.ignore_eos:
            released = row.text.finish()  # EOS is never content; held-back text is
            self._finish(row, FINISH_STOP, text=released.text, n_tokens=released.tokens)
            return
        if row.grammar is not None and not row.grammar.consume(info.token):
            # the mask allowed it, so this is a backend fault: fail the row, keep the others
            self._finish(row, FINISH_ERROR, error=f"the grammar rejected token {info.token}: {row.grammar.error}")
            return
        row.output.append(info.token)
        row.unreleased.append(info)
        self.metrics.generation_tokens += 1
        released = row.text.push(info.token)
        # a complete grammar (nothing but EOS may follow) ends the output here, also inside
        # a burst of accepted drafts
        complete = row.grammar is not None and row.grammar.stopped
        if released.stopped:
            self._finish(row, FINISH_STOP, text=released.text, n_tokens=released.tokens)
        elif complete or len(row.output) >= row.request.max_tokens:
            tail = row.text.finish()
            reason = FINISH_STOP if complete or tail.stopped else FINISH_LENGTH
            self._finish(row, reason, text=released.text + tail.text, n_tokens=released.tokens + tail.tokens)
        else:
            row.pending = info.token
            if released.text or released.tokens:
                self._emit(row, released.text, released.tokens)

    def _emit(self, row: Row, text: str, n_tokens: int, finish: str | None = None, error: str | None = None) -> None:
        tokens, row.unreleased = row.unreleased[:n_tokens], row.unreleased[n_tokens:]
        out = RequestOutput(row.id, text, tokens, finish, error, row.prompt_len, len(row.output))
        if finish is not None:
            out.time_to_first_token, out.decode_time = row.timings()
            out.speculation = self.drafting.usage(row)
            out.stop_string = row.text.matcher.matched if finish == FINISH_STOP else None
        try:
            row.sink(out)
        except Exception:  # noqa: BLE001 - a broken consumer must not break the engine
            log.exception("sink of request %s failed", row.id)

    def _finish(self, row: Row, reason: str, text: str = "", n_tokens: int = 0, error: str | None = None) -> None:
        if row.state is RowState.FINISHED:
            return
        if self.prefix is not None and row.kv is not None and row.state is RowState.DECODE and reason != FINISH_ERROR:
            self.prefix.insert(list(row.request.prompt_ids) + row.output, row.kv, row.features)
        self.scheduler.remove(row)
        self._rows.pop(row.id, None)
        self.drafting.detach(row)
        self.metrics.requests_finished[reason] += 1
        self.metrics.e2e.observe(time.perf_counter() - row.arrival)
        if error:
            log.warning("request %s failed: %s", row.id, error)
        self._emit(row, text, n_tokens, reason, error)

"""Admission by KV budget and the plan of each step.

A waiting deque and a running list. Admission is strictly first come, first served: the
head of the queue starts as soon as its KV reservation (prompt + max_tokens, from
`KVCache.bytes_for`) fits in what the budget has left and a batch slot is free; nobody
overtakes it, so sustained load of small requests cannot starve a large one. A request
that could never fit is refused at submit time (engine.py), not here.

Each step decodes every running row that has a pending token (decode is never delayed),
then spends a prefill token budget on prompts in admission order. The budget is small
while rows are decoding (a long prompt is cut into chunks interleaved with decode steps,
so running streams keep flowing) and larger when nothing is decoding (then only time to
first token matters).

With a prefix cache, its entries count against the same budget: admission evicts them
(least recently used first) before a row would wait, and a row's prompt is looked up
there (`on_first_chunk`) right before its first prefill chunk is planned. A row whose
prompt another running row is prefilling right now waits for it (the engine then puts
that prompt's KV into the cache), so the `n` choices of a request prefill it once; a row
whose prefill adds nothing to the cache (a prompt shorter than a block, or one restored
whole) holds nobody back, so the other choices start in the same step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from verispec.models.kv_cache import KVCache
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.row import Row, RowState


@dataclass
class PrefillChunk:
    row: Row
    start: int
    stop: int

    @property
    def completes_prompt(self) -> bool:
        return self.stop == self.row.prompt_len


@dataclass
class StepPlan:
    decode: list[Row]
    prefill: list[PrefillChunk]
    admitted: list[Row]  # rows that got their KV this step

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, cache: KVCache, kv_budget: int, max_rows: int, prefill_chunk: int, idle_prefill_chunk: int,
                 prefix: PrefixCache | None = None, on_first_chunk=None):
        self.cache = cache
        self.prefix = prefix  # its bytes count against the budget; evicted before a row waits
        # called with a row right before its first prefill chunk is planned (the prefix
        # cache's lookup); returns False for rows that never read the cache
        self.on_first_chunk = on_first_chunk
        self.kv_budget = kv_budget
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.idle_prefill_chunk = max(idle_prefill_chunk, prefill_chunk)
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self.reserved = 0  # bytes of KV reserved by running rows

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def admit(self) -> list[Row]:
        admitted = []
        while self.waiting and len(self.running) < self.max_rows:
            row = self.waiting[0]
            over = self.reserved + self.prefix_bytes + row.kv_bytes - self.kv_budget
            if over > 0 and self.prefix is not None:
                self.prefix.evict(over)
                over = self.reserved + self.prefix_bytes + row.kv_bytes - self.kv_budget
            if over > 0:
                break  # first come, first served: wait for memory, let nobody overtake
            self.waiting.popleft()
            row.kv = self.cache.allocate(row.capacity)
            row.state = RowState.PREFILL
            self.reserved += row.kv_bytes
            self.running.append(row)
            admitted.append(row)
        return admitted

    def plan(self) -> StepPlan:
        admitted = self.admit()
        decode = [r for r in self.running if r.state is RowState.DECODE]
        budget = self.prefill_chunk if decode else self.idle_prefill_chunk
        prefill = []
        prefilling = None  # prompts whose KV a running row is prefilling now, built once a step
        for row in self.running:
            if budget <= 0:
                break
            if row.state is RowState.PREFILL:
                if not row.looked_up and self.on_first_chunk is not None:
                    key = tuple(row.request.prompt_ids) if row.reads_prefix_cache else None
                    if key is not None:
                        if prefilling is None:
                            prefilling = self._prompts_prefilling()
                        if key in prefilling:
                            continue  # its twin's prompt KV will be in the prefix cache: wait for it
                    row.looked_up = True
                    self.on_first_chunk(row)
                    if key is not None:
                        # a twin waits only for a prefill that puts blocks into the cache which
                        # the lookup did not find there: a prompt shorter than a block and one
                        # restored whole (the twins after the first) add nothing, and waiting on
                        # them started one twin a step (500 choices of a short prompt: 500 steps)
                        row.fills_prefix_cache = row.prefilled < self.prefix.cacheable(len(key))
                        if row.fills_prefix_cache:
                            prefilling.add(key)
                n = min(row.remaining_prompt, budget)
                prefill.append(PrefillChunk(row, row.prefilled, row.prefilled + n))
                budget -= n
        return StepPlan(decode, prefill, admitted)

    def _prompts_prefilling(self) -> set[tuple[int, ...]]:
        """The prompts running rows are prefilling after their lookup: a row with one of them
        waits (the choices of an `n > 1` request, or users sending the same prompt at once).
        A set, so that a step with R such rows costs O(R), not O(R^2) prompt comparisons."""
        return {tuple(other.request.prompt_ids) for other in self.running
                if other.state is RowState.PREFILL and other.fills_prefix_cache}  # set only after a lookup

    def waits_on(self, row: Row) -> bool:
        """Rows are waiting to reuse this row's prompt KV."""
        prompt = row.request.prompt_ids
        return any(other is not row and other.state is RowState.PREFILL and not other.looked_up
                   and other.reads_prefix_cache and other.request.prompt_ids == prompt for other in self.running)

    def remove(self, row: Row) -> None:
        """Take a finished or cancelled row out and free its KV at once."""
        if row.state is RowState.WAITING:
            try:
                self.waiting.remove(row)
            except ValueError:
                pass
        elif row in self.running:
            self.running.remove(row)
            self.reserved -= row.kv_bytes
        if row.kv is not None:
            self.cache.release(row.kv)
            row.kv = None
        row.state = RowState.FINISHED

    @property
    def prefix_bytes(self) -> int:
        return self.prefix.bytes if self.prefix is not None else 0

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

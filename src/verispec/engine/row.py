"""All of one request's state inside the engine (nano-vllm's `Sequence`).

A row moves WAITING -> PREFILL (its prompt enters the KV cache in chunks) -> DECODE (one
pending token per step) -> finished. `pending` is the last sampled token: it is already
part of the output but not yet in the KV cache; the next forward feeds it. So the cache
always holds prompt + output[:-1], and a row's capacity of prompt + max_tokens is never
exceeded (the last token is never fed).
"""

from __future__ import annotations

import time
from enum import Enum

import torch

from verispec.models.kv_cache import SequenceKV
from verispec.engine.request import GenerationRequest, Sink, TokenInfo
from verispec.engine.sampling import make_generator
from verispec.engine.textstream import TextStream


class RowState(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class Row:
    def __init__(self, request: GenerationRequest, sink: Sink, tokenizer, kv_bytes: int):
        self.request = request
        self.sink = sink
        self.params = request.params
        self.kv_bytes = kv_bytes  # reserved at admission, freed at finish
        self.kv: SequenceKV | None = None
        self.state = RowState.WAITING
        self.prefilled = 0  # prompt tokens already in the cache
        self.looked_up = False  # the prefix cache was asked for this prompt (engine/scheduler.py)
        self.fills_prefix_cache = False  # ... and its prefill adds blocks the cache did not hold (scheduler.py)
        self.reads_prefix_cache = False  # set at submit: the engine has a prefix cache
        self.restored = 0  # prompt tokens restored from the prefix cache, not yet handed to the draft source
        self.restored_features = None  # their tapped hidden states, for a source that reads them
        # per forward that put this row's positions into the cache, their tapped hidden states
        # (prompt chunks, then each step's kept rows): what the prefix cache keeps for sources
        # that read them. None: not kept (no cache, no such source, or a forward without them)
        self.features: list[tuple[torch.Tensor, ...]] | None = None
        self.output: list[int] = []
        self.pending: int | None = None
        self.unreleased: list[TokenInfo] = []  # emitted tokens whose text is still held back
        self.text = TextStream(tokenizer, request.stop)
        # structured output: this row's own matcher, advanced only by emitted tokens
        self.grammar = request.grammar.new_matcher() if request.grammar is not None else None
        self.generator = None if self.params.is_greedy else make_generator(self.params.seed)
        # penalties read the prompt every step: one tensor, made once
        self.prompt_tensor = torch.tensor(request.prompt_ids, dtype=torch.long) if self.params.has_penalties else None
        # drafting (engine/drafting.py attaches these at admission)
        self.source = None
        self.source_needs_hidden = False
        self.draft_stats = None
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.request.max_tokens

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.prefilled

    def timings(self) -> tuple[float | None, float | None]:
        """(arrival -> first token, first token -> last token) in seconds."""
        if self.first_token_at is None:
            return None, None
        return self.first_token_at - self.arrival, self.last_token_at - self.first_token_at

    def __repr__(self) -> str:
        return f"Row({self.id[:8]}, {self.state.value}, prompt={self.prompt_len}, out={len(self.output)})"

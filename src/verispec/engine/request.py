"""What a caller asks the engine for, and what the engine sends back.

A `GenerationRequest` is validated input: token ids, a token limit, sampling parameters
and stop strings. The engine answers through the request's sink with `RequestOutput`
deltas: newly released text, the tokens it accounts for (with logprobs when asked) and,
once, a finish reason. The sink is called from the engine's thread; the server wraps it
into an asyncio queue, `collect` below into a blocking one.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from verispec.engine.sampling import SamplingParams

FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"  # cancelled by the caller (client went away)
FINISH_ERROR = "error"  # this row failed; the others carried on


class RequestRejected(ValueError):
    """A request the engine refuses before doing any work (HTTP 400), naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: object | None = None  # a compiled grammar (grammar/backend.py CompiledGrammar): structured output
    speculation: bool = True  # False: this request decodes without a draft source (its grammar may still force)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class TokenInfo:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # generated so far (stop-string tokens included: they were computed)
    # on the final delta: seconds from arrival to the first token, and from it to the last
    time_to_first_token: float | None = None
    decode_time: float | None = None
    speculation: dict | None = None  # drafted / accepted / rounds / mean_accepted_length, with a drafter
    stop_string: str | None = None  # on the final delta: the stop string that ended it, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[RequestOutput], None]


@dataclass
class Completion:
    """A whole answer, assembled from the deltas (what `collect` returns)."""

    text: str
    token_ids: list[int]
    tokens: list[TokenInfo]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    speculation: dict | None = None
    time_to_first_token: float | None = None
    decode_time: float | None = None


class Collector:
    """A sink that gathers one request's deltas; `result()` blocks until it finished."""

    def __init__(self):
        self.queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def __call__(self, out: RequestOutput) -> None:
        self.queue.put(out)

    def result(self, timeout: float | None = None) -> Completion:
        text, tokens = [], []
        while True:
            out = self.queue.get(timeout=timeout)
            text.append(out.text)
            tokens.extend(out.tokens)
            if out.finished:
                return Completion(
                    "".join(text), [t.token for t in tokens], tokens, out.finish_reason, out.prompt_tokens,
                    out.completion_tokens, out.error, out.speculation, out.time_to_first_token, out.decode_time,
                )

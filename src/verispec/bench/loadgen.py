"""Load generation against an OpenAI-compatible server: streaming requests, closed-loop
lanes of C concurrent clients, and a peak-RSS sampler for the server's process tree.

Used by `verispec bench matrix` and bench/serve_load.py. TTFT is the time to the first
SSE event that carries content (not the role-only first chunk); a request's decode time
runs from that event to its last content event. Token counts come from the server's
usage block when it sends one (stream_options.include_usage), else from `count_tokens`
on the streamed text.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil


@dataclass
class RequestResult:
    ttft: float  # seconds to the first content event
    decode_s: float  # first to last content event
    tokens: int
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive content events
    index: int = -1  # which of the lane's bodies this answers (failed requests leave gaps)

    @property
    def stream_tok_s(self) -> float | None:
        """This request's decode rate: tokens after the first over the time after the first."""
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


@dataclass
class LaneResult:
    requests: list[RequestResult]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    @property
    def agg_tok_s(self) -> float:
        return sum(r.tokens for r in self.requests) / self.wall_s if self.wall_s > 0 else 0.0


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _content(chunk: dict) -> str:
    """The generated text an SSE chunk carries (chat deltas or completion text)."""
    out = []
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if piece:
            out.append(piece)
    return "".join(out)


def _finish(chunk: dict) -> str | None:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, count_tokens=None) -> RequestResult:
    """POST `body` (with stream on) to `url` (a /v1/chat/completions or /v1/completions
    URL) and time its content events."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, usage, gaps, finish = [], None, [], None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
            finish = _finish(chunk) or finish
            piece = _content(chunk)
            if piece:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                first = first or now
                last = now
                text.append(piece)
    if first is None:
        raise RuntimeError("no content streamed")
    joined = "".join(text)
    tokens = (usage or {}).get("completion_tokens") or (count_tokens(joined) if count_tokens else len(text))
    return RequestResult(first - t0, last - first, tokens, joined, finish, usage, gaps)


async def run_lane(url: str, bodies: list[dict], concurrency: int, count_tokens=None,
                   timeout: float = 600.0) -> LaneResult:
    """`concurrency` clients send `bodies` back to back (each takes the next unsent one);
    results keep the order of `bodies` (failed ones are left out and listed in errors)."""
    queue = list(enumerate(bodies))
    results: dict[int, RequestResult] = {}
    errors: list[str] = []

    async def client_loop(client):
        while queue:
            index, body = queue.pop(0)
            try:
                results[index] = await stream_one(client, url, body, count_tokens)
                results[index].index = index
            except Exception as e:  # noqa: BLE001 - counted and reported, the lane goes on
                errors.append(f"request {index}: {type(e).__name__}: {e}")

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return LaneResult([results[i] for i in sorted(results)], wall, errors)


def run_lane_sync(url: str, bodies: list[dict], concurrency: int, count_tokens=None) -> LaneResult:
    return asyncio.run(run_lane(url, bodies, concurrency, count_tokens))


class RssSampler:
    """Peak resident memory of a process and its children, sampled every 100 ms."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        try:
            procs = [self.process, *self.process.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(0.1)

    def __enter__(self):
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

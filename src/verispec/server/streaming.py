"""Engine requests as asyncio streams, and Server-Sent Events framing.

`EngineStream` submits a request's rows (one per choice) and delivers their deltas into
an asyncio queue from the engine thread. Closing it (client disconnected, handler
cancelled, error) cancels every row that has not finished, which frees its batch slot
and KV memory at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from verispec.engine.engine import Engine
from verispec.engine.request import GenerationRequest, RequestOutput, RequestRejected

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(payload: dict) -> str:
    """An event named by its own `type` (Anthropic's and the Responses API's streams)."""
    return f"event: {payload['type']}\n" + sse(payload)


class EngineStream:
    def __init__(self, engine: Engine, requests: list[GenerationRequest]):
        self.engine = engine
        self.requests = requests
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.open: set[int] = set()

    def submit(self) -> None:
        """All rows or none: each is checked before any is queued."""
        for request in self.requests:
            self.engine.check(request)
        try:
            for index, request in enumerate(self.requests):
                self.engine.submit(request, self._sink(index))
                self.open.add(index)
        except RequestRejected:
            self.close()
            raise

    def _sink(self, index: int):
        def deliver(out: RequestOutput) -> None:  # engine thread
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))

        return deliver

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput]:
        """The next delta of any row (asyncio.TimeoutError after `timeout` seconds; waiting
        on the queue, unlike on an async generator, survives being timed out)."""
        while True:
            index, out = await asyncio.wait_for(self.queue.get(), timeout)
            if index in self.open:  # a cancelled row's late deltas are dropped
                break
        if out.finished:
            self.open.discard(index)
        return index, out

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.open:
            yield await self.next()

    def cancel(self, index: int) -> None:
        """Stop one row now (its remaining deltas are not waited for)."""
        if index in self.open:
            self.engine.cancel(self.requests[index].request_id)
            self.open.discard(index)

    def close(self) -> None:
        for index in self.open:
            self.engine.cancel(self.requests[index].request_id)
        self.open.clear()

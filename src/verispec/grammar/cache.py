"""Compiled grammars, cached by (tokenizer, grammar) and capped in bytes.

Requests with the same schema share one compiled grammar (each row still gets its own
matcher). The cache is an LRU over the backend's byte estimate of each entry; an entry
larger than the whole cap is compiled and used but not kept. Concurrent requests for a
grammar that is being compiled wait for that one compilation instead of starting their
own; a compile error is not cached (the request gets its 400, a retry compiles again).
Every compile goes through grammar/guard.py (input limits, a big-stack thread, a time
budget), so a hostile constraint costs its own request a 400 and nobody else anything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from verispec.grammar.backend import CompiledGrammar, GrammarBackend
from verispec.grammar.guard import compile_guarded
from verispec.grammar.constraint import Constraint

DEFAULT_CACHE_BYTES = 64 * 2**20


class GrammarCache:
    def __init__(self, backend: GrammarBackend, max_bytes: int = DEFAULT_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.backend = backend
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.compiles = 0

    def get(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar for `constraint` (GrammarError if it does not compile)."""
        key = (self.backend.fingerprint, constraint)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
                self.misses += 1
                self.compiles += 1
            else:
                self.hits += 1
        if not owner:
            return future.result()
        try:
            compiled = compile_guarded(self.backend, constraint)
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            future.set_exception(e)
            raise
        with self._lock:
            del self._inflight[key]
            self._store(key, compiled)
        future.set_result(compiled)
        return compiled

    def _store(self, key: tuple, compiled: CompiledGrammar) -> None:
        if compiled.nbytes > self.max_bytes:
            return
        self._entries[key] = compiled
        self.bytes += compiled.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "compiles": self.compiles}

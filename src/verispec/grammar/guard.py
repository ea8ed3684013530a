"""Compiling a constraint so that no request can crash the process or hold it hostage.

`compile_guarded(backend, constraint)` is the only way verispec compiles a grammar (the
server's GrammarCache and `verispec generate` both call it):

1. the limits of grammar/limits.py, in Python, before native code sees the input;
2. the backend's compile, including its first mask (that is where llguidance builds its
   lexer: `(a{1000}){1000}` compiled in 2 ms and then took 2.1 s over its first mask, on
   the engine's step, stalling every running row), on a thread of its own with a 64 MiB
   stack, 8x the stack that the crash reproducers overflowed;
3. a time budget: a compile that has not finished after `COMPILE_BUDGET_S` is a
   GrammarError (400) for its request, which stops waiting; the thread finishes in the
   background (llguidance releases the GIL while it compiles, so nothing else waits on
   it), and at most `MAX_CONCURRENT` compiles run at once;
4. any exception the native code raises, Rust panics included (pyo3's PanicException is
   a BaseException), becomes a GrammarError whose message is cut to its first lines,
   never a backtrace.

Why a thread and not a worker process: bench/grammar_guard.py measured both on the 36
structured-output cases (SmolLM2's tokenizer, AMD EPYC, 2 cores), cold compiles with the
first mask: direct p50 0.63 ms; on a fresh 64 MiB-stack thread 0.96 ms (+0.33 ms, the
limits included); through a worker process that compiles first 1.66 ms (+1.0 ms: an IPC
round trip and a second compile, since a compiled matcher cannot cross processes), plus
3.1 s to start the worker and a second copy of the tokenizer index. And a worker would
protect only the compile: every later mask of the row is computed in this process
anyway, so what keeps those safe is the same thing that keeps the compile safe, the
input limits (a 64-level schema is far from the ~1,000 levels that overflowed 8 MiB).
So the thread, at a third of the process's cost; compiled grammars are cached, so even
that is paid once per schema.

Checked by tests/test_grammar_limits.py (the crash reproducers, a compile over budget,
a panic's message) and the HTTP fuzz test in tests/test_structured_server.py.
"""

from __future__ import annotations

import re
import threading
import time

from verispec.grammar import limits
from verispec.grammar.constraint import GrammarError, Constraint

GUARD_STACK_BYTES = 64 * 2**20
COMPILE_BUDGET_S = 5.0
MAX_CONCURRENT = 4
MAX_MESSAGE_LINES = 6
MAX_MESSAGE_CHARS = 800

_running = threading.BoundedSemaphore(MAX_CONCURRENT)
_stack_lock = threading.Lock()


def compile_guarded(backend, constraint: Constraint, budget_s: float = COMPILE_BUDGET_S):
    """backend.compile(constraint), bounded, on a big-stack thread, within `budget_s` seconds;
    GrammarError for anything that goes wrong."""
    limits.check(constraint)
    deadline = time.monotonic() + budget_s
    if not _running.acquire(timeout=budget_s):
        raise GrammarError(f"the server is compiling {MAX_CONCURRENT} other grammars; retry in a moment")
    result: dict = {}

    def work():
        try:
            result["value"] = backend.compile(constraint)
        except GrammarError as e:
            result["error"] = e
        except BaseException as e:  # noqa: BLE001 - native panics arrive as BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            result["error"] = GrammarError(f"the grammar compiler failed on this input: {clean_message(str(e))}")
        finally:
            _running.release()

    with _stack_lock:  # stack_size is process-wide: set it for this thread's creation only
        previous = threading.stack_size(GUARD_STACK_BYTES)
        try:
            thread = threading.Thread(target=work, name="verispec-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise GrammarError(f"the constraint did not compile within {budget_s:g} s; simplify it")
    if "error" in result:
        raise result["error"]
    return result["value"]


_BACKTRACE = re.compile(r"^\s*(stack backtrace:|note: run with|\d+: |at \S+:\d+)", re.M)


def clean_message(message: str) -> str:
    """A native error message as a client may see it: no backtrace, a few lines."""
    match = _BACKTRACE.search(message)
    if match:
        message = message[: match.start()]
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    text = "\n".join(lines[:MAX_MESSAGE_LINES])
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."

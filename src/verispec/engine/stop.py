"""Stop strings matched on decoded text, with hold-back of partial matches.

Text arrives in pieces (one detokenized token at a time). A stop string can span pieces,
so the matcher holds back the longest tail of what it has seen that is still a prefix of
some stop string, and releases everything before it. When a stop string appears, the
output is cut exactly where it starts; the stop string itself and anything after it
never reach the client.

Why this is exact: any occurrence of a stop string starts inside the held-back buffer.
Text was released only when no stop string occurred in the buffer and no suffix starting
at or before it was a proper prefix of a stop string, so an occurrence starting in
released text would have been found (if it ended there) or held (if it did not).
When several stop strings occur, the one that starts earliest wins.

Checked by tests/test_stop.py against a whole-text oracle on random texts and random
splits into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a piece of text; return (text safe to release, whether a stop string ended it)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        self.buffer += text
        found = [(i, n, s) for n, s in enumerate(self.stops) if (i := self.buffer.find(s)) >= 0]
        if found:
            cut, _, self.matched = min(found)
            out, self.buffer, self.stopped = self.buffer[:cut], "", True
            return out, True
        hold = self._partial_tail()
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(self.buffer) - hold :]
        return out, False

    def flush(self) -> str:
        """The held-back text at the end of generation (no stop string came)."""
        out, self.buffer = self.buffer, ""
        return out

    @property
    def held(self) -> int:
        """Characters currently held back."""
        return len(self.buffer)

    def _partial_tail(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(stop[:n]):
                    best = n
                    break
        return best

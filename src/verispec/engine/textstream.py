"""One request's output text: tokens in, exact text out.

Chains the streaming detokenizer (holds back incomplete UTF-8) and the stop matcher
(holds back partial stop strings, cuts exactly), and says which tokens the released text
accounts for, so per-token data (logprobs) leaves together with its text and tokens that
fall wholly inside a stop string never leave at all.

A token counts as released once the released text reaches the end of its own text; when a
stop string cuts the output, every token whose text starts before the cut is released
(it contributed at least one character), the rest are dropped.

Checked by tests/test_textstream.py (real tokenizers: concatenated text equals the full
decode cut at the first stop string; released tokens are exactly those before the cut).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verispec.engine.detokenize import REPLACEMENT, StreamDetokenizer
from verispec.engine.stop import StopMatcher


@dataclass
class Released:
    text: str
    tokens: int  # how many more tokens this text accounts for
    stopped: bool = False  # a stop string ended the output


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.detok = StreamDetokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.decoded = 0  # characters the detokenizer has produced
        self.released = 0  # characters released to the client
        self.token_ends: list[int] = []  # per token: `decoded` right after it
        self.tokens_released = 0

    def push(self, token: int) -> Released:
        held_from = self.detok.read
        piece = self.detok.push(token)
        self.decoded += len(piece)
        self.token_ends.append(self.decoded)
        # tokens the detokenizer held (their bytes only complete now) end with this piece
        for i in range(held_from, self.detok.read):
            self.token_ends[i] = self.decoded
        text, stopped = self.matcher.feed(piece)
        self.released += len(text)
        if stopped:
            return Released(text, self._release_started_before(self.released), stopped=True)
        return Released(text, self._release_ended_by(self.released))

    def finish(self) -> Released:
        """End of generation without a stop string: everything held back leaves."""
        tail, stopped = self.matcher.feed(self.detok.flush())
        if stopped:  # the dangling bytes completed a stop string
            self.released += len(tail)
            return Released(tail, self._release_started_before(self.released), stopped=True)
        tail += self.matcher.flush()
        self.released += len(tail)
        return Released(tail, self._release_all())

    def _release_ended_by(self, offset: int) -> int:
        # only tokens the detokenizer has let go of: one whose bytes it still holds (an
        # incomplete character) may yet turn out to lie inside a stop string
        n = self.tokens_released
        while n < self.detok.read and self.token_ends[n] <= offset:
            n += 1
        return self._advance_to(n)

    def _release_started_before(self, cut: int) -> int:
        """At a stop: release the tokens whose text starts before `cut`. A token's start is
        what the tokens before it decode to, less a trailing incomplete character (a token
        that carries the last bytes of a character split across tokens starts inside it).
        Runs once per request, over the few tokens still held back."""
        detok = self.detok
        n = self.tokens_released
        while n < len(self.token_ends):
            start = len(detok._decode(detok.tokens[:n]).rstrip(REPLACEMENT))
            if start >= cut:
                break
            n += 1
        return self._advance_to(n)

    def _release_all(self) -> int:
        return self._advance_to(len(self.token_ends))

    def _advance_to(self, n: int) -> int:
        count, self.tokens_released = n - self.tokens_released, n
        return count

"""Grammars over token ids for the tiny random models (which have no real tokenizer):
small automata implementing grammar/backend.py's Matcher protocol, so the engine's
grammar path (masks at every verify position, rollback, completion inside a burst) is
tested with an oracle that is a few lines of Python: `accepts(tokens)` and
`allowed(prefix)`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class TokenGrammar:
    """Subclasses define `allowed(prefix) -> set of next tokens` and `complete(prefix)`
    (the output may end here). A prefix with nothing allowed and complete is stopped."""

    eos: frozenset = frozenset()

    def allowed(self, prefix: tuple[int, ...]) -> set[int]:
        raise NotImplementedError

    def complete(self, prefix: tuple[int, ...]) -> bool:
        raise NotImplementedError

    def accepts(self, tokens) -> bool:
        tokens = tuple(tokens)
        return all(t in self.allowed(tokens[:i]) for i, t in enumerate(tokens)) and self.complete(tokens)


class NoMultiplesOf(TokenGrammar):
    """Any token not divisible by `k`, exactly `length` of them (loose: most drafts fit)."""

    def __init__(self, k: int, length: int, vocab: int):
        self.k, self.length, self.vocab = k, length, vocab

    def allowed(self, prefix):
        return set() if len(prefix) >= self.length else {t for t in range(self.vocab) if t % self.k}

    def complete(self, prefix):
        return len(prefix) == self.length


class Phrase(TokenGrammar):
    """3 to 6 even tokens below 40, then 50, then one of 60..69 (tight, with a choice of
    length: complete after the last token only)."""

    def allowed(self, prefix):
        if 50 in prefix:
            return set() if len(prefix) > prefix.index(50) + 1 else set(range(60, 70))
        evens = set(range(0, 40, 2))
        n = len(prefix)
        return evens if n < 3 else (evens | {50}) if n < 6 else {50}

    def complete(self, prefix):
        return 50 in prefix and len(prefix) == prefix.index(50) + 2


class Template(TokenGrammar):
    """Fixed runs with free slots between them, like a JSON schema's punctuation and
    property names around its values: 10 11 12, one of 20..29, 30 31 32 33, one of 40..44,
    44 (runs of forced tokens for forced-token drafting)."""

    PARTS = ([10, 11, 12], set(range(20, 30)), [30, 31, 32, 33], set(range(40, 45)), [44])

    def _expected(self):
        for part in self.PARTS:
            if isinstance(part, list):
                yield from ({t} for t in part)
            else:
                yield part

    def allowed(self, prefix):
        expected = list(self._expected())
        return expected[len(prefix)] if len(prefix) < len(expected) else set()

    def complete(self, prefix):
        return len(prefix) == len(list(self._expected()))


class DeadEnd(TokenGrammar):
    """Two tokens, then nothing allowed and not complete: the engine must fail the row
    instead of sampling from an all-masked distribution."""

    def allowed(self, prefix):
        return {1, 2, 3} if len(prefix) < 2 else set()

    def complete(self, prefix):
        return False


class EndsWithEos(TokenGrammar):
    """At least 2 tokens from {4, 5, 6}; then EOS (the engine's stop id) may end it."""

    def __init__(self, eos: int):
        self.eos = frozenset({eos})

    def allowed(self, prefix):
        return {4, 5, 6}

    def complete(self, prefix):
        return len(prefix) >= 2


@dataclass
class TokenGrammarMatcher:
    grammar: TokenGrammar
    prefix: list[int] = field(default_factory=list)

    def _allowed(self) -> set[int]:
        allowed = self.grammar.allowed(tuple(self.prefix))
        return allowed | set(self.grammar.eos) if self.grammar.complete(tuple(self.prefix)) else allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = np.zeros(bitmask.shape[1] * 32, dtype=np.uint8)
        bits[sorted(self._allowed())] = 1
        # bit i of word w is token 32 w + i: little-endian bits, little-endian words
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())

    def validate(self, tokens: list[int]) -> int:
        saved = list(self.prefix)
        n = 0
        for t in tokens:
            if t not in self.grammar.allowed(tuple(self.prefix)):
                break
            self.prefix.append(t)
            n += 1
        self.prefix = saved
        return n

    def consume(self, token: int) -> bool:
        if token not in self._allowed():
            return False
        self.prefix.append(token)
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.prefix[-n:]

    def forced(self, max_n: int) -> list[int]:
        """Tokens that are the only choice, one after another (EOS choices end the run)."""
        saved, out = list(self.prefix), []
        while len(out) < max_n:
            allowed = self._allowed()
            if len(allowed) != 1 or allowed & set(self.grammar.eos):
                break
            token = next(iter(allowed))
            self.prefix.append(token)
            out.append(token)
        self.prefix = saved
        return out

    @property
    def accepting(self) -> bool:
        return self.grammar.complete(tuple(self.prefix))

    @property
    def stopped(self) -> bool:
        return self.accepting and not self.grammar.allowed(tuple(self.prefix))

    @property
    def error(self) -> str | None:
        return None


@dataclass
class CompiledTokenGrammar:
    grammar: TokenGrammar
    spec: object = None
    nbytes: int = 1
    matchers: list = field(default_factory=list)

    def new_matcher(self) -> TokenGrammarMatcher:
        m = TokenGrammarMatcher(self.grammar)
        self.matchers.append(m)
        return m

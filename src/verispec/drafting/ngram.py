"""N-gram / prompt-lookup drafting: no weights, proposals copied from earlier text.

The longest suffix of the row's tokens (prompt + output, `max_ngram` down to `min_ngram`
tokens) that occurred before is looked up; the tokens that followed its most recent
earlier occurrence are the proposal. Editing, summarizing, quoting and code continuation
repeat long spans of the prompt, and there this drafts many tokens per step for free.

The index maps every n-gram to the end of its latest occurrence and is extended as tokens
arrive (O(max_ngram) per token); the suffix itself is indexed only after it has been
looked up, so a lookup never finds itself.
"""

from __future__ import annotations

from verispec.engine.draft import Draft, DraftProvider, DraftSource, SourceContext

DEFAULT_MIN_NGRAM = 2
DEFAULT_MAX_NGRAM = 4


class NgramSource(DraftSource):
    def __init__(self, context: SourceContext, min_ngram: int, max_ngram: int):
        self.context = context
        self.min_n, self.max_n = min_ngram, max_ngram
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest indexed occurrence
        self.indexed = 0  # n-grams ending before this position are in the index

    def _tokens(self) -> list[int]:
        return self.context.prompt + self.context.output

    def draft(self, pending: int, max_n: int) -> Draft:
        tokens = self._tokens()  # ends with `pending`
        end = len(tokens)
        self._index_until(tokens, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            hit = self.index.get(tuple(tokens[end - n :]))
            if hit is not None:
                proposal = tokens[hit : hit + max_n]
                return Draft(proposal, feature=[n] * len(proposal))  # longer matches are surer
        return Draft()

    def _index_until(self, tokens: list[int], stop: int) -> None:
        """Index the n-grams ending at positions [indexed, stop)."""
        for end in range(self.indexed + 1, stop + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, stop)


class NgramProvider(DraftProvider):
    name = "ngram"
    free = True

    def __init__(self, min_ngram: int = DEFAULT_MIN_NGRAM, max_ngram: int = DEFAULT_MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def new_source(self, context: SourceContext) -> NgramSource:
        return NgramSource(context, self.min_ngram, self.max_ngram)

    def describe(self) -> str:
        return f"ngram (prompt lookup, {self.min_ngram}..{self.max_ngram}-grams)"

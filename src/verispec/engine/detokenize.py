"""Incremental detokenization: text out as tokens come in, never a broken character.

Decoding tokens one at a time is wrong for byte-level BPE (a multi-byte UTF-8 character
spans tokens) and for SentencePiece (leading spaces depend on the neighbour). So we
decode a short window — from a `prefix` offset a few tokens back to the end — and emit
only the text beyond what the same window decoded without the newest tokens. Text that
ends in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token
completes it.

Checked by tests/test_detokenize.py: for real tokenizers and multilingual/emoji text,
the concatenated stream equals tokenizer.decode(all tokens), and no chunk ever
contains a replacement character that the full decode does not.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text has been emitted

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special)

    def push(self, token: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""  # incomplete character (or nothing visible yet): hold back
        new_text = after[len(before) :]
        self.prefix = self.read
        self.read = len(self.tokens)
        return new_text

    def flush(self) -> str:
        """Text still held back at the end of generation (a dangling partial char)."""
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        self.read = len(self.tokens)
        return after[len(before) :] if len(after) > len(before) else ""

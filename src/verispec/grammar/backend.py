"""The seam between the engine and a grammar library.

A `GrammarBackend` compiles a `Constraint` for one tokenizer into a `CompiledGrammar`;
each request row gets its own `Matcher` from it. The engine needs only these operations:

* `fill_bitmask(bitmask, row)`: the tokens allowed next, one bit per token id (int32
  words, bit i of word w is token 32 w + i, the layout both llguidance and xgrammar use);
* `validate(tokens)`: how many of these tokens, in order, the grammar accepts from here
  (the verify walk uses it on a row's drafts);
* `consume(token)` / `rollback(n)`: advance on an emitted token / undo the last n;
* `forced(max_n)`: tokens the grammar forces from here (JSON punctuation and property
  names of a fixed schema): the engine verifies them as drafts, so they cost one forward
  position each instead of one step each (engine.py, "forced-token drafts");
* `accepting` (the output so far is complete: EOS is allowed), `stopped` (nothing but EOS
  can follow: the row is done), `error`.

llguidance implements it (grammar/llguidance_backend.py). bench/grammar_backends.py
measured it against xgrammar on this machine; docs/structured-output.md has the numbers
and the reasons for the choice. Another backend is one more class with these methods.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from verispec.grammar.constraint import Constraint


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def validate(self, tokens: list[int]) -> int: ...
    def consume(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def forced(self, max_n: int) -> list[int]: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


class CompiledGrammar(Protocol):
    constraint: Constraint
    nbytes: int  # what it costs to keep in the compile cache (an estimate: see the backend)

    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str
    fingerprint: str  # identifies the tokenizer: part of the compile-cache key
    vocab_size: int  # width of the masks (the model's logits)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile or raise GrammarError naming the problem."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 bitmask -> [N, vocab_size] bool, True = allowed."""
    return _unpack(bitmask, vocab_size)


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 bitmask -> [N, vocab_size] bool, True = not allowed: what a mask
    fills with -inf, without a separate inversion pass over the vocabulary."""
    return _unpack(~bitmask, vocab_size)


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # numpy's unpackbits over the little-endian bytes: ~3x faster than shifting in torch
    bits = np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab_size]

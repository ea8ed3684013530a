"""The llguidance grammar backend (https://github.com/guidance-ai/llguidance).

llguidance is an Earley parser over a lazily built lexer: compiling a grammar is cheap
(well under a millisecond for our schemas) and each mask is computed on demand (about
10 us median here, a few hundred us the first time a lexer state is met). It is a 8 MB
wheel with no dependencies. bench/grammar_backends.py has the comparison with xgrammar.

JSON is compiled compact (", " and ": " separators, no other whitespace): flexible
whitespace lets a small model emit newlines inside an object until max_tokens cuts it.
Grammars are Lark (llguidance's dialect); a grammar without a `start:` rule is read as
GBNF (llama.cpp's `root ::= ...`) and converted by llguidance's own converter.

A `strict` schema with a keyword llguidance cannot enforce (say uniqueItems) is refused
by name; a non-strict one ignores such keywords ("lenient"), as OpenAI's non-strict
mode is best effort.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import torch

from verispec.grammar.backend import bitmask_words
from verispec.grammar.guard import clean_message
from verispec.grammar.limits import PARSER_ROW_ITEMS
from verispec.grammar.constraint import GrammarError, Constraint

# Cost of one compiled grammar in the cache, measured with psutil on SmolLM2's tokenizer
# over tests/structured_cases.py: ~12 KiB per matcher, ~62 KiB more once its lexer states
# are built by the first masks; plus the grammar text itself.
ENTRY_BASE_BYTES = 80 * 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, matcher):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def validate(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens) if tokens else 0

    def consume(self, token: int) -> bool:
        return self._m.consume_token(token)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self._m.get_error()}")

    def forced(self, max_n: int) -> list[int]:
        return self._m.compute_ff_tokens()[:max_n] if max_n > 0 else []

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


@dataclass
class LLGuidanceGrammar:
    constraint: Constraint
    template: object  # an LLMatcher in its start state; rows get deep copies (cheap: shared lexer)
    nbytes: int
    warnings: tuple[str, ...] = ()

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int]):
        """GrammarError when this tokenizer cannot drive llguidance."""
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        size = max(vocab_size, len(hf_tokenizer))
        try:
            # every engine stop id counts as EOS: allowed exactly when the grammar is complete
            self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=sorted(stop_ids))
            serialized = hf_tokenizer.backend_tokenizer.to_str()
        except Exception as e:  # noqa: BLE001 - e.g. a slow (non-Rust) tokenizer: llguidance cannot index it
            raise GrammarError(f"structured output is unavailable for this model's tokenizer: {e}") from None
        self.vocab_size = vocab_size
        digest = hashlib.sha256(serialized.encode())
        digest.update(json.dumps([size, sorted(stop_ids)]).encode())
        self.fingerprint = digest.hexdigest()[:16]

    def grammar_text(self, constraint: Constraint) -> str:
        M = self._llg.LLMatcher
        try:
            if constraint.kind in ("json_schema", "json_object"):
                options = JSON_OPTIONS if constraint.strict else {**JSON_OPTIONS, "lenient": True}
                return M.grammar_from_json_schema(constraint.schema, defaults=options)
            if constraint.kind == "regex":
                return M.grammar_from_regex(constraint.text)
            if constraint.kind == "choice":
                return M.grammar_from_regex(constraint.choice_regex())
            return M.grammar_from_lark(self._lark(constraint.text))
        except ValueError as e:
            raise GrammarError(f"invalid {constraint.kind.replace('_', ' ').replace('json', 'JSON')}: {clean_message(str(e))}") from None

    @staticmethod
    def _lark(text: str) -> str:
        """Lark as it is; anything else is read as GBNF (llama.cpp's `root ::= ...`, which
        vLLM users send as guided_grammar) and converted."""
        from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

        if is_lark_syntax(text):
            return text
        try:
            return any_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions for user errors
            raise GrammarError(f"invalid grammar (no `start:` rule, so read as GBNF): {e}") from None

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        """Compile and compute the start state's mask once: llguidance builds its lexer
        lazily, and the first mask is where a pathological regex spends its time, so it
        is spent here (grammar/guard.py runs this off the engine's step, within a time
        budget) and not in the first row's step. Rows' matchers are copies of this one
        and share what it built."""
        text = self.grammar_text(constraint)
        matcher = self._llg.LLMatcher(self._tokenizer, text, log_level=0, limits=self._limits())
        if not matcher.is_error():
            scratch = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * scratch.element_size())
        if matcher.is_error():
            message = matcher.get_error()
            if constraint.kind in ("regex", "choice"):  # drop the echo of the one-rule grammar it was wrapped in
                message = re.split(r"\n\s*1 \| start:", message)[0]
            raise GrammarError(f"invalid {constraint.kind.replace('_', ' ')}: {clean_message(message)}")
        return LLGuidanceGrammar(constraint, matcher, ENTRY_BASE_BYTES + len(text.encode()),
                                 tuple(matcher.get_grammar_warnings()))

    def _limits(self):
        # verbose_errors off: llguidance's verbose errors dump parser state and grammar
        # text into the message, which a client then receives; the row limit is raised
        # to what grammar/limits.py bounds inputs by (its default of 2,000 Earley items
        # failed a 500-optional-key object mid-answer)
        return self._llg.LLParserLimits(verbose_errors=False, max_items_in_row=PARSER_ROW_ITEMS)

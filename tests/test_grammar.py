"""The grammar layer: the compile cache, the bitmask layout, and the llguidance backend
on the default model's real tokenizer.

Oracles: a counting backend (compile-once under concurrency, LRU by bytes); numpy's
packbits for the bit layout; and, for llguidance, jsonschema / re.fullmatch on texts
produced by random walks that only ever take tokens the masks allow (a backend or mask
conversion that let one wrong token through would produce a text that fails them).
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.structured_cases import ARITHMETIC_GRAMMAR, CHOICES, REGEXES, SCHEMAS, arithmetic_ok, validate_json
from verispec.grammar.backend import bitmask_to_bool, bitmask_words
from verispec.grammar.cache import GrammarCache
from verispec.grammar.constraint import GrammarError, Constraint


@dataclass
class FakeCompiled:
    spec: Constraint
    nbytes: int

    def new_matcher(self):
        raise NotImplementedError


class CountingBackend:
    name, fingerprint, vocab_size = "counting", "tok-a", 10

    def __init__(self, delay=0.0, nbytes=100):
        self.delay, self.nbytes, self.calls = delay, nbytes, []
        self.lock = threading.Lock()

    def compile(self, spec):
        with self.lock:
            self.calls.append(spec)
        time.sleep(self.delay)
        if spec.kind == "regex" and spec.text == "(":
            raise GrammarError("invalid regex: unclosed group")
        return FakeCompiled(spec, self.nbytes)


def test_concurrent_requests_with_the_same_schema_compile_once():
    backend = CountingBackend(delay=0.2)
    cache = GrammarCache(backend)
    spec = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    results = [None] * 8

    def worker(i):
        # each request builds its own spec object from the same schema: equal, not identical
        results[i] = cache.get(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(backend.calls) == 1
    assert all(r is results[0] for r in results)
    assert cache.get(spec) is results[0]
    assert cache.stats()["compiles"] == 1 and cache.stats()["hits"] == 8


def test_the_cache_is_capped_in_bytes_least_recently_used_first():
    backend = CountingBackend(nbytes=100)
    cache = GrammarCache(backend, max_bytes=250)
    a, b, c = (Constraint.regex(p) for p in ("a+", "b+", "c+"))
    cache.get(a), cache.get(b)
    cache.get(a)  # a is now more recent than b
    cache.get(c)  # over the cap: b goes
    assert len(cache) == 2 and cache.bytes == 200
    cache.get(a)
    cache.get(b)
    assert [s.text for s in backend.calls] == ["a+", "b+", "c+", "b+"]


def test_an_entry_larger_than_the_cap_is_used_but_not_kept():
    backend = CountingBackend(nbytes=1000)
    cache = GrammarCache(backend, max_bytes=500)
    first = cache.get(Constraint.regex("x"))
    assert first.nbytes == 1000 and len(cache) == 0 and cache.bytes == 0


def test_compile_errors_are_not_cached():
    backend = CountingBackend()
    cache = GrammarCache(backend)
    for _ in range(2):
        with pytest.raises(GrammarError, match="unclosed"):
            cache.get(Constraint.regex("("))
    assert len(backend.calls) == 2 and len(cache) == 0


def test_schema_property_order_is_kept_in_the_spec():
    spec = Constraint.json_schema({"properties": {"name": {}, "age": {}}})
    assert spec.text.index("name") < spec.text.index("age")


def test_bitmask_layout_matches_packbits():
    rng = np.random.default_rng(0)
    for vocab in (31, 32, 33, 97, 49152):
        allowed = rng.random(vocab) < 0.3
        padded = np.zeros(bitmask_words(vocab) * 32, dtype=np.uint8)
        padded[:vocab] = allowed
        words = torch.from_numpy(np.packbits(padded, bitorder="little").view("<i4").copy())[None]
        assert torch.equal(bitmask_to_bool(words, vocab)[0], torch.from_numpy(allowed))


# -- llguidance on the real tokenizer ---------------------------------------------------------


@dataclass
class RealTokenizer:
    backend: object
    tokenizer: object
    stop_ids: list[int]
    short: set[int]  # ids whose text is at most 2 characters: walks that prefer them end sooner


def real_tokenizer(folder) -> RealTokenizer:
    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.models.loader import read_config
    from verispec.models.tokenizer import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(folder)
    stops = stop_token_ids(folder, tokenizer)
    vocab = read_config(folder)["vocab_size"]
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    short = {i for i, p in enumerate(pieces) if p is not None and len(p) <= 2}
    return RealTokenizer(LLGuidanceBackend(tokenizer, vocab, stops), tokenizer, stops, short)


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def backend(request):
    """SmolLM2's byte-level BPE (49k) and Gemma 3's SentencePiece-style vocabulary (262k)."""
    return real_tokenizer(request.getfixturevalue(f"{request.param}_folder"))


def walk(backend: RealTokenizer, spec: Constraint, seed: int, limit: int = 400) -> tuple[str, bool]:
    """Random allowed tokens until the grammar stops (or EOS is taken once allowed)."""
    be, tokenizer, stops = backend.backend, backend.tokenizer, set(backend.stop_ids)
    matcher = be.compile(spec).new_matcher()
    rng = random.Random(seed)
    mask = torch.empty(1, bitmask_words(be.vocab_size), dtype=torch.int32)
    tokens = []
    while len(tokens) < limit and not matcher.stopped:
        matcher.fill_bitmask(mask, 0)
        allowed = bitmask_to_bool(mask, be.vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, "a live grammar always allows something"
        if matcher.accepting:
            assert stops <= set(allowed), "every stop id is allowed once the output is complete"
            if rng.random() < 0.5:
                return tokenizer.decode(tokens), True
        else:
            assert not stops & set(allowed), "EOS is masked until the output is complete"
        allowed = [t for t in allowed if t not in stops]
        short = [t for t in allowed if t in backend.short]
        # short tokens (closing brackets, digits) half the time, so walks end
        token = rng.choice(short if short and rng.random() < 0.5 else allowed)
        assert matcher.consume(token)
        tokens.append(token)
    return tokenizer.decode(tokens), matcher.stopped


@pytest.mark.real_model
@pytest.mark.parametrize("case", SCHEMAS, ids=[c.name for c in SCHEMAS])
def test_every_text_the_masks_allow_validates_against_the_schema(backend, case):
    completed = 0
    for seed in range(4):
        text, complete = walk(backend, Constraint.json_schema(case.schema), seed)
        if complete:
            validate_json(text, case.schema)
            completed += 1
    assert completed, "at least one walk reached a complete document"


@pytest.mark.real_model
def test_regex_choice_and_grammar_masks_allow_only_matches(backend):
    for case in REGEXES:
        for seed in range(3):
            text, complete = walk(backend, Constraint.regex(case.pattern), seed)
            assert complete and re.fullmatch(case.pattern, text), (case.name, text)
    for case in CHOICES:
        text, complete = walk(backend, Constraint.choice(case.choices), 0)
        assert complete and text in case.choices
    for seed in range(3):
        text, complete = walk(backend, Constraint.grammar(ARITHMETIC_GRAMMAR), seed, limit=30)
        assert complete and arithmetic_ok(text), text
    gbnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30} "."\n'
    for seed in range(3):
        text, complete = walk(backend, Constraint.grammar(gbnf), seed, limit=60)
        assert complete and re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", text), text


@pytest.mark.real_model
def test_validate_and_rollback_walk_drafts_without_moving_the_matcher(backend):
    be, tokenizer = backend.backend, backend.tokenizer
    spec = Constraint.json_schema(SCHEMAS[0].schema)
    matcher = be.compile(spec).new_matcher()
    good = tokenizer.encode('{"name": "Ann", "age": 3', add_special_tokens=False)
    bad = good + tokenizer.encode("x", add_special_tokens=False)  # a letter cannot follow the number
    assert matcher.validate(good) == len(good)
    assert matcher.validate(bad) == len(good)
    for t in good[:4]:
        assert matcher.consume(t)
    matcher.rollback(4)
    assert matcher.validate(good) == len(good), "rolled back to the start"


@pytest.mark.real_model
@pytest.mark.parametrize("spec, message", [
    (Constraint.regex("a(b"), "unclosed group"),
    (Constraint.grammar("start: foo"), "unknown name"),
    (Constraint.grammar("root ::= ("), "read as GBNF"),
    (Constraint.json_schema({"type": "wat"}), "wat"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_invalid_constraints_raise_a_message_naming_the_problem(backend, spec, message):
    with pytest.raises(GrammarError, match=message):
        backend.backend.compile(spec)


@pytest.mark.real_model
def test_a_non_strict_schema_ignores_keywords_it_cannot_enforce(backend):
    compiled = backend.backend.compile(Constraint.json_schema({"type": "array", "uniqueItems": True,
                                                           "items": {"type": "integer"}}, strict=False))
    assert any("uniqueItems" in w for w in compiled.warnings)


def test_a_tokenizer_the_backend_cannot_use_is_a_400_not_a_crash():
    from verispec.engine.request import RequestRejected
    from verispec.server.structured import AskedConstraint, StructuredOutput

    class SlowTokenizer:  # no Rust backend_tokenizer: llguidance cannot index it
        def __len__(self):
            return 10

    structured = StructuredOutput(SlowTokenizer(), 10, [0])
    with pytest.raises(RequestRejected, match="unavailable for this model's tokenizer") as e:
        structured.compile(AskedConstraint(Constraint.regex("a+"), "guided_regex"))
    assert e.value.param == "guided_regex" and e.value.status == 400

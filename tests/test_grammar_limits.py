"""Grammar input limits and the guarded compile (grammar/limits.py, grammar/guard.py).

Oracles: the crash reproducers of the fresh-machine issue (a 3,000-`$ref` chain, a
5,000-rule Lark chain, `(a{1000}){1000}`, 100k alternatives) are refused by name before
the backend is called (a recording backend proves it never saw them); inputs just inside
each limit compile on the real tokenizer; a compile over its time budget and a native
panic both come back as GrammarError with a short message; and a chain that overflows
llguidance's default 8 MiB stack compiles under the guard's 64 MiB stack (in a child
process, so a regression is a failed test and not a dead test run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from verispec.grammar import limits
from verispec.grammar.guard import clean_message, compile_guarded
from verispec.grammar.constraint import GrammarError, Constraint


def ref_chain(n: int) -> dict:
    """The reproducer: $defs d0..dn, each an object whose x is the next, the last an integer."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_objects(n: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"\n'


def lark_alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


class RecordingBackend:
    name, fingerprint, vocab_size = "recording", "t", 8

    def __init__(self, compile_fn=None):
        self.seen = []
        self.compile_fn = compile_fn

    def compile(self, spec):
        self.seen.append(spec)
        return self.compile_fn(spec) if self.compile_fn else spec


HOSTILE = [
    (Constraint.json_schema(ref_chain(3000)), "nests more than 64 levels"),
    (Constraint.json_schema(ref_chain(1000)), "nests more than 64 levels"),
    (Constraint.json_schema(nested_objects(200)), "nests more than 64 levels"),
    (Constraint.grammar(lark_chain(5000)), "rules; the limit is 1000"),
    (Constraint.grammar(lark_alternatives(100_000)), "bytes; the limit is"),
    (Constraint.grammar("start: " + " | ".join(['"a"'] * 8_002)), "alternatives"),
    (Constraint.regex("(a{1000}){1000}"), "repeats 1000000 times"),
    (Constraint.regex("((a{100}){100}){100}"), "repeats 1000000 times"),
    (Constraint.regex("a{20000}"), "repeats 20000 times"),
    (Constraint.regex("(" * 40 + "a" + ")" * 40), "nests groups more than 32"),
    (Constraint.json_schema({"type": "string", "pattern": "(x{500}){500}"}), "a `pattern` in the JSON schema"),
    (Constraint.json_schema({"type": "array", "prefixItems": [{} for _ in range(20_001)]}),
     "more than 20000 subschemas"),
    (Constraint.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2001)}}),
     "more than 2000 optional properties"),
    (Constraint.json_schema({"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
                                        for _ in range(41)]}), "more than 2000 optional properties"),
    (Constraint.json_schema({"anyOf": [{"const": i} for i in range(8001)]}), "more than 8000 anyOf/oneOf branches"),
]


@pytest.mark.parametrize("spec,message", HOSTILE, ids=[m.split(";")[0][:30] + f"-{i}" for i, (_, m) in enumerate(HOSTILE)])
def test_hostile_constraints_are_refused_before_the_backend_sees_them(spec, message):
    backend = RecordingBackend()
    with pytest.raises(GrammarError, match=message.replace("(", r"\(").replace("$", r"\$")):
        compile_guarded(backend, spec)
    assert backend.seen == []


def test_recursion_through_ref_is_not_nesting():
    """A tree schema refers to itself: that is recursion (expanded lazily), not depth."""
    tree = {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                "children": {"type": "array", "maxItems": 2,
                                                                             "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    limits.check(Constraint.json_schema(tree))
    limits.check(Constraint.json_schema(ref_chain(20)))
    limits.check(Constraint.json_schema(nested_objects(30)))


def test_regex_counts_read_off_the_text():
    for ok in [r"\d{3}-\d{4}", r"[a-z]{1,5000}x", r"(ab){100}(cd){100}", r"\{(\d{2}){50}\}", "[{]{1000}", r"(a{100}){100}"]:
        limits.check_regex(ok)
    with pytest.raises(GrammarError):
        limits.check_regex(r"(ab{10}c){2000}")


@pytest.fixture(scope="module")
def backend(smollm2_folder):
    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_folder)
    return LLGuidanceBackend(tokenizer, 49152, [2])


JUST_INSIDE = [
    Constraint.json_schema(ref_chain(20)),
    Constraint.json_schema(nested_objects(30)),
    Constraint.grammar(lark_chain(900)),
    Constraint.grammar(lark_alternatives(7_900)),
    Constraint.regex("(a{100}){100}"),
    Constraint.choice([f"option {i}" for i in range(1024)]),
    Constraint.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}),
]


@pytest.mark.real_model
@pytest.mark.parametrize("spec", JUST_INSIDE, ids=["refs20", "nest30", "lark900", "alts7900", "regex100x100", "choice1024",
                                                "optional2000"])
def test_constraints_just_inside_the_limits_compile_and_walk(backend, spec):
    """Compiles, and a walk of 40 allowed tokens (the first allowed token, each step)
    never trips the parser's runtime limits (a 500-optional-key object did)."""
    import torch

    from verispec.grammar.backend import bitmask_words

    matcher = compile_guarded(backend, spec).new_matcher()
    mask = torch.zeros(1, bitmask_words(backend.vocab_size), dtype=torch.int32)
    for _ in range(40):
        if matcher.stopped:
            break
        matcher.fill_bitmask(mask, 0)
        words = mask[0].tolist()
        token = next(32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1)
        assert matcher.consume(token), matcher.error
    assert matcher.error is None


def test_a_compile_over_its_budget_is_a_grammar_error_for_that_request_only():
    backend = RecordingBackend(lambda spec: time.sleep(1.5) or spec)
    start = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
        compile_guarded(backend, Constraint.regex("a+"), budget_s=0.3)
    assert time.monotonic() - start < 1.2  # the request stopped waiting; the thread finishes on its own
    assert compile_guarded(RecordingBackend(), Constraint.regex("b+"), budget_s=0.3).text == "b+"


class FakePanic(BaseException):  # what pyo3 raises for a Rust panic
    pass


def test_a_native_panic_is_a_short_message_without_a_backtrace():
    def panic(spec):
        raise FakePanic("called `Option::unwrap()` on a `None` value\nstack backtrace:\n   0: rust_begin_unwind\n"
                        "             at /rustc/abc/library/std/src/panicking.rs:665:5\n   1: core::panicking::panic_fmt")

    with pytest.raises(GrammarError) as info:
        compile_guarded(RecordingBackend(panic), Constraint.regex("a"))
    message = str(info.value)
    assert message.startswith("the grammar compiler failed on this input: called `Option::unwrap()`")
    assert "backtrace" not in message and "panicking.rs" not in message and "rust_begin_unwind" not in message


def test_clean_message_keeps_a_few_lines():
    text = "\n".join(f"line {i}" for i in range(50))
    assert clean_message(text).splitlines() == [f"line {i}" for i in range(6)]
    assert len(clean_message("x" * 5000)) <= 800


CHILD = """
import json, sys
from verispec.grammar import guard, limits
from verispec.grammar.llguidance_backend import LLGuidanceBackend
from verispec.grammar.constraint import Constraint
from verispec.models.tokenizer import load_tokenizer
limits.MAX_SCHEMA_DEPTH = 10**6  # let the reproducer through the limits: only the stack stands
n = int(sys.argv[2])
defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
defs[f"d{n}"] = {"type": "integer"}
backend = LLGuidanceBackend(load_tokenizer(sys.argv[1]), 49152, [2])
compiled = guard.compile_guarded(backend, Constraint.json_schema({"$ref": "#/$defs/d0", "$defs": defs}), budget_s=60)
print("compiled", compiled.new_matcher().error)
"""


@pytest.mark.real_model
def test_the_guard_thread_stack_holds_what_the_default_stack_does_not(smollm2_folder):
    """1,000 chained $refs overflowed the 8 MiB default stack (exit 139); the guard's
    thread compiles them (the limits refuse them anyway: this is the second line)."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_folder), "1000"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1500:]}"
    assert "compiled None" in done.stdout

"""Bounds on what a request may ask the grammar compiler to build, checked in Python
before any native code sees it.

llguidance is native code that recurses: a JSON schema whose `$defs` form a chain of
1,000 `$ref`s, or a Lark grammar of 5,000 rules each naming the next, overflowed the 8 MiB
thread stack and took the whole server down (exit 139). A regex like `(a{1000}){1000}`
compiled in 2 ms and then spent 2.1 s on its first mask; a Lark grammar of 100k
alternatives compiled for 21 s. So each kind of constraint is measured here first, and
one over a limit is a GrammarError naming the limit (a 400 naming the field):

| constraint | limits |
|---|---|
| JSON schema | JSON text <= 256 KiB; nesting <= 64 levels, counted through `$ref`s (a `$ref` back to an enclosing schema is recursion, which llguidance expands lazily, and is fine); <= 20,000 subschemas; <= 2,000 optional properties and <= 8,000 anyOf/oneOf branches in all; every `pattern` as a regex below |
| regex | <= 16 KiB; groups nested <= 32 deep; a bounded repetition `{n}` / `{n,m}` <= 10,000, and so is the product of the counts of nested repetitions |
| Lark / GBNF grammar | <= 128 KiB; <= 1,000 rules; <= 8,000 alternatives (`|`) |
| choice | <= 1,024 entries (protocol.py), <= 128 KiB in all |

What the numbers rest on (SmolLM2's tokenizer, this CPU, llguidance 1.9, default 8 MiB
stack): a 500-`$ref` chain compiles in 48 ms, 1,000 crash; a 2,000-rule Lark chain
compiles in 21 ms, 5,000 crash; 10,000 alternatives compile in 0.18 s, 20,000 in 0.47 s;
`(a{100}){100}` (product 10,000) gets its first mask in 8 ms. Compiling is not the only
cost: llguidance's parser refuses a position with more than its row limit of Earley
items *mid-answer* (an object of 500 optional keys compiled, then failed at its first
key with 2,007 items), so the row limit is raised to 10,000 and the inputs bounded below
it: with it, 8,000 alternatives take at most 3.1 ms a token, 2,000 optional keys 1.4 ms. The limits sit well inside
what compiles quickly, and grammar/guard.py compiles on a thread with a 64 MiB stack, so
even a bound-passing input has 8x the stack these crashed on.

Checked by tests/test_grammar_limits.py (each limit refuses just above and accepts just
below; the crash reproducers are refused without reaching llguidance) and
tests/test_structured_server.py's fuzz test (deep and wide schemas, grammars and
regexes over HTTP: a 4xx or a valid answer, and the server still serves a concurrent
stream).
"""

from __future__ import annotations

import json
import re

from verispec.grammar.constraint import GrammarError, Constraint

MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 20_000
# llguidance's parser keeps the Earley items of one position in a row, at most
# PARSER_ROW_ITEMS (we raise its default of 2,000; grammar/llguidance_backend.py): an
# optional object key costs ~4 items, a union branch or a grammar alternative ~1
PARSER_ROW_ITEMS = 10_000
MAX_OPTIONAL_PROPERTIES = 2_000  # in the whole schema
MAX_UNION_BRANCHES = 8_000  # anyOf / oneOf branches in the whole schema
MAX_REGEX_BYTES = 16 * 1024
MAX_REGEX_GROUP_DEPTH = 32
MAX_REGEX_REPEAT = 10_000
MAX_GRAMMAR_BYTES = 128 * 1024
MAX_GRAMMAR_RULES = 1_000
MAX_GRAMMAR_ALTERNATIVES = 8_000
MAX_CHOICE_BYTES = 128 * 1024


def check(constraint: Constraint) -> None:
    """GrammarError naming the limit when `constraint` is over one; else nothing."""
    if constraint.kind == "json_schema":
        check_schema(constraint.schema)
    elif constraint.kind == "regex":
        check_regex(constraint.text)
    elif constraint.kind == "grammar":
        check_grammar(constraint.text)
    elif constraint.kind == "choice":
        if len(constraint.text.encode()) > MAX_CHOICE_BYTES:
            raise GrammarError(f"the choices are {len(constraint.text.encode())} bytes in all; the limit is {MAX_CHOICE_BYTES}")


# -- JSON schema ----------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")


def _subschemas(node: dict) -> list:
    out = []
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(v for v in value.values() if isinstance(v, dict))
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            out.extend(v for v in value if isinstance(v, dict))
    for key in _SCHEMA_ONE:
        value = node.get(key)
        if isinstance(value, dict):
            out.append(value)
        elif isinstance(value, list):  # draft-4 tuple items
            out.extend(v for v in value if isinstance(v, dict))
    return out


def _resolve(root, ref: str):
    """A local JSON pointer (`#/$defs/x`), or None for anything else (llguidance itself
    refuses remote references with its own message)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def check_schema(schema) -> None:
    text = json.dumps(schema, separators=(",", ":"))
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the JSON schema is {len(text.encode())} bytes; the limit is {MAX_SCHEMA_BYTES}")
    if not isinstance(schema, dict):
        return
    # depth-first over subschemas and resolved $refs, iteratively (no Python recursion):
    # depth(node) = 1 + max over its children; a child already on the path is recursion (0)
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    nodes = optional = branches = 0
    stack: list[list] = [[schema, None, 0]]  # node, its children (once expanded), next child
    while stack:
        entry = stack[-1]
        node, children, at = entry
        key = id(node)
        if children is None:
            if key in depth:
                stack.pop()
                continue
            nodes += 1
            if nodes > MAX_SCHEMA_NODES:
                raise GrammarError(f"the JSON schema has more than {MAX_SCHEMA_NODES} subschemas")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex(pattern, "a `pattern` in the JSON schema")
            properties = node.get("properties")
            if isinstance(properties, dict):
                required = node.get("required") if isinstance(node.get("required"), list) else []
                optional += len(set(properties) - {r for r in required if isinstance(r, str)})
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise GrammarError(f"the JSON schema has more than {MAX_OPTIONAL_PROPERTIES} optional properties "
                                       "(required ones are not limited)")
            for union in ("anyOf", "oneOf"):
                if isinstance(node.get(union), list):
                    branches += len(node[union])
            if branches > MAX_UNION_BRANCHES:
                raise GrammarError(f"the JSON schema has more than {MAX_UNION_BRANCHES} anyOf/oneOf branches")
            children = _subschemas(node)
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = _resolve(schema, ref)
                if target is not None:
                    children.append(target)
            entry[1] = children
            on_path.add(key)
            if len(on_path) > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep "
                                   "(counting through $ref)")
            continue
        while at < len(children) and (id(children[at]) in depth or id(children[at]) in on_path):
            at += 1
        entry[2] = at
        if at < len(children):
            stack.append([children[at], None, 0])
            continue
        depth[key] = 1 + max((depth.get(id(c), 0) for c in children), default=0)
        if depth[key] > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep (counting through $ref)")
        on_path.discard(key)
        stack.pop()


# -- regex ----------------------------------------------------------------------------------

_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_regex(pattern: str, what: str = "the regex") -> None:
    """Group nesting and bounded repetition, read off the text: a count applies to the
    atom before it, and a group's count multiplies the counts inside it."""
    if len(pattern.encode()) > MAX_REGEX_BYTES:
        raise GrammarError(f"{what} is {len(pattern.encode())} bytes; the limit is {MAX_REGEX_BYTES}")
    # inner[d] = the largest repetition product inside the group open at depth d
    inner = [1]
    last_group = 1  # the product inside the group that just closed (a count after it multiplies it)
    after_group = False
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            after_group = False
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            in_class, after_group = True, False
            i += 1
            # a ']' right after '[' or '[^' is a literal
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            continue
        if c == "(":
            inner.append(1)
            if len(inner) - 1 > MAX_REGEX_GROUP_DEPTH:
                raise GrammarError(f"{what} nests groups more than {MAX_REGEX_GROUP_DEPTH} deep")
            after_group = False
        elif c == ")":
            if len(inner) > 1:
                last_group = inner.pop()
                inner[-1] = max(inner[-1], last_group)
            after_group = True
            i += 1
            continue
        elif c == "{":
            m = _COUNT.match(pattern, i)
            if m and (m.group(1) or m.group(2)):
                count = max(int(m.group(1) or 0), int(m.group(2) or 0))
                product = count * (last_group if after_group else 1)
                if count > MAX_REGEX_REPEAT or product > MAX_REGEX_REPEAT:
                    raise GrammarError(f"{what} repeats {product if product > count else count} times "
                                       f"(counts of nested repetitions multiply); the limit is {MAX_REGEX_REPEAT}")
                inner[-1] = max(inner[-1], product)
                i = m.end()
                after_group = False
                continue
        after_group = False
        i += 1


# -- Lark / GBNF ----------------------------------------------------------------------------

_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_.]*(?:\{[^}]*\})?\s*(?::|::=)", re.M)


def check_grammar(text: str) -> None:
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}")
    rules = len(_LARK_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarError(f"the grammar has {rules} rules; the limit is {MAX_GRAMMAR_RULES}")
    alternatives = _count_outside_strings(text, "|")
    if alternatives > MAX_GRAMMAR_ALTERNATIVES:
        raise GrammarError(f"the grammar has {alternatives} alternatives ('|'); the limit is {MAX_GRAMMAR_ALTERNATIVES}")
    for pattern in _lark_regexes(text):
        check_regex(pattern, "a regex in the grammar")


def _count_outside_strings(text: str, char: str) -> int:
    """Occurrences of `char` outside "..." strings and /.../ regexes (roughly: a bound, not a parser)."""
    count, quote, i = 0, None, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote or c == "\n":
                quote = None
        elif c in "\"'":
            quote = c
        elif c == char:
            count += 1
        i += 1
    return count


_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imsx]*")


def _lark_regexes(text: str) -> list[str]:
    return [m.group(1) for m in _LARK_REGEX.finditer(text)]

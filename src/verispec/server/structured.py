"""Structured output on the wire: which constraint a request asks for, compiled once.

Sources (at most one per request, else a 400 naming both):

* `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
* vLLM's extensions: `guided_json` (a schema, object or JSON text), `guided_regex`,
  `guided_choice` (a list of strings), `guided_grammar` (llguidance's Lark syntax:
  https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md; a grammar with no
  `start:` rule is read as GBNF, llama.cpp's `root ::= ...`);
* chat `tools` with `tool_choice` "auto" (or unset: text, or calls in the model's own
  `<tool_call>` syntax with each call's arguments constrained: server/tool_syntax.py),
  "required" (the output is a JSON array of one to
  MAX_PARALLEL_TOOL_CALLS `{"name", "arguments"}` calls, exactly one with
  `parallel_tool_calls: false`, each function's arguments validated by its parameters
  schema; the first exact repeat of a call ends the answer) or `{"type": "function", "function": {"name": ...}}` (the output is that
  function's arguments). "none" ignores the tools.

The fields themselves are parsed by server/protocol.py; this module gives them meaning.
The constraint becomes a grammar Constraint, compiled through the shared GrammarCache in a
worker thread (the event loop keeps serving); an invalid schema, regex or grammar is a
400 with the compiler's message before any engine work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from verispec.engine.request import RequestRejected
from verispec.grammar.cache import DEFAULT_CACHE_BYTES, GrammarCache
from verispec.grammar.constraint import GrammarError, Constraint
from verispec.server.protocol import FunctionDef, NamedToolChoice, Tool
from verispec.server.tool_syntax import ToolSyntax

log = logging.getLogger("verispec.server")

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_PARALLEL_TOOL_CALLS = 8  # calls in one "required" answer (parallel_tool_calls: false -> 1)
TOOL_CHOICE_FORMS = 'tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolMode:
    """How to turn a tool-constrained output into `tool_calls`.

    "required" outputs are a JSON array of calls. A small model, free to add calls,
    repeats the same call until max_tokens (one ran for 382 s until the 8k context was
    full), so the array is bounded (MAX_PARALLEL_TOOL_CALLS), and the server watches the
    calls as they complete: the first exact repeat of an earlier call ends the answer
    there (`repeats`), without it. A cut-short output (`max_tokens`) keeps its complete
    calls and drops the partial one: never half a call in `content`."""

    named: str | None  # the forced function's name; None: "required" (an array of calls) or "auto"
    syntax: ToolSyntax | None = None  # "auto": text or calls in the model's own syntax (tool_syntax.py)

    @property
    def auto(self) -> bool:
        return self.syntax is not None

    def content(self, text: str) -> str:
        """The part of an output that is text for the user (auto: before the call syntax)."""
        return self.syntax.split(text)[0] if self.syntax is not None else ""

    def complete_calls(self, text: str) -> tuple[list[tuple[str, str]], bool]:
        """(name, arguments JSON) of the calls complete in `text` so far, in order and
        without repeats, and whether one repeated an earlier call."""
        if self.named is not None:
            try:
                json.loads(text)
            except ValueError:
                return [], False
            return [(self.named, text)], False
        calls, seen = [], set()
        for item in self.syntax.split(text)[1] if self.syntax is not None else array_items(text):
            call = json.loads(item)
            key = json.dumps(call, sort_keys=True)
            if key in seen:
                return calls, True
            seen.add(key)
            arguments = call["arguments"] if "arguments" in call else call.get("parameters", {})
            calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls, False

    def repeats(self, text: str) -> bool:
        return self.named is None and self.complete_calls(text)[1]

    def calls(self, text: str) -> list[dict]:
        """OpenAI tool_calls for the complete calls in the constrained text."""
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}} for name, arguments in self.complete_calls(text)[0]]


def array_items(text: str) -> list[str]:
    """The complete object elements of a JSON array text that may be cut short (the
    grammar made it valid JSON as far as it goes)."""
    items, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "}]":
            if depth == 2 and ch == "}":
                items.append(text[start : i + 1])
            depth -= 1
    return items


@dataclass(frozen=True)
class AskedConstraint:
    constraint: Constraint
    param: str  # the request field it came from (400s name it)
    tools: ToolMode | None = None


def constraint(req, tools: list[Tool] | None = None, tool_choice: Any = None,
               parallel_tool_calls: bool | None = None, syntax: ToolSyntax | None = None) -> AskedConstraint | None:
    """The request's constraint, or None; RequestRejected naming the field when two
    sources conflict or one is malformed."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(AskedConstraint(Constraint.json_object(), "response_format"))
        else:
            if rf.json_schema is None:
                raise RequestRejected("response_format of type json_schema needs a json_schema object",
                                      "response_format.json_schema")
            schema = rf.json_schema.schema_
            # OpenAI: strict defaults to false (best effort); we always enforce what we can
            found.append(AskedConstraint(Constraint.json_schema({} if schema is None else schema,
                                                            strict=bool(rf.json_schema.strict)),
                                    "response_format.json_schema.schema"))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestRejected(f"guided_json is not valid JSON: {e}", "guided_json") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestRejected("guided_json must be a JSON schema (an object)", "guided_json")
        found.append(AskedConstraint(Constraint.json_schema(schema), "guided_json"))
    if req.guided_regex is not None:
        if not req.guided_regex:
            raise RequestRejected("guided_regex must not be empty", "guided_regex")
        found.append(AskedConstraint(Constraint.regex(req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        if any(not c for c in req.guided_choice):
            raise RequestRejected("guided_choice entries must not be empty", "guided_choice")
        found.append(AskedConstraint(Constraint.choice(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        if not req.guided_grammar.strip():
            raise RequestRejected("guided_grammar must not be empty", "guided_grammar")
        found.append(AskedConstraint(Constraint.grammar(req.guided_grammar), "guided_grammar"))
    tool = tool_constraint(tools, tool_choice, parallel_tool_calls is not False, syntax)
    if tool is not None:
        found.append(tool)
    if len(found) > 1:
        raise RequestRejected(f"{found[0].param.split('.')[0]} and {found[1].param.split('.')[0]} cannot be combined: "
                              "a request takes one output constraint", found[1].param.split(".")[0])
    return found[0] if found else None


def tool_constraint(tools: list[Tool] | None, tool_choice: Any, parallel: bool = True,
                    syntax: ToolSyntax | None = None) -> AskedConstraint | None:
    if tool_choice is not None and not tools and tool_choice != "none":
        raise RequestRejected("tool_choice needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return None
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise RequestRejected("tool function names must be unique", "tools")
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
              "required": ["name", "arguments"], "additionalProperties": False} for name, f in by_name.items()]
    if tool_choice in (None, "auto"):
        if syntax is None:
            raise RequestRejected(
                'tool_choice "auto" is not supported for this model: its chat template renders tools in a call '
                'syntax verispec does not parse yet (it parses <tool_call> blocks); use "required" or name a '
                'function ({"type": "function", "function": {"name": ...}})', "tool_choice")
        grammar = syntax.grammar({name: _parameters(f) for name, f in by_name.items()},
                                 MAX_PARALLEL_TOOL_CALLS if parallel else 1)
        return AskedConstraint(Constraint.grammar(grammar), "tools", ToolMode(None, syntax))
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return AskedConstraint(Constraint.json_schema(schema), "tools", ToolMode(None))
    if isinstance(tool_choice, dict):
        try:
            named = NamedToolChoice.model_validate(tool_choice)
        except ValueError:
            raise RequestRejected(TOOL_CHOICE_FORMS, "tool_choice") from None
        function = by_name.get(named.function.name)
        if function is None:
            raise RequestRejected(f"tool_choice names {named.function.name!r}, which is not among the tools",
                                  "tool_choice.function.name")
        return AskedConstraint(Constraint.json_schema(_parameters(function)), "tools", ToolMode(function.name))
    raise RequestRejected(TOOL_CHOICE_FORMS, "tool_choice")


def _parameters(function: FunctionDef) -> dict:
    return function.parameters if function.parameters is not None else EMPTY_PARAMETERS


class StructuredOutput:
    """The server's grammar backend and compile cache, created on first use (building
    the backend's tokenizer index takes a fraction of a second; `warm()` does it ahead)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._args = (tokenizer, vocab_size, sorted(stop_ids))
        self._cache_bytes = cache_bytes
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> GrammarCache:
        """The compile cache (GrammarError when this model's tokenizer cannot drive the
        backend: then every structured request gets that 400, and the server serves on)."""
        with self._lock:
            if self._cache is None:
                from verispec.grammar.llguidance_backend import LLGuidanceBackend

                self._cache = GrammarCache(LLGuidanceBackend(*self._args), self._cache_bytes)
            return self._cache

    def warm(self) -> None:
        def build():
            try:
                self.cache
            except GrammarError as e:
                log.warning("%s", e)

        threading.Thread(target=build, name="verispec-grammar-warm", daemon=True).start()

    def compile(self, c: AskedConstraint):
        try:
            return self.cache.get(c.constraint)
        except GrammarError as e:
            raise RequestRejected(str(e), e.param or c.param) from None

    async def compile_async(self, c: AskedConstraint):
        return await asyncio.to_thread(self.compile, c)

    def stats(self) -> dict | None:
        return self._cache.stats() if self._cache is not None else None


def tools_system_note(tools: list[Tool], syntax: ToolSyntax | None = None) -> str:
    """For chat templates that know nothing of tools: the functions, in the prompt, and
    under "auto" how to call them."""
    listing = [{"name": t.function.name, "description": t.function.description or "",
                "parameters": _parameters(t.function)} for t in tools]
    how = syntax.note() if syntax is not None else "Answer with the call's arguments as JSON."
    return f"You can call these functions. {how}\n" + json.dumps(listing)

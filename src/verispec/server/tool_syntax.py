"""tool_choice "auto": the model's own tool-call syntax, as a grammar and as a parser.

Under "auto" the model may answer in text or call functions. The output is constrained
by one Lark grammar (llguidance) with two branches:

    start: TEXT | PRE <calls> CLOSE
    TEXT:  any text that does not contain OPEN
    PRE:   any text that ends at the first OPEN

so plain text is never touched (TEXT allows every string without the trigger), and once
the model writes OPEN the rest is forced into calls whose arguments validate against each
function's parameters (so `strict` holds), then CLOSE, then the end. Two syntaxes, by
what the chat template says:

* "array" (SmolLM2's, and what the system note teaches templates that know nothing of
  tools): `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`;
* "hermes" (Qwen 2.5 / 3, Hermes: templates that render `tools` and mention
  `<tool_call>`): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block
  per call, blocks one after another;
* "llama3" (Llama 3.1+: templates that ask for `{"name": ..., "parameters": ...}`): the
  whole answer is one call object, or text that does not start with `{` (the grammar is
  `start: TEXT | call` without a trigger string).

Gemma 3's template knows nothing of tools: it gets the system note and "array". Other
templates that render tools in a syntax none of these is get a 400 for "auto" naming the
reason. Checked by tests/test_tool_auto.py: the grammar accepts
text and valid calls and refuses invalid ones (token by token through the real
tokenizer), the parser against the texts that built them, and live: a plain answer under
"auto" is the unconstrained answer to the same prompt, every emitted call validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolSyntax:
    name: str  # "array" | "hermes" | "llama3"

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == "llama3" else "arguments"

    def grammar(self, functions: dict[str, dict], max_calls: int) -> str:
        """The grammar for functions {name: parameters schema}, at most `max_calls` calls."""
        call_schemas = [{"type": "object", "properties": {"name": {"const": name}, self.arguments_key: params},
                         "required": ["name", self.arguments_key], "additionalProperties": False}
                        for name, params in functions.items()]
        one = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        if self.name == "llama3":  # the whole answer is one call object, or text not starting with "{"
            return "\n".join(["start: TEXT | call", f"call: %json {json.dumps(one)}", "TEXT: /(?s:[^{].*)?/"])
        head = ['TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/',
                'PRE: /(?s:.*)<tool_call>/ & ~/(?s:.*)<tool_call>(?s:.+)/']
        if self.name == "array":
            calls = {"type": "array", "minItems": 1, "maxItems": max_calls, "items": one}
            return "\n".join([f'start: TEXT | PRE calls "{CLOSE}"', f"calls: %json {json.dumps(calls)}", *head])
        tail = ""  # up to max_calls - 1 more blocks, each optional after the one before
        for _ in range(max_calls - 1):
            tail = f'("\\n{OPEN}\\n" call "\\n{CLOSE}" {tail})?'.replace(" )", ")")
        return "\n".join([f'start: TEXT | PRE "\\n" call "\\n{CLOSE}" {tail}'.rstrip(),
                          f"call: %json {json.dumps(one)}", *head])

    def note(self) -> str:
        """How to call, for a system note (templates that know nothing of tools)."""
        return ('To call functions, answer with <tool_call>[{"name": <function name>, "arguments": <arguments '
                'object>}]</tool_call> and nothing else; otherwise answer normally in text.')

    def render(self, functions: list[dict]) -> str:
        """Earlier calls ({"name", "arguments": JSON text}) written in this syntax."""
        def call(f):
            try:
                arguments = json.loads(f.get("arguments") or "{}")
            except (TypeError, ValueError):
                arguments = f.get("arguments")
            return {"name": f.get("name"), "arguments": arguments}

        calls = [call(f) for f in functions]
        if self.name == "llama3":
            return json.dumps({"name": calls[0]["name"], "parameters": calls[0]["arguments"]}, ensure_ascii=False)
        if self.name == "array":
            return f"{OPEN}{json.dumps(calls, ensure_ascii=False)}{CLOSE}"
        return "\n".join(f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}" for c in calls)

    def split(self, text: str) -> tuple[str, list[str]]:
        """(the text before the first OPEN, the JSON of each complete call after it). A
        call cut short (max_tokens) is left out."""
        if self.name == "llama3":
            if not text.startswith("{"):
                return text, []
            try:
                json.loads(text)
            except ValueError:
                return "", []
            return "", [text]
        at = text.find(OPEN)
        if at < 0:
            return text, []
        body = text[at + len(OPEN):]
        if self.name == "array":
            from verispec.server.structured import array_items

            return text[:at], array_items(body.split(CLOSE, 1)[0])
        calls = []
        for block in body.split(OPEN):
            inner, closed, _ = block.partition(CLOSE)
            if closed:
                calls.append(inner.strip())
        return text[:at], calls

    def held(self, text: str) -> int:
        """How many trailing characters of a text without OPEN could still begin it (a
        stream holds them back until it knows)."""
        if self.name == "llama3":
            return 0  # decided by the first character
        for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if text.endswith(OPEN[:n]):
                return n
        return 0


def syntax_of(chat_template: str | None) -> ToolSyntax | None:
    """The syntax a model's chat template implies, or None where "auto" cannot be served."""
    template = chat_template or ""
    if "tools" not in template:
        return ToolSyntax("array")  # tools go in a system note that teaches this syntax
    if OPEN in template:
        return ToolSyntax("hermes")
    if '"parameters"' in template or "<|python_tag|>" in template:
        return ToolSyntax("llama3")
    return None

"""What a request constrains its output to, in a form that is a cache key.

A `Constraint` is one of: a JSON schema (compact JSON text; keys keep their order,
which is the order properties are generated in), any JSON object, a regex, a choice among
strings, or a grammar in llguidance's Lark syntax. The server builds it from
`response_format`, `guided_*` or `tools` (server/structured.py); a backend compiles it
(grammar/backend.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the message names the problem; `param` the
    request field it came from (the server answers 400 with both)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    text: str  # the schema as compact JSON, the regex, the grammar, or the choices as a JSON list
    # json_schema only: refuse keywords the backend cannot enforce (else ignore them)
    strict: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool, strict: bool = True) -> Constraint:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls("grammar", lark)

    @property
    def schema(self) -> dict | bool:
        return json.loads(self.text) if self.kind == "json_schema" else {"type": "object"}

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text)

    def choice_regex(self) -> str:
        """The choices as one regex: an exact alternative of the escaped strings."""
        return "(" + "|".join(re.escape(c) for c in self.choices) + ")"

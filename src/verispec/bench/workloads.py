"""The matrix's workloads, as request bodies for a chat model or a base (completion) model.

  chat   short chat: the shared eval prompts (turns[0], one per set in turn: mt-bench,
         gsm8k, humaneval, mbpp), ~128 new tokens
  long   long form: mt-bench's writing prompts, ~512 new tokens
  json   JSON extraction: a short document and a real-world schema (an invoice, a job
         post, a support ticket, ...) per prompt. With grammar on, `response_format`
         json_schema constrains the answer and every output is validated against its
         schema (jsonschema); with grammar off the same prompt asks for the same JSON in
         words only, so the two cells decode comparable text

A base model (no chat template) gets the same tasks as completions: "Question: ...
Answer:" and "... JSON:". Every string, array and number in the schemas is bounded, so
a 135M model (or a random tiny one) finishes each answer well inside max_tokens: an
unbounded field lets a small model ramble inside it until the length cut breaks the JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("chat", "long", "json")
DEFAULT_MAX_TOKENS = {"chat": 128, "long": 512, "json": 256}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _str(n: int = 40) -> dict:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


@dataclass(frozen=True)
class Extraction:
    name: str
    document: str
    schema: dict

    def instruction(self) -> str:
        fields = ", ".join(self.schema["properties"])
        return (f"Extract the following fields from the text as a JSON object: {fields}.\n\n"
                f"Text:\n{self.document}")


EXTRACTIONS: tuple[Extraction, ...] = (
    Extraction("invoice",
               "Invoice INV-20417 from Harbor Lights Supply, dated March 3, 2024. Bill to: Greene & Co. "
               "Items: 12 LED panels at $45.00, 3 mounting kits at $18.50. Total due: $595.50 within 30 days.",
               _obj({"invoice_number": _str(16), "vendor": _str(),
                     # "[.]", not a backslash-escaped dot: llama-cpp-python 0.3.36 turns that into GBNF
                     # its own parser refuses, and its server then dies with SIGSEGV (found by this bench)
                     "total_usd": {"type": "string", "pattern": "^[0-9]{1,6}[.][0-9]{2}$"},
                     "due_in_days": _int(0, 365),
                     "items": {"type": "array", "maxItems": 4, "items": _obj({"name": _str(24), "quantity": _int(1, 999)})}})),
    Extraction("job_post",
               "We are hiring a Senior Backend Engineer in Lisbon (hybrid, 3 days in office). You will build "
               "payment APIs in Go and PostgreSQL. Salary 70,000-85,000 EUR. 5+ years of experience required.",
               _obj({"title": _str(), "city": _str(24), "remote_policy": {"enum": ["onsite", "hybrid", "remote"]},
                     "min_years": _int(0, 40),
                     "skills": {"type": "array", "maxItems": 4, "items": _str(16)}})),
    Extraction("support_ticket",
               "Hi, my order #88213 arrived yesterday but the blender's lid is cracked. I'd like a replacement, "
               "not a refund. This is the second time this happened and I'm pretty frustrated. - Dana Whitfield",
               _obj({"order_id": _str(12), "customer": _str(32), "product": _str(24),
                     "request": {"enum": ["refund", "replacement", "repair", "information"]},
                     "sentiment": {"enum": ["positive", "neutral", "negative"]}})),
    Extraction("meeting",
               "Notes: Product sync on Tuesday 14 May at 10:30. Attendees: Priya, Tom, Alejandro. Decision: ship "
               "the beta on June 1. Action items: Tom updates the docs; Priya books the launch review.",
               _obj({"day": _str(16), "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                     "attendees": {"type": "array", "maxItems": 5, "items": _str(16)},
                     "decision": _str(60)})),
    Extraction("recipe",
               "Lemon garlic pasta (serves 4, 20 minutes): boil 400 g spaghetti; fry 3 cloves of garlic in olive "
               "oil; add the zest and juice of one lemon, toss with the pasta and parmesan.",
               _obj({"dish": _str(32), "servings": _int(1, 20), "minutes": _int(1, 600),
                     "ingredients": {"type": "array", "maxItems": 6, "items": _str(20)}})),
    Extraction("bug_report",
               "Version 2.4.1 on Windows 11: the app crashes when exporting a PDF with more than 200 pages. "
               "Steps: open a large project, File > Export > PDF. Expected a file, got 'Out of memory'. Severity: high.",
               _obj({"version": _str(12), "os": _str(20), "summary": _str(60),
                     "severity": {"enum": ["low", "medium", "high", "critical"]}})),
    Extraction("apartment",
               "Sunny 2-bedroom apartment for rent, 68 square meters, 4th floor with elevator, 1,450 dollars a month, "
               "pets allowed, available from September. Contact Marco at 555-0142.",
               _obj({"bedrooms": _int(0, 10), "area_m2": _int(5, 1000), "rent_usd": _int(0, 100000),
                     "pets_allowed": {"type": "boolean"}, "contact": _str(24)})),
    Extraction("flight",
               "Your booking is confirmed: flight LH 1234 from Frankfurt (FRA) to Madrid (MAD) on 22 August, "
               "departing 07:15, seat 14C, economy class. Passenger: Mr. Jonas Berg.",
               _obj({"flight": _str(10), "from_airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
                     "to_airport": {"type": "string", "pattern": "^[A-Z]{3}$"}, "seat": _str(4),
                     "cabin": {"enum": ["economy", "premium", "business", "first"]}, "passenger": _str(32)})),
)


@dataclass
class Prompt:
    """One request's variable part: its text and, for json, the schema it answers."""

    text: str
    schema: dict | None = None


@dataclass
class Workload:
    name: str
    prompts: list[Prompt]
    max_tokens: int
    extra: dict = field(default_factory=dict)

    def bodies(self, model: str, chat: bool, count: int) -> list[dict]:
        """`count` request bodies (the prompts in turn), greedy; a prompt with a schema gets
        its `response_format` (the grammar-off cells take it out)."""
        out = []
        for i in range(count):
            p = self.prompts[i % len(self.prompts)]
            text = p.text if chat else completion_text(self.name, p.text)
            body = {"model": model, "max_tokens": self.max_tokens, "temperature": 0, **self.extra}
            body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
            if p.schema is not None:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "extraction", "schema": p.schema, "strict": True}}
            out.append(body)
        return out


def completion_text(workload: str, text: str) -> str:
    return f"{text}\n\nJSON:" if workload == "json" else f"Question: {text}\nAnswer:"


def build_workloads(eval_dir: Path, prompts: int, max_tokens: dict[str, int] | None = None) -> dict[str, Workload]:
    """The three workloads with `prompts` prompts each (json: at most len(EXTRACTIONS))."""
    from verispec.data.eval_prompts import EVAL_SETS, load_eval

    limits = {**DEFAULT_MAX_TOKENS, **(max_tokens or {})}
    per_set = {name: load_eval(eval_dir, name, prompts) for name in EVAL_SETS}
    chat = [Prompt(per_set[EVAL_SETS[i % len(EVAL_SETS)]][i // len(EVAL_SETS)])
            for i in range(prompts) if i // len(EVAL_SETS) < len(per_set[EVAL_SETS[i % len(EVAL_SETS)]])]
    writing = [t for t in load_eval(eval_dir, "mt-bench", 80) if _asks_for_long_form(t)] or per_set["mt-bench"]
    extraction = [Prompt(e.instruction(), e.schema) for e in EXTRACTIONS[:max(1, prompts)]]
    return {
        "chat": Workload("chat", chat, limits["chat"]),
        "long": Workload("long", [Prompt(t) for t in writing[:prompts]], limits["long"]),
        "json": Workload("json", extraction, limits["json"]),
    }


def _asks_for_long_form(text: str) -> bool:
    words = ("blog post", "essay", "story", "email", "article", "describe", "write", "compose", "draft")
    return any(w in text.lower() for w in words)


def validate(output: str, schema: dict) -> str | None:
    """Why `output` is not a JSON document valid against `schema` (formats checked), or None."""
    import jsonschema

    try:
        document = json.loads(output)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    return None if error is None else f"{error.message} (at {'/'.join(map(str, error.absolute_path)) or 'root'})"

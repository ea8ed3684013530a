"""The structured-output conformance cases: JSON schemas, regexes, choices and a grammar,
each with a prompt that asks for it.

Used by tests/test_structured_server.py (every output must validate: jsonschema with
format checking, re.fullmatch, membership) and by bench/structured.py and
bench/grammar_backends.py (the same constraints timed). Every string and array is
bounded (maxLength, maxItems, enum, pattern, format), and so is every number, so a 135M
model finishes each within the tests' token limit: an unbounded string or integer lets a
small model ramble inside it ("1234567890123...") until max_tokens cuts the JSON
("length"), which tests the model, not the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict
    prompt: str


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "maxLength": 24}

SCHEMAS: list[SchemaCase] = [
    SchemaCase("person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
               "Describe a fictional person as JSON with a name and an age."),
    SchemaCase("city", _obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 10**8}}),
               "Give the largest city of Japan as JSON: city, country, population."),
    SchemaCase("boolean_flag", _obj({"is_prime": {"type": "boolean"},
                                          "number": {"type": "integer", "minimum": 0, "maximum": 1000}}),
               "Is 7 a prime number? Answer as JSON."),
    SchemaCase("enum_color", _obj({"color": {"enum": ["red", "green", "blue"]}}),
               "What color is the sky on a clear day? Answer as JSON."),
    SchemaCase("const_version", _obj({"version": {"const": 2}, "status": {"enum": ["ok", "error"]}}),
               "Report the service status as JSON."),
    SchemaCase("number_range", _obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
               "What is a typical summer temperature in Paris, in Celsius? Answer as JSON."),
    SchemaCase("integer_exclusive", _obj({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
               "Rate the movie Inception from 1 to 9 as JSON."),
    SchemaCase("array_bounded", _obj({"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                 "minItems": 2, "maxItems": 4}}),
               "List a few fruits as JSON."),
    SchemaCase("array_of_integers", _obj({"primes": {"type": "array", "items": {"type": "integer", "minimum": 2,
                                                                                "maximum": 100},
                                                     "minItems": 3, "maxItems": 5}}),
               "List the first few prime numbers as JSON."),
    SchemaCase("nested_object", _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                                    "profile": _obj({"nickname": NAME,
                                                                     "verified": {"type": "boolean"}})})}),
               "Create a user record with an id and a profile as JSON."),
    SchemaCase("array_of_objects", _obj({"items": {"type": "array", "maxItems": 3, "minItems": 1,
                                                   "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                                  "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}})}}),
               "Write a small shopping order as JSON."),
    SchemaCase("optional_fields", _obj({"title": NAME, "subtitle": NAME, "year": {"type": "integer", "minimum": 1900,
                                                                                  "maximum": 2100}},
                                       required=["title"]),
               "Describe a book as JSON (title, and optionally subtitle and year)."),
    SchemaCase("string_pattern", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
               "Give a US zip code as JSON."),
    SchemaCase("format_date", _obj({"date": {"type": "string", "format": "date"}}),
               "When did the first moon landing happen? Answer as JSON with the date."),
    SchemaCase("format_email", _obj({"email": {"type": "string", "format": "email", "maxLength": 40}}),
               "Give an example email address as JSON."),
    SchemaCase("format_uuid", _obj({"id": {"type": "string", "format": "uuid"}}),
               "Generate a record id as JSON."),
    SchemaCase("format_ipv4", _obj({"ip": {"type": "string", "format": "ipv4"}}),
               "What is the IP address of localhost? Answer as JSON."),
    SchemaCase("string_length", _obj({"code": {"type": "string", "minLength": 4, "maxLength": 6}}),
               "Make up a short product code as JSON."),
    SchemaCase("any_of", _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                                   {"type": "string", "maxLength": 10}]}}),
               "Give me either a number or a short word, as JSON."),
    SchemaCase("one_of", _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}}),
    ]}}), "Describe a geometric shape as JSON."),
    SchemaCase("ref_defs", {"$defs": {"point": _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                     "y": {"type": "integer", "minimum": -100, "maximum": 100}})},
                            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
               "Describe a line segment with a start point and an end point as JSON."),
    SchemaCase("ref_array", {"$defs": {"tag": {"type": "string", "enum": ["news", "sports", "tech", "art"]}},
                             **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1,
                                              "maxItems": 3}})},
               "Tag an article about a new smartphone as JSON."),
    SchemaCase("nullable", _obj({"middle_name": {"anyOf": [NAME, {"type": "null"}]}, "first_name": NAME}),
               "Give a person's first name and middle name (or null) as JSON."),
    SchemaCase("top_level_array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "minItems": 2, "maxItems": 5},
               "Give a short list of digits as a JSON array."),
    SchemaCase("deep_nesting", _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}})})})}),
               "Fill in this nested JSON structure."),
    SchemaCase("mixed_record", _obj({
        "name": NAME, "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]},
        "logins": {"type": "integer", "minimum": 0, "maximum": 10000},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3},
    }, required=["name", "active", "role"]), "Create an account record as JSON."),
    SchemaCase("weather_report", _obj({
        "location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": _obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                    "high": {"type": "integer", "minimum": -40, "maximum": 50}})},
    }), "Give a two-day weather forecast for Berlin as JSON."),
]


@dataclass(frozen=True)
class RegexCase:
    name: str
    pattern: str
    prompt: str


REGEXES: list[RegexCase] = [
    RegexCase("phone", r"\(\d{3}\) \d{3}-\d{4}", "Write a US phone number."),
    RegexCase("iso_date", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "What is today's date?"),
    RegexCase("yes_no_reason", r"(Yes|No), because [a-z ]{1,40}\.", "Is the earth round? Answer yes or no with a reason."),
    RegexCase("hex_color", r"#[0-9a-f]{6}", "Give a hex color code for orange."),
    RegexCase("word_list", r"[a-z]{2,10}(, [a-z]{2,10}){2}", "Name three animals, separated by commas."),
]


@dataclass(frozen=True)
class ChoiceCase:
    name: str
    choices: list[str]
    prompt: str


CHOICES: list[ChoiceCase] = [
    ChoiceCase("sentiment", ["positive", "negative", "neutral"], "Sentiment of: 'I love this phone!'"),
    ChoiceCase("capital", ["Paris", "London", "Berlin", "Madrid"], "What is the capital of France?"),
    ChoiceCase("yes_no", ["yes", "no"], "Is water wet?"),
]

# A Lark grammar (llguidance's syntax: Lark with lexer regexes and {m,n} repetition): an
# equation with 2 to 4 numbers on the left
ARITHMETIC_GRAMMAR = r"""
start: expr "=" NUMBER
expr: NUMBER (OP NUMBER){1,3}
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
"""
GRAMMAR_PROMPT = "Write an arithmetic expression that equals ten."


def validate_json(text: str, schema: dict) -> None:
    """Raise unless `text` is JSON that validates against `schema` (formats checked)."""
    import json

    import jsonschema

    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def arithmetic_ok(text: str) -> bool:
    import re

    return re.fullmatch(r"[0-9]{1,3}([-+*/][0-9]{1,3}){1,3}=[0-9]{1,3}", text) is not None

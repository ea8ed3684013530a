"""Structured output over the real HTTP wire, with the official `openai` client.

Every conformance case of tests/structured_cases.py (27 JSON schemas, 5 regexes, 3
choices, a Lark grammar) runs greedy on the default model in float32, serially in four
lanes: the reference (no speculation at all: each token its own step), plain with
forced-token drafts (the default), n-gram speculation and the shipped DSpark drafter;
then 4 concurrent requests with different schemas arriving staggered, plain and DSpark.
Oracles: 100% of outputs validate (jsonschema with format checking, re.fullmatch,
membership); every lane gives the reference's text (greedy is token-identical with and
without speculation, and a request in a batch gives what it gives alone). Plus the API's edges: 400s naming the problem, tools, streaming, n > 1,
json_object, sampling.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import httpx
import pytest

from tests.structured_cases import ARITHMETIC_GRAMMAR, CHOICES, GRAMMAR_PROMPT, REGEXES, SCHEMAS, arithmetic_ok, validate_json
from verispec.server.launch import live_server

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 160
# reference: grammar without any speculation, every token its own step; plain: the same
# with forced-token drafts (the default); then n-gram and DSpark speculation
LANES = {"reference": ("--no-draft", "--no-forced-drafts"), "plain": ("--no-draft",), "ngram": ("--speculate", "ngram"),
         "dspark": ("--speculate", "dspark")}


@pytest.fixture(scope="module")
def servers(smollm2_folder, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured-logs")
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(live_server("--dtype", "float32", *args, log=logs / f"{name}.log"))
                for name, args in LANES.items()}
        yield urls


def client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(c, prompt, **kwargs):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                     temperature=0, max_tokens=MAX_TOKENS, **kwargs)


def run_case(c, kind, case) -> tuple[str, str]:
    """(text, finish_reason) of one conformance case."""
    if kind == "schema":
        fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}
        r = chat(c, case.prompt, response_format=fmt)
    elif kind == "regex":
        r = chat(c, case.prompt, extra_body={"guided_regex": case.pattern})
    elif kind == "choice":
        r = chat(c, case.prompt, extra_body={"guided_choice": case.choices})
    else:
        r = c.completions.create(model=MODEL, prompt=GRAMMAR_PROMPT + "\n", temperature=0, max_tokens=40,
                                 extra_body={"guided_grammar": ARITHMETIC_GRAMMAR})
        return r.choices[0].text, r.choices[0].finish_reason
    return r.choices[0].message.content, r.choices[0].finish_reason


CASES = ([("schema", c) for c in SCHEMAS] + [("regex", c) for c in REGEXES] + [("choice", c) for c in CHOICES]
         + [("grammar", None)])


def conforms(kind, case, text) -> str | None:
    """None when the output is valid, else why not."""
    try:
        if kind == "schema":
            validate_json(text, case.schema)
        elif kind == "regex" and not re.fullmatch(case.pattern, text):
            return f"{text!r} does not match {case.pattern}"
        elif kind == "choice" and text not in case.choices:
            return f"{text!r} is not one of {case.choices}"
        elif kind == "grammar" and not arithmetic_ok(text):
            return f"{text!r} is not an arithmetic expression"
    except Exception as e:  # noqa: BLE001 - json / jsonschema errors: the reason is the report
        return f"{text!r}: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def name_of(kind, case):
    return "arithmetic" if case is None else f"{kind}:{case.name}"


@pytest.fixture(scope="module")
def serial(servers):
    """Every case, one at a time, on every lane."""
    return {lane: {name_of(k, c): run_case(client(url), k, c) for k, c in CASES} for lane, url in servers.items()}


def assert_all_conform(results: dict) -> None:
    failures = []
    for kind, case in CASES:
        name = name_of(kind, case)
        if name not in results:
            continue
        text, finish = results[name]
        problem = conforms(kind, case, text) or (None if finish == "stop" else f"finish_reason {finish}")
        if problem:
            failures.append(f"{name}: {problem}")
    assert not failures, "outputs that do not conform:\n" + "\n".join(failures)


@pytest.mark.parametrize("lane", list(LANES))
def test_every_output_conforms_serially(serial, lane):
    assert len(serial[lane]) == len(CASES) >= 36
    assert_all_conform(serial[lane])


@pytest.mark.parametrize("lane", ["plain", "ngram", "dspark"])
def test_speculation_gives_the_same_outputs_as_decoding_without_it(serial, lane):
    differ = [name for name in serial["reference"] if serial[lane][name] != serial["reference"][name]]
    assert not differ, {name: (serial["reference"][name], serial[lane][name]) for name in differ}


@pytest.mark.parametrize("lane", ["plain", "dspark"])
def test_four_concurrent_requests_with_different_schemas(servers, serial, lane):
    """Groups of 4 different cases arrive staggered while the others decode: each row has
    its own matcher, and each gives what it gives alone."""
    c = client(servers[lane])
    results, errors = {}, []

    def one(kind, case, delay):
        time.sleep(delay)
        try:
            results[name_of(kind, case)] = run_case(c, kind, case)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    for start in range(0, len(CASES), 4):
        group = CASES[start : start + 4]
        threads = [threading.Thread(target=one, args=(k, case, 0.15 * i)) for i, (k, case) in enumerate(group)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert_all_conform(results)
    differ = [n for n in results if results[n] != serial["reference"][n]]
    assert not differ, {n: (serial["reference"][n], results[n]) for n in differ}


def test_the_dspark_drafter_and_forced_drafts_were_exercised(servers, serial):
    stats = httpx.get(servers["dspark"] + "/stats").json()
    spec = stats["speculation"]
    assert spec is not None and spec["drafted"] > 0 and spec["accepted"] > 0
    assert spec["drafted"] > stats["forced_drafts"]["drafted"], "the drafter drafted, not only the grammar"
    assert stats["grammar_cache"]["compiles"] <= len(CASES), "each constraint compiled once"
    plain = httpx.get(servers["plain"] + "/stats").json()["forced_drafts"]
    assert plain["drafted"] > 0 and plain["accepted"] > 0
    assert httpx.get(servers["reference"] + "/stats").json()["forced_drafts"]["drafted"] == 0
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(servers["plain"] + "/metrics").text)}
    assert families["verispec_forced_drafted_tokens"].samples[0].value == plain["drafted"]
    cache = httpx.get(servers["plain"] + "/stats").json()["grammar_cache"]
    assert families["verispec_grammar_compiles"].samples[0].value == cache["compiles"] > 0


# -- the API's edges ----------------------------------------------------------------------------


def post(base, body, path="/v1/chat/completions"):
    return httpx.post(base + path, json={"model": MODEL, **body}, timeout=120)


MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "read as GBNF"),
    ({"guided_json": {"type": "wat"}}, "guided_json", "wat"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "cannot be combined"),
    ({"guided_choice": []}, "guided_choice", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_constraints_are_a_400_naming_the_problem(servers, body, param, message):
    r = post(servers["plain"], {"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if message:
        assert message in error["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("lane", ["plain", "dspark"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_validate_against_the_function_parameters(servers, lane, stream, choice):
    c = client(servers[lane])
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
                  max_tokens=MAX_TOKENS, tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    if stream:
        calls, finish = {}, None
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for choice_ in chunk.choices:
                for call in choice_.delta.tool_calls or []:
                    calls[call.index] = call
                finish = choice_.finish_reason or finish
        calls = [calls[i] for i in sorted(calls)]
    else:
        r = c.chat.completions.create(**kwargs)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert r.choices[0].message.content is None
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    function = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]["function"]
    if choice == "named":
        assert calls[0].function.name == "get_weather"
    validate_json(calls[0].function.arguments, function["parameters"])


def test_a_tool_result_conversation_continues_with_a_constrained_answer(servers):
    c = client(servers["plain"])
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    schema = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 60}}, "required": ["summary"],
              "additionalProperties": False}
    r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                  response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    validate_json(r.choices[0].message.content, schema)


def test_concurrent_requests_with_a_new_schema_compile_it_once(servers):
    base = servers["plain"]
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
              "required": ["word", "n"], "additionalProperties": False}
    before = httpx.get(base + "/stats").json()["grammar_cache"]["compiles"]
    results = []

    def one():
        r = post(base, {"messages": [{"role": "user", "content": "A word and a number as JSON."}], "temperature": 0,
                        "max_tokens": 40, "guided_json": schema})
        results.append(r.json()["choices"][0]["message"]["content"])

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    validate_json(results[0], schema)
    assert httpx.get(base + "/stats").json()["grammar_cache"]["compiles"] == before + 1


def test_the_grammar_cache_keeps_to_its_byte_cap(smollm2_folder, tmp_path):
    with live_server("--no-draft", "--grammar-cache", "200KB", log=tmp_path / "cache.log") as base:
        for pattern in ("[a-c]{3}", "[d-f]{3}", "[g-i]{3}"):
            r = post(base, {"messages": MESSAGES, "max_tokens": 8, "guided_regex": pattern})
            assert re.fullmatch(pattern, r.json()["choices"][0]["message"]["content"])
        cache = httpx.get(base + "/stats").json()["grammar_cache"]
    assert cache["max_bytes"] == 200_000 and cache["bytes"] <= 200_000
    assert cache["compiles"] == 3 and cache["entries"] == 2, "the least recently used grammar was evicted"


def test_a_gbnf_grammar_constrains_like_lark(servers):
    c = client(servers["dspark"])
    gbnf = 'root ::= answer ", because " reason\nanswer ::= "Yes" | "No"\nreason ::= [a-z ]{1,40} "."\n'
    r = chat(c, "Is the earth round? Answer yes or no with a reason.", extra_body={"guided_grammar": gbnf})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(Yes|No), because [a-z ]{1,40}\.", r.choices[0].message.content)


def test_json_object_mode_returns_a_json_object(servers):
    c = client(servers["dspark"])
    r = chat(c, "Describe a cat as JSON with keys name and color.", response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an open-ended object may run to the limit: then it is a valid prefix, cut
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content.startswith("{")


def test_max_tokens_inside_the_json_finishes_with_length(servers):
    c = client(servers["dspark"])
    case = SCHEMAS[-1]
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": case.prompt}], temperature=0,
                                  max_tokens=6, response_format=fmt)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    cut, full = r.choices[0].message.content, run_case(c, "schema", case)[0]
    assert full.startswith(cut) and len(full) > len(cut), "the cut output is a prefix of the complete one"


def test_streamed_structured_output_equals_the_whole_answer(servers):
    c = client(servers["dspark"])
    case = SCHEMAS[10]
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}
    whole = chat(c, case.prompt, response_format=fmt).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in chat(c, case.prompt, response_format=fmt, stream=True)
             if ch.choices]
    assert "".join(parts) == whole
    validate_json(whole, case.schema)


@pytest.mark.parametrize("lane", ["plain", "dspark"])
def test_sampled_choices_all_conform(servers, lane):
    """n = 4 sampled rows of one request, each with its own matcher, at temperature 1."""
    c = client(servers[lane])
    for case in (SCHEMAS[7], SCHEMAS[19], SCHEMAS[26]):
        fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": case.prompt}],
                                      temperature=1.0, n=4, max_tokens=MAX_TOKENS, response_format=fmt)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            validate_json(choice.message.content, case.schema)


# -- tool calls end ---------------------------------------------------------------------------


def _call_key(call) -> str:
    return json.dumps([call.function.name, json.loads(call.function.arguments)], sort_keys=True)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_without_max_tokens_end_with_distinct_valid_calls(servers, stream):
    """The small model, allowed parallel calls and no max_tokens, used to repeat the same
    call until the context was full (382 s); the first repeat now ends the answer."""
    from verispec.server.structured import MAX_PARALLEL_TOOL_CALLS

    c = client(servers["plain"])
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
                  temperature=0, tools=[WEATHER, TIME], tool_choice="required")
    start = time.monotonic()
    if stream:
        calls, finish, text = {}, None, ""
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for choice_ in chunk.choices:
                text += choice_.delta.content or ""
                for call in choice_.delta.tool_calls or []:
                    calls[call.index] = call
                finish = choice_.finish_reason or finish
        calls = [calls[i] for i in sorted(calls)]
        assert text == ""
    else:
        r = c.chat.completions.create(**kwargs)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert r.choices[0].message.content is None and r.usage.completion_tokens < 300
    assert time.monotonic() - start < 60
    assert finish == "tool_calls" and 1 <= len(calls) <= MAX_PARALLEL_TOOL_CALLS
    assert len({_call_key(call) for call in calls}) == len(calls), "no call repeats an earlier one"
    for call in calls:
        function = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        validate_json(call.function.arguments, function["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_is_length_without_half_a_call(servers, stream):
    c = client(servers["plain"])
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
                  tools=[WEATHER], tool_choice="required", max_tokens=6)
    if stream:
        calls, finish, text = [], None, ""
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for choice_ in chunk.choices:
                text += choice_.delta.content or ""
                calls += choice_.delta.tool_calls or []
                finish = choice_.finish_reason or finish
        content = text or None
    else:
        r = c.chat.completions.create(**kwargs)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        calls, content = message.tool_calls or [], message.content
    assert finish == "length"
    assert content is None, "no half call in content"
    assert calls == [], "six tokens cannot hold a whole call"


# -- no constraint can crash or stall the server ------------------------------------------------


def _ref_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _nested(n, key="x"):
    schema = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {key: schema}, "required": [key]}
    return schema


def _hostile_bodies():
    import random

    rng = random.Random(12)
    bodies = []
    for n in (10, 100, 1000, 3000):
        bodies.append({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _ref_chain(n)}}})
    for n in (8, 40, 100, 300):
        bodies.append({"guided_json": _nested(n)})
    for n in (50, 5000):
        bodies.append({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}})
    bodies.append({"guided_json": {"anyOf": [{"const": f"v{i}"} for i in range(3000)]}})
    for n in (10, 900, 1100, 5000):
        bodies.append({"guided_grammar": "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"\n'})
    for n in (100, 9000, 12000, 100_000):
        bodies.append({"guided_grammar": "start: " + " | ".join(f'"w{i % 977}"' for i in range(n)) + "\n"})
    for pattern in ("(a{1000}){1000}", "a{20000}", "(" * 50 + "a" + ")" * 50, "(a|b|c)*" * 200, "[a-z]{1,5000}",
                    r"(\d{3}-){3}\d{4}", "((a{100}){100})b"):
        bodies.append({"guided_regex": pattern})
    for depth in (3, 10, 40, 90, 20, 60):  # random trees of objects, arrays and unions, one path `depth` deep
        budget = [400]

        def grow(depth):
            if depth <= 0 or budget[0] <= 0:
                return rng.choice([{"type": "integer", "maximum": 9}, {"enum": ["a", "b"]}, {"type": "boolean"}])
            budget[0] -= 1
            kind = rng.choice(["object", "array", "anyOf"])
            width = rng.randint(1, 4) if kind == "object" else rng.randint(2, 3)
            children = [grow(depth - 1)] + [grow(rng.randint(0, 2)) for _ in range(width - 1)]
            if kind == "object":
                keys = [f"k{i}" for i in range(width)]
                return {"type": "object", "properties": dict(zip(keys, children)), "required": keys}
            if kind == "array":
                return {"type": "array", "items": children[0], "maxItems": 2}
            return {"anyOf": children}

        bodies.append({"guided_json": grow(depth)})
    return bodies


def test_hostile_constraints_get_a_4xx_or_an_answer_while_a_stream_completes(servers):
    """The crash reproducers of the fresh-machine issue and a fuzz of deep and wide
    schemas, grammars and regexes, while a greedy stream runs beside them: every answer
    is a 4xx with a short message or a 200, the stream gives exactly what it gives alone,
    and the server is alive afterwards."""
    base = servers["plain"]
    c = client(base)
    prompt = "Write a long story about a lighthouse keeper."
    streamed = {}

    def stream_beside():
        text = ""
        for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                               max_tokens=120, stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        streamed["text"] = text

    beside = threading.Thread(target=stream_beside)
    beside.start()
    outcomes = []
    for body in _hostile_bodies():
        start = time.monotonic()
        r = post(base, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **body})
        outcomes.append((r.status_code, round(time.monotonic() - start, 2)))
        assert r.status_code in (200, 400, 413), (body.keys(), r.status_code, r.text[:300])
        if r.status_code != 200:
            message = r.json()["error"]["message"]
            assert len(message) < 1000 and "backtrace" not in message and "panicked" not in message, message
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    beside.join(300)
    print("hostile constraint outcomes (status, seconds):", outcomes)
    assert sum(1 for status, _ in outcomes if status == 200) >= 10 and sum(1 for status, _ in outcomes if status == 400) >= 10
    alone = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                      max_tokens=120, extra_body={"ignore_eos": True}).choices[0].message.content
    assert streamed["text"] == alone

"""OpenAI's Responses API (/v1/responses), live on loopback, driven by the official
`openai` client's `responses` methods.

Oracles: the chat route on the same server (the same conversation asked through
/v1/chat/completions gives the same greedy text and prompt token count); a
previous_response_id chain against the whole conversation sent at once; streamed events
against the whole response; jsonschema for json_schema text and function-call arguments;
the client's exception classes for errors. The store's bounds are checked directly.
The server runs its default speculation (n-gram).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from verispec.server.launch import live_server
from verispec.server.openai_responses import ResponseStore

KEY = "test-key"
MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smollm2_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "serve.log"
    with live_server("-m", str(smollm2_folder), "--served-model-name", MODEL, "--dtype", "float32",
                     "--api-key", KEY, log=log) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


@pytest.mark.real_model
def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", input="Name three primary colours.",
                                max_output_tokens=48, temperature=0)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": "Name three primary colours."}], 48)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text and text
    assert r.usage.input_tokens == prompt_tokens and r.usage.total_tokens == prompt_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete")


@pytest.mark.real_model
def test_streamed_events_add_up_to_the_whole_response(client):
    kwargs = dict(model=MODEL, input="Write one sentence about rivers.", max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with client.responses.stream(**kwargs) as stream:  # the client's own accumulator agrees
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.real_model
def test_previous_response_id_continues_the_conversation_without_its_instructions(client):
    first = client.responses.create(model=MODEL, instructions="Be terse.", input="My name is Ada. Say hello.",
                                    max_output_tokens=24, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=24, temperature=0)
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ada. Say hello."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 24)
    assert second.output_text == text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not stored"):
        client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.real_model
def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_validate_against_the_parameters(client, stream, choice):
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                  parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    if stream:
        with client.responses.stream(**kwargs) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


@pytest.mark.real_model
def test_a_function_call_output_turn_is_the_chat_routes_tool_message(client):
    args = json.dumps({"city": "Paris", "unit": "celsius"})
    r = client.responses.create(model=MODEL, max_output_tokens=40, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}])
    text, prompt_tokens = chat_text(client, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}], 40)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens


@pytest.mark.real_model
def test_a_cut_short_response_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


@pytest.mark.real_model
@pytest.mark.parametrize("kwargs,field", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **kwargs)
    assert e.value.body["param"].startswith(field) if e.value.body.get("param") else field in str(e.value)


def test_the_store_is_bounded_in_count_and_bytes_least_recently_used_first():
    store = ResponseStore(max_items=3, max_bytes=10_000)
    for i in range(4):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and len(store) == 3
    store.get("r1")  # used: r2 is now the oldest
    store.put({"id": "r4"}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 9_900}])  # over the bytes: r3, then r4 leave
    assert store.bytes <= 10_000 and store.get("big") is not None
    assert store.get("r3") is None and store.get("r4") is None and store.get("r1") is not None
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 20_000}])  # never fits: not stored
    assert store.get("huge") is None and store.get("big") is not None

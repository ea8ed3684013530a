"""Anthropic's Messages API (/v1/messages), live on loopback, driven by the official
`anthropic` client.

Oracles: the chat route on the same server (the same conversation asked through
/v1/chat/completions gives the same greedy text and the same prompt token count: the
Messages route is a translation, not a second model path); the un-stopped output cut at
the stop sequence; jsonschema for tool_use inputs; the client's own exception classes for
errors (status codes and Anthropic's error body). The server runs its default speculation
(n-gram), so every answer here also went through speculative decoding.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from verispec.server.launch import live_server

pytestmark = pytest.mark.real_model

KEY = "test-key"
MODEL = "smollm2"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                             "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def base_url(smollm2_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("messages") / "serve.log"
    with live_server("-m", str(smollm2_folder), "--served-model-name", MODEL, "--dtype", "float32",
                     "--api-key", KEY, log=log) as url:
        yield url


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


# this client (2.x) no longer has sampling arguments; the API still takes temperature
T0 = {"extra_body": {"temperature": 0}}


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_is_the_chat_answer_to_the_same_conversation(claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=48, **T0, system="Answer briefly.",
                               messages=[{"role": "user", "content": "Name three primary colours."}])
    r = oai.chat.completions.create(model=MODEL, max_tokens=48, temperature=0,
                                    messages=[{"role": "system", "content": "Answer briefly."},
                                              {"role": "user", "content": "Name three primary colours."}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert text_of(m) == r.choices[0].message.content and text_of(m)
    assert m.usage.input_tokens == r.usage.prompt_tokens
    assert m.usage.output_tokens == r.usage.completion_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[r.choices[0].finish_reason]


def test_content_blocks_and_a_multi_turn_conversation_read_like_plain_strings(claude):
    turns = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Now say goodbye."}]
    as_blocks = [{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in turns]
    a = claude.messages.create(model=MODEL, max_tokens=24, **T0, messages=turns)
    b = claude.messages.create(model=MODEL, max_tokens=24, **T0, messages=as_blocks,
                               system=[{"type": "text", "text": "You are a helpful AI assistant named SmolLM, "
                                                                "trained by Hugging Face"}])
    assert text_of(a) == text_of(b)  # the template's default system prompt, given explicitly
    assert a.usage.input_tokens == b.usage.input_tokens


def test_streamed_events_add_up_to_the_whole_message(claude):
    kwargs = dict(model=MODEL, max_tokens=40, **T0,
                  messages=[{"role": "user", "content": "Write one sentence about rivers."}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events


def test_stop_sequences_cut_the_text_and_say_which(claude):
    kwargs = dict(model=MODEL, max_tokens=60, **T0,
                  messages=[{"role": "user", "content": "Count from one to ten in words, separated by commas."}])
    free = text_of(claude.messages.create(**kwargs))
    assert len(free) > 12, free
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # cut where this text first occurs
    m = claude.messages.create(**kwargs, stop_sequences=["zzz-never", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == free[: free.index(stop)]
    short = claude.messages.create(**{**kwargs, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_use_inputs_validate_against_their_schema(claude, stream, choice):
    kwargs = dict(model=MODEL, max_tokens=120, **T0, tools=[WEATHER, TIME], tool_choice=choice,
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        with claude.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kwargs)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, schemas[use.name])
    if choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_weather"]


def test_a_tool_result_turn_is_the_chat_routes_tool_message(claude, oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "unit": "celsius"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": '{"temperature": 21}'}]}]
    m = claude.messages.create(model=MODEL, max_tokens=40, **T0, messages=messages)
    r = oai.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature": 21}'}])
    assert text_of(m) == r.choices[0].message.content
    assert m.usage.input_tokens == r.usage.prompt_tokens


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": 10, "messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 10, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, "temperature"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "hi"}]}, "thinking"),
    ({"max_tokens": 10, "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}],
      "messages": [{"role": "user", "content": "hi"}]}, "tools[0].type"),
])
def test_bad_requests_are_400s_in_anthropics_error_shape(base_url, body, field):
    r = httpx.post(base_url + "/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_output_config_json_schema_constrains_the_text(claude):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    m = claude.messages.create(model=MODEL, max_tokens=80, **T0,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "Invent a person."}])
    jsonschema.validate(json.loads(text_of(m)), schema)


def test_the_client_raises_its_own_errors(base_url, claude):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-4", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="needs tools"):
        claude.messages.create(model=MODEL, max_tokens=5, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "hi"}])

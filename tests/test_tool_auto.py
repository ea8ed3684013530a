"""tool_choice "auto": text or calls in the model's own syntax (server/tool_syntax.py).

Oracles: llguidance's matcher fed the real tokenizer's tokens of hand-written outputs
(text and valid calls accepted, invalid arguments, extra calls and text after a call
refused); the parser against the calls that built its input; jsonschema for every
emitted call; and, live, the unconstrained answer to the same rendered prompt (a plain
answer under "auto" is the answer without any grammar, token for token) and the chat
route for the other APIs.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from verispec.engine.request import RequestRejected
from verispec.server.protocol import ChatCompletionRequest, Tool
from verispec.server.structured import ToolMode, tool_constraint
from verispec.server.tool_syntax import ToolSyntax, syntax_of

pytestmark = pytest.mark.real_model

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": PARAMS}}
TOOLS = [Tool.model_validate(WEATHER)]
# a conversation in which the model has called the tool before: a 135M model then calls it again
FEW_SHOT = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def backend(smollm2_folder):
    from verispec.grammar.llguidance_backend import LLGuidanceBackend
    from verispec.models.tokenizer import load_tokenizer, stop_token_ids

    tok = load_tokenizer(smollm2_folder)
    return tok, LLGuidanceBackend(tok, 49152, stop_token_ids(smollm2_folder, tok))


def feed(backend, asked, text: str) -> tuple[bool, bool]:
    """(every token accepted, the grammar accepts the end here)."""
    tok, be = backend
    m = be.compile(asked.constraint).new_matcher()
    ok = all(m.consume(t) for t in tok.encode(text, add_special_tokens=False))
    return ok, ok and m.accepting


CALL = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'


@pytest.mark.parametrize("name", ["array", "hermes"])
def test_the_grammar_takes_any_text_or_valid_calls_and_nothing_else(backend, name):
    syntax = ToolSyntax(name)
    asked = tool_constraint(TOOLS, "auto", parallel=False, syntax=syntax)
    one = f"<tool_call>[{CALL}]</tool_call>" if name == "array" else f"<tool_call>\n{CALL}\n</tool_call>"
    two = (f"<tool_call>[{CALL}, {CALL}]</tool_call>" if name == "array"
           else f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>")
    bad = one.replace('"celsius"', '"kelvin"')
    assert feed(backend, asked, "Rome is sunny today, <b>really</b> warm {json: no}.") == (True, True)
    assert feed(backend, asked, "Let me look that up. " + one) == (True, True)
    assert feed(backend, asked, one) == (True, True)
    assert not feed(backend, asked, bad)[0], "arguments outside the schema"
    assert not feed(backend, asked, one + " and more text")[0], "text after the call"
    assert not feed(backend, asked, two)[0], "a second call with parallel_tool_calls false"
    parallel = tool_constraint(TOOLS, None, parallel=True, syntax=syntax)  # unset tool_choice is auto
    assert feed(backend, parallel, two) == (True, True)


@pytest.mark.parametrize("name", ["array", "hermes"])
def test_the_parser_gives_back_the_text_and_calls_it_was_built_from(name):
    syntax = ToolSyntax(name)
    mode = ToolMode(None, syntax)
    calls = [{"name": "get_weather", "arguments": json.dumps({"city": c, "unit": "celsius"})} for c in ("Rome", "Oslo")]
    text = "Checking. " + syntax.render(calls)
    assert mode.content(text) == "Checking. "
    assert [(n, json.loads(a)) for n, a in mode.complete_calls(text)[0]] == \
        [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert mode.complete_calls(text[:-20])[0][:1] == mode.complete_calls(text)[0][:1]  # a cut call is left out
    assert mode.content("no call at all") == "no call at all" and mode.complete_calls("no call")[0] == []
    assert mode.repeats(syntax.render([calls[0], calls[0]]))
    assert syntax.held("text <tool_") == len("<tool_") and syntax.held("text <b>") == 0


def test_llama3s_call_is_the_whole_answer_or_there_is_none(backend):
    syntax = ToolSyntax("llama3")
    asked = tool_constraint(TOOLS, "auto", syntax=syntax)
    call = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'
    assert feed(backend, asked, call) == (True, True)
    assert feed(backend, asked, "Rome is sunny {not a call}.") == (True, True)  # text: it does not start with {
    assert not feed(backend, asked, call.replace("celsius", "kelvin"))[0]
    assert not feed(backend, asked, '{"name": "get_time", "parameters": {}}')[0]  # not among the tools
    assert not feed(backend, asked, call + " and more")[0]
    mode = ToolMode(None, syntax)
    assert [(n, json.loads(a)) for n, a in mode.complete_calls(call)[0]] == [("get_weather", {"city": "Rome",
                                                                                            "unit": "celsius"})]
    assert mode.content(call) == "" and mode.content("plain") == "plain"
    assert syntax.render([{"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}]) == call


def test_the_template_says_which_syntax_and_others_are_refused_with_a_reason():
    assert syntax_of("{{ messages }}") == ToolSyntax("array")  # no tools in the template: the system note's
    assert syntax_of("{% if tools %}<tools>{{ tools }}</tools> reply in <tool_call></tool_call>{% endif %}") == \
        ToolSyntax("hermes")
    llama3 = '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary}{% endif %}'
    assert syntax_of(llama3) == ToolSyntax("llama3")
    other = "{% if tools %}Call with <function=name>{args}</function>{% endif %}"
    assert syntax_of(other) is None
    with pytest.raises(RequestRejected, match="not supported for this model"):
        tool_constraint(TOOLS, "auto", syntax=syntax_of(other))


@pytest.fixture(scope="module")
def server(smollm2_folder, tmp_path_factory):
    from verispec.server.launch import live_server

    with live_server("-m", str(smollm2_folder), "--served-model-name", "m", "--dtype", "float32",
                     log=tmp_path_factory.mktemp("auto") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=300)


def test_a_plain_answer_under_auto_is_the_unconstrained_answer_to_the_same_prompt(client, smollm2_folder):
    from verispec.models.tokenizer import load_tokenizer
    from verispec.server.prompts import chat_prompt

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="auto",
                                       temperature=0, max_tokens=60)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": [WEATHER]})
    ids = chat_prompt(load_tokenizer(smollm2_folder), req, with_tools=True, syntax=ToolSyntax("array"))
    free = client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=60)
    assert "<tool_call>" not in free.choices[0].text  # the premise: the free answer calls nothing
    assert r.choices[0].message.content == free.choices[0].text
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_an_emitted_call_validates_and_streams_whole(client, stream):
    kwargs = dict(model="m", messages=FEW_SHOT, tools=[WEATHER], temperature=0, max_tokens=80)
    if stream:
        calls, content, finish = {}, "", None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                calls[call.index] = call.function
            finish = chunk.choices[0].finish_reason or finish
        functions = list(calls.values())
    else:
        r = client.chat.completions.create(**kwargs)
        functions = [c.function for c in r.choices[0].message.tool_calls or []]
        content, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    assert functions and finish == "tool_calls", "the few-shot premise: the model calls the tool again"
    assert "<tool_call>" not in content
    for f in functions:
        assert f.name == "get_weather"
        jsonschema.validate(json.loads(f.arguments), PARAMS)


def test_sampled_answers_under_auto_are_text_or_valid_calls(client):
    for seed in range(6):
        r = client.chat.completions.create(model="m", messages=FEW_SHOT, tools=[WEATHER], temperature=1.0,
                                           seed=seed, max_tokens=80)
        message = r.choices[0].message
        assert "<tool_call>" not in (message.content or "")
        for call in message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS)


def test_messages_and_responses_default_to_auto_with_tools(server, client):
    claude = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Current weather in a city", "input_schema": PARAMS}
    few_shot = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris", "unit": "celsius"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": '{"temperature": 21}'}]},
                {"role": "assistant", "content": "It is 21 degrees in Paris."},
                {"role": "user", "content": "What is the weather in Rome?"}]
    m = claude.messages.create(model="m", max_tokens=80, tools=[tool], messages=few_shot,
                               extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    for use in uses:
        jsonschema.validate(use.input, PARAMS)
    plain = claude.messages.create(model="m", max_tokens=30, tools=[tool], extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.content[0].type == "text"
    r = client.responses.create(model="m", input="What is 2 + 2?", max_output_tokens=30, temperature=0,
                                tools=[{"type": "function", **WEATHER["function"]}])
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                          tools=[WEATHER], temperature=0, max_tokens=30)
    assert r.output_text == chat.choices[0].message.content

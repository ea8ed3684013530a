"""Request validation and shaping, without a model: every mistake names its field the way
OpenAI's `param` does, and the OpenAI fields map onto SamplingParams as documented."""

from __future__ import annotations

import json

import pytest

from verispec.engine.request import RequestRejected
from verispec.serve_cli import parse_bytes
from verispec.server.errors import authorized
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest, build_requests, parse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**change) -> bytes:
    return json.dumps({**CHAT, **change}).encode()


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b"{", None, "not valid JSON"),
        (b"[]", None, "JSON object"),
        (json.dumps({"messages": CHAT["messages"]}).encode(), "model", "required"),
        (_chat(messages=[{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]), "messages[1].role", "'user'"),
        (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
         "messages[0].content", ""),
        (_chat(max_tokens=1.5), "max_tokens", "integer"),
        (_chat(max_tokens=True), "max_tokens", "integer"),
        (_chat(temperature=2.5), "temperature", "2"),
        (_chat(logit_bias={"12": 500}), "logit_bias.12", "100"),
        (_chat(stop=["a", 1]), "stop", "string"),
        (_chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "boolean"),
        (_chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
        (_chat(tools=[{"type": "function"}]), "tools[0].function", "required"),
        (_chat(functions=[{"name": "f"}]), "functions", "not supported"),
        (_chat(logprobs=False, top_logprobs=2), "top_logprobs", "requires logprobs"),
        (_chat(top_logprobs=21, logprobs=True), "top_logprobs", "20"),
    ],
)
def test_chat_mistakes_name_the_field(body, param, words):
    with pytest.raises(RequestRejected) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == param and words in str(e.value) and e.value.status == 400


def test_unknown_fields_are_ignored_and_known_ones_typed():
    req = parse(ChatCompletionRequest, _chat(user="u", metadata={"a": 1}, store=False, temperature=0, stop="END"))
    assert req.temperature == 0.0 and req.stop_strings() == ("END",)
    req = parse(CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode())
    assert req.prompt == [1, 2, 3]
    with pytest.raises(RequestRejected, match="echo"):
        parse(CompletionRequest, json.dumps({"model": "m", "prompt": "x", "echo": True}).encode())


def test_build_requests_maps_fields_and_defaults():
    req = parse(ChatCompletionRequest, _chat(n=2, seed=10, top_k=-1, min_p=0.1, presence_penalty=0.5,
                                            logit_bias={"7": -100}, stop=["x", "y"]))
    out = build_requests(req, [[1, 2, 3]], None, 2, {"temperature": 0.6}, lambda n: 50 - n)
    assert [r.max_tokens for r in out] == [47, 47]
    assert [r.params.seed for r in out] == [10, 11], "choices of a seeded request differ, reproducibly"
    p = out[0].params
    assert (p.temperature, p.top_k, p.min_p, p.presence_penalty, p.logit_bias, p.logprobs) == (
        0.6, 0, 0.1, 0.5, {7: -100.0}, 2)
    assert out[0].stop == ("x", "y")
    unseeded = build_requests(parse(ChatCompletionRequest, _chat()), [[1]], 5, None, {}, lambda n: 9)
    assert unseeded[0].params.temperature == 1.0 and unseeded[0].max_tokens == 5, "OpenAI's default temperature"
    with pytest.raises(RequestRejected, match="no room"):
        build_requests(parse(ChatCompletionRequest, _chat()), [[1] * 9], None, None, {}, lambda n: 0)


def test_sizes_and_keys():
    assert parse_bytes("4GB") == 4 * 10**9 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
    for bad in ("lots", "-1GB", "0", "3 parsecs"):
        with pytest.raises(Exception, match="size"):
            parse_bytes(bad)
    assert authorized(None, None) and authorized("Bearer k", "k") and authorized("bearer k", "k")
    assert not authorized(None, "k") and not authorized("Bearer x", "k") and not authorized("k", "k")

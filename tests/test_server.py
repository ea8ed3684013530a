"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client.

Oracles: the same request run alone (batching is exact: concurrent, staggered requests
give, in float32, the same greedy text as each alone); the un-stopped output cut at the
stop string; the tokenizer (prompt token counts, logprob token bytes); prometheus_client's
parser for /metrics; /stats for memory (a dropped stream frees its row and KV at once).
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from verispec.server.launch import live_server
from verispec.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.real_model

KEY = "test-key"
MODEL = "smollm2"
PROMPTS = [
    "Write a short poem about the ocean.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "What is the boiling point of water at sea level?",
]
KV_PER_TOKEN_FP32 = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x kv heads x head_dim x float32


@pytest.fixture(scope="module")
def base_url(smollm2_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    # --no-draft: these tests are about serving; speculation has its own (test_spec_real.py)
    with live_server("-m", str(smollm2_folder), "--served-model-name", MODEL, "--dtype", "float32", "--no-draft",
                     "--api-key", KEY, "--max-batch", "8", log=log) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return load_tokenizer(smollm2_folder)


def chat(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def stats(base_url) -> dict:
    return httpx.get(base_url + "/stats").json()


def wait_for(predicate, timeout=30.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


# -- endpoints ------------------------------------------------------------------------------


def test_models_health_and_chat(client, base_url, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    # the template is rendered once: its ids (BOS included once) are exactly the prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_and_max_completion_tokens(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    batch = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 8
    r = chat(client, PROMPTS[0], max_completion_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming_and_ends_with_done(client, base_url):
    whole = chat(client, PROMPTS[1], max_tokens=40)
    chunks = list(chat(client, PROMPTS[1], max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the raw wire: SSE events, the bare [DONE] sentinel last
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    raw = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_concurrent_staggered_requests_equal_each_alone(client, base_url):
    """Rows join mid-decode (staggered arrivals) and leave at different times (different
    max_tokens); in float32 each one's greedy text equals the same request alone."""
    limits = [48, 20, 36, 28]
    alone = [chat(client, p, max_tokens=n) for p, n in zip(PROMPTS, limits)]
    steps_before = stats(base_url)["steps"]
    results = [None] * len(PROMPTS)

    def run(i):
        time.sleep(0.05 * i)  # staggered, yet inside each other (a 48-token answer takes ~0.3 s here)
        results[i] = chat(client, PROMPTS[i], max_tokens=limits[i], stream=(i % 2 == 1))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (result, reference) in enumerate(zip(results, alone)):
        text = (result.choices[0].message.content if i % 2 == 0
                else "".join(c.choices[0].delta.content or "" for c in result if c.choices))
        assert text == reference.choices[0].message.content, f"request {i} changed when batched"
    generated = sum(r.usage.completion_tokens for r in alone)
    assert stats(base_url)["steps"] - steps_before < generated, "the requests did share steps"


def test_stop_string_across_token_boundary_is_cut_exactly(client):
    prompt = "Write a short paragraph about the history of bread."
    full = chat(client, prompt, max_tokens=60, logprobs=True)
    tokens = [t.token for t in full.choices[0].logprobs.content]
    text = full.choices[0].message.content
    assert "".join(tokens) == text
    # a stop string that starts inside one token and ends inside the next
    k = next(i for i in range(5, len(tokens) - 1) if len(tokens[i]) >= 3 and len(tokens[i + 1]) >= 3)
    start = len("".join(tokens[:k]))
    stop = tokens[k][1:] + tokens[k + 1][:2]
    expected = text[: text.find(stop)]
    assert text.find(stop) <= start + 1 and len(expected) > 0
    cut = chat(client, prompt, max_tokens=60, stop=[stop, "never-appears"], logprobs=True)
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert "".join(t.token for t in cut.choices[0].logprobs.content).startswith(expected)
    deltas = [c.choices[0].delta.content or "" for c in chat(client, prompt, max_tokens=60, stop=stop, stream=True)
              if c.choices]
    assert "".join(deltas) == expected and not any(stop in d for d in deltas)


def test_logprobs_shapes(client):
    r = chat(client, PROMPTS[2], max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # raw logprobs: the top one is the max
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
    assert all(len(alts) <= 2 for alts in lp.top_logprobs)


def test_n_choices_are_seeded_and_distinct(client):
    kw = dict(max_tokens=16, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    first, second = chat(client, PROMPTS[0], **kw), chat(client, PROMPTS[0], **kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices], "a seeded request is reproducible"
    assert len(set(texts)) > 1, "the choices of one request differ"
    assert first.usage.completion_tokens == 3 * 16, "usage sums the choices"


def test_disconnect_mid_stream_frees_the_row_and_its_memory(base_url):
    before = stats(base_url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert any('"content"' in line for line in got)
        assert stats(base_url)["kv_bytes_in_use"] > 0
    assert wait_for(lambda: stats(base_url)["running"] == 0 and stats(base_url)["kv_bytes_in_use"] == 0, timeout=10)
    after = stats(base_url)
    assert after["requests_finished"].get("abort", 0) == before["requests_finished"].get("abort", 0) + 1
    # a client that gives up on a non-streaming request frees its row too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base_url + "/v1/chat/completions", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5)
    assert wait_for(lambda: stats(base_url)["running"] == 0 and stats(base_url)["kv_bytes_in_use"] == 0, timeout=10)
    assert stats(base_url)["requests_finished"].get("abort", 0) == after["requests_finished"].get("abort", 0) + 1


# -- bad input -----------------------------------------------------------------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "change, status, param",
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ({"max_tokens": -3}, 400, "max_tokens"),
        ({"max_tokens": 10**7}, 400, "max_tokens"),
        ({"temperature": -0.5}, 400, "temperature"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"stop": 3}, 400, "stop"),
        ({"stop": [""]}, 400, "stop[0]"),
        ({"logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),
        ({"stream": "yes"}, 400, "stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"model": None}, 400, "model"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(base_url, change, status, param):
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_json_oversized_bodies_and_keys(base_url, client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(base_url + "/v1/chat/completions", content=b'{"model": ', headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", content=b"x" * (9 * 2**20), headers=auth)
    assert r.status_code == 413
    assert httpx.post(base_url + "/v1/chat/completions", json=GOOD).status_code == 401
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=10**7)
    assert "context length" in str(e.value)
    # nothing of that crashed the engine
    assert httpx.get(base_url + "/health").status_code == 200 and chat(client, "hi", max_tokens=2).choices


def test_metrics_are_prometheus_and_count_what_happened(base_url, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = httpx.get(base_url + "/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    r = chat(client, PROMPTS[3], max_tokens=7, temperature=0)
    after = scrape()
    generated = "verispec_generation_tokens_total{}"
    assert after[generated] - before[generated] == r.usage.completion_tokens
    ttft = "verispec_time_to_first_token_seconds_count{}"
    assert after[ttft] - before[ttft] == 1
    for name in ("verispec_kv_bytes_in_use{}", "verispec_queue_depth{}", "verispec_inter_token_latency_seconds_sum{}"):
        assert name in after


# -- admission by memory ---------------------------------------------------------------------


def test_kv_budget_queues_instead_of_overcommitting(smollm2_folder, tmp_path, tokenizer):
    """A budget that holds two of these requests at a time: the other two wait in the queue
    (seen in /stats), none fails, memory never exceeds the budget; a request that could never
    fit is a 400 that says why."""
    budget = 2 * 150 * KV_PER_TOKEN_FP32
    with live_server("-m", str(smollm2_folder), "--served-model-name", MODEL, "--dtype", "float32", "--no-draft",
                     "--kv-budget", str(budget), log=tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        results: list = [None] * 4

        def run(i):
            try:
                results[i] = chat(client, PROMPTS[i], max_tokens=100, extra_body={"ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - reported by the assert below
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        peak_waiting, peak_kv = 0, 0
        while any(t.is_alive() for t in threads):
            s = stats(url)
            peak_waiting, peak_kv = max(peak_waiting, s["waiting"]), max(peak_kv, s["kv_bytes_in_use"])
            time.sleep(0.05)
        assert [getattr(getattr(r, "usage", None), "completion_tokens", r) for r in results] == [100] * 4
        assert peak_waiting >= 1 and 0 < peak_kv <= budget
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, PROMPTS[0], max_tokens=400)
        assert "KV budget" in str(e.value)
        # with no max_tokens the default is what fits the budget, not the whole context
        r = chat(client, "Say OK.")
        assert r.choices[0].finish_reason in ("stop", "length")


# -- what no request may do to the server ------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_post_that_is_not_declared_json_is_refused(base_url, content_type):
    """A page on any site can POST text/plain or a form cross-origin without a preflight:
    such bodies are never parsed, so no web page can start generations here."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type:
        headers["Content-Type"] = content_type
    before = stats(base_url)["requests_finished"]
    r = httpx.post(base_url + "/v1/chat/completions", content=json.dumps(GOOD).encode(), headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]
    assert stats(base_url)["requests_finished"] == before
    ok = httpx.post(base_url + "/v1/chat/completions", content=json.dumps(GOOD).encode(),
                    headers={**headers, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_a_huge_prompt_is_refused_by_size_without_freezing_the_server(base_url):
    """5 MB of text cannot fit 8,192 tokens of a tokenizer whose longest token is 81
    characters: refused before tokenizing, while /health keeps answering."""
    body = {**GOOD, "messages": [{"role": "user", "content": "tokens " * 750_000}]}
    latencies, done = [], threading.Event()

    def poll():
        while not done.is_set():
            start = time.monotonic()
            httpx.get(base_url + "/health", timeout=30)
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for path, field, payload in (("/v1/chat/completions", "messages", body),
                                     ("/v1/completions", "prompt", {"model": MODEL, "prompt": "tokens " * 750_000})):
            r = httpx.post(base_url + path, json=payload, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field and "characters" in r.json()["error"]["message"]
    finally:
        done.set()
        poller.join()
    assert latencies and max(latencies) < 1.0, f"/health stalled for {max(latencies):.2f} s"


def test_a_prompt_longer_than_the_context_is_reported_against_the_prompt(base_url, client):
    long_text = "one two three four five six seven eight nine ten " * 1200  # ~12k tokens, under the size bound
    r = httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={**GOOD, "messages": [{"role": "user", "content": long_text}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": long_text, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "context length" in r.json()["error"]["message"]


def test_stats_do_not_reveal_paths(base_url, smollm2_folder):
    text = json.dumps(stats(base_url))
    assert str(smollm2_folder) not in text and str(smollm2_folder.parent) not in text
    models = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "/" not in json.dumps([m["id"] for m in models["data"]])


def test_openapi_describes_every_request_body(base_url):
    schema = httpx.get(base_url + "/openapi.json").json()
    for path, required in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        model = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
        assert required in model["required"] and "model" in model["required"]
        assert {"temperature", "max_tokens", "stream", "response_format"} <= set(model["properties"])
    # every $ref resolves
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs and refs <= set(schema["components"]["schemas"])


def test_requests_in_flight_at_shutdown_get_503(smollm2_folder, tmp_path):
    import signal

    from verispec.server.launch import free_port, server_process, verispec_serve_command

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = verispec_serve_command(port, "-m", str(smollm2_folder), "--dtype", "float32", "--no-draft")
    with server_process(cmd, base + "/health", log=tmp_path / "serve.log") as proc:
        body = {"model": "x", "messages": [{"role": "user", "content": "Count to a million."}], "max_tokens": 4000,
                "ignore_eos": True, "temperature": 0}
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        result = {}

        def long_request():
            result["r"] = httpx.post(base + "/v1/chat/completions", json={**body, "model": name}, timeout=120)

        thread = threading.Thread(target=long_request)
        thread.start()
        assert wait_for(lambda: stats(base)["running"] == 1, timeout=30)
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
    r = result["r"]
    assert r.status_code == 503, r.text
    assert "shutting down" in r.json()["error"]["message"]

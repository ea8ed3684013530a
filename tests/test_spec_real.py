"""Speculation on the real default model (float32): greedy outputs identical to plain
decoding for every source, batched with joins; a stop string inside an accepted burst
cuts exactly where plain decoding cuts; a drafter with another tokenizer is refused;
over HTTP, usage carries the speculation block and outputs equal the plain server's."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.errors import UserError
from verispec.models.loader import LoadedModel, load_model
from verispec.models.tokenizer import encode_chat
from verispec.server.launch import live_server
from verispec.drafting.factory import build_drafter
from verispec.drafting.ngram import NgramProvider
from verispec.drafting.two_model import TwoModelProvider

pytestmark = pytest.mark.real_model

CODE = (
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n"
    "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n"
)
PROMPTS = [
    "Repeat the following code exactly, then add a docstring to each function:\n" + CODE,
    "Write a short poem about autumn leaves.",
    "Here is a sentence: 'The committee will meet on Tuesday to review the budget.' Repeat it twice.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_folder) -> LoadedModel:
    return load_model(str(smollm2_folder), dtype=torch.float32)


def _ids(loaded, prompt):
    return encode_chat(loaded.tokenizer, [{"role": "user", "content": prompt}])


def _run(loaded, drafter, limits, stop=(), **config):
    engine = Engine(loaded.model, loaded.tokenizer, loaded.stop_ids,
                    EngineConfig(kv_budget=2**30, **config), drafter=drafter)
    collectors = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, limits)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(_ids(loaded, prompt), n, stop=stop), collectors[-1])
        for _ in range(3 * i):
            engine.step()
    engine.run_until_idle()
    return [c.result(0) for c in collectors]


@pytest.mark.parametrize("source", ["ngram", "self-draft"])
def test_greedy_speculation_on_smollm2_equals_plain(smollm2, source):
    limits = [96, 48, 64]
    plain = _run(smollm2, None, limits)
    drafter = NgramProvider() if source == "ngram" else TwoModelProvider(smollm2.model, max_draft=63)
    spec = _run(smollm2, drafter, limits, num_draft_tokens=6, adaptive_draft=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.text for r in spec] == [r.text for r in plain]
    accepted = sum(r.speculation["accepted"] for r in spec)
    assert accepted > 20, "drafts were accepted in bursts"


def test_stop_string_inside_an_accepted_burst_cuts_exactly(smollm2):
    plain = _run(smollm2, None, [96, 8, 8])[0]
    # a stop string from the copied code: ngram drafts accept whole lines of it
    stop = "** 2 f"
    assert stop in plain.text
    plain_cut = _run(smollm2, None, [96, 8, 8], stop=(stop,))[0]
    spec_cut = _run(smollm2, NgramProvider(), [96, 8, 8], stop=(stop,), num_draft_tokens=8, adaptive_draft=False)[0]
    assert spec_cut.text == plain_cut.text == plain.text[: plain.text.find(stop)]
    assert spec_cut.finish_reason == "stop" and spec_cut.speculation["accepted"] > 0


def test_a_drafter_with_another_tokenizer_is_refused(smollm2, gemma_folder):
    with pytest.raises(UserError, match="tokenizer differs"):
        build_drafter(smollm2, None, str(gemma_folder), torch.float32)
    with pytest.raises(UserError, match="one of"):
        build_drafter(smollm2, "ngram", str(gemma_folder), torch.float32)


def test_served_speculation_reports_usage_and_changes_nothing(smollm2_folder, tmp_path):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    args = ("-m", str(smollm2_folder), "--served-model-name", "m", "--dtype", "float32")
    outputs = {}
    for name, extra in (("plain", ("--no-draft",)), ("ngram", ("--speculate", "ngram"))):
        with live_server(*args, *extra, log=tmp_path / f"{name}.log") as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            whole = client.chat.completions.create(model="m", messages=messages, max_tokens=80, temperature=0)
            chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=80, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == whole.choices[0].message.content
            outputs[name] = (whole, chunks[-1].usage)
            metrics = httpx.get(url + "/metrics").text
            assert ("verispec_spec_accepted_tokens_total" in metrics) == (name == "ngram")
    plain, spec = outputs["plain"], outputs["ngram"]
    assert spec[0].choices[0].message.content == plain[0].choices[0].message.content
    block = spec[0].usage.model_extra["speculation"]
    assert block["drafted"] >= block["accepted"] > 0 and block["rounds"] > 0
    # tokens per target forward, bonus included: every decode round emits at least one
    assert 1.0 < block["mean_accepted_length"] <= 9.0
    assert block["rounds"] < spec[0].usage.completion_tokens
    streamed_block = spec[1].model_extra["speculation"]  # another request: its drafts may differ, its text does not
    assert set(streamed_block) == set(block) and streamed_block["accepted"] > 0
    assert "speculation" not in (plain[0].usage.model_extra or {})

"""The continuous-batching engine against its oracles.

* Batching is exact: requests joining and leaving a running batch at staggered steps
  (chunked prefill interleaved with decode) produce, in float32, the same greedy tokens as
  transformers' own decode of each prompt alone, for every family (gemma3's sliding
  window included).
* Sampling rows keep their own seeded streams: a seeded request gives the same tokens in a
  busy batch as alone.
* Memory: the KV budget queues requests instead of over-committing; first come first
  served, so a large request is not starved by a stream of small ones; a request that
  can never fit, or exceeds the context, is refused before any work; a cancelled row
  frees its KV at once.
* Failure stays local: a row whose forward raises fails alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import CharTokenizer, build_reference, family_configs, reference_greedy
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest, RequestRejected
from verispec.engine.sampling import SamplingParams
from verispec.models.loader import load_folder

FAMILIES = ["llama", "qwen3", "gemma3", "gemma4-shared-moe"]



@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(family_configs()[request.param], folder)
    return reference, load_folder(folder, dtype=torch.float32)


def _engine(model, **config) -> Engine:
    return Engine(model, CharTokenizer(), stop_ids=(), config=EngineConfig(**{"kv_budget": 2**30, **config}))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # lengths straddle the prefill chunk and gemma3's window of 8
    return [torch.randint(0, 97, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_staggered_joins_and_leaves_match_each_request_alone(tiny):
    reference, model = tiny
    prompts = _prompts(5)
    max_tokens = [24, 7, 30, 12, 18]  # rows leave at different steps
    expected = [reference_greedy(reference, p, n) for p, n in zip(prompts, max_tokens)]

    engine = _engine(model, prefill_chunk=8, idle_prefill_chunk=8)
    collectors = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, n), collectors[-1])
        for _ in range(3 + 2 * i):  # later requests join a batch that is already decoding
            engine.step()
    engine.run_until_idle()
    got = [c.result(0).token_ids for c in collectors]
    assert got == expected
    assert engine.cache.bytes_in_use == 0 and not engine.scheduler.running


def test_prefill_is_chunked_and_interleaved_with_decode(tiny):
    _, model = tiny
    engine = _engine(model, prefill_chunk=4, idle_prefill_chunk=4)
    streaming = Collector()
    engine.submit(GenerationRequest(_prompts(1)[0], 40), streaming)
    while not engine.scheduler.running or engine.scheduler.running[0].state.value != "decode":
        engine.step()
    long_prompt = _prompts(1, seed=3)[0] * 3  # 3 x (3..40) tokens: several chunks of 4
    engine.submit(GenerationRequest(long_prompt, 4), Collector())
    before = len(engine.scheduler.running[0].output)
    steps = 0
    while len(engine.scheduler.running) < 2 or engine.scheduler.running[1].remaining_prompt > 0:
        engine.step()
        steps += 1
    decoded = len(engine.scheduler.running[0].output) - before
    assert steps >= len(long_prompt) // 4, "the long prompt was prefilled in chunks"
    assert decoded >= steps - 1, "the running stream got a token on every prefill step"


def test_seeded_sampling_in_a_busy_batch_equals_alone(tiny):
    _, model = tiny
    params = SamplingParams(temperature=0.9, top_k=20, seed=1234, repetition_penalty=1.2)
    prompt = _prompts(1, seed=7)[0]
    alone = _engine(model).generate(GenerationRequest(prompt, 20, params)).token_ids

    engine = _engine(model, prefill_chunk=8)
    others = [Collector() for _ in range(3)]
    for i, p in enumerate(_prompts(3, seed=8)):
        engine.submit(GenerationRequest(p, 25, SamplingParams(temperature=1.0, seed=i)), others[i])
    for _ in range(4):
        engine.step()
    mine = Collector()
    engine.submit(GenerationRequest(prompt, 20, params), mine)
    engine.run_until_idle()
    assert mine.result(0).token_ids == alone


def test_kv_budget_queues_first_come_first_served(tiny):
    _, model = tiny
    probe = _engine(model)
    small, large = 30, 90
    budget = probe.cache.bytes_for(large)  # one large request, or three small ones
    engine = _engine(model, kv_budget=budget)
    order = []

    def sink(name):
        def record(out):
            if out.finished:
                order.append(name)
        return record

    prompt = [1, 2, 3]
    engine.submit(GenerationRequest(prompt, small - 3), sink("s0"))
    engine.submit(GenerationRequest(prompt, large - 3), sink("L"))
    for i in range(1, 6):  # a steady stream of small requests behind the large one
        engine.submit(GenerationRequest(prompt, small - 3), sink(f"s{i}"))
    peak = 0
    while engine.step() or engine._rows:
        peak = max(peak, engine.scheduler.reserved)
        assert engine.scheduler.reserved <= budget
        assert engine.cache.bytes_in_use <= budget
    assert peak <= budget
    assert order.index("L") < order.index("s2"), f"the large request was overtaken: {order}"
    assert sorted(order) == sorted(["s0", "L", *(f"s{i}" for i in range(1, 6))])


def test_requests_that_can_never_run_are_refused_before_work(tiny):
    _, model = tiny
    engine = _engine(model, kv_budget=_engine(model).cache.bytes_for(50))
    with pytest.raises(RequestRejected, match="KV budget") as e:
        engine.submit(GenerationRequest([1, 2, 3], 60), Collector())
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestRejected, match="context length"):
        engine.submit(GenerationRequest([1, 2, 3], model.args.max_position_embeddings), Collector())
    with pytest.raises(RequestRejected, match="empty"):
        engine.submit(GenerationRequest([], 5), Collector())
    with pytest.raises(RequestRejected, match="vocabulary"):
        engine.submit(GenerationRequest([1], 5, SamplingParams(logit_bias={500: 1.0})), Collector())
    assert engine.max_new_tokens(3) == 47
    assert engine.metrics.requests_rejected == 4 and not engine._rows


def test_cancel_frees_the_row_and_its_memory_at_once(tiny):
    _, model = tiny
    engine = _engine(model)
    keep, drop = Collector(), Collector()
    engine.submit(GenerationRequest([5, 6, 7], 30), keep)
    request = GenerationRequest([8, 9], 30)
    engine.submit(request, drop)
    for _ in range(5):
        engine.step()
    held = engine.cache.bytes_in_use
    engine.cancel(request.request_id)
    engine.step()
    assert engine.cache.bytes_in_use == held - engine.cache.bytes_for(32)
    assert len(engine.scheduler.running) == 1
    engine.run_until_idle()
    assert drop.result(0).finish_reason == "abort"
    kept = keep.result(0)
    assert kept.finish_reason == "length" and len(kept.token_ids) == 30
    assert engine.cache.bytes_in_use == 0


def test_a_failing_row_fails_alone(tiny, monkeypatch):
    reference, model = tiny
    prompts = _prompts(3, seed=11)
    expected = [reference_greedy(reference, p, 10) for p in prompts]
    engine = _engine(model)
    collectors = [Collector() for _ in prompts]
    bad = GenerationRequest(prompts[1], 10)
    for prompt, c in zip(prompts, collectors):
        engine.submit(bad if prompt is prompts[1] else GenerationRequest(prompt, 10), c)
    for _ in range(3):
        engine.step()
    # from now on, any forward that includes the bad row raises (a poisoned row)
    original = type(model).forward
    bad_kv = engine._rows[bad.request_id].kv

    def poisoned(self, input_ids, batch, *args, **kwargs):
        if any(seq is bad_kv for seq in batch.seqs):
            raise RuntimeError("poisoned row")
        return original(self, input_ids, batch, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", poisoned)
    engine.run_until_idle()
    results = [c.result(0) for c in collectors]
    assert results[1].finish_reason == "error" and "poisoned" in results[1].error
    assert results[0].token_ids == expected[0] and results[2].token_ids == expected[2]
    assert engine.cache.bytes_in_use == 0


def test_joined_rows_is_the_concatenation_and_a_view_where_the_rows_lie_back_to_back():
    """decide() joins the emitting rows' logits: the same values as torch.cat in every
    layout, without a copy when they are consecutive slices of the forward's logits."""
    from verispec.engine.runner import joined_rows

    base, wide = torch.randn(10, 7), torch.randn(10, 14)
    layouts = {
        "consecutive": ([base[0:2], base[2:3], base[3:7]], True),
        "an empty slice between": ([base[0:2], base[2:2], base[2:5]], True),
        "a gap": ([base[0:2], base[3:4]], False),
        "out of order": ([base[2:4], base[0:2]], False),
        "another buffer": ([base[0:2], torch.randn(3, 7)], False),
        "narrowed columns": ([base[0:1, :3], base[1:3, :3]], True),
        "columns strided otherwise": ([wide[0:2, ::2], wide[2:3, :7]], False),
    }
    for name, (parts, shares) in layouts.items():
        joined = joined_rows(parts)
        assert torch.equal(joined, torch.cat(parts)), name
        assert (joined.data_ptr() == parts[0].data_ptr()) == shares, name

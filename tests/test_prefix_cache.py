"""The prefix cache (engine/prefix_cache.py) against its oracles.

* Lossless: greedy tokens with the cache on equal transformers' decode of each prompt
  alone and the same engine with the cache off, for every family (gemma3's sliding window
  of 8 included), across multi-turn conversations (turn 2 starts with turn 1's prompt and
  answer), staggered joins and leaves, n-gram speculation (rollbacks) and evictions.
* It hits: turn 2 skips the tokens turn 1 left behind (prefill tokens computed drop by
  them); a prompt differing in its first block does not hit.
* Memory: the cache's bytes plus the rows' reservations never exceed the KV budget; a
  row that needs the memory evicts cache entries instead of waiting.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import CharTokenizer, build_reference, family_configs, reference_greedy
from verispec.drafting.ngram import NgramProvider
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.models.loader import load_folder

FAMILIES = ["llama", "qwen3", "gemma3", "gemma4-shared-moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(family_configs()[request.param], folder)
    return reference, load_folder(folder, dtype=torch.float32)


def _engine(model, drafter=None, **config) -> Engine:
    return Engine(model, CharTokenizer(), stop_ids=(),
                  config=EngineConfig(**{"kv_budget": 2**30, "prefill_chunk": 8, "idle_prefill_chunk": 8, **config}),
                  drafter=drafter)


def _run(engine: Engine, prompts: list[list[int]], max_tokens: list[int], stagger: int = 0,
         check_budget: bool = True) -> list[list[int]]:
    collectors = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, n), collectors[-1])
        for _ in range(stagger * (i + 1)):
            engine.step()
            if check_budget:
                _assert_budget(engine)
    while engine.step() or engine._rows:
        if check_budget:
            _assert_budget(engine)
    return [c.result(0).token_ids for c in collectors]


def _assert_budget(engine: Engine) -> None:
    s = engine.scheduler
    assert s.reserved + s.prefix_bytes <= engine.kv_budget
    assert engine.prefix is None or engine.prefix.bytes <= engine.prefix.max_bytes


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_second_turn_reuses_the_first_and_decodes_the_same(tiny):
    reference, model = tiny
    turn1 = _prompt(37, 1)
    engine = _engine(model)
    (answer,) = _run(engine, [turn1], [20])
    assert answer == reference_greedy(reference, turn1, 20)
    turn2 = turn1 + answer + _prompt(9, 2)
    before = engine.metrics.prefill_tokens
    (second,) = _run(engine, [turn2], [16])
    stats = engine.prefix.stats()
    assert stats["hits"] == 1 and stats["hit_tokens"] >= 48  # 37 + 20 - 1 tokens held: 3 blocks of 16
    assert engine.metrics.prefill_tokens - before == len(turn2) - stats["hit_tokens"]
    assert second == reference_greedy(reference, turn2, 16)
    off = _engine(model, prefix_cache=False)
    assert _run(off, [turn1, turn2], [20, 16]) == [answer, second] and off.prefix is None
    miss = [turn2[0] + 1] + turn2[1:]  # the first block differs: nothing to reuse
    _run(engine, [miss], [4])
    assert engine.prefix.stats()["hits"] == 1


def test_staggered_rows_with_a_shared_prefix_speculation_and_evictions(tiny):
    reference, model = tiny
    system = _prompt(40, 3)
    prompts = [system + _prompt(n, 10 + i) for i, n in enumerate([5, 12, 3, 20, 9, 15])]
    max_tokens = [12, 20, 7, 15, 18, 10]
    expected = [reference_greedy(reference, p, n) for p, n in zip(prompts, max_tokens)]
    # a cap of about two entries: later rows evict earlier ones
    per_token = model.new_cache().bytes_for(1)
    engine = _engine(model, NgramProvider(min_ngram=1), prefix_cache_bytes=per_token * 130)
    assert _run(engine, prompts, max_tokens, stagger=3) == expected
    stats = engine.prefix.stats()
    # a sliding-window model reuses an entry only at its own length (its ring keeps no older
    # window), so rows sharing just the system prompt do not hit there
    assert (stats["hits"] >= 3 and stats["evictions"] >= 1) if not engine.prefix.sliding else stats["hits"] == 0
    assert engine.drafting.totals.rounds > 0  # speculation ran (and rolled back) on restored rows


def test_the_choices_of_one_prompt_prefill_it_once(tiny):
    reference, model = tiny
    prompt = _prompt(40, 6)
    engine = _engine(model)
    outs = _run(engine, [prompt] * 3, [10, 10, 10])  # submitted together, as the server does for n = 3
    assert outs == [reference_greedy(reference, prompt, 10)] * 3
    # the first computes all 40 tokens, the others only what follows the last whole block
    # of the first 39 (32 restored): 40 + 2 x 8, where three full prefills were 120
    assert engine.metrics.prefill_tokens == 40 + 2 * 8
    off = _engine(model, prefix_cache=False)
    assert _run(off, [prompt] * 3, [10, 10, 10]) == outs and off.metrics.prefill_tokens == 120


def test_choices_that_add_nothing_to_the_cache_start_in_the_same_step(tiny):
    """A twin waits only for a row whose prefill puts blocks into the cache. A prompt shorter
    than a block has none (all its choices prefill in the first step), and once the first
    choice of a long prompt is cached, the others restore it whole and start together:
    steps to finish one token each are 1 and 2, where waiting on every twin took 3 and 3
    (one choice a step). Same tokens as transformers' decode of the prompt alone."""
    reference, model = tiny
    for prompt, steps in ((_prompt(10, 7), 1), (_prompt(40, 8), 2)):
        engine = _engine(model, prefill_chunk=64, idle_prefill_chunk=64)
        collectors = [Collector() for _ in range(3)]
        for c in collectors:
            engine.submit(GenerationRequest(prompt, 1), c)
        taken = 0
        while engine.step():
            taken += 1
        assert [c.result(0).token_ids for c in collectors] == [reference_greedy(reference, prompt, 1)] * 3
        assert taken == steps, f"{len(prompt)}-token prompt: {taken} steps"


def test_a_row_that_needs_the_memory_evicts_the_cache_instead_of_waiting(tiny):
    _, model = tiny
    cache = model.new_cache()
    engine = _engine(model, kv_budget=cache.bytes_for(60) * 2, prefix_cache_bytes=cache.bytes_for(60))
    _run(engine, [_prompt(30, 4)], [20])
    held = engine.prefix.bytes
    assert held > 0
    # now a row of 60 tokens fits the budget only without the cached entry
    engine.kv_budget = engine.scheduler.kv_budget = cache.bytes_for(60) + held - 1
    out = _run(engine, [_prompt(50, 5)], [10])
    assert len(out[0]) == 10 and engine.prefix.stats()["evictions"] >= 1


def test_a_drafter_reading_hidden_states_restores_their_features_and_proposes_as_without_the_cache():
    """A DSpark row restores a prefix together with the tapped features of its positions,
    so its drafter is handed what the prefill it skipped would have given it. Oracle: the
    same conversation with the cache off (the DeepSpec fixture's target and drafter, float32,
    every round a full block): the same tokens, and the same proposals round by round
    (tokens equal, confidence logits within float32 rounding: the features of a position
    computed in turn 1's decode steps or in turn 2's prefill). An entry left by a row
    without a drafter (no features) is not restored into a row whose drafter needs them."""
    import json

    from tests.fixtures import oracle
    from verispec.drafting.dspark.checkpoint import load_dspark
    from verispec.drafting.dspark.source import DSparkProvider
    from verispec.models.loader import load_model

    root = oracle()
    target = load_model(str(root / "target"), dtype=torch.float32)
    drafter = load_dspark(root / "drafter", dtype=torch.float32)
    turn1 = json.loads((root / "prompts.jsonl").read_text().splitlines()[0])["prompt_ids"]

    def conversation(prefix_cache: bool):
        provider = DSparkProvider(drafter, confidence_threshold=0.0)
        provider.trace = []
        engine = Engine(target.model, CharTokenizer(), target.stop_ids,
                        EngineConfig(kv_budget=2**30, adaptive_draft=False, prefix_cache=prefix_cache,
                                     prefill_chunk=16, idle_prefill_chunk=16), drafter=provider)
        plain = engine.generate(GenerationRequest(turn1, 20, speculation=False)).token_ids  # an entry without features
        hits = engine.prefix.stats()["hits"] if prefix_cache else 0
        first = engine.generate(GenerationRequest(turn1 + plain[:3], 24)).token_ids
        missed = (engine.prefix.stats()["hits"] - hits) if prefix_cache else 0
        turn2 = turn1 + plain[:3] + first + turn1[:7]
        before = engine.metrics.prefill_tokens
        second = engine.generate(GenerationRequest(turn2, 24)).token_ids
        proposals = [(e["draft_tokens"], e["proposal_len"], e["num_new_context"], e["confidence_logits"])
                     for e in provider.trace if e["event"] == "propose"]
        return plain, first, second, proposals, engine.metrics.prefill_tokens - before, missed, len(turn2), engine

    *on, computed, missed, n_prompt, engine = conversation(True)
    *off, computed_off, _, _, _ = conversation(False)
    assert missed == 0, "the entry without features was restored into a row whose drafter reads them"
    assert on[:3] == off[:3]
    assert computed_off == n_prompt and computed < n_prompt - 32, (computed, n_prompt)  # turn 2 restored turn 1
    assert engine.drafting.totals.accepted > 0
    assert len(on[3]) == len(off[3]) > 0
    for a, b in zip(on[3], off[3]):
        assert a[:3] == b[:3]
        assert torch.allclose(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-4)

"""Structured output inside the engine: masks, batching, speculation, finishing.

Tiny random models with grammars over token ids (tests/token_grammars.py), so every
check has a plain-Python oracle:
* greedy with a grammar equals transformers' forward with the same mask applied by hand,
  token for token, for rows joining mid-decode with different grammars side by side;
* with speculation (n-gram, a draft model, the target drafting for itself) the output is
  the same as grammar without speculation, and a grammar that completes inside an
  accepted burst ends the output there;
* the matcher ends holding exactly the emitted tokens (draft walks are rolled back);
* sampling with a draft model under a grammar has the exact masked distribution (chi-square
  over the first tokens against an enumeration with the mask applied by hand);
* a dead-end grammar fails its row alone; max_tokens inside the grammar is "length".
"""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch

from tests.goodness_of_fit import chi_square_p
from tests.tiny_models import TINY_VOCAB, CharTokenizer, build_reference, family_configs, reference_logits, tiny_vocab_pair
from tests.token_grammars import CompiledTokenGrammar, DeadEnd, EndsWithEos, NoMultiplesOf, Phrase, Template
from verispec.engine import sampling
from verispec.engine.engine import Engine, EngineConfig
from verispec.engine.request import Collector, GenerationRequest
from verispec.engine.sampling import SamplingParams
from verispec.models.loader import load_folder
from verispec.drafting.ngram import NgramProvider
from verispec.drafting.two_model import TwoModelProvider

VOCAB = 97


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = family_configs()["llama"]
    folder = tmp_path_factory.mktemp("grammar-llama")
    reference = build_reference(config, folder / "target", seed=0)
    build_reference(config, folder / "draft", seed=1)
    return reference, load_folder(folder / "target"), load_folder(folder / "draft")


def masked_reference_greedy(reference, prompt, n, grammar) -> list[int]:
    """transformers' logits, the grammar's mask by hand, argmax; stop when complete and
    nothing more is allowed."""
    out: list[int] = []
    while len(out) < n:
        allowed = grammar.allowed(tuple(out))
        if grammar.complete(tuple(out)):
            allowed = allowed | set(grammar.eos)
        if not allowed:
            break
        logits = reference_logits(reference, prompt + out)[-1]
        mask = torch.full_like(logits, -math.inf)
        mask[sorted(allowed)] = 0
        token = int((logits + mask).argmax())
        if token in grammar.eos:
            break
        out.append(token)
    return out


def engine_for(model, drafter=None, k=4, stop_ids=(), **config):
    cfg = EngineConfig(kv_budget=2**30, num_draft_tokens=k, adaptive_draft=False, **config)
    return Engine(model, CharTokenizer(), stop_ids=stop_ids, config=cfg, drafter=drafter)


PROMPTS = [[5, 9, 14, 3, 5, 9, 14, 3, 5, 9], [22, 8, 22, 8, 22, 8, 1], [40, 41, 42, 40, 41, 42], [7, 7, 7, 7, 7, 7]]


def grammars():
    return [Phrase(), NoMultiplesOf(5, 17, VOCAB), None, Template()]


def run_staggered(engine, limits, compiled, params=None):
    collectors = []
    for i, (prompt, n, grammar) in enumerate(zip(PROMPTS, limits, compiled)):
        collectors.append(Collector())
        engine.submit(GenerationRequest(prompt, n, params or SamplingParams(), grammar=grammar), collectors[-1])
        for _ in range(1 + 2 * i):  # later rows join mid-decode, next to rows with other grammars
            engine.step()
    engine.run_until_idle()
    return [c.result(0) for c in collectors]


LIMITS = [30, 30, 12, 30]


def test_greedy_with_grammars_equals_transformers_with_the_mask(models):
    reference, target, _ = models
    gs = grammars()
    compiled = [CompiledTokenGrammar(g) if g else None for g in gs]
    results = run_staggered(engine_for(target, prefill_chunk=4), LIMITS, compiled)
    for r, g, prompt, n, c in zip(results, gs, PROMPTS, LIMITS, compiled):
        if g is None:
            assert r.finish_reason == "length"
            continue
        assert r.token_ids == masked_reference_greedy(reference, prompt, n, g)
        assert g.accepts(r.token_ids), "the output is in the grammar"
        assert r.finish_reason == "stop", "a complete grammar ends the row"
        assert c.matchers[0].prefix == r.token_ids, "the matcher holds exactly the emitted tokens"


@pytest.mark.parametrize("source", ["ngram", "draft-model", "self-draft"])
def test_grammar_with_speculation_equals_grammar_without(models, source):
    reference, target, draft = models
    drafter = {"ngram": lambda: NgramProvider(min_ngram=1),
               "draft-model": lambda: TwoModelProvider(draft, max_draft=63),
               "self-draft": lambda: TwoModelProvider(target, max_draft=63)}[source]()
    plain = run_staggered(engine_for(target, prefill_chunk=4), LIMITS,
                          [CompiledTokenGrammar(g) if g else None for g in grammars()])
    compiled = [CompiledTokenGrammar(g) if g else None for g in grammars()]
    engine = engine_for(target, drafter, k=5, prefill_chunk=4)
    spec = run_staggered(engine, LIMITS, compiled)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    for r, c in zip(spec, compiled):
        if c is not None:
            assert c.matchers[0].prefix == r.token_ids, "drafts walked for masks were rolled back exactly"
    totals = engine.drafting.totals
    assert totals.drafted > 0
    if source == "self-draft":
        # the target's unmasked argmax is often what the grammar allows: bursts get
        # accepted, and NoMultiplesOf completes inside one (its length is not a
        # multiple of the burst)
        assert totals.accepted > 0
    assert engine.cache.bytes_in_use == 0


@pytest.mark.parametrize("source", [None, "draft-model"])
def test_forced_token_drafts_change_nothing_but_the_number_of_steps(models, source):
    """The tokens a grammar forces are verified as drafts: the same output as decoding
    them one step each, in fewer steps; with a drafter, the forced rows skip it."""
    _, target, draft = models

    def run(forced):
        drafter = TwoModelProvider(draft, max_draft=63) if source else None
        engine = engine_for(target, drafter, k=5, prefill_chunk=4, forced_drafts=forced)
        results = run_staggered(engine, LIMITS, [CompiledTokenGrammar(g) if g else None for g in grammars()])
        return results, engine

    (off, engine_off), (on, engine_on) = run(False), run(True)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = engine_on.stats()["forced_drafts"]
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], "greedy keeps what the grammar forces"
    assert engine_off.stats()["forced_drafts"]["drafted"] == 0
    assert engine_on.metrics.steps < engine_off.metrics.steps
    template = on[3].speculation  # the usage block, with or without a drafter
    assert template["forced_drafted"] > 0 and template["forced_accepted"] == template["forced_drafted"]
    assert template["mean_accepted_length"] > 1


class OracleDrafts:
    """A draft source that proposes the known answer and junk after its end, so a round's
    burst runs past the grammar's completion."""

    def __init__(self, answer: list[int], junk: int):
        from verispec.engine.draft import Draft, DraftProvider, DraftSource

        class Source(DraftSource):
            def __init__(self, context):
                self.output = context.output

            def draft(self, pending, max_n):
                rest = answer[len(self.output):]
                return Draft((rest + [junk] * max_n)[:max_n])

        class Provider(DraftProvider):
            name = "oracle"

            def new_source(self, context):
                return Source(context)

        self.provider = Provider()


def test_a_grammar_completing_inside_an_accepted_burst_ends_the_output_there(models):
    reference, target, _ = models
    grammar = NoMultiplesOf(5, 17, VOCAB)
    answer = masked_reference_greedy(reference, PROMPTS[1], 40, grammar)
    assert len(answer) == 17
    engine = engine_for(target, OracleDrafts(answer, junk=1).provider, k=5)
    r = engine.generate(GenerationRequest(PROMPTS[1], 40, grammar=CompiledTokenGrammar(grammar)))
    assert r.token_ids == answer and r.finish_reason == "stop"
    # the first token comes from the prompt's step; then 6, 6, and a last round whose 5
    # drafts are the answer's last 4 tokens and junk: the output ends at the 4th
    assert r.speculation["rounds"] == 3 and r.speculation["accepted"] == 14
    assert engine.cache.bytes_in_use == 0


def test_eos_is_allowed_only_once_the_grammar_is_complete(models):
    _, target, _ = models
    # the model's favourite next token at the start: make it the stop id, so without the
    # grammar's rule the row would stop at once
    first = int(reference_logits(models[0], PROMPTS[0])[-1].argmax())
    grammar = EndsWithEos(first)
    engine = engine_for(target, stop_ids=(first,))
    plain = engine.generate(GenerationRequest(PROMPTS[0], 20))
    assert plain.token_ids == [] and plain.finish_reason == "stop"
    r = engine.generate(GenerationRequest(PROMPTS[0], 20, grammar=CompiledTokenGrammar(grammar)))
    assert r.token_ids == masked_reference_greedy(models[0], PROMPTS[0], 20, grammar)
    assert len(r.token_ids) >= 2 and all(t in (4, 5, 6) for t in r.token_ids)
    assert r.finish_reason == ("length" if len(r.token_ids) == 20 else "stop")


def test_max_tokens_inside_the_grammar_is_length(models):
    _, target, _ = models
    r = engine_for(target).generate(GenerationRequest(PROMPTS[1], 5, grammar=CompiledTokenGrammar(Phrase())))
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    g = Phrase()
    assert all(t in g.allowed(tuple(r.token_ids[:i])) for i, t in enumerate(r.token_ids)), "a valid prefix"
    assert not g.accepts(r.token_ids), "cut before the grammar was complete"


def test_a_dead_end_grammar_fails_its_row_alone(models):
    reference, target, _ = models
    engine = engine_for(target, NgramProvider(min_ngram=1), k=3)
    dead, fine = Collector(), Collector()
    engine.submit(GenerationRequest(PROMPTS[0], 10, grammar=CompiledTokenGrammar(DeadEnd())), dead)
    engine.submit(GenerationRequest(PROMPTS[1], 10, grammar=CompiledTokenGrammar(Phrase())), fine)
    engine.run_until_idle()
    d, f = dead.result(0), fine.result(0)
    assert d.finish_reason == "error" and "allows no next token" in d.error
    assert len(d.token_ids) == 2
    assert f.token_ids == masked_reference_greedy(reference, PROMPTS[1], 10, Phrase())


# -- sampling: the masked distribution, exactly --------------------------------------------------


class FirstTokens(NoMultiplesOf):
    """On the 6-token vocabulary: tokens 1, 2, 4, 5 only (no multiples of 3), 4 of them."""

    def __init__(self):
        super().__init__(3, 4, TINY_VOCAB)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    return tiny_vocab_pair(tmp_path_factory.mktemp("grammar-tiny-vocab"))


PROMPT = [1, 4, 2]
TEMPERATURE, TOP_K = 0.8, 3


def exact_masked(reference, grammar, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens): transformers' logits, mask, temperature, top-k, softmax, by hand."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, mass in dist.items():
            logits = reference_logits(reference, PROMPT + list(prefix))[-1]
            allowed = torch.zeros(TINY_VOCAB, dtype=torch.bool)
            allowed[sorted(grammar.allowed(prefix))] = True
            scores = logits.masked_fill(~allowed, -math.inf) / TEMPERATURE
            kth = scores.topk(TOP_K).values[-1]
            probs = scores.masked_fill(scores < kth, -math.inf).softmax(-1)
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    nxt[prefix + (token,)] = mass * p
        dist = nxt
    total = sum(dist.values())  # float32 softmax rounding: renormalize for the test's sums
    return {k: v / total for k, v in dist.items()}


N_SAMPLES = 5000


def sample_under_grammar(target, draft, grammar) -> dict[tuple[int, ...], int]:
    engine = Engine(target, CharTokenizer(), (), EngineConfig(kv_budget=2**31, max_rows=512, num_draft_tokens=3,
                                                              max_waiting=N_SAMPLES + 1, adaptive_draft=False),
                    drafter=TwoModelProvider(draft, max_draft=63))
    compiled = CompiledTokenGrammar(grammar)
    collectors = []
    with mock.patch.object(sampling.secrets, "randbits", side_effect=itertools.count(1)):
        for _ in range(N_SAMPLES):
            c = Collector()
            engine.submit(GenerationRequest(PROMPT, 4, SamplingParams(temperature=TEMPERATURE, top_k=TOP_K),
                                            grammar=compiled), c)
            collectors.append(c)
        engine.run_until_idle()
    counts: dict[tuple[int, ...], int] = {}
    for c in collectors:
        r = c.result(0)
        assert grammar.accepts(r.token_ids)
        key = tuple(r.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    totals = engine.drafting.totals
    assert totals.drafted > 0 and 0 < totals.accepted < totals.drafted
    return counts


def test_sampling_with_a_draft_model_under_a_grammar_keeps_the_masked_distribution(tiny_vocab):
    reference, target, draft = tiny_vocab
    exact = exact_masked(reference, FirstTokens(), 3)
    counts = sample_under_grammar(target, draft, FirstTokens())
    assert chi_square_p(counts, exact) > 1e-3


def test_masking_after_top_k_instead_of_before_is_caught(tiny_vocab, monkeypatch):
    """The power check: truncating first and masking after changes the distribution
    (top-k picks among tokens the grammar forbids), and the same test sees it."""
    from verispec.engine import runner

    reference, target, draft = tiny_vocab
    exact = exact_masked(reference, FirstTokens(), 3)
    original = runner.process_logits

    def mask_last(logits, params, prompts=None, histories=None, grammar_mask=None):
        scores = original(logits, params, prompts, histories).clone()
        if grammar_mask is not None:
            rows, forbidden = grammar_mask
            scores[rows if rows is not None else slice(None)] = scores[rows if rows is not None else slice(None)] \
                .masked_fill(forbidden, -math.inf)
        return scores

    monkeypatch.setattr(runner, "process_logits", mask_last)
    counts = sample_under_grammar(target, draft, FirstTokens())
    assert chi_square_p(counts, exact) < 1e-6

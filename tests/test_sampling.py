"""Tests for verispec.engine.sampling, against independent oracles.

* transformers' logits processors (TemperatureLogitsWarper, TopKLogitsWarper,
  TopPLogitsWarper, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
  SequenceBiasLogitsProcessor) on random logits and histories;
* a per-token loop of OpenAI's documented presence/frequency formula;
* each row processed alone, for batches that mix settings;
* a chi-square test (scipy) of sampled frequencies against softmax(processed),
  with a wrong distribution that must fail it;
* torch.log_softmax of the raw logits for logprobs.

No test compares against a stored snapshot of this module's own output.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.goodness_of_fit import chi_square_p_of_arrays
from verispec.engine import sampling
from verispec.engine.sampling import (
    SamplingParams,
    make_generator,
    process_logits,
    sample,
    sampling_probs,
    token_logprobs,
)

VOCAB = 1000


def random_logits(rows: int, vocab: int = VOCAB, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def random_history(length: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Token ids drawn from a small range so that repeats (counts > 1) are common."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 60), (length,), generator=generator)


def hf_chain(logits_row: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """One row through transformers' processors (plus the hand presence/frequency
    oracle), in the documented order."""
    scores = logits_row.float().unsqueeze(0).clone()
    input_ids = torch.cat([torch.as_tensor(prompt, dtype=torch.long), torch.as_tensor(output, dtype=torch.long)])
    input_ids = input_ids.unsqueeze(0)
    if params.logit_bias:
        bias = [[[token], value] for token, value in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(input_ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    scores = openai_penalties_oracle(scores[0], output, params.presence_penalty, params.frequency_penalty)[None]
    if params.is_greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(input_ids, scores)
    return scores[0]


def openai_penalties_oracle(row: torch.Tensor, output, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula, token by token:
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence,
    with c[j] the count of token j in the generated tokens (not the prompt)."""
    out = row.clone()
    counts: dict[int, int] = {}
    for token in torch.as_tensor(output).tolist():
        counts[token] = counts.get(token, 0) + 1
    for token, count in counts.items():
        if 0 <= token < row.shape[0]:
            out[token] = out[token] - count * frequency - float(count > 0) * presence
    return out


def assert_same_rows(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same removed (-inf) set exactly; surviving values equal to float32 rounding."""
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Each processor against transformers


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.9])
def test_temperature_matches_hf(temperature):
    logits = random_logits(4)
    ours = process_logits(logits, [SamplingParams(temperature=temperature)] * 4)
    assert torch.equal(ours, TemperatureLogitsWarper(temperature)(None, logits))


@pytest.mark.parametrize("top_k", [1, 5, 50, VOCAB - 1, VOCAB, VOCAB + 7])
def test_top_k_matches_hf(top_k):
    logits = random_logits(4)
    ours = process_logits(logits, [SamplingParams(temperature=0.8, top_k=top_k)] * 4)
    expected = TopKLogitsWarper(top_k)(None, TemperatureLogitsWarper(0.8)(None, logits))
    assert torch.equal(ours, expected)


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    ours = process_logits(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert torch.equal(ours, TopKLogitsWarper(2)(None, logits))
    assert torch.isfinite(ours).sum() == 4


WIDE_TOP_K_PARAMS = [
    SamplingParams(temperature=1.0, top_k=64, top_p=0.95),  # Gemma 3's recommended sampling
    SamplingParams(temperature=0.7, top_k=1),
    SamplingParams(temperature=1.3, top_k=300, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_k=1024, logit_bias={7: 30.0, 9: -100.0}),
]


@pytest.mark.parametrize("vocab", [65_536, 50_021])  # a block path, and widths no block divides
def test_small_top_k_rows_warped_on_their_candidates_match_hf(monkeypatch, vocab):
    """Rows that all set a small top-k are warped on their candidates alone
    (sampling._warp_top_k_candidates); on a vocabulary wider than SPARSE_TOP_K that path
    must run, every row alone and batched, and give HF's chain exactly."""
    taken = []
    original = sampling._warp_top_k_candidates
    monkeypatch.setattr(sampling, "_warp_top_k_candidates",
                        lambda values, params: taken.append(1) or original(values, params))
    logits = random_logits(len(WIDE_TOP_K_PARAMS), vocab=vocab, scale=4.0, seed=vocab)
    prompts = [random_history(30, vocab=vocab, seed=row) for row in range(len(WIDE_TOP_K_PARAMS))]
    outputs = [random_history(9, vocab=vocab, seed=50 + row) for row in range(len(WIDE_TOP_K_PARAMS))]
    batched = process_logits(logits, WIDE_TOP_K_PARAMS, prompts, outputs)
    for row, params in enumerate(WIDE_TOP_K_PARAMS):
        expected = hf_chain(logits[row], params, prompts[row], outputs[row])
        assert_same_rows(batched[row], expected)
        alone = process_logits(logits[row : row + 1], [params], [prompts[row]], [outputs[row]])
        assert_same_rows(alone[0], expected)
    assert len(taken) == 1 + len(WIDE_TOP_K_PARAMS)


WIDE_TOP_P_PARAMS = [
    SamplingParams(temperature=0.2, top_p=0.9),  # SmolLM2's recommended sampling
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.7, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=0.6, top_p=0.8, presence_penalty=0.5, logit_bias={3: 5.0}),
]


@pytest.mark.parametrize("vocab", [65_536, 50_021])
def test_top_p_rows_warped_on_their_candidates_match_hf(monkeypatch, vocab):
    """Rows that all set top-p and no top-k are warped on their TOP_P_CANDIDATES most likely
    tokens when those hold every row's nucleus (sampling._warp_top_p_candidates, with a
    logsumexp of its own); spiky rows as a language model's: that path must run and give
    HF's chain, batched and alone."""
    taken = []
    original = sampling._warp_top_p_candidates
    monkeypatch.setattr(sampling, "_warp_top_p_candidates",
                        lambda values, params: taken.append(original(values, params)) or taken[-1])
    rows = len(WIDE_TOP_P_PARAMS)
    logits = random_logits(rows, vocab=vocab, scale=2.0, seed=vocab)
    spikes = torch.randint(0, vocab, (rows, 30), generator=torch.Generator().manual_seed(1))
    logits.scatter_add_(1, spikes, torch.linspace(9.0, 3.0, 30).expand(rows, -1).contiguous())
    prompts = [random_history(30, vocab=vocab, seed=row) for row in range(rows)]
    outputs = [random_history(9, vocab=vocab, seed=50 + row) for row in range(rows)]
    batched = process_logits(logits, WIDE_TOP_P_PARAMS, prompts, outputs)
    for row, params in enumerate(WIDE_TOP_P_PARAMS):
        expected = hf_chain(logits[row], params, prompts[row], outputs[row])
        assert_same_rows(batched[row], expected)
        assert_same_rows(process_logits(logits[row : row + 1], [params], [prompts[row]], [outputs[row]])[0], expected)
    assert len(taken) == 1 + rows and all(result is not None for result in taken)


@pytest.mark.parametrize("vocab", [4_096 * 8, 4_099])
def test_top_k_ties_beyond_the_candidates_keep_hf_semantics(vocab):
    """Ties with the k-th value are all kept (HF): with 100 tokens tied just below the top
    5 and top_k 10, all 105 survive, though the candidates hold only 10."""
    logits = torch.full((1, vocab), -2.0)
    logits[0, torch.arange(5) * 97] = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0])
    tied = torch.arange(100) * 31 + 3
    logits[0, tied] = 1.0
    params = SamplingParams(temperature=0.9, top_k=10)
    ours = process_logits(logits, [params])
    assert_same_rows(ours[0], TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.9)(None, logits))[0])
    assert int(torch.isfinite(ours).sum()) == 105


@pytest.mark.parametrize("vocab,k", [(262_144, 64), (262_144, 256), (65_536, 1024), (49_152, 64), (1_000, 3)])
def test_largest_finds_the_same_values_as_topk(vocab, k):
    logits = random_logits(3, vocab=vocab, scale=2.0, seed=k)
    values, columns = sampling._largest(logits, k)
    expected = torch.topk(logits, k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(logits.gather(1, columns), values)
    assert all(len(set(row)) == k for row in columns.tolist())


# Candidate sizes that exercise every top-p path: the default (candidates found),
# none at all (always a full sort), a size too small to hold the nucleus (fallback).
@pytest.mark.parametrize("candidates", [sampling.TOP_P_CANDIDATES, (), (2,)])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0])
def test_top_p_matches_hf(monkeypatch, candidates, top_p, scale):
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    logits = random_logits(4, scale=scale, seed=int(scale * 10))
    ours = process_logits(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 4)
    assert_same_rows(ours, TopPLogitsWarper(top_p)(None, logits))


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 0.95])
def test_min_p_matches_hf(min_p):
    logits = random_logits(4)
    ours = process_logits(logits, [SamplingParams(temperature=0.6, min_p=min_p)] * 4)
    expected = TemperatureLogitsWarper(0.6)(None, logits)
    if min_p > 0:
        expected = MinPLogitsWarper(min_p)(None, expected)
    assert_same_rows(ours, expected)


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hf_over_prompt_and_output(penalty):
    logits = random_logits(1)
    prompt, output = random_history(40, seed=1), random_history(25, seed=2)
    params = SamplingParams(repetition_penalty=penalty)
    ours = process_logits(logits, [params], [prompt], [output])
    input_ids = torch.cat([prompt, output]).unsqueeze(0)
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits))


def test_history_ids_outside_vocabulary_are_ignored_like_hf():
    logits = random_logits(1, vocab=50)
    prompt = torch.tensor([3, 49, 50, 75, 3])  # 50 and 75 lie past the output head
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5)
    ours = process_logits(logits, [params], [prompt], [[7, 90, 7]])
    input_ids = torch.cat([prompt, torch.tensor([7, 90, 7])]).unsqueeze(0)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(input_ids, logits)[0]
    expected = openai_penalties_oracle(expected, [7, 90, 7], 0.0, 0.5)
    assert torch.equal(ours[0], expected)


def test_logit_bias_matches_hf_sequence_bias():
    logits = random_logits(1)
    bias = {0: 5.0, 17: -100.0, 999: 0.25, 400: 100.0}
    ours = process_logits(logits, [SamplingParams(logit_bias=bias)])
    expected = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias.items()])(
        torch.zeros(1, 1, dtype=torch.long), logits
    )
    assert torch.equal(ours, expected)


def test_logit_bias_accepts_json_string_keys():
    assert SamplingParams(logit_bias={"42": 1.5}).logit_bias == {42: 1.5}


@pytest.mark.parametrize("presence, frequency", [(0.0, 0.7), (1.2, 0.0), (-0.5, 1.5), (2.0, -2.0)])
def test_presence_frequency_match_openai_formula(presence, frequency):
    logits = random_logits(1, vocab=80)
    prompt, output = random_history(30, vocab=80, seed=3), random_history(45, vocab=80, seed=4)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = process_logits(logits, [params], [prompt], [output])
    expected = openai_penalties_oracle(logits[0], output, presence, frequency)
    torch.testing.assert_close(ours[0], expected, rtol=0, atol=1e-5)


def test_presence_frequency_ignore_the_prompt():
    logits = random_logits(1, vocab=30)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    ours = process_logits(logits, [params], [list(range(30))], [[]])
    assert torch.equal(ours, logits)


# ---------------------------------------------------------------------------
# Full chain and batching

MIXED_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(repetition_penalty=1.5, logit_bias={5: 4.0, 9: -3.0}),  # greedy with processors
    SamplingParams(temperature=0.5, min_p=0.1, logit_bias={1: 2.0}, frequency_penalty=-0.6),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.9, top_k=100, top_p=0.5, repetition_penalty=0.8, seed=4),
    SamplingParams(temperature=1.0),
]


def mixed_histories(rows: int):
    prompts = [random_history(20 + 3 * row, seed=10 + row) for row in range(rows)]
    outputs = [random_history(2 * row, seed=40 + row).tolist() for row in range(rows)]  # lists too
    return prompts, outputs


def test_full_chain_matches_hf_row_by_row():
    logits = random_logits(len(MIXED_PARAMS), seed=5)
    prompts, outputs = mixed_histories(len(MIXED_PARAMS))
    ours = process_logits(logits, MIXED_PARAMS, prompts, outputs)
    for row, params in enumerate(MIXED_PARAMS):
        assert_same_rows(ours[row], hf_chain(logits[row], params, prompts[row], outputs[row]))


def test_batched_rows_equal_each_row_alone():
    logits = random_logits(len(MIXED_PARAMS), seed=6)
    prompts, outputs = mixed_histories(len(MIXED_PARAMS))
    batched = process_logits(logits, MIXED_PARAMS, prompts, outputs)
    for row, params in enumerate(MIXED_PARAMS):
        alone = process_logits(logits[row : row + 1], [params], [prompts[row]], [outputs[row]])
        assert torch.equal(batched[row], alone[0])


def test_verify_positions_of_one_request_use_their_own_histories():
    """Speculative verification: one request, several rows, histories growing by the
    drafts accepted so far; each row equals that position processed alone."""
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5)
    prompt, generated, drafts = [1, 2, 3, 4], [5, 6], [7, 5, 5]
    logits = random_logits(len(drafts) + 1, vocab=40, seed=7)
    outputs = [generated + drafts[:position] for position in range(len(drafts) + 1)]
    batched = process_logits(logits, [params] * len(outputs), [prompt] * len(outputs), outputs)
    for position, output in enumerate(outputs):
        alone = process_logits(logits[position : position + 1], [params], [prompt], [output])
        assert torch.equal(batched[position], alone[0])
        assert_same_rows(batched[position], hf_chain(logits[position], params, prompt, output))


def test_bf16_input_is_processed_in_float32():
    logits = random_logits(len(MIXED_PARAMS), seed=8).bfloat16()
    prompts, outputs = mixed_histories(len(MIXED_PARAMS))
    ours = process_logits(logits, MIXED_PARAMS, prompts, outputs)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, process_logits(logits.float(), MIXED_PARAMS, prompts, outputs))


def test_input_logits_are_never_modified():
    logits = random_logits(len(MIXED_PARAMS), seed=9)
    before = logits.clone()
    prompts, outputs = mixed_histories(len(MIXED_PARAMS))
    process_logits(logits, MIXED_PARAMS, prompts, outputs)
    assert torch.equal(logits, before)


def test_greedy_noop_returns_the_input_without_copying():
    logits = random_logits(3)
    assert process_logits(logits, [SamplingParams()] * 3) is logits


def test_greedy_ignores_warpers_and_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 4.0, 3.9, -2.0]])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1, repetition_penalty=2.0)
    processed = process_logits(logits, [params], [[1]], [[]])
    assert torch.equal(processed, torch.tensor([[1.0, 2.0, 3.9, -2.0]]))
    assert sample(processed, [params], [None]).tolist() == [2]


def test_sampling_probs_are_softmax_of_processed_and_one_hot_for_greedy():
    logits = random_logits(len(MIXED_PARAMS), seed=11)
    prompts, outputs = mixed_histories(len(MIXED_PARAMS))
    processed = process_logits(logits, MIXED_PARAMS, prompts, outputs)
    probs = sampling_probs(processed, MIXED_PARAMS)
    for row, params in enumerate(MIXED_PARAMS):
        if params.is_greedy:
            expected = torch.nn.functional.one_hot(processed[row].argmax(), processed.shape[1]).float()
        else:
            expected = torch.softmax(processed[row], dim=-1)
        assert torch.equal(probs[row], expected)


# ---------------------------------------------------------------------------
# Sampling: generators, reproducibility, exactness


def draw_stream(params: SamplingParams, generator: torch.Generator, steps: int = 40) -> list[int]:
    logits = random_logits(steps, vocab=50, scale=1.0, seed=12)
    return [
        int(sample(process_logits(logits[step : step + 1], [params]), [params], [generator])[0])
        for step in range(steps)
    ]


def test_same_seed_gives_same_tokens_and_no_seed_gives_different_streams():
    params = SamplingParams(temperature=1.0, seed=1234)
    assert draw_stream(params, make_generator(1234)) == draw_stream(params, make_generator(1234))
    assert draw_stream(params, make_generator(1234)) != draw_stream(params, make_generator(1235))
    assert draw_stream(params, make_generator(None)) != draw_stream(params, make_generator(None))


def test_seeded_request_does_not_depend_on_its_batch_mates():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    other = SamplingParams(temperature=0.7)
    logits = random_logits(30, vocab=60, scale=1.0, seed=13)
    alone_gen, batched_gen, other_gen = make_generator(77), make_generator(77), make_generator(5)
    for step in range(logits.shape[0]):
        row = logits[step : step + 1]
        alone = sample(process_logits(row, [params]), [params], [alone_gen])
        batch = torch.cat([row.flip(-1), row, row])
        batch_params = [other, params, SamplingParams()]
        batched = sample(process_logits(batch, batch_params), batch_params, [other_gen, batched_gen, None])
        assert int(batched[1]) == int(alone[0])


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit over the support of probs (tokens outside it fail)."""
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0, "drew a token with probability 0"
    return chi_square_p_of_arrays(counts.tolist(), probs.double().tolist())


SIGNIFICANCE = 1e-3
DRAWS = 20_000


@pytest.mark.parametrize("shared_generator", [True, False])
def test_draws_follow_softmax_of_processed_row(shared_generator):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    params = SamplingParams(temperature=0.9, top_k=6, repetition_penalty=1.4)
    processed = process_logits(logits, [params], [[0, 7]], [[7]])
    probs = torch.softmax(processed[0], dim=-1)
    assert (probs == 0).sum() == 2  # top-k removed two tokens: they must never appear
    rows = processed.expand(DRAWS, -1)
    if shared_generator:  # one request's rows, drawn in one call
        generators = [make_generator(2024)] * DRAWS
    else:  # many requests, one generator each
        generators = [make_generator(2024 + i) for i in range(DRAWS)]
    tokens = sample(rows, [params] * DRAWS, generators)
    assert chi_square_pvalue(tokens, probs) > SIGNIFICANCE
    # Power: the same draws against a plausible but wrong distribution (the raw model
    # softmax, without temperature/penalty/top-k) must be rejected.
    wrong = torch.softmax(logits[0], dim=-1)
    wrong = torch.where(probs > 0, wrong, torch.zeros_like(wrong))
    assert chi_square_pvalue(tokens, wrong / wrong.sum()) < SIGNIFICANCE


def test_two_level_draw_follows_the_weights_across_blocks_and_a_short_last_block():
    """inverse_cdf_draw picks a block by block sums, then an entry inside it: with blocks
    of 4 over 23 entries (the last block 3 long), unnormalized weights with zeros at
    block edges, the draws must follow weights / total; shifting the weights by one
    entry (a block-boundary off-by-one) must fail the same test."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.rand(23, generator=generator) * 5
    weights[[0, 3, 4, 11, 22]] = 0.0
    rows = weights.expand(DRAWS, -1)
    tokens = sampling.inverse_cdf_draw(rows, make_generator(99), block=4)
    exact = weights.double() / weights.double().sum()
    assert chi_square_pvalue(tokens, exact) > SIGNIFICANCE
    shifted = torch.roll(exact, 1)
    shifted[[0, 3, 4, 11, 22]] = 0.0
    counts = torch.bincount(tokens, minlength=23)
    assert chi_square_p_of_arrays(counts[shifted > 0].tolist(), (shifted[shifted > 0] / shifted.sum()).tolist()) < SIGNIFICANCE


def test_two_level_draw_never_lands_past_a_block_when_its_sum_rounds_up(monkeypatch):
    """In float32 1 + 6e-8 rounds up to 1 + 2**-23, past the float64 cumsum inside the block
    (1 + 6e-8): a uniform landing in that gap must still give a positive entry of the
    block, not the zero after it or an index past the row."""
    weights = torch.tensor([[1.0, 6e-8, 0.0, 0.0]])
    block_sum = float(weights.sum())
    assert block_sum > 1.0 + 6e-8  # the rounding this test is about
    gap = (1.0 + 9e-8) / block_sum
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.full((1, 1), gap, dtype=torch.float64))
    assert int(sampling.inverse_cdf_draw(weights, make_generator(0), block=4)[0]) == 1


def _grid_counts(row: torch.Tensor, draws: int) -> torch.Tensor:
    """How often draw_rows gives each token for the uniforms (i + 0.5) / draws, i < draws."""
    uniforms = ((torch.arange(draws, dtype=torch.float64) + 0.5) / draws)[:, None]
    return torch.bincount(sampling.draw_rows(row.expand(draws, -1), uniforms), minlength=row.shape[0])


@pytest.mark.parametrize("width", [60, 5037, 40_000])
def test_draw_rows_is_the_inverse_cdf_of_the_rows_softmax(width, monkeypatch):
    """Oracle: the softmax of the row in float64. An exact inverse CDF over evenly spaced
    uniforms gives token j between draws * P(<= j-1) and draws * P(<= j) of them, so each
    count is draws * p_j within one. Rows cut to a few blocks of columns (top-k, a top-p
    nucleus, one token) take the compact route; a whole row and one cut to many scattered
    tokens the full-width one; widths with a short last block (5037, 60) too. A token at -inf
    is never drawn."""
    draws = 3000
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(width, generator=g) * 2
    rows = {"whole": logits}
    for k in (1, 5, 40):
        rows[f"top-{k}"] = logits.masked_fill(logits < logits.topk(k).values[-1], -math.inf)
    scattered = torch.full((width,), -math.inf)
    scattered[::7] = logits[::7]  # every 7th token: more blocks than the compact route takes
    rows["scattered"] = scattered
    edge = torch.full((width,), -math.inf)
    edge[[0, width - 1]] = torch.tensor([0.3, -0.2])  # the first and the last column
    rows["edges"] = edge
    full_width = []
    inverse_cdf_draw = sampling.inverse_cdf_draw
    monkeypatch.setattr(sampling, "inverse_cdf_draw", lambda *a, **k: full_width.append(name) or inverse_cdf_draw(*a, **k))
    for name, row in rows.items():
        exact = torch.softmax(row.double(), dim=-1)
        counts = _grid_counts(row, draws)
        assert counts[exact == 0].sum() == 0, name
        assert (counts.double() - draws * exact).abs().max() <= 1.0 + 1e-6, name
    # under 4096 columns every row takes the full width; above, up to 64 blocks of 256 are compact
    assert full_width == (list(rows) if width < 4096 else ["whole", "scattered"] if width > 64 * 256 else [])


def test_a_cut_rows_draw_does_not_depend_on_its_batch_mates():
    """A row takes the compact or the full-width route by its own entries: beside a whole row
    (full width), a row of a 7-token cut draws what it draws alone, for every uniform."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 262_144 // 8, generator=g) * 3
    cut = logits[0].masked_fill(logits[0] < logits[0].topk(7).values[-1], -math.inf)
    uniforms = torch.rand(400, 1, generator=g, dtype=torch.float64)
    alone = sampling.draw_rows(cut.expand(400, -1), uniforms)
    mixed = sampling.draw_rows(torch.stack([cut, logits[1]]).repeat(400, 1), uniforms.repeat_interleave(2, 0))
    assert torch.equal(mixed[0::2], alone)


def test_sampled_row_without_generator_is_an_error():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="generator"):
        sample(random_logits(1), [params], [None])


# ---------------------------------------------------------------------------
# Logprobs


def test_token_logprobs_are_raw_model_logprobs():
    logits = random_logits(3, seed=14).bfloat16()
    tokens = torch.tensor([0, 5, 999])
    result = token_logprobs(logits, tokens, 4)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(result.chosen, reference[torch.arange(3), tokens])
    assert torch.equal(result.top_logprobs, reference.sort(dim=-1, descending=True).values[:, :4])
    assert torch.equal(reference.gather(1, result.top_ids), result.top_logprobs)
    assert token_logprobs(logits, tokens, 0).top_ids.shape == (3, 0)


# ---------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0)]}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_are_greedy_and_top_k_none_means_off():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(top_k=None).top_k == 0


def test_batch_errors():
    logits = random_logits(2)
    with pytest.raises(ValueError, match="2 logits rows"):
        process_logits(logits, [SamplingParams()])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        process_logits(logits, [SamplingParams(logit_bias={VOCAB: 1.0})] * 2)
    with pytest.raises(ValueError, match="prompt_histories"):
        process_logits(logits, [SamplingParams(repetition_penalty=1.2)] * 2)


def test_greedy_tokens_are_argmax_on_ties_nan_and_infinities():
    """The oracle is torch.argmax (the first maximal index): greedy_tokens takes another
    route for speed and must pick the same token in every row, whatever the row holds."""
    from verispec.engine.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, width = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 70000, (1,), generator=g))
        x = torch.randint(-2, 3, (rows, width), generator=g).float()  # every row full of ties
        if trial % 3 == 0:
            x[0, int(torch.randint(0, width, (1,), generator=g))] = float("nan")
        if trial % 4 == 0:
            x[-1] = float("-inf")
        if trial % 5 == 0:
            x[:, width // 2:] = float("inf")
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(greedy_tokens(x.to(dtype)), x.to(dtype).argmax(dim=-1)), (trial, dtype)

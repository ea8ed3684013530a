"""The serial generation loop: stop ids end generation and are never content; the
sampler hook sees every token; stats count what was produced. Oracle: transformers'
greedy continuation of the same tiny model."""

from __future__ import annotations

import pytest

from tests.tiny_models import build_reference, family_configs, reference_greedy
from verispec.engine.generate import GenerationStats, TokenEvent, stream_generate
from verispec.models.loader import load_folder

PROMPT = [5, 17, 42, 8, 61, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    reference = build_reference(family_configs()["llama"], folder)
    return reference, load_folder(folder)


def test_greedy_stream_matches_transformers_and_counts(pair):
    reference, ours = pair
    stats = GenerationStats()
    got = [e.token for e in stream_generate(ours, PROMPT, 20, stats=stats)]
    assert got == reference_greedy(reference, PROMPT, 20)
    assert (stats.prompt_tokens, stats.generated_tokens, stats.finish_reason) == (len(PROMPT), 20, "length")
    assert stats.prefill_s > 0 and stats.decode_s > 0


def test_stop_id_ends_generation_and_is_not_yielded(pair):
    reference, ours = pair
    expected = reference_greedy(reference, PROMPT, 20)
    # the first token that has not appeared before makes a clean stop id
    cut = next(i for i in range(2, 20) if expected[i] not in expected[:i])
    stats = GenerationStats()
    got = [e.token for e in stream_generate(ours, PROMPT, 20, stop_ids=[expected[cut]], stats=stats)]
    assert got == expected[:cut]
    assert stats.finish_reason == "stop"


def test_sampler_hook_sees_the_growing_output(pair):
    _, ours = pair
    seen = []

    def pick(logits, generated):
        seen.append(list(generated))
        return TokenEvent(7)  # force a token: the loop must feed it back

    got = [e.token for e in stream_generate(ours, PROMPT, 4, sampler=pick)]
    assert got == [7, 7, 7, 7]
    assert seen == [[], [7], [7, 7], [7, 7, 7]]


def test_empty_prompt_is_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="empty"):
        list(stream_generate(ours, [], 4))

"""Every family against transformers' own implementation (the oracle): float32 logits,
greedy tokens, batched rows of different lengths, taps, logits_at."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import VOCAB, build_reference, family_configs, reference_greedy, reference_logits
from verispec.engine.generate import greedy_batch
from verispec.models.kv_cache import KVCache
from verispec.models.decoder import BatchKV
from verispec.models.loader import load_folder

FAMILIES = list(family_configs())


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(family_configs()[request.param], folder)
    return request.param, reference, load_folder(folder)


def _prompts(seed: int, lengths=(5, 23, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_logits_match_transformers_batched_rows(pair):
    _, reference, ours = pair
    prompts = _prompts(1)
    cache = KVCache(ours.args)
    seqs = [cache.allocate(64) for _ in prompts]
    flat = torch.tensor([t for p in prompts for t in p])
    out = ours(flat, BatchKV(seqs, [len(p) for p in prompts]), logits_at=torch.arange(len(flat)))
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_32_tokens_match_transformers(pair):
    _, reference, ours = pair
    prompts = _prompts(2)
    ours_batched = greedy_batch(ours, prompts, 32)
    for prompt, got in zip(prompts, ours_batched):
        assert got == reference_greedy(reference, prompt, 32)


def test_default_logits_are_last_token_of_each_row(pair):
    _, reference, ours = pair
    prompts = _prompts(3, lengths=(7, 3))
    cache = KVCache(ours.args)
    seqs = [cache.allocate(16) for _ in prompts]
    out = ours(torch.tensor(prompts[0] + prompts[1]), BatchKV(seqs, [7, 3]))
    assert out.logits.shape == (2, VOCAB)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(out.logits[row], reference_logits(reference, prompt)[-1], rtol=1e-4, atol=1e-4)


def test_taps_are_transformers_hidden_states(pair):
    """Tap i is the raw output of layer i (transformers' hidden_states[i + 1]); tap -1
    is the embedding output (hidden_states[0]). The last layer's tap is before the final
    norm, unlike transformers' hidden_states[-1], so it is not compared here."""
    _, reference, ours = pair
    prompt = _prompts(4, lengths=(9,))[0]
    n_layers = ours.args.num_layers
    taps = [-1] + list(range(n_layers - 1))
    cache = KVCache(ours.args)
    out = ours(torch.tensor(prompt), BatchKV([cache.allocate(9)], [9]), taps=taps)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(out.hidden) == len(taps)
    for tap, got in zip(taps, out.hidden):
        torch.testing.assert_close(got, ref[tap + 1][0], rtol=1e-4, atol=1e-4)


def test_no_taps_returns_nothing_extra(pair):
    _, _, ours = pair
    cache = KVCache(ours.args)
    out = ours(torch.tensor([1, 2, 3]), BatchKV([cache.allocate(3)], [3]))
    assert out.hidden == ()


def test_bfloat16_teacher_forced_logits_close_to_transformers_bf16(pair, tmp_path):
    """bf16 has knife-edge ties, so trajectories are compared in float32 only; in bf16
    the teacher-forced logits must stay within bf16 rounding of transformers' bf16."""
    name, reference, _ = pair
    reference.save_pretrained(tmp_path)
    ours = load_folder(tmp_path, dtype=torch.bfloat16)
    ref16 = reference.to(torch.bfloat16)
    try:
        prompt = _prompts(5, lengths=(30,))[0]
        cache = ours.new_cache()
        got = ours(torch.tensor(prompt), BatchKV([cache.allocate(30)], [30]), logits_at=torch.arange(30)).logits
        expected = reference_logits(ref16, prompt)
        exact = reference_logits(reference.float(), prompt)
        # our bf16 error against the float32 truth is no worse than transformers' own bf16 error (+ slack)
        ours_err = (got - exact).abs().mean()
        ref_err = (expected - exact).abs().mean()
        assert ours_err <= 1.5 * ref_err + 1e-3, (name, float(ours_err), float(ref_err))
        # and ours sits as close to transformers' bf16 as both sit to the truth
        assert (got - expected).abs().mean() <= 2 * ref_err + 1e-3
    finally:
        reference.float()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_greedy_matches_transformers(family, tmp_path):
    reference = build_reference(family_configs()[family], tmp_path)
    ours = load_folder(tmp_path, device="cuda")
    prompts = _prompts(6)
    for prompt, got in zip(prompts, greedy_batch(ours, prompts, 16)):
        assert got == reference_greedy(reference, prompt, 16)

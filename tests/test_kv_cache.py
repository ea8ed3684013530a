"""KV cache: rollback, sliding-window rings after wrap, chunked prefill, byte accounting.
Oracle: transformers' logits for the same full token sequence, computed fresh."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import VOCAB, build_reference, extend_logits, family_configs, reference_logits
from verispec.models.kv_cache import CacheError, KVCache
from verispec.models.decoder import BatchKV
from verispec.models.loader import load_folder

WINDOW = 8  # the tiny gemma3 config's sliding window
MAX_ROLLBACK = 3  # a small ring (window + 3 slots) so tests wrap it many times


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    reference = build_reference(family_configs()["gemma3"], folder)
    return reference, load_folder(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    reference = build_reference(family_configs()["llama"], folder)
    return reference, load_folder(folder)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 5, 17, 40])
def test_chunked_prefill_through_wrapped_ring_matches_fresh(gemma, chunk):
    """Chunks of 1..4 use the write-then-view path, longer chunks the gather path; both
    must equal one fresh transformers forward over the whole 40 tokens (window 8, ring 11)."""
    reference, ours = gemma
    tokens = _tokens(40, seed=chunk)
    seq = KVCache(ours.args, max_rollback=MAX_ROLLBACK).allocate(40)
    got = torch.cat([extend_logits(ours, seq, tokens[i : i + chunk]) for i in range(0, 40, chunk)])
    _close(got, reference_logits(reference, tokens))


@pytest.mark.parametrize("n_back", [1, 2, 4])
def test_rollback_after_wrap_then_reextend_matches_fresh(gemma, n_back):
    reference, ours = gemma
    prompt, drafted, corrected = _tokens(30, 1), _tokens(5, 2), _tokens(6, 3)
    seq = KVCache(ours.args, max_rollback=MAX_ROLLBACK).allocate(64)
    extend_logits(ours, seq, prompt)
    for tok in drafted:  # decode one at a time: the ring (11 slots) has long wrapped
        extend_logits(ours, seq, [tok])
    seq.rollback(n_back)
    assert seq.length == 35 - n_back
    kept = prompt + drafted[: len(drafted) - n_back]
    # a verify-sized chunk after the rollback, then single steps
    got = torch.cat([extend_logits(ours, seq, corrected[:4]), extend_logits(ours, seq, [corrected[4]]), extend_logits(ours, seq, [corrected[5]])])
    expected = reference_logits(reference, kept + corrected)[len(kept) :]
    _close(got, expected)


def test_rollback_beyond_ring_margin_is_refused(gemma):
    _, ours = gemma
    seq = KVCache(ours.args, max_rollback=MAX_ROLLBACK).allocate(64)
    extend_logits(ours, seq, _tokens(30, 4))
    with pytest.raises(CacheError, match="sliding-window ring"):
        seq.rollback(MAX_ROLLBACK + 2)
    assert seq.length == 30  # a refused rollback changes nothing
    seq.rollback(MAX_ROLLBACK + 1)
    assert seq.length == 30 - MAX_ROLLBACK - 1


def test_rollback_global_layers_matches_fresh(llama):
    reference, ours = llama
    prompt, junk, real = _tokens(20, 5), _tokens(7, 6), _tokens(5, 7)
    seq = KVCache(ours.args).allocate(40)
    extend_logits(ours, seq, prompt)
    extend_logits(ours, seq, junk)
    seq.rollback(len(junk))
    _close(extend_logits(ours, seq, real), reference_logits(reference, prompt + real)[len(prompt) :])


def test_rows_roll_back_independently(llama):
    reference, ours = llama
    a, b = _tokens(10, 8), _tokens(14, 9)
    cache = KVCache(ours.args)
    seq_a, seq_b = cache.allocate(32), cache.allocate(32)
    ours(torch.tensor(a + b), BatchKV([seq_a, seq_b], [10, 14]))
    extra_a, extra_b = _tokens(3, 10), _tokens(3, 11)
    ours(torch.tensor(extra_a + extra_b), BatchKV([seq_a, seq_b], [3, 3]))
    seq_a.rollback(2)  # only row a rolls back; row b keeps its 3 tokens
    nxt = [5, 6]
    out = ours(torch.tensor(nxt), BatchKV([seq_a, seq_b], [1, 1])).logits
    _close(out[0], reference_logits(reference, a + extra_a[:1] + [5])[-1])
    _close(out[1], reference_logits(reference, b + extra_b + [6])[-1])


def test_overflowing_capacity_is_an_error(llama):
    _, ours = llama
    seq = KVCache(ours.args).allocate(4)
    with pytest.raises(CacheError, match="capacity"):
        extend_logits(ours, seq, _tokens(5, 12))


def test_bytes_accounting(gemma):
    _, ours = gemma
    args = ours.args
    cache = KVCache(args, max_rollback=MAX_ROLLBACK)
    per_slot = 2 * args.num_kv_heads * args.head_dim * 4  # K and V, float32
    n_sliding = sum(w is not None for w in args.layer_windows)
    n_global = args.num_layers - n_sliding
    # sliding layers hold at most window + max_rollback slots, global layers everything
    expected = (n_global * 100 + n_sliding * (WINDOW + MAX_ROLLBACK)) * per_slot
    assert cache.bytes_for(100) == expected
    a = cache.allocate(100)
    b = cache.allocate(5)  # shorter than the ring: sliding layers hold only 5 slots
    assert a.nbytes == expected
    assert b.nbytes == cache.bytes_for(5) == args.num_layers * 5 * per_slot
    assert cache.bytes_in_use == a.nbytes + b.nbytes
    cache.release(a)
    assert cache.bytes_in_use == b.nbytes

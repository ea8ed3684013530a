"""walk.py: the live-like walk over teacher-forced blocks, against the live loop itself.

Oracles: a Monte Carlo of the loop live decoding runs (draft at the last committed token,
keep each draft with its conditional acceptance until one fails, move past the kept drafts
and the bonus token), a statistical test at 5 standard errors; the T=0 walk followed by hand.
"""

import math
import random

import pytest
import torch

from verispec.training.dspark import walk


def _live_rounds(accept: torch.Tensor, start: int, end: int, rng: random.Random) -> int:
    """One live decode of positions start+1 .. end-1, a round at a time."""
    pos, rounds = start, 0
    while pos < end - 1:
        kept = 0
        for c in accept[pos - start].tolist():
            if rng.random() < c:
                kept += 1
            else:
                break
        pos = min(pos + kept + 1, end - 1)
        rounds += 1
    return rounds


def _random_blocks(n_tokens: int, gamma: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    accept = torch.rand(n_tokens - 1, gamma, generator=g) ** 0.5  # mostly high, some low
    for row in range(n_tokens - 1):  # slot j of anchor row labels row + j + 1: none past the end
        accept[row, max(0, n_tokens - 1 - row):] = 0
    return accept


@pytest.mark.parametrize("seed,gamma", [(0, 7), (1, 3), (2, 1)])
def test_expected_rounds_match_a_monte_carlo_of_the_live_loop(seed, gamma):
    start, end = 5, 45
    accept = _random_blocks(end - start, gamma, seed)
    rng = random.Random(seed)
    draws = [_live_rounds(accept, start, end, rng) for _ in range(4000)]
    mean = sum(draws) / len(draws)
    sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    expected = walk.walk_rounds(accept, start, end)
    assert abs(expected - mean) < 5 * sd / math.sqrt(len(draws)) + 1e-9


def test_the_greedy_walk_visits_anchors_after_each_rejection():
    # 11 answer tokens at positions 0..10, gamma 3. Matches (1 = the draft is the target's argmax):
    rows = {0: [1, 1, 0], 3: [1, 1, 1], 7: [0, 1, 1], 8: [1, 1, 0]}
    accept = torch.zeros(10, 3)
    for p in range(10):
        accept[p] = torch.tensor(rows.get(p, [1, 0, 1]), dtype=torch.float)
        accept[p, max(0, 10 - p):] = 0
    # by hand: anchor 0 keeps 2 -> 3; keeps 3 -> 7; keeps 0 -> 8; keeps 2 (its third slot is past the end) -> 10
    assert walk.walk_rounds(accept, 0, 11) == 4
    mask = torch.ones(11)
    anchors, keep = walk.all_anchors(mask)
    assert anchors.tolist() == list(range(10)) and bool(keep.all())
    assert walk.walk_tau(accept, anchors, mask) == (10, 4)


def test_segments_walk_apart_and_every_anchor_is_required():
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1], dtype=torch.float)  # the last run is 1 long
    assert walk.answer_segments(mask) == [(1, 4), (6, 10)]
    anchors, _ = walk.all_anchors(mask)
    assert anchors.tolist() == [1, 2, 6, 7, 8]
    none_kept = torch.zeros(len(anchors), 2)
    assert walk.walk_tau(none_kept, anchors, mask) == (2 + 3, 2 + 3)  # a token per round
    with pytest.raises(ValueError, match="every anchor"):
        walk.walk_tau(none_kept[:4], anchors[:4], mask)

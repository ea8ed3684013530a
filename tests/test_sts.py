"""STS calibration (training/dspark/sts.py) and calibrated confidences when serving.

Oracles: rounds drawn from a known model (true conditional acceptance sigmoid(z_k),
observed logits z_k * s_k, acceptance simulated left to right), for which the calibrated
temperatures are s_k and the calibrated survival has the ECE of sampling noise on fresh
rounds; plain loops for the ECE and the AUC; DeepSpec's truncation rule for the cut.
"""

from __future__ import annotations

import math

import torch

from verispec.drafting.dspark.model import confident_prefix
from verispec.training.dspark.sts import Rounds, auc, ece, fit_sts, report

SCALES = [2.0, 0.5, 1.6, 1.0]  # position 0 overconfident x2, position 1 underconfident, ...


def _draw(n: int, seed: int, scales=SCALES, proposal: int | None = None) -> list[tuple[list[float], int, int]]:
    g = torch.Generator().manual_seed(seed)
    k = len(scales)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * 1.5 + torch.tensor([0.5, 0.0, 0.8, 1.2][:k])
    accept = torch.rand(n, k, generator=g, dtype=torch.float64) < torch.sigmoid(z)
    accepted = torch.where(accept.all(1), torch.tensor(k), (~accept).long().argmax(1))
    logits = z * torch.tensor(scales, dtype=torch.float64)
    return [(logits[i].tolist(), int(accepted[i]), proposal or k) for i in range(n)]


def test_sts_recovers_the_temperatures_that_calibrate_the_survival_products():
    fit = Rounds(_draw(80000, 1), len(SCALES))
    temperatures = fit_sts(fit)
    for t, s in zip(temperatures, SCALES):
        assert abs(math.log(t / s)) < 0.12, (temperatures, SCALES)
    check = Rounds(_draw(20000, 2), len(SCALES))
    before, after, truth = report(check, None), report(check, temperatures), report(check, SCALES)
    for k, (b, a, t) in enumerate(zip(before, after, truth)):
        # as calibrated as the true temperatures are, up to sampling noise (~0.01 at 20k rounds)
        assert a["ece"] <= t["ece"] + 0.003, (k, a["ece"], t["ece"])
        if k < 3:  # the miscalibrated positions were visibly off
            assert b["ece"] > t["ece"] + 0.01, (k, b["ece"], t["ece"])
    # order-preserving per position: each c_k's ranking is unchanged
    for k in range(len(SCALES)):
        mask = check.tested(k)
        raw = check.logits[mask, k]
        assert auc(torch.sigmoid(raw / temperatures[k]), check.survived(k)[mask]) == auc(raw, check.survived(k)[mask])


def test_calibrated_data_keeps_identity_like_temperatures():
    temperatures = fit_sts(Rounds(_draw(80000, 3, scales=[1.0, 1.0, 1.0]), 3))
    assert all(abs(math.log(t)) < 0.12 for t in temperatures), temperatures


def test_positions_a_proposal_did_not_reach_are_not_counted():
    rounds = _draw(50, 4, proposal=2) + _draw(70, 5)
    r = Rounds(rounds, len(SCALES))
    rep = report(r, None)
    assert [p["tested"] for p in rep] == [120, 120, 70, 70]
    empty = Rounds([], 3)
    assert fit_sts(empty) == [1.0, 1.0, 1.0]  # no evidence: raw confidences


def test_ece_and_auc_against_plain_loops():
    g = torch.Generator().manual_seed(6)
    p = torch.rand(3000, generator=g, dtype=torch.float64)
    p[:7] = 1.0
    p[7:12] = 0.0
    y = torch.rand(3000, generator=g, dtype=torch.float64) < p ** 0.7
    total = 0.0
    for b in range(20):
        members = [(pi, yi) for pi, yi in zip(p.tolist(), y.tolist())
                   if b / 20 <= pi < (b + 1) / 20 or (b == 19 and pi == 1.0)]
        if members:
            total += len(members) / 3000 * abs(sum(m[0] for m in members) / len(members)
                                               - sum(m[1] for m in members) / len(members))
    assert abs(ece(p, y) - total) < 1e-12
    scores = torch.round(p * 10) / 10  # ties
    pos = [s for s, t in zip(scores.tolist(), y.tolist()) if t]
    neg = [s for s, t in zip(scores.tolist(), y.tolist()) if not t]
    pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    assert abs(auc(scores, y) - pairs / (len(pos) * len(neg))) < 1e-12


def test_the_cut_uses_the_calibrated_confidence():
    logits = torch.tensor([1.0, -0.2, 2.0, 0.5])
    # raw sigmoids 0.73, 0.45, 0.88, 0.62: a threshold of 0.4 keeps the whole block
    assert confident_prefix(logits, [0.4] * 4, 4) == 4
    # at temperature 0.25 on slot 1, sigmoid(-0.8) = 0.31 < 0.4: cut before it
    assert confident_prefix(logits, [0.4] * 4, 4, temperatures=[1.0, 0.25, 1.0, 1.0]) == 1
    assert confident_prefix(logits, [0.4] * 4, 4, temperatures=None) == 4
    assert confident_prefix(logits, 0.0, 4, temperatures=[1.0, 0.25, 1.0, 1.0]) == 4  # no threshold: no cut


def test_a_checkpoint_without_temperatures_loads_identity_and_bad_ones_are_refused():
    import json

    import pytest

    from tests.fixtures import oracle
    from verispec.drafting.dspark.config import DraftCheckpointError, DSparkConfig

    raw = json.loads((oracle() / "drafter" / "config.json").read_text())
    assert "confidence_temperature" not in raw  # DeepSpec's own checkpoint
    assert DSparkConfig.from_dict(raw).confidence_temperature is None
    g = raw["block_size"]
    calibrated = DSparkConfig.from_dict({**raw, "confidence_temperature": [0.5] * g})
    assert DSparkConfig.from_dict(calibrated.to_dict()).confidence_temperature == [0.5] * g
    for bad in ([1.0], [0.0] * g, ["x"] * g, [float("nan")] * g, 2.0):
        with pytest.raises(DraftCheckpointError, match="confidence_temperature"):
            DSparkConfig.from_dict({**raw, "confidence_temperature": bad})


def test_the_noise_floor_is_what_calibrated_labels_show():
    from verispec.training.dspark.sts import ece_floor

    g = torch.Generator().manual_seed(8)
    p = torch.rand(2000, generator=g, dtype=torch.float64)
    floors = [ece(p, torch.rand(2000, generator=g, dtype=torch.float64) < p) for _ in range(200)]
    assert abs(ece_floor(p) - sum(floors) / len(floors)) < 0.004
    assert ece_floor(p) > 0.01  # a few thousand rounds cannot show 1%

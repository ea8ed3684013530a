"""bench/dspark_scaling.py's fit: what the drafter's scaling curve says the next 0.5 of tau
costs. Oracle: points laid exactly on a known log-linear line, whose slope per doubling and
the factor 2 ** (0.5 / slope) are known in closed form; and the grid's compute axis adds the
step counts asked for at the smallest and largest size only."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

_SPEC = importlib.util.spec_from_file_location("dspark_scaling", Path(__file__).parents[1] / "bench" / "dspark_scaling.py")
scaling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(scaling)


def _point(n, steps, tau_tf, tau_live, minutes=30.0, **over):
    return {"source": "regenerated", "layers": 1, "draft_vocab": 16384, "sequences": n, "steps": steps,
            "tau_teacher_forced": tau_tf, "tau_live_t0": tau_live, "train_minutes_this_run": minutes, **over}


def test_the_fit_recovers_a_known_log_linear_curve_and_prices_the_next_half_tau():
    # data axis: tau = 1 + 0.1 log2(n / 100) teacher-forced, 0.05 per doubling live
    sizes = [200, 400, 800, 1600]
    points = [_point(n, 300, 1 + 0.1 * math.log2(n / 100), 1 + 0.05 * math.log2(n / 100)) for n in sizes]
    # points off the size curve must not move it: another vocabulary, another step count
    points.append(_point(800, 300, 9.0, 9.0, draft_vocab=8192))
    # compute axis at 1600 sequences: 0.125 tau per doubling of steps, 45 minutes at 600 steps
    points.append(_point(1600, 600, points[3]["tau_teacher_forced"] + 0.125, points[3]["tau_live_t0"] + 0.125, 45.0))
    f = scaling.fit(points)
    tf, live = f["data_tau_teacher_forced"], f["data_tau_live_t0"]
    assert tf["per_doubling"] == pytest.approx(0.1) and live["per_doubling"] == pytest.approx(0.05)
    assert tf["points"] == 4 and tf["steps"] == 300
    assert tf["factor_for_gain"] == pytest.approx(2 ** 5, rel=1e-3)
    assert live["factor_for_gain"] == pytest.approx(2 ** 10, rel=1e-3)
    more = 1600 * (2 ** 5 - 1)
    assert tf["cpu_hours_for_gain"] == pytest.approx(more / scaling.ANSWERS_PER_HOUR
                                                     + more * scaling.FEATURE_SECONDS_PER_SEQUENCE / 3600, abs=0.05)
    # 32x 1600 sequences is past the 300 x 16 this compute reads; 4 sequences a doubling would not be
    assert tf["unseen_at_this_compute"] and "data alone cannot buy it" in scaling._fit_lines(f)[0]
    c = f["compute"][1600]
    assert c["steps"] == [300, 600]
    assert c["tau_teacher_forced"]["per_doubling"] == pytest.approx(0.125)
    assert c["tau_teacher_forced"]["factor_for_gain"] == pytest.approx(16, rel=1e-3)
    # 16x the steps of the 45-minute run: 15 more such runs
    assert c["tau_teacher_forced"]["cpu_hours_for_gain"] == pytest.approx(45 * 15 / 60, abs=0.06)
    assert set(f["compute"]) == {1600}  # the only size measured at two step counts
    assert any("per doubling" in line for line in scaling._fit_lines(f))


def test_a_flat_or_falling_curve_prices_nothing():
    points = [_point(200, 300, 1.3, 1.3), _point(400, 300, 1.3, 1.2)]
    f = scaling.fit(points)
    assert "factor_for_gain" not in f["data_tau_teacher_forced"]
    assert f["data_tau_live_t0"]["per_doubling"] < 0 and "factor_for_gain" not in f["data_tau_live_t0"]
    assert all("no gain" in line for line in scaling._fit_lines(f))
    assert scaling.fit(points[:1]) == {}


def test_the_grid_adds_the_compute_axis_at_the_ends_of_the_size_axis():
    args = SimpleNamespace(sizes=[200, 400, 800], pivot=400, steps=300, batch=16, sharegpt=None, compute_steps=[150, 300, 600])
    keys = [p["key"] for p in scaling.grid(args)]
    assert len(keys) == len(set(keys))
    compute = [k for k in keys if not k.endswith("-s300x16")]
    assert sorted(compute) == sorted(f"regenerated-n{n}-L1-v16384-s{s}x16" for n in (200, 800) for s in (150, 600))
    assert "regenerated-n400-L2-v16384-s300x16" in keys


def test_the_plot_puts_each_side_point_beside_the_base_point_of_its_size(tmp_path, monkeypatch):
    points = [_point(n, 300, 1.2 + n / 10000, 1.1 + n / 10000) for n in (200, 400, 800)]
    points += [_point(400, 300, 1.31, 1.24, layers=2), _point(400, 300, 1.32, 1.25, draft_vocab=0),
               _point(800, 600, 1.4, 1.3)]
    drawn = {}
    real = scaling.plot.__globals__["_side_label"]
    monkeypatch.setitem(scaling.plot.__globals__, "_side_label", lambda p: drawn.setdefault(id(p), real(p)))
    scaling.plot(points, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    # every point off the size curve gets a column, named by what it changes
    assert sorted(drawn.values()) == ["2 draft layers", "600 steps", "draft vocab full"]

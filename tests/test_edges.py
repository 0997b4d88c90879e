"""Answers that must be true at the edges: the findings of an adversarial run (issue 22), one
regression test (or a few) per finding."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from cli_runner import invoke

HUGE = np.full((1, 8), 1e308)  # each count finite, the layer's total overflows float64


# -- 1. a layer whose total overflows float64 --------------------------------------------------

@pytest.fixture(scope="module")
def small_plan():
    return eplb.plan(np.arange(1.0, 9.0)[None, :], num_slots=12, num_gpus=4)


@pytest.mark.parametrize("call", ["balancedness", "gpu_loads", "dispatch", "optimal_balancedness"])
def test_loads_of_a_layer_whose_total_overflows_are_refused_not_nan(small_plan, call):
    run = {
        "balancedness": lambda: small_plan.balancedness(HUGE),
        "gpu_loads": lambda: small_plan.gpu_loads(HUGE),
        "dispatch": lambda: eplb.dispatch(HUGE, small_plan),
        "optimal_balancedness": lambda: small_plan.balancedness(np.stack([np.ones((1, 8)), HUGE]), "optimal"),
    }[call]
    with pytest.raises(ValueError, match="total of layer 0.*overflows float64"):
        run()


def test_loads_just_below_overflow_stay_finite(small_plan):
    counts = np.full((1, 8), 1e307)  # total 8e307: finite
    assert np.isfinite(small_plan.gpu_loads(counts)).all()
    assert 0 < small_plan.balancedness(counts)[0] <= 1


def test_simulate_and_sweep_refuse_a_series_whose_layer_total_overflows():
    series = np.stack([np.ones((1, 8)), HUGE[0][None, :]])  # [2, 1, 8]
    with pytest.raises(ValueError, match="series: the total of layer 0 of window 1 overflows"):
        eplb.simulate(series, num_slots=8, num_gpus=4)
    with pytest.raises(ValueError, match="series: the total of layer 0 of window 1 overflows"):
        eplb.sweep(series, num_gpus=(4,), workers=1)


def test_simulate_refuses_cost_constants_that_overflow_the_step_time():
    cost = eplb.CostModel.preset(flops_per_token=1e200, flops=1e100)  # 1e100 s per token: finite
    with pytest.raises(ValueError, match="overflows float64"):
        eplb.simulate(np.full((2, 1, 8), 1e300), num_slots=8, num_gpus=4, cost_model=cost)


def test_cli_simulate_refuses_an_overflowing_series_with_exit_1(tmp_path):
    np.save(tmp_path / "s.npy", np.stack([np.ones((1, 8)), HUGE]))
    _, err = invoke("simulate", "s.npy", "-s", "8", "-g", "4", "-o", "sim", cwd=tmp_path, expect=1)
    assert "overflows float64" in err and "nan" not in err


@pytest.mark.parametrize("weights", [[1e300] * 4, [5e-324] * 4, [3.0] * 4])
def test_equal_window_weights_of_any_size_give_the_unweighted_plan(weights):
    series = np.random.default_rng(0).random((4, 2, 8)) * 1e12
    plain = eplb.plan(series, num_slots=12, num_gpus=4, window_weights=[1.0] * 4)
    weighted = eplb.plan(series, num_slots=12, num_gpus=4, window_weights=weights)
    np.testing.assert_array_equal(weighted.phy2log, plain.phy2log)
    np.testing.assert_allclose(weighted.max_load, plain.max_load, rtol=1e-12)
    assert np.isfinite(weighted.gap).all()


def test_window_weights_are_relative():
    series = np.random.default_rng(1).random((3, 2, 8)) * 1000
    a = eplb.plan(series, num_slots=12, num_gpus=4, window_weights=[1.0, 2.0, 4.0])
    b = eplb.plan(series, num_slots=12, num_gpus=4, window_weights=[2.0**-1070, 2.0**-1069, 2.0**-1068])
    np.testing.assert_array_equal(a.phy2log, b.phy2log)

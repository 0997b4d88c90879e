"""plan()'s planning modes (eplb.planning.modes): each request reaches the mode it names, the
Balancer plans through the same registry, and a move budget holds for a hedged series."""

import numpy as np
import pytest

import eplb
from eplb.planning.modes import MODES, make_request, mode_of
from eplb.model.deployment import make_deployment

DEPLOY = dict(num_slots=40, num_gpus=8, num_nodes=2, num_groups=4)


def _series(seed=0, windows=4, layers=3, experts=32):
    rng = np.random.default_rng(seed)
    base = rng.gamma(0.6, size=(layers, experts))
    return rng.poisson(400 * base[None] * rng.gamma(2.0, size=(windows, layers, experts)) / 2.0).astype(float)


def test_every_mode_is_reached_and_named_in_info():
    series = _series()
    counts = series.sum(axis=0)
    plans = {
        "scratch": eplb.plan(counts, **DEPLOY),
        "series": eplb.plan(series, **DEPLOY),
        "near": eplb.plan(series, previous=eplb.plan(counts, method="greedy", **DEPLOY), **DEPLOY),
        "capped": eplb.plan(counts, max_off_node=0.1, **DEPLOY),
        "engine": eplb.plan(series, dispatch="sglang-static", **DEPLOY),
    }
    assert set(plans) == set(MODES)
    for name, placement in plans.items():
        assert placement.info["mode"] == name
        assert placement.home_node is not None  # hierarchical: every mode reports the groups' nodes
        assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all()


def test_modes_are_tried_in_order():
    problem = make_deployment(32, 40, 8, 2, 4)
    series = _series()
    previous = eplb.plan(series.sum(axis=0), method="greedy", **DEPLOY).phy2log
    assert mode_of(make_request(series, problem, method="balanced")) == "series"
    assert mode_of(make_request(series[:1], problem, method="balanced")) == "scratch"
    assert mode_of(make_request(series, problem, method="balanced", previous=previous)) == "near"
    assert mode_of(make_request(series[0], problem, method="balanced", max_off_node=0.0)) == "capped"
    assert mode_of(make_request(series, problem, method="balanced", dispatch="sglang-dynamic")) == "engine"


def test_a_request_plans_for_given_weights_of_the_windows_shape_only():
    problem = make_deployment(32, 40, 8, 2, 4)
    series = _series()
    forecast = series[-1] * 2.0
    np.testing.assert_array_equal(make_request(series, problem, method="balanced", weights=forecast).weights, forecast)
    with pytest.raises(ValueError, match="weights must have the windows' shape"):
        make_request(series, problem, method="balanced", weights=forecast[:, :16])


@pytest.mark.parametrize("max_moves", [0, 2, 6])
def test_a_hedged_series_near_a_placement_keeps_the_move_budget(max_moves):
    series = _series(1)
    previous = eplb.plan(_series(2).sum(axis=0), **DEPLOY)
    placement = eplb.plan(series, previous=previous, max_moves=max_moves, **DEPLOY)
    changed = (placement.phy2log != previous.phy2log).sum(axis=1)
    assert (changed <= max_moves).all(), changed
    np.testing.assert_array_equal(changed, placement.info["slots_changed"])


def test_the_balancer_plans_through_the_modes():
    series = _series(3, windows=12)
    balancer = eplb.Balancer(3, 32, **DEPLOY, compile="lazy", subwindows=4)
    for counts in series:
        balancer.record(counts)
    placement, _ = balancer.rebalance()
    assert placement.info["mode"] == "near"
    assert placement.home_node is not None
    assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all()

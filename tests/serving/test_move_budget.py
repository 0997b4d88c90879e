"""The Balancer's default move budget knows the slots per GPU ``k``: up to 4 a GPU (one copy moves a
quarter or more of a GPU's load) a rebalance changes at most ``round(k)`` slots per layer, the most
balanced plan within that; above, the tolerance tuned at 9 a GPU and no budget, as before."""

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.model.defaults import (AUTO, BALANCER_TOLERANCE, BUDGET_MAX_SLOTS_PER_GPU, balancer_move_budget,
                                 slots_per_gpu)
from eplb.planning.migration import SPREAD_WARNING, groups_spread
from eplb.simulation.synthetic import drifting_counts


@given(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False))
def test_the_budget_is_one_gpus_worth_of_slots_at_few_slots_per_gpu(k):
    budget = balancer_move_budget(k)
    if k > BUDGET_MAX_SLOTS_PER_GPU:
        assert budget is None
    else:
        assert budget == max(1, round(k)) and 1 <= budget <= BUDGET_MAX_SLOTS_PER_GPU


@given(st.floats(min_value=1e-3, max_value=BUDGET_MAX_SLOTS_PER_GPU), st.floats(min_value=0, max_value=3))
def test_fewer_slots_per_gpu_never_get_a_larger_budget(k, more):
    """Monotone in k where there is a budget: a copy moves a larger share of a GPU's load at fewer
    slots a GPU, and a rebalance may make no more of them."""
    larger = min(k + more, BUDGET_MAX_SLOTS_PER_GPU)
    assert balancer_move_budget(k) <= balancer_move_budget(larger)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "two"])
def test_a_bad_slot_count_is_refused(bad):
    with pytest.raises(ValueError, match="slots"):
        balancer_move_budget(bad)


@pytest.mark.parametrize("gpus, budget", [(288, 1), (144, 2), (96, 3), (72, 4), (32, None)])
def test_the_balancers_defaults_follow_the_slots_per_gpu(gpus, budget):
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=gpus)
    assert slots_per_gpu(deployment.topology) == 288 / gpus
    balancer = eplb.Balancer(2, deployment, compile="lazy")
    assert balancer.max_moves == budget
    assert balancer.tolerance == (BALANCER_TOLERANCE if budget is None else 0.0)
    # what the caller gives wins; tolerance left to itself follows the budget
    given_budget = eplb.Balancer(2, deployment, compile="lazy", max_moves=None)
    assert (given_budget.tolerance, given_budget.max_moves) == (BALANCER_TOLERANCE, None)
    assert eplb.Balancer(2, deployment, compile="lazy", max_moves=7).tolerance == 0.0
    assert eplb.Balancer(2, deployment, compile="lazy", tolerance=0.1).tolerance == 0.1


@pytest.mark.parametrize("options, match", [
    (dict(tolerance="loose"), "tolerance must be a number, None or 'auto'"),
    (dict(max_moves="many"), "max_moves must be a number, None or 'auto'"),
    (dict(tolerance=-0.1), "tolerance must be a non-negative number"),
    (dict(tolerance=math.nan), "tolerance must be a non-negative number"),
    (dict(max_moves=-1), "max_moves"),
    (dict(tolerance=None, max_moves=None), "give tolerance, max_moves or both"),
])
def test_bad_move_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        eplb.Balancer(2, eplb.Deployment.of(32, num_slots=40, num_gpus=20), compile="lazy", **options)


def balancer_from_a_plan(deployment, series, **options):
    """A Balancer serving the greedy plan of ``series[0]`` (groups home), which has recorded ``series[1]``."""
    start = eplb.plan(series[0], topology=deployment.topology, num_groups=deployment.num_groups, method="greedy")
    balancer = eplb.Balancer(series.shape[1], deployment, placement=start, window=1, compile="lazy", **options)
    balancer.record(series[1], physical=False)
    return balancer


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(40, 20, 1, None), (40, 10, 1, None), (64, 16, 2, 4), (48, 24, 2, 4)]),
       st.integers(0, 2**16))
def test_a_default_rebalance_changes_at_most_one_gpus_worth_per_layer(layout, seed):
    slots, gpus, nodes, groups = layout
    deployment = eplb.Deployment.of(32, num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    series = drifting_counts(2, 3, 32, drift=0.8, tokens=4096, seed=seed)
    balancer = balancer_from_a_plan(deployment, series)
    placement, transfer = balancer.rebalance()
    changed = (placement.phy2log != balancer_from_a_plan(deployment, series).placement.phy2log).sum(axis=1)
    assert (changed <= slots // gpus).all()
    np.testing.assert_array_equal(placement.info["slots_changed"], changed)
    assert len(transfer) <= changed.sum()  # a changed slot costs at most one copy
    assert not groups_spread(placement.phy2log, deployment, 32).any()


def test_decisions_and_plans_are_deterministic():
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=20)
    series = drifting_counts(2, 3, 32, drift=0.8, tokens=4096, seed=3)
    cost = eplb.CostModel.preset("H100", "deepseek-v3", regime="compute")
    first, second = (balancer_from_a_plan(deployment, series, cost_model=cost, min_gain=0.0) for _ in range(2))
    assert first.should_rebalance() == second.should_rebalance()
    assert json.dumps(first.last_decision, default=str) == json.dumps(second.last_decision, default=str)
    np.testing.assert_array_equal(first.rebalance()[0].phy2log, second.rebalance()[0].phy2log)


def test_the_round_robin_start_of_a_hierarchical_deployment_is_gathered_without_a_warning():
    """Gathering spread groups on their nodes is not chosen for its gain: the default budget does
    not bind it (an explicit one does, and says so)."""
    deployment = eplb.Deployment.of(64, num_slots=80, num_gpus=40, num_nodes=2, num_groups=4)
    balancer = eplb.Balancer(3, deployment, window=1, compile="lazy")
    assert balancer.max_moves == 2 and groups_spread(balancer.placement.phy2log, deployment, 64).all()
    balancer.record(drifting_counts(1, 3, 64, tokens=4096, seed=1)[0], physical=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SPREAD_WARNING)
        placement, _ = balancer.rebalance()
    assert not groups_spread(placement.phy2log, deployment, 64).any()
    explicit = eplb.Balancer(3, deployment, window=1, compile="lazy", max_moves=2)
    explicit.record(drifting_counts(1, 3, 64, tokens=4096, seed=1)[0], physical=False)
    with pytest.warns(RuntimeWarning, match=SPREAD_WARNING):
        explicit.rebalance()


def test_a_saved_state_keeps_the_budget_following_the_deployment(tmp_path):
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=20)
    balancer = eplb.Balancer(2, deployment, compile="lazy")
    config = json.loads(str(balancer.state_dict()["config"]))
    assert config["tolerance"] == AUTO and config["max_moves"] == AUTO
    restored = eplb.Balancer.from_state_dict(balancer.state_dict(), compile="lazy")
    assert (restored.tolerance, restored.max_moves) == (0.0, 2)
    fixed = eplb.Balancer(2, deployment, compile="lazy", tolerance=0.02, max_moves=3)
    config = json.loads(str(fixed.state_dict()["config"]))
    assert (config["tolerance"], config["max_moves"]) == (0.02, 3)


def test_the_budget_is_read_again_after_the_slots_per_gpu_change():
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=20)
    balancer = eplb.Balancer(2, deployment, compile="lazy")
    balancer.record(drifting_counts(1, 2, 32, tokens=4096, seed=2)[0], physical=False)
    assert balancer.max_moves == 2
    balancer.rebalance(deployment=eplb.Deployment.of(32, num_slots=80, num_gpus=20))  # 4 slots a GPU
    assert (balancer.tolerance, balancer.max_moves) == (0.0, 4)
    balancer.rebalance(deployment=eplb.Deployment.of(32, num_slots=180, num_gpus=20))  # 9 slots a GPU
    assert (balancer.tolerance, balancer.max_moves) == (BALANCER_TOLERANCE, None)

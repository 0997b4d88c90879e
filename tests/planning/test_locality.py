"""Locality-aware hierarchical placement (eplb.planning.locality): validity, the cap, home nodes, the bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eplb.kernels.search.off_node import exchange_descent
from eplb.planning.locality import (capped_lower_bound, home_nodes, off_node_tokens, off_node_curve,
                           plan_locality)
from eplb.simulation.synthetic import skewed_counts
from eplb.analysis.loads import gpu_loads
from eplb.planning.methods import get_method
from eplb.model.deployment import make_deployment


def group_skewed(num_layers, num_experts, num_groups, hot_groups, hot_share, seed):
    """``[L, E]`` counts where ``hot_groups`` groups carry ``hot_share`` of every layer's tokens."""
    rng = np.random.default_rng(seed)
    size = num_experts // num_groups
    out = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        p = np.exp(rng.normal(0.0, 0.7, num_experts)).reshape(num_groups, size)
        share = np.full(num_groups, (1 - hot_share) / (num_groups - hot_groups))
        share[rng.choice(num_groups, hot_groups, replace=False)] = hot_share / hot_groups
        p = (p / p.sum(axis=1, keepdims=True) * share[:, None]).ravel()
        out[layer] = rng.multinomial(20000, p)
    return out


def check_plan(weights, problem, phy2log, shares, home, max_off_node, source):
    """Every invariant a locality plan keeps (a layer taken from the global plan, ``source`` 2, or
    from its replicas exchanged across nodes, ``source`` 3, may leave an expert without a replica
    on its group's home node)."""
    num_layers, num_experts = weights.shape
    size = num_experts // problem.num_groups
    topology = problem.topology
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    for layer in range(num_layers):
        counts = np.bincount(phy2log[layer], minlength=num_experts)
        assert (counts >= 1).all(), "every expert keeps a replica"
        sums = np.bincount(phy2log[layer], weights=shares[layer], minlength=num_experts)
        np.testing.assert_allclose(sums, 1.0, rtol=1e-9, err_msg="an expert's shares sum to 1")
        assert (shares[layer] >= 0).all()
        for expert in range(num_experts if source[layer] not in (2, 3) else 0):
            nodes = node_of_slot[phy2log[layer] == expert]
            assert home[layer, expert // size] in nodes, "every expert keeps a replica on its home node"
    away = off_node_tokens(weights, phy2log, shares, home, topology)
    assert (away <= max_off_node * weights.sum(axis=1) * (1 + 1e-9) + 1e-9).all(), "the cap holds"


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.2, 1.0])
def test_cap_home_nodes_and_shares_hold_on_group_skew(fraction):
    weights = group_skewed(6, 64, 8, 2, 0.4, seed=1)
    problem = make_deployment(64, 96, 16, 4, 8)
    phy2log, shares, home, info = plan_locality(weights, problem, fraction)
    check_plan(weights, problem, phy2log, shares, home, fraction, info["source"])
    np.testing.assert_allclose(info["off_node_fraction"],
                               off_node_tokens(weights, phy2log, shares, home, problem.topology) / weights.sum(axis=1))


def test_zero_cap_is_the_hierarchical_plan():
    weights = group_skewed(5, 64, 8, 2, 0.4, seed=2)
    problem = make_deployment(64, 96, 16, 4, 8)
    phy2log, shares, home, info = plan_locality(weights, problem, 0.0)
    expected, _ = get_method("balanced")(weights, problem)
    np.testing.assert_array_equal(phy2log, expected)
    assert (info["off_node_fraction"] == 0).all()
    np.testing.assert_array_equal(home, home_nodes(expected, 8, 64, problem.topology))


def test_a_tenth_of_the_tokens_off_node_buys_balance_under_group_skew():
    """The point of the feature: 2 of 8 groups with 40% of the tokens cap a hierarchical plan near
    0.83 on 4 nodes; 10% of the tokens off their node bring it close to 1."""
    weights = group_skewed(8, 256, 8, 2, 0.4, seed=3)
    problem = make_deployment(256, 288, 32, 4, 8)
    balance = {}
    for fraction in (0.0, 0.1):
        phy2log, shares, home, _ = plan_locality(weights, problem, fraction)
        loads = gpu_loads(weights, phy2log, problem.topology, shares=shares)
        balance[fraction] = float((loads.mean(axis=1) / loads.max(axis=1)).mean())
    assert balance[0.0] < 0.9
    assert balance[0.1] > 0.97


@settings(max_examples=25, deadline=None)
@given(num_nodes=st.sampled_from([2, 4]), groups_per_node=st.sampled_from([1, 2]),
       group_size=st.integers(2, 6), gpus_per_node=st.integers(1, 3), extra=st.integers(0, 3),
       fraction=st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_properties_on_random_deployments(num_nodes, groups_per_node, group_size, gpus_per_node, extra, fraction,
                                          seed):
    num_groups = num_nodes * groups_per_node
    num_experts = num_groups * group_size
    per_gpu = -(-groups_per_node * group_size // gpus_per_node) + extra
    num_gpus = num_nodes * gpus_per_node
    problem = make_deployment(num_experts, per_gpu * num_gpus, num_gpus, num_nodes, num_groups)
    rng = np.random.default_rng(seed)
    weights = rng.pareto(1.2, (3, num_experts)) * 100
    weights[0] = 0.0 if seed % 5 == 0 else weights[0]  # a dense layer now and then
    phy2log, shares, home, info = plan_locality(weights, problem, fraction)
    check_plan(weights, problem, phy2log, shares, home, fraction, info["source"])
    peak = gpu_loads(weights, phy2log, problem.topology, shares=shares).max(axis=1)
    bound = capped_lower_bound(weights, problem, fraction)
    assert (bound <= peak * (1 + 1e-9) + 1e-12).all(), "the capped bound never exceeds what a plan reaches"
    hierarchical = plan_locality(weights, problem, 0.0)
    base_peak = gpu_loads(weights, hierarchical[0], problem.topology, shares=hierarchical[1]).max(axis=1)
    assert (peak <= base_peak * 1.01 + 1e-12).all(), "a cap never costs more than 1% over no off-node tokens"
    again = plan_locality(weights, problem, fraction)
    np.testing.assert_array_equal(again[0], phy2log)
    np.testing.assert_array_equal(again[1], shares)


def test_capped_bound_counts_the_heaviest_nodes():
    """Hand-checked: 4 groups of equal experts on 2 nodes of 1 GPU (2 groups each), group loads
    40, 30, 20, 10; with 10 tokens allowed off node the node holding the 40 group keeps at least
    40 + 10 (the lightest other) - 10 = 40 on its single GPU."""
    weights = np.repeat(np.array([[40.0, 30.0, 20.0, 10.0]]) / 2, 2, axis=1)
    problem = make_deployment(8, 8, 2, 2, 4)
    bound = capped_lower_bound(weights, problem, 0.1)
    assert bound[0] == pytest.approx(50.0)  # the average (100 / 2) is higher here
    bound = capped_lower_bound(weights * np.array([[1, 1, 1, 1, 1, 1, 0.2, 0.2]]), problem, 0.1)
    # loads 40, 30, 20, 2 (total 92): heaviest node >= 40 + 2 - 9.2 = 32.8 < average 46
    assert bound[0] == pytest.approx(46.0)


def test_pareto_curve_in_and_out_of_sample():
    windows = np.stack([group_skewed(4, 64, 8, 2, 0.4, seed=s) for s in range(3)])
    problem = make_deployment(64, 96, 16, 4, 8)
    curve = off_node_curve(windows[:2].sum(axis=0), problem, (0.0, 0.1, 1.0), held_out=windows[2:])
    assert curve["balancedness"].shape == (3,)
    assert curve["off_node_fraction"][0] == 0.0
    assert (curve["off_node_fraction"] <= np.array([0.0, 0.1, 1.0]) + 1e-9).all()
    assert curve["balancedness"][1] > curve["balancedness"][0]
    assert np.isfinite(curve["balancedness_held_out"]).all()


def test_plan_with_a_cap_carries_shares_home_nodes_and_an_honest_gap():
    import eplb

    weights = group_skewed(4, 64, 8, 2, 0.4, seed=4)
    placement = eplb.plan(weights, num_slots=96, num_gpus=16, num_nodes=4, num_groups=8, max_off_node=0.1)
    assert placement.shares is not None and placement.home_node.shape == (4, 8)
    assert placement.replicas_sharing_a_gpu().sum() == 0, "no GPU holds two slots of one expert"
    assert (placement.off_node_fraction(weights) <= 0.1 + 1e-9).all()
    assert (placement.gap >= -1e-12).all() and (placement.gap < 0.05).all()
    np.testing.assert_allclose(placement.max_load, placement.gpu_loads(weights, "shares").max(axis=1))
    hierarchical = eplb.plan(weights, num_slots=96, num_gpus=16, num_nodes=4, num_groups=8)
    assert (placement.balancedness(weights, "shares") > hierarchical.balancedness(weights)).all()
    assert (hierarchical.off_node_fraction(weights) == 0).all()
    restored = eplb.Placement.from_dict(placement.to_dict())
    np.testing.assert_array_equal(restored.shares, placement.shares)
    np.testing.assert_array_equal(restored.home_node, placement.home_node)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.1", None])
def test_bad_caps_are_refused_with_the_name(bad):
    import eplb

    weights = group_skewed(1, 64, 8, 2, 0.4, seed=5)
    if bad is None:
        with pytest.raises(ValueError, match="hierarchical"):
            eplb.plan(weights, num_slots=96, num_gpus=16, num_nodes=4, max_off_node=0.1)
        return
    with pytest.raises(ValueError, match="max_off_node"):
        eplb.plan(weights, num_slots=96, num_gpus=16, num_nodes=4, num_groups=8, max_off_node=bad)


def test_public_pareto_validates_and_returns_the_curve():
    import eplb

    weights = group_skewed(3, 64, 8, 2, 0.4, seed=6)
    deployment = eplb.Deployment.of(64, num_slots=96, num_gpus=16, num_nodes=4, num_groups=8)
    curve = eplb.pareto(weights, deployment, fractions=[0, 0.2], held_out=weights)
    assert set(curve) >= {"max_off_node", "balancedness", "off_node_fraction", "balancedness_held_out_optimal"}
    with pytest.raises(ValueError, match="fractions"):
        eplb.pareto(weights, deployment, fractions=[2])
    with pytest.raises(ValueError, match="held_out"):
        eplb.pareto(weights, deployment, held_out=weights[:, :32])
    with pytest.raises(ValueError, match="needs a hierarchical"):
        eplb.pareto(weights, eplb.Deployment.of(64, num_slots=96, num_gpus=16))


def _balancedness(loads):
    peak = loads.max(axis=1)
    return float((loads.mean(axis=1) / peak).mean())


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_racks_as_nodes_spend_the_budget_at_two_slots_a_gpu(num_nodes):
    """Racks as nodes with 2 slots a GPU (DeepSeek's decode unit, scaled down: 64 experts in 8
    groups on 36 GPUs): with 15% of the tokens allowed off their rack the plan comes within 0.01 of
    the global plan's balancedness, where keeping every group home is far behind."""
    counts = skewed_counts(12, 64, num_groups=8, top_k=8, seed=3).astype(float)
    deployment = make_deployment(64, 72, 36, num_nodes, 8)
    flat = make_deployment(64, 72, 36, 1)
    global_plan, _ = get_method("balanced")(counts, flat)
    reach = _balancedness(gpu_loads(counts, global_plan, flat.topology))
    phy2log, shares, home, info = plan_locality(counts, deployment, 0.15)
    check_plan(counts, deployment, phy2log, shares, home, 0.15, info["source"])
    capped = _balancedness(gpu_loads(counts, phy2log, deployment.topology, shares=shares))
    kept_home = plan_locality(counts, deployment, 0.0)
    home_only = _balancedness(gpu_loads(counts, kept_home[0], deployment.topology, shares=kept_home[1]))
    assert capped >= reach - 0.01, (capped, reach)
    assert capped > home_only, (capped, home_only)
    assert info["off_node_fraction"].max() <= 0.15 + 1e-9


@settings(max_examples=30, deadline=None)
@given(num_nodes=st.sampled_from([2, 3]), gpus_per_node=st.integers(1, 4), per_gpu=st.integers(1, 3),
       budget=st.sampled_from([0.0, 0.05, 0.3, 1.0]), keep_home=st.booleans(), seed=st.integers(0, 2**16))
def test_exchanges_never_raise_the_peak_nor_overspend(num_nodes, gpus_per_node, per_gpu, budget, keep_home, seed):
    """The exchange descent lowers (never raises) each layer's heaviest GPU, spends at most the budget
    beyond the off-home tokens it started with, and with ``keep_home`` leaves every expert a replica
    at home."""
    rng = np.random.default_rng(seed)
    num_gpus = num_nodes * gpus_per_node
    num_slots = num_gpus * per_gpu
    num_experts = max(1, num_slots - int(rng.integers(0, num_gpus + 1)))
    weights = rng.pareto(1.1, (3, num_experts)) * 50
    weights[0] = 0.0 if seed % 4 == 0 else weights[0]
    phy2log = np.stack([rng.permutation(np.concatenate([np.arange(num_experts),
                                                        rng.integers(0, num_experts, num_slots - num_experts)]))
                        for _ in range(3)]).astype(np.int64)
    replicas = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log]).astype(np.int64)
    slot_gpu = np.repeat(np.arange(num_gpus), per_gpu).astype(np.int64)
    gpu_node = np.repeat(np.arange(num_nodes), gpus_per_node).astype(np.int64)
    expert_node = np.ascontiguousarray(rng.integers(0, num_nodes, (3, num_experts)).astype(np.int64))
    for layer in range(3):  # every expert starts with a replica at home
        for expert in range(num_experts):
            expert_node[layer, expert] = gpu_node[slot_gpu[np.flatnonzero(phy2log[layer] == expert)[0]]]

    def peaks_and_away(rows):
        load = weights[np.arange(3)[:, None], rows] / np.take_along_axis(replicas, rows, axis=1)
        peaks = np.stack([np.bincount(slot_gpu, weights=load[l], minlength=num_gpus) for l in range(3)]).max(axis=1)
        away = (load * (gpu_node[slot_gpu][None, :] != np.take_along_axis(expert_node, rows, axis=1))).sum(axis=1)
        return peaks, away

    before, away_before = peaks_and_away(phy2log)
    allowed = budget * weights.sum(axis=1)
    rows = phy2log.copy()
    exchange_descent(weights, rows, replicas, slot_gpu, gpu_node, expert_node, allowed, 64, keep_home)
    after, away_after = peaks_and_away(rows)
    assert (after <= before * (1 + 1e-9) + 1e-9).all()
    assert (away_after <= np.maximum(allowed, away_before) * (1 + 1e-9) + 1e-6).all()
    np.testing.assert_array_equal(np.sort(rows, axis=1), np.sort(phy2log, axis=1))  # the same replicas
    if keep_home:
        for layer in range(3):
            homes = gpu_node[slot_gpu][None, :] == expert_node[layer][rows[layer]][None, :]
            assert set(rows[layer][homes[0]]) == set(range(num_experts))

"""Hierarchical deployments degrade instead of refusing: a deployment that can hold every expert is planned."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.planning.replan import RELAXED_WARNING, fit_groups


def _units_on_one_node(placement, units):
    """Whether every unit (``E / units`` consecutive experts) has replicas on one node only."""
    size = placement.num_experts // units
    node = placement.topology.node_of_gpu[placement.topology.gpu_of_slot]
    for row in placement.phy2log:
        for u in range(units):
            if np.unique(node[(row // size) == u]).size > 1:
                return False
    return True


def test_a_node_that_lost_a_gpu_keeps_groups_as_the_largest_units_that_fit_and_says_so():
    deployment = eplb.Deployment.of(32, topology=eplb.Topology(np.array([11, 0, 11, 11]), 2), num_groups=4)
    counts = np.random.default_rng(0).gamma(0.8, 100.0, (3, 32))
    with pytest.warns(RuntimeWarning, match=RELAXED_WARNING):
        placement = eplb.plan(counts, deployment)
    assert "units of 2" in placement.info["relaxed"]
    assert placement.num_groups == 16 and _units_on_one_node(placement, 16)
    assert all(set(row) == set(range(32)) for row in placement.phy2log)


def test_a_deployment_whose_groups_fit_is_not_relaxed():
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=4, num_nodes=2, num_groups=4)
    assert fit_groups(deployment) == (deployment, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert "relaxed" not in eplb.plan(np.ones((1, 32)), deployment).info


def test_groups_that_cannot_be_split_to_fit_fall_back_to_global():
    # groups of 3 experts (odd): no smaller unit; node 0 holds 2 slots, fewer than one group
    deployment = eplb.Deployment.of(6, topology=eplb.Topology(np.array([2, 0, 4, 4]), 2), num_groups=2)
    relaxed, note = fit_groups(deployment)
    assert not relaxed.hierarchical and "global" in note


@settings(max_examples=30)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([2, 4, 8]), st.integers(0, 2),
       st.lists(st.integers(0, 6), min_size=9, max_size=9), st.integers(0, 2**16))
def test_every_hierarchical_deployment_that_holds_every_expert_is_planned(nodes, per_node, groups_per_node, extra,
                                                                          slots, seed):
    gpus = nodes * per_node
    groups = nodes * groups_per_node
    experts = groups * 2
    slots = np.asarray(slots[:gpus], np.int64)
    if slots.sum() < experts:
        slots = slots + (-(-(experts - slots.sum()) // gpus)) + extra
    deployment = eplb.Deployment.of(experts, topology=eplb.Topology(slots, nodes), num_groups=groups)
    counts = np.random.default_rng(seed).gamma(0.6, 50.0, (2, experts))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        placement = eplb.plan(counts, deployment)
    assert all(set(row) == set(range(experts)) for row in placement.phy2log)
    if placement.num_groups is not None:
        assert _units_on_one_node(placement, placement.num_groups)
    assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all()


def test_a_rebalance_on_a_relaxed_deployment_stays_close_to_the_placement_in_service():
    # 4 nodes / 8 groups of 16 experts, 9 slots per GPU; GPU 1 lost: node 0 holds fewer than 2 whole groups.
    # Regrouping into units, as a plan from scratch does, moved most slots; from the placement in
    # service the plan moves few slots and balances about as well.
    rng = np.random.default_rng(4)
    counts = rng.gamma(0.7, 100.0, (4, 128))
    old = eplb.plan(counts, num_slots=144, num_gpus=16, num_nodes=4, num_groups=8)
    change = eplb.DeploymentChange.lose(old.deployment, [1])
    with pytest.warns(RuntimeWarning, match=RELAXED_WARNING):
        in_service = eplb.plan(counts, change, previous=old)
    drifted = counts * rng.lognormal(0.0, 0.3, counts.shape)
    with pytest.warns(RuntimeWarning, match=RELAXED_WARNING):
        again = eplb.plan(drifted, change.new, previous=in_service)
        scratch = eplb.plan(drifted, change.new)
    changed = (again.phy2log != in_service.phy2log).sum(axis=1)
    assert (changed <= 0.4 * change.new.num_slots).all(), changed
    assert ((scratch.phy2log != in_service.phy2log).sum(axis=1) > changed).all()
    assert again.max_load.mean() <= scratch.max_load.mean() * 1.02
    assert "close to the placement in service" in again.info["relaxed"]
    assert all(set(row) == set(range(128)) for row in again.phy2log)

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

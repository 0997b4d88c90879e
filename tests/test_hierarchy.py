"""The group -> node search of hierarchical placement (:mod:`eplb.kernels.hierarchy`) and the
bound it proves: never above the optimum (brute force on tiny instances dominated by one hot
expert, where the hot-expert condition binds), and tight where a hand argument gives the optimum."""

import numpy as np
from brute_force import optimum
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb


@st.composite
def hot_instances(draw):
    """``(weights [1, E], topology, num_groups)``: 2 nodes, 2 groups, one expert far above the rest."""
    per_node = draw(st.integers(2, 3))
    slots = np.array(draw(st.lists(st.integers(1, 2), min_size=2 * per_node, max_size=2 * per_node)), np.int64)
    size = draw(st.integers(1, 2))
    if min(slots[:per_node].sum(), slots[per_node:].sum()) < size or slots.sum() > 7:
        slots = np.ones(2 * per_node, np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    weights = rng.integers(0, 12, 2 * size).astype(np.float64)
    weights[draw(st.integers(0, 2 * size - 1))] = draw(st.sampled_from([40.0, 60.0, 100.0, 250.0]))
    return weights[None, :], eplb.Topology(slots, 2), 2


@settings(max_examples=30)
@given(hot_instances())
def test_the_hierarchical_bound_never_exceeds_the_brute_force_optimum(instance):
    weights, topology, groups = instance
    best = float(optimum(weights[0], topology.slots_per_gpu, 2, groups))
    bound = eplb.lower_bound(weights, topology, groups, hierarchical=True)
    assert bound[0] <= best * (1 + 1e-9) + 1e-12
    placement = eplb.plan(weights, topology=topology, num_groups=groups, method="best")
    assert placement.max_load[0] >= best * (1 - 1e-9)
    assert placement.lower_bound[0] <= placement.max_load[0] * (1 + 1e-12)


def test_a_hot_expert_on_every_gpu_of_its_node_leaves_room_for_the_others():
    """Expert 0 (100) must sit on both GPUs of its node (50 each), so expert 1 (10) adds to one:
    the optimum is 60; the load and replica conditions alone prove only the global 50."""
    weights = np.array([[100.0, 10.0, 1.0, 1.0]])
    topology = eplb.Topology(np.array([2, 1, 1, 1]), 2)
    assert eplb.lower_bound(weights, topology)[0] == 50.0
    bound = eplb.lower_bound(weights, topology, 2, hierarchical=True)[0]
    assert abs(bound - 60.0) < 1e-4
    assert float(optimum(weights[0], topology.slots_per_gpu, 2, 2)) == 60.0
    placement = eplb.plan(weights, topology=topology, num_groups=2)
    assert placement.max_load[0] == 60.0


def test_groups_go_to_nodes_that_can_hold_their_hot_expert():
    """Four groups on two nodes of 4 GPUs: the group with the hot expert keeps company that its
    node can still balance; the placement stays within 1% of the proven bound."""
    rng = np.random.default_rng(3)
    weights = rng.integers(50, 150, (4, 64)).astype(np.float64)
    weights[:, 5] = 4000.0  # group 0 holds a hot expert: more than 3 of its node's 4 GPUs can carry
    placement = eplb.plan(weights, num_slots=80, num_gpus=8, num_nodes=2, num_groups=4)
    assert placement.gap.max() < 0.01

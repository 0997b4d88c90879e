"""The Placement type and the Topology it lives on."""

import json

import numpy as np
import pytest
from checks import assert_valid

import eplb
from eplb.analysis.placement import Placement, build_log2phy
from eplb.model.topology import Topology


def make(phy2log, num_experts=3, slots=4, gpus=2):
    return Placement(phy2log=np.array(phy2log), num_experts=num_experts, topology=Topology.uniform(slots, gpus))


def test_derived_arrays_are_consistent_and_read_only():
    placement = make([[0, 1, 0, 2], [2, 2, 1, 0]])
    assert_valid(placement, 3)
    assert placement.log2phy[0].tolist() == [[0, 2], [1, -1], [3, -1]]
    assert placement.logcnt.tolist() == [[2, 1, 1], [1, 1, 2]]
    with pytest.raises(ValueError):
        placement.phy2log[0, 0] = 1
    assert placement.padded_log2phy(4).shape == (2, 3, 4)
    with pytest.raises(ValueError, match="width"):
        placement.padded_log2phy(1)


def test_json_round_trip():
    counts = np.array([[5.0, 1.0, 2.0, 7.0]])
    placement = eplb.plan(counts, num_slots=6, num_gpus=2, method="greedy")
    restored = Placement.from_dict(json.loads(json.dumps(placement.to_dict())))
    assert restored == placement
    np.testing.assert_allclose(restored.lower_bound, placement.lower_bound)
    np.testing.assert_allclose(restored.gap, placement.gap)
    assert restored.method == "greedy"


@pytest.mark.parametrize("phy2log, message", [
    ([[0, 1, 0, 0]], "expert 2 has none in layer 0"),
    ([[0, 1, 2, 3]], r"expert ids in \[0, 3\)"),
    ([[0, 1, 2]], "4 slots"),
    ([0, 1, 2, 0], r"shape \[L, S\]"),
    ([[0.0, 1.0, 2.0, 0.0]], "integer"),
])
def test_invalid_placements_are_rejected(phy2log, message):
    with pytest.raises(ValueError, match=message):
        make(phy2log)


def test_from_dict_names_a_missing_key():
    with pytest.raises(ValueError, match="phy2log"):
        Placement.from_dict({"num_experts": 3})


def test_counts_must_match_the_placement():
    placement = make([[0, 1, 0, 2]])
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        placement.gpu_loads(np.ones((1, 4)))


def test_build_log2phy_lists_slots_in_increasing_order():
    log2phy = build_log2phy(np.array([[1, 0, 1, 1]]), 2)
    assert log2phy.tolist() == [[[1, -1, -1], [0, 2, 3]]]


def test_topology_checks_and_views():
    topology = Topology(np.array([2, 3, 0, 1]), num_nodes=2)
    assert topology.num_slots == 6 and not topology.is_uniform
    assert topology.gpu_of_slot.tolist() == [0, 0, 1, 1, 1, 3]
    assert topology.node_of_gpu.tolist() == [0, 0, 1, 1]
    assert topology.slots_per_node.tolist() == [5, 1]
    assert Topology.from_dict(topology.to_dict()) == topology
    for bad, message in [((np.array([1, -1]), 1), "non-negative"), ((np.array([0, 0]), 1), "at least one slot"),
                         ((np.array([1, 1, 1]), 2), "divisible by num_nodes"), ((np.array([1.5]), 1), "integers")]:
        with pytest.raises(ValueError, match=message):
            Topology(*bad)


@pytest.mark.parametrize("rule", ["uniform", "optimal", "sglang-static", "sglang-dynamic", "vllm"])
def test_a_plan_remembers_its_dispatch_rule_and_is_judged_under_it(rule):
    """``plan(dispatch=rule)`` records the rule; the metrics judge under it unless told otherwise,
    and it survives eplb JSON and pickle."""
    import pickle

    counts = np.random.default_rng(3).zipf(1.4, (3, 32)).astype(float)
    placement = eplb.plan(counts, num_slots=40, num_gpus=4, num_nodes=2, dispatch=rule)
    assert placement.dispatch == rule
    np.testing.assert_array_equal(placement.balancedness(counts), placement.balancedness(counts, rule))
    np.testing.assert_array_equal(placement.gpu_loads(counts), placement.gpu_loads(counts, rule))
    for copy in (Placement.from_dict(json.loads(json.dumps(placement.to_dict()))), pickle.loads(pickle.dumps(placement))):
        assert copy.dispatch == rule
        np.testing.assert_array_equal(copy.balancedness(counts), placement.balancedness(counts))


def test_a_placement_without_a_recorded_rule_is_judged_under_the_even_split():
    placement = eplb.plan(np.arange(64.0).reshape(2, 32), num_slots=40, num_gpus=4)
    data = placement.to_dict()
    del data["dispatch"]  # a file written before the rule was recorded
    restored = Placement.from_dict(data)
    assert restored.dispatch == "uniform"
    with pytest.raises(ValueError, match="dispatch must be the rule the placement was planned for"):
        Placement(placement.phy2log, 32, placement.topology, dispatch="shares")

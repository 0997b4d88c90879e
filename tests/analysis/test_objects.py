"""Objects that leave eplb whole: a Placement survives pickle and deepcopy (multiprocessing,
torch.distributed.broadcast_object_list and Ray all pickle what they send)."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import configs, counts_for

import eplb
from eplb.analysis.placement import Placement
from eplb.model.topology import Topology

ROUND_TRIPS = {
    "pickle": lambda placement: pickle.loads(pickle.dumps(placement)),
    "deepcopy": copy.deepcopy,
}


def assert_same_placement(restored: Placement, original: Placement, counts: np.ndarray) -> None:
    """Every attribute and every metric of ``restored`` equals ``original``'s, arrays read-only."""
    assert restored == original
    for name in ("phy2log", "log2phy", "logcnt", "shares", "home_node", "lower_bound", "max_load", "gap"):
        mine, theirs = getattr(restored, name), getattr(original, name)
        if theirs is None:
            assert mine is None, name
        else:
            np.testing.assert_array_equal(mine, theirs, err_msg=name)
            assert name == "gap" or not mine.flags.writeable, f"{name} must stay read-only"
    assert (restored.num_experts, restored.num_groups, restored.method) == (
        original.num_experts, original.num_groups, original.method)
    assert restored.topology == original.topology
    assert restored.info.keys() == original.info.keys()
    np.testing.assert_equal(dict(restored.info), dict(original.info))  # arrays inside compared by value
    with pytest.raises(TypeError):
        restored.info["method"] = "changed"  # info stays read-only
    np.testing.assert_array_equal(restored.gpu_loads(counts), original.gpu_loads(counts))
    np.testing.assert_array_equal(restored.balancedness(counts), original.balancedness(counts))
    np.testing.assert_array_equal(restored.replicas_sharing_a_gpu(), original.replicas_sharing_a_gpu())
    assert restored.to_dict() == original.to_dict()


@st.composite
def placements_from_arrays(draw):
    """``(placement, counts)``: a random valid placement of a generated configuration, with its
    diagnostics given as arrays, as callables (lazy, evaluated or not before the round trip) or
    not at all."""
    config = draw(configs())
    topology = Topology.uniform(config["num_slots"], config["num_gpus"], config["num_nodes"])
    counts = draw(counts_for(config["num_experts"]))
    num_layers, num_experts = counts.shape
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_layers):
        extra = rng.integers(0, num_experts, topology.num_slots - num_experts)
        rows.append(rng.permutation(np.concatenate([np.arange(num_experts), extra])))
    phy2log = np.asarray(rows, dtype=np.int64)
    loads = Placement(phy2log, num_experts, topology).gpu_loads(counts)
    peaks, bound = loads.max(axis=1), counts.sum(axis=1) / topology.num_gpus
    kind = draw(st.sampled_from(["arrays", "lazy", "lazy_evaluated", "none"]))
    diagnostics = {"arrays": dict(max_load=peaks, lower_bound=bound),
                   "lazy": dict(max_load=lambda: peaks, lower_bound=lambda: bound),
                   "lazy_evaluated": dict(max_load=lambda: peaks, lower_bound=lambda: bound),
                   "none": {}}[kind]
    info = draw(st.sampled_from([{}, {"optimal": np.ones(num_layers, bool), "status": ["OPTIMAL"] * num_layers,
                                      "time_s": 0.25, "mode": "scratch"}]))
    placement = Placement(phy2log, num_experts, topology, method=draw(st.sampled_from(["unknown", "greedy"])),
                          info=info, **diagnostics)
    if kind == "lazy_evaluated":
        placement.lower_bound, placement.max_load  # noqa: B018 (computed before the round trip)
    return placement, counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=placements_from_arrays(), how=st.sampled_from(sorted(ROUND_TRIPS)))
def test_a_placement_round_trips_through_pickle_and_deepcopy(case, how):
    placement, counts = case
    assert_same_placement(ROUND_TRIPS[how](placement), placement, counts)


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("deployment", [
    dict(num_slots=24, num_gpus=4),
    dict(num_slots=24, num_gpus=4, num_nodes=2, num_groups=4),  # hierarchical: home_node
    dict(num_slots=24, num_gpus=4, num_nodes=2, num_groups=4, max_off_node=0.2),  # shares
    dict(num_slots=24, num_gpus=4, dispatch="sglang-static"),  # the engine mode's lazy bound
])
def test_a_plan_round_trips_with_its_lazy_bound_computed_or_not(how, deployment):
    rng = np.random.default_rng(3)
    series = np.floor(rng.pareto(0.8, (3, 2, 16)) * 100)
    fresh = eplb.plan(series, **deployment)
    computed = eplb.plan(series, **deployment)
    computed.gap  # noqa: B018 (lower bound and max load computed before the round trip)
    for placement in (fresh, computed):
        restored = ROUND_TRIPS[how](placement)
        assert_same_placement(restored, placement, series)
    np.testing.assert_array_equal(ROUND_TRIPS[how](fresh).lower_bound, computed.lower_bound)

"""Configurations engines really run: uneven slot counts, masked ranks, models without groups."""

import pytest
from checks import assert_valid
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.simulation.synthetic import drifting_counts


def test_from_layout_spreads_slots_and_masks_ranks():
    even = eplb.Topology.from_layout(64, 8, 2)
    assert even == eplb.Topology.uniform(64, 8, 2)
    uneven = eplb.Topology.from_layout(70, 8, 2)
    assert uneven.slots_per_gpu.tolist() == [9, 9, 9, 9, 9, 9, 8, 8]
    masked = eplb.Topology.from_layout(64, 8, 2, masked_gpus=[2, 5])
    assert masked.slots_per_gpu.tolist() == [11, 11, 0, 11, 11, 0, 10, 10]
    assert masked.num_slots == 64 and masked.num_gpus == 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=64, num_gpus=8, num_nodes=3), "divisible"),
    (dict(num_slots=64, num_gpus=4, masked_gpus=[0, 1, 2, 3]), "at least one GPU"),
    (dict(num_slots=64, num_gpus=4, masked_gpus=[4]), r"\[0, 4\)"),
    (dict(num_slots=0, num_gpus=4), "num_slots"),
])
def test_from_layout_refuses_what_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        eplb.Topology.from_layout(**kwargs)


@st.composite
def layouts(draw):
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.integers(2, 4))
    masked = draw(st.sets(st.integers(0, num_gpus - 1), max_size=num_gpus - 1))
    num_groups = draw(st.sampled_from([None, 2, 4]))
    num_experts = (num_groups or 1) * draw(st.integers(1, 6))
    num_slots = draw(st.integers(num_experts, num_experts + 2 * num_gpus + 3))
    return eplb.Topology.from_layout(num_slots, num_gpus, num_nodes, sorted(masked)), num_experts, num_groups


@settings(max_examples=40)
@given(layouts(), st.integers(0, 2**31))
def test_default_method_and_migration_handle_uneven_and_masked_layouts(layout, seed):
    topology, num_experts, num_groups = layout
    series = drifting_counts(2, 2, num_experts, drift=0.3, seed=seed)
    try:
        first = eplb.plan(series[0], topology=topology, num_groups=num_groups)
    except ValueError as exc:  # groups that cannot stay whole on the nodes: refused, and said why
        assert num_groups is not None and "group" in str(exc)
        return
    assert_valid(first, num_experts)
    masked = topology.slots_per_gpu == 0
    assert (first.gpu_loads(series[0])[:, masked] == 0).all()  # masked ranks carry nothing
    fresh = eplb.plan(series[1], topology=topology, num_groups=num_groups)
    near = eplb.plan(series[1], topology=topology, num_groups=num_groups, previous=first)
    assert_valid(near, num_experts)
    assert (near.max_load <= fresh.max_load * 1.005 + 1e-9).all()
    plan = eplb.transfer_plan(first, near)
    assert len(plan) == int((first.phy2log != near.phy2log).sum())
    assert (topology.slots_per_gpu[plan.src_gpu] > 0).all() and (topology.slots_per_gpu[plan.dst_gpu] > 0).all()


def test_greedy_refuses_uneven_layouts_clearly():
    topology = eplb.Topology.from_layout(70, 8, 2)
    counts = drifting_counts(1, 2, 64, seed=0)[0]
    with pytest.raises(ValueError, match="greedy.*same number of slots"):
        eplb.plan(counts, topology=topology, method="greedy")


def test_previous_placement_from_another_layout_is_re_planned_across_the_change():
    counts = drifting_counts(1, 2, 64, seed=0)[0]
    before = eplb.plan(counts, num_slots=72, num_gpus=8)
    drained = eplb.Topology.from_layout(72, 8, masked_gpus=[3])
    after = eplb.plan(counts, topology=drained, previous=before)
    assert after.info["lost_gpus"] == [3] and (after.info["copies"] >= after.info["copy_floor"]).all()


def test_balancer_on_a_masked_uneven_deployment_without_groups():
    topology = eplb.Topology.from_layout(75, 8, 2, masked_gpus=[6])
    series = drifting_counts(12, 4, 60, drift=0.05, tokens=16384, seed=4)
    balancer = eplb.Balancer(4, eplb.Deployment.of(60, topology=topology), window=4)
    for t in range(12):
        balancer.record(series[t])
        if t % 4 == 3 and balancer.should_rebalance():
            placement, transfer = balancer.rebalance()
            assert_valid(placement, 60)
            assert (placement.gpu_loads(series[t])[:, 6] == 0).all()
    assert balancer.rebalances >= 1
    assert balancer.num_groups is None

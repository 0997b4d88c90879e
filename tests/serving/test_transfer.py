"""Transfer plans: the weight copies from one placement to another."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_migration import random_previous

import eplb
from eplb.serving.transfer import CROSS_NODE, INTRA_GPU, INTRA_NODE, TransferPlan


@st.composite
def placement_pairs(draw):
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    num_experts = draw(st.integers(1, 24))
    min_k = -(-num_experts // num_gpus)
    k = draw(st.integers(min_k, min_k + 3))
    config = dict(num_experts=num_experts, num_slots=num_gpus * k)
    num_layers = draw(st.integers(1, 3))
    seeds = draw(st.tuples(st.integers(0, 2**31), st.integers(0, 2**31)))
    topology = eplb.Topology.uniform(num_gpus * k, num_gpus, num_nodes)
    old, new = (eplb.Placement(random_previous(config, num_layers, s), num_experts, topology) for s in seeds)
    return old, new


def apply(plan, old):
    """Run the copies on the old slots: every write reads the old weights."""
    result = old.phy2log.copy()
    for layer, expert, src, dst in zip(plan.layer, plan.expert, plan.src_slot, plan.dst_slot):
        assert old.phy2log[layer, src] == expert, "copies read a slot holding the expert"
        result[layer, dst] = expert
    return result


@settings(max_examples=60)
@given(placement_pairs())
def test_copies_turn_old_into_new_and_nothing_more(pair):
    old, new = pair
    plan = eplb.transfer_plan(old, new)
    np.testing.assert_array_equal(apply(plan, old), new.phy2log)
    assert len(plan) == int((old.phy2log != new.phy2log).sum())  # no copy for an unchanged slot
    topo = old.topology
    np.testing.assert_array_equal(plan.src_gpu, topo.gpu_of_slot[plan.src_slot])
    np.testing.assert_array_equal(plan.dst_gpu, topo.gpu_of_slot[plan.dst_slot])


@settings(max_examples=60)
@given(placement_pairs())
def test_sources_are_as_close_as_possible(pair):
    old, new = pair
    plan = eplb.transfer_plan(old, new)
    topo = old.topology
    node = topo.node_of_gpu
    gpu_of_slot = topo.gpu_of_slot
    for i in range(len(plan)):
        layer, expert, dst_gpu = plan.layer[i], plan.expert[i], plan.dst_gpu[i]
        holders = gpu_of_slot[old.phy2log[layer] == expert]
        if dst_gpu in holders:
            assert plan.kind[i] == INTRA_GPU and plan.src_gpu[i] == dst_gpu
        elif (node[holders] == node[dst_gpu]).any():
            assert plan.kind[i] == INTRA_NODE and node[plan.src_gpu[i]] == node[dst_gpu]
        else:
            assert plan.kind[i] == CROSS_NODE


def test_senders_are_spread_evenly():
    # expert 0 lives on GPUs 0 and 1 (node 0); GPUs 4..7 (node 1) all need it
    topology = eplb.Topology.uniform(16, 8, 2)
    old = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]])
    new = old.copy()
    new[0, 8:16:2] = 0
    plan = eplb.transfer_plan(old, new, eplb.Deployment.of(8, topology=topology))
    assert (plan.kind == CROSS_NODE).all()
    sends = plan.sends_per_gpu()[0]
    assert sends[0] == sends[1] == 2 and sends.sum() == 4


def test_totals_bytes_and_chunks():
    from eplb.simulation.synthetic import drifting_counts

    series = drifting_counts(2, 10, 64, num_groups=8, drift=0.3, seed=4)
    config = dict(num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
    old = eplb.plan(series[0], **config)
    new = eplb.plan(series[1], **config)
    plan = eplb.transfer_plan(old, new, expert_bytes=1000)
    counts = plan.counts()
    assert counts["total"] == len(plan) == counts["intra_gpu"] + counts["intra_node"] + counts["cross_node"]
    assert plan.bytes() == {k: v * 1000 for k, v in counts.items()}
    chunks = plan.chunks(3)
    assert [c.layers for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sum(len(c) for c in chunks) == len(plan)
    for c in chunks:
        assert ((c.layer >= c.layers[0]) & (c.layer < c.layers[1])).all()
    np.testing.assert_array_equal(np.concatenate([c.dst_slot for c in chunks]), plan.dst_slot)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["totals"]["copies"] == counts and len(data["expert"]) == len(plan)
    # a migration-aware plan needs far fewer copies than a plan from scratch
    near = eplb.plan(series[1], previous=old, **config)
    assert len(eplb.transfer_plan(old, near)) < len(plan) / 2


def test_bad_input_is_refused():
    topology = eplb.Topology.uniform(8, 2)
    a = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), 4, topology)
    other = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), 4, eplb.Topology.uniform(8, 4))
    # placements on two deployments are a deployment change (tests/serving/test_transfer_across.py)
    assert eplb.transfer_plan(a, other).topology == other.topology
    with pytest.raises(ValueError, match="the deployment is required"):
        eplb.transfer_plan(a.phy2log, a.phy2log)
    with pytest.raises(ValueError, match="deployment must be an eplb.Deployment"):
        eplb.transfer_plan(a.phy2log, a.phy2log, a.topology)
    with pytest.raises(ValueError, match="new"):
        eplb.transfer_plan(a, np.array([[0, 1, 2, 3, 0, 1, 2, 9]]))
    with pytest.raises(ValueError, match="expert_bytes"):
        eplb.transfer_plan(a, a).bytes()
    with pytest.raises(ValueError, match="layers_per_chunk"):
        eplb.transfer_plan(a, a).chunks(0)


@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(1, 7))
def test_chunks_partition_the_copies_in_layer_order_whatever_order_they_were_given_in(layers, size):
    """A plan built from copies in any order keeps them in layer order (stably), and its chunks
    are exactly the copies of their layers, as a mask would select them."""
    topology = eplb.Topology.from_layout(8, 2, 1)
    layer = np.array(layers, dtype=np.int64)
    ids = np.arange(layer.size, dtype=np.int64)
    plan = TransferPlan(layer, ids, ids % 8, ids % 8, ids % 2, ids % 2, np.zeros_like(ids), num_layers=6,
                        topology=topology)
    order = np.argsort(layer, kind="stable")
    np.testing.assert_array_equal(plan.layer, layer[order])
    np.testing.assert_array_equal(plan.expert, ids[order])
    chunks = plan.chunks(size)
    assert [c.layers for c in chunks] == [(s, min(s + size, 6)) for s in range(0, 6, size)]
    for chunk in chunks:
        start, stop = chunk.layers
        keep = (layer[order] >= start) & (layer[order] < stop)
        np.testing.assert_array_equal(chunk.expert, ids[order][keep])  # stable: given order within a layer
        np.testing.assert_array_equal(plan.for_layers(start, stop).expert, chunk.expert)
    assert sum(len(c) for c in chunks) == len(plan)


def test_the_deprecated_topology_keyword_still_plans_the_same_with_a_warning():
    topology = eplb.Topology.uniform(8, 2)
    old, new = np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), np.array([[0, 1, 2, 3, 3, 2, 1, 0]])
    with pytest.warns(DeprecationWarning, match="pass the deployment"):
        before = eplb.transfer_plan(old, new, topology=topology, num_experts=4)
    after = eplb.transfer_plan(old, new, eplb.Deployment.of(4, topology=topology))
    assert before.counts() == after.counts() and (before.dst_slot == after.dst_slot).all()
    with pytest.raises(TypeError, match="num_slots"):
        eplb.transfer_plan(old, new, num_slots=8)

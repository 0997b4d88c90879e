"""Transfer plans across a deployment change: sources on surviving GPUs only, orphans from host once."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.serving.transfer import FROM_HOST, INTRA_GPU, INTRA_NODE


@st.composite
def changes(draw):
    """A deployment, a placement in service on it, a change (GPUs lost, added, renumbered, slots
    per GPU changed) and the counts to re-plan for."""
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.integers(1, 3))
    experts = draw(st.integers(2, 12))
    k = -(-experts // num_gpus) + draw(st.integers(0, 2))
    old = eplb.Deployment.of(experts, num_slots=num_gpus * k, num_gpus=num_gpus, num_nodes=num_nodes)
    new_gpus = num_nodes * draw(st.integers(1, 3))
    new_k = max(-(-experts // new_gpus), k + draw(st.integers(-1, 2)))
    new = eplb.Deployment.of(experts, num_slots=new_gpus * new_k, num_gpus=new_gpus, num_nodes=num_nodes)
    pool = draw(st.permutations(list(range(new_gpus))))
    keep = draw(st.lists(st.booleans(), min_size=num_gpus, max_size=num_gpus))
    gpu_map = [pool[i] if keep[i] and i < new_gpus else -1 for i in range(num_gpus)]
    seed = draw(st.integers(0, 2**16))
    counts = np.random.default_rng(seed).gamma(0.7, 100.0, (2, experts))
    return eplb.DeploymentChange(old, new, gpu_map), eplb.plan(counts, old), counts


def apply(plan, change, old_phy2log):
    """The new slots after the copies: carried weights, then the host loads, then the copies that
    read them, each copy reading a slot that holds its expert at that point: a slot of the
    placement in service on a surviving GPU (carried, or given up by a shrinking GPU), or a slot
    a load fills."""
    slots = change.carry(old_phy2log)
    after = slots.copy()
    old_gpu = change.old.topology.gpu_of_slot
    for c in np.argsort(plan.after_load, kind="stable"):  # loads and plain copies first
        layer, expert, src, dst = plan.layer[c], plan.expert[c], plan.src_slot[c], plan.dst_slot[c]
        old_src = plan.src_old_slot[c]
        if plan.kind[c] == FROM_HOST:
            assert src == -1 and old_src == -1 and plan.src_gpu[c] == -1
        elif plan.after_load[c]:
            assert old_src == -1 and after[layer, src] == expert, "a copy after a load reads the loaded slot"
        else:
            assert old_phy2log[layer, old_src] == expert, "a copy reads a slot that does not hold its expert"
            assert change.surviving[old_gpu[old_src]] and plan.src_gpu[c] == change.gpu_map[old_gpu[old_src]]
            if src >= 0:  # a carried slot: the same weights in the new numbering
                assert change.slot_map[src] == old_src and slots[layer, src] == expert
            else:  # a slot its GPU gives up
                assert change.given_up(old_phy2log)[layer, old_src] == expert
        after[layer, dst] = expert
    return after


@settings(max_examples=40)
@given(changes())
def test_the_copies_turn_the_carried_placement_into_the_new_one_reading_no_lost_gpu(case):
    change, old, counts = case
    new = eplb.plan(counts, change.new, previous=old, gpu_map=change.gpu_map)
    plan = eplb.transfer_plan(old, new, change)
    assert plan.topology == change.new.topology
    assert np.array_equal(apply(plan, change, old.phy2log), new.phy2log)
    survivors_new = change.gpu_map[change.surviving]
    loads = plan.kind == FROM_HOST
    carried = ~loads & ~plan.after_load  # reads what a survivor carried: never a lost (or new, empty) GPU
    assert np.isin(plan.src_gpu[carried], survivors_new).all()
    loaded_slots = set(zip(plan.layer[loads].tolist(), plan.dst_slot[loads].tolist()))
    assert set(zip(plan.layer[plan.after_load].tolist(), plan.src_slot[plan.after_load].tolist())) <= loaded_slots
    loaded = set(zip(plan.layer[loads].tolist(), plan.expert[loads].tolist()))
    assert len(loaded) == loads.sum()  # each orphan once per layer
    assert loaded == set(zip(*np.nonzero(change.orphans(old.phy2log))))
    assert plan.counts()["from_host"] == int(change.orphans(old.phy2log).sum())
    assert plan.counts()["total"] == int(new.info["copies"].sum()) if "copies" in new.info else True


def test_an_orphan_with_two_new_replicas_is_loaded_once_and_copied_once():
    old = eplb.Deployment.of(4, num_slots=8, num_gpus=4, num_nodes=2)
    new = eplb.Deployment.of(4, num_slots=8, num_gpus=2, num_nodes=1)
    change = eplb.DeploymentChange(old, new, gpu_map=[0, 1, -1, -1])
    previous = np.array([[0, 1, 0, 1, 2, 3, 2, 3]])  # experts 2, 3 only on the lost GPUs
    target = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    plan = eplb.transfer_plan(previous, target, change, expert_bytes=10)
    loads = plan.kind == FROM_HOST
    assert sorted(plan.expert[loads].tolist()) == [2, 3]
    assert plan.after_load.sum() == 2 and set(plan.kind[plan.after_load].tolist()) <= {INTRA_GPU, INTRA_NODE}
    assert plan.bytes()["from_host"] == 20
    cost = eplb.CostModel.preset("H100")
    assert cost.transfer_time(plan) > cost.copy_time(*([np.zeros(2)] * 3))


def test_a_change_without_the_old_deployment_is_refused():
    a = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), 4, eplb.Topology.uniform(8, 2))
    with pytest.raises(ValueError, match="gpu_map needs old and new as eplb.Placement"):
        eplb.transfer_plan(a.phy2log, a.phy2log, a.deployment, gpu_map=[1, 0])
    b = eplb.Placement(np.array([[0, 1, 2, 3]]), 4, eplb.Topology.uniform(4, 2))
    with pytest.raises(ValueError, match="one new index per old GPU"):
        eplb.transfer_plan(a, b, gpu_map=[0])
    # GPUs swapped and shrunk to 2 slots: each keeps its first two (experts 0, 1); new GPU 1 (old
    # GPU 0) reads 2 and 3 from the slots it gives up, nothing from host
    swapped = eplb.transfer_plan(a, b, gpu_map=[1, 0])
    assert swapped.counts()["from_host"] == 0 and swapped.counts()["intra_gpu"] == 2
    assert sorted(swapped.expert.tolist()) == [2, 3] and swapped.src_slot.tolist() == [-1, -1]
    assert sorted(swapped.src_old_slot.tolist()) == [2, 3] and set(swapped.src_gpu.tolist()) == {1}


def test_item20_a_plan_made_with_a_gpu_map_carries_it_to_its_transfer_plan():
    """Issue 47 item 20: ``transfer_plan(old, new)`` for a plan made with ``gpu_map=`` paired GPUs by
    index when the map was not passed again (many more copies than planned); the plan carries its
    map (``info["gpu_map"]``), and another map is refused."""
    rng = np.random.default_rng(3)
    counts = rng.gamma(0.7, 100.0, (2, 16))
    old = eplb.Deployment.of(16, num_slots=32, num_gpus=8, num_nodes=2)
    new = eplb.Deployment.of(16, num_slots=28, num_gpus=7, num_nodes=1)
    gpu_map = [0, 1, -1, 2, 3, 4, 5, 6]  # GPU 2 gone, the later ones one index down
    in_service = eplb.plan(counts, old)
    placement = eplb.plan(counts, new, previous=in_service, gpu_map=gpu_map)
    assert placement.info["gpu_map"] == gpu_map
    carried = eplb.transfer_plan(in_service, placement)
    given = eplb.transfer_plan(in_service, placement, gpu_map=gpu_map)
    assert len(carried) == len(given) == int(placement.info["copies"].sum())
    np.testing.assert_array_equal(carried.src_old_slot, given.src_old_slot)
    with pytest.raises(ValueError, match="new was planned with gpu_map"):
        eplb.transfer_plan(in_service, placement, gpu_map=[0, 1, 2, 3, 4, 5, 6, -1])
    with pytest.raises(ValueError, match="new was planned with gpu_map"):
        eplb.transfer_plan(in_service, placement, eplb.DeploymentChange(old, new))

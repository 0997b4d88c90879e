"""DeploymentChange: the one value for GPUs lost, added or renumbered, and slots per GPU changed."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.model.change import HOLE, DeploymentChange


def _deployment(slots, nodes=1, experts=8, groups=None):
    return eplb.Deployment.of(experts, topology=eplb.Topology(np.asarray(slots, np.int64), nodes), num_groups=groups)


def test_by_default_gpus_keep_their_index_and_extra_old_gpus_are_gone():
    change = DeploymentChange(_deployment([3, 3, 3, 3], experts=6), _deployment([3, 3], experts=6))
    assert change.gpu_map.tolist() == [0, 1, -1, -1]
    assert change.lost_gpus.tolist() == [2, 3] and change.added_gpus.tolist() == []
    grown = DeploymentChange(_deployment([3, 3], experts=6), _deployment([3, 3, 3], experts=6))
    assert grown.gpu_map.tolist() == [0, 1] and grown.added_gpus.tolist() == [2]


def test_a_gpu_with_no_slots_after_the_change_is_lost():
    change = DeploymentChange.lose(_deployment([3, 3, 3, 3]), [1])
    assert change.new.topology.slots_per_gpu.tolist() == [3, 0, 3, 3]
    assert change.lost_gpus.tolist() == [1] and change.surviving.tolist() == [True, False, True, True]


def test_carry_keeps_each_survivors_first_slots_in_its_new_place():
    old = _deployment([3, 3, 3])
    new = _deployment([4, 2, 3])
    change = DeploymentChange(old, new, gpu_map=[2, -1, 0])  # GPU 0 -> 2, GPU 1 gone, GPU 2 -> 0
    previous = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0]])
    carried = change.carry(previous)
    # new GPU 0 (4 slots) keeps old GPU 2's three; new GPU 1 (2 slots) is added; new GPU 2 keeps old GPU 0's three
    assert carried.tolist() == [[6, 7, 0, HOLE, HOLE, HOLE, 0, 1, 2]]
    assert change.added_gpus.tolist() == [1]
    assert change.orphans(previous)[0].tolist() == [False, False, False, True, True, True, False, False]
    assert change.missing(previous).tolist() == change.orphans(previous).tolist()  # old GPU 1 was lost
    assert change.floor(previous).tolist() == [3]  # 3 holes, 3 orphans
    assert change.source_gpu.tolist() == [2, -1, 0]


def test_a_shrunken_gpu_gives_up_its_last_slots():
    change = DeploymentChange(_deployment([4, 4], experts=6), _deployment([3, 3], experts=6))
    previous = np.array([[0, 1, 2, 3, 4, 5, 0, 1]])
    assert change.carry(previous).tolist() == [[0, 1, 2, 4, 5, 0]]
    # expert 3 sat only in a slot GPU 0 gives up: missing (one copy), read from that slot, no orphan
    assert change.given_up(previous).tolist() == [[-1, -1, -1, 3, -1, -1, -1, 1]]
    assert np.flatnonzero(change.missing(previous)[0]).tolist() == [3]
    assert not change.orphans(previous).any()
    assert change.floor(previous).tolist() == [1]


@pytest.mark.parametrize("gpu_map, message", [
    ([0, 1], "one new index per old GPU: 3 entries, got 2"),
    ([0, 0, 1], "maps two old GPUs to one new GPU"),
    ([0, 1, 3], r"-1 \(gone\) or new GPU indices in \[0, 3\)"),
    ([0, 1, -2], r"-1 \(gone\) or new GPU indices"),
    ([0.5, 1, 2], "list of integers"),
])
def test_a_bad_gpu_map_is_refused_naming_the_rule(gpu_map, message):
    with pytest.raises(ValueError, match=message):
        DeploymentChange(_deployment([3, 3, 3]), _deployment([3, 3, 3]), gpu_map=gpu_map)


def test_losing_too_many_gpus_says_how_many_slots_per_gpu_would_hold_every_expert():
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4)
    with pytest.raises(ValueError, match="8 GPUs lost: 216 slots for 256 experts; give the survivors 11 slots per GPU"):
        DeploymentChange.lose(deployment, range(24, 32))
    assert DeploymentChange.lose(deployment, range(24, 32), slots_per_gpu=11).new.num_slots == 264
    for bad, message in (([32], r"GPU indices in \[0, 32\)"), ([-1], r"GPU indices in \[0, 32\)"), ([3, 3], "twice"),
                         ([], "at least one GPU")):
        with pytest.raises(ValueError, match=message):
            DeploymentChange.lose(deployment, bad)


def test_another_expert_count_is_refused():
    with pytest.raises(ValueError, match="keeps the experts: old has 8, new has 9"):
        DeploymentChange(_deployment([3, 3, 3]), _deployment([3, 3, 3], experts=9))


@given(st.lists(st.integers(0, 4), min_size=2, max_size=6), st.lists(st.integers(0, 4), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_the_carried_placement_is_the_old_one_on_surviving_gpus(old_slots, new_slots, rng):
    """Every carried slot holds what its old slot held; holes are the new slots nothing maps to;
    the floor is max(missing, holes); orphans are the experts no surviving GPU holds."""
    if sum(old_slots) < 1 or sum(new_slots) < 1:
        return
    experts = max(1, min(sum(old_slots), sum(new_slots)) - 1)
    old, new = _deployment(old_slots, experts=experts), _deployment(new_slots, experts=experts)
    pool = list(range(len(new_slots)))  # distinct new indices or -1, one per old GPU
    rng.shuffle(pool)
    gpu_map = [pool.pop() if pool and rng.random() < 0.7 else -1 for _ in old_slots]
    change = DeploymentChange(old, new, gpu_map=gpu_map)
    row = np.array([rng.randrange(experts) for _ in range(old.num_slots)])
    row[:experts] = np.arange(experts)
    carried = change.carry(row[None])[0]
    kept = change.slot_map >= 0
    assert np.array_equal(carried[kept], row[change.slot_map[kept]])
    assert (carried[~kept] == HOLE).all()
    missing = change.missing(row[None])[0]
    assert set(np.flatnonzero(missing)) == set(range(experts)) - set(carried[kept].tolist())
    assert change.floor(row[None])[0] == max(missing.sum(), (~kept).sum())
    given_up = change.given_up(row[None])[0]  # old slots of surviving GPUs that no new slot keeps
    read = change.surviving[old.topology.gpu_of_slot]
    read[change.slot_map[kept]] = False
    assert np.array_equal(given_up >= 0, read) and np.array_equal(given_up[read], row[read])
    orphans = change.orphans(row[None])[0]  # on no surviving GPU at all
    assert set(np.flatnonzero(orphans)) == set(range(experts)) - set(row[change.surviving[old.topology.gpu_of_slot]].tolist())
    for g_old, g_new in enumerate(gpu_map):  # a surviving GPU's slots land on its new index only
        if g_new >= 0:
            lo, hi = new.topology.slot_offsets[g_new], new.topology.slot_offsets[g_new + 1]
            sources = change.slot_map[lo:hi]
            sources = sources[sources >= 0]
            assert ((sources >= old.topology.slot_offsets[g_old]) & (sources < old.topology.slot_offsets[g_old + 1])).all()

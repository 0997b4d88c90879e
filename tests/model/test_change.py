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


# -- issue 47 items 16, 17, 18: sizes, maps and expert ids checked before anything is done ------------------

DEEPSEEK = eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)


@pytest.mark.parametrize("slots_per_gpu, message", [
    (10**12, "slots_per_gpu is 1,000,000,000,000, above the limit of 1,048,576 .*EPLB_MAX_SLOTS"),
    (200_000, "the slots of the 31 surviving GPUs is 6,200,000, above the limit of 1,048,576"),
])
def test_item16_lose_checks_the_slot_limit_before_allocating(slots_per_gpu, message):
    """``lose(slots_per_gpu=10**12)`` raised MemoryError (a slot table of 31 trillion entries) and
    200,000 ran for minutes: one ValueError naming the size, the limit and how to raise it."""
    with pytest.raises(ValueError, match=message):
        DeploymentChange.lose(DEEPSEEK, [5], slots_per_gpu=slots_per_gpu)


def test_item16_deployments_beyond_the_documented_limits_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="num_gpus is 8,008, above the limit of 4,096 .*EPLB_MAX_GPUS"):
        eplb.Deployment.of(256, num_slots=8008 * 9, num_gpus=8008)
    with pytest.raises(ValueError, match="the number of GPUs is 5,000, above the limit of 4,096"):
        eplb.Topology(np.ones(5000, np.int64))
    with pytest.raises(ValueError, match="the slots of one GPU is 2,000,000"):
        eplb.Topology(np.array([2_000_000, 1]))
    with pytest.raises(ValueError, match="num_experts is 100,000, above the limit of 65,536 .*EPLB_MAX_EXPERTS"):
        eplb.Deployment.of(100_000, num_slots=100_000, num_gpus=1000)
    monkeypatch.setenv("EPLB_MAX_GPUS", "8192")  # the limits move with their variables
    assert eplb.Deployment.of(256, num_slots=8008 * 9, num_gpus=8008).num_gpus == 8008
    monkeypatch.setenv("EPLB_MAX_SLOTS", "100")
    with pytest.raises(ValueError, match="num_slots is 288, above the limit of 100"):
        eplb.Deployment.of(256, num_slots=288, num_gpus=32)


def test_item17_an_unsigned_gpu_map_entry_never_wraps_to_minus_one():
    """A uint64 ``gpu_map`` holding 2**64 - 1 wrapped to -1 and its GPU counted as lost."""
    old = _deployment([3, 3, 3], experts=6)
    for gpu_map in (np.array([0, 2**64 - 1, 2], np.uint64), np.array([0, 255, 2], np.uint8)):
        with pytest.raises(ValueError, match="gpu_map entries must be -1 .* new GPU indices in \\[0, 3\\)"):
            DeploymentChange(old, old, gpu_map)
    assert DeploymentChange(old, old, np.array([2, 1, 0], np.uint64)).gpu_map.tolist() == [2, 1, 0]
    for gpu_map in ([0, 2**64 - 1, 2], [0, 2**70, 2], [0, 1.0, 2]):
        with pytest.raises(ValueError, match="gpu_map must be a list of integers"):
            DeploymentChange(old, old, gpu_map)


def test_item17_duplicate_lost_gpus_are_refused_in_every_entry():
    with pytest.raises(ValueError, match="names a GPU twice"):
        DeploymentChange.lose(_deployment([3, 3, 3]), [1, 1])
    with pytest.raises(ValueError, match="masked_gpus names a GPU twice"):
        eplb.Topology.from_layout(12, 4, masked_gpus=[1, 1])
    from eplb.simulation.events import Resize

    with pytest.raises(ValueError, match="fail-gpu names each GPU once"):
        Resize("fail-gpu", (5, 5))


@pytest.mark.parametrize("previous, message", [
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0.5]]), "integer expert ids, got float64"),
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7, 1.0]]), "integer expert ids, got float64"),
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7, -1]]), r"expert ids in \[0, 8\), got \[-1\]"),
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8]]), r"expert ids in \[0, 8\), got \[8\]"),
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), r"phy2log \[L, 9\]"),
])
@pytest.mark.parametrize("helper", ["carry", "missing", "orphans", "floor", "given_up"])
def test_item18_change_helpers_refuse_expert_ids_they_cannot_hold(previous, message, helper):
    """``carry``, ``missing``, ``orphans`` and ``floor`` truncated float ids (0.5 -> expert 0),
    miscounted negative ones and raised IndexError for ids >= E: one ValueError naming the rule."""
    change = DeploymentChange(_deployment([3, 3, 3]), _deployment([4, 2, 3]), gpu_map=[2, -1, 0])
    with pytest.raises(ValueError, match=message):
        getattr(change, helper)(previous)


def test_item18_integer_ids_of_any_width_are_read_as_they_are():
    change = DeploymentChange(_deployment([3, 3, 3]), _deployment([4, 2, 3]), gpu_map=[2, -1, 0])
    previous = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0]])
    for dtype in (np.uint8, np.int32, np.uint64):
        np.testing.assert_array_equal(change.carry(previous.astype(dtype)), change.carry(previous))
        np.testing.assert_array_equal(change.floor(previous.astype(dtype)), change.floor(previous))

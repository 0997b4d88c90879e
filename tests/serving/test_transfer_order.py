"""Issue 47 item 11: a transfer plan run in its documented order ends in the planned placement.

The executor below is a memory model of an engine's expert slots: each slot holds an expert id
(the weights it holds). It runs a plan's steps in the order :meth:`eplb.TransferPlan.ordered`
gives and the docs document, each copy writing what its source holds *at that moment* (not the
expert the plan says it copies): step ``"copy"`` as one bulk step (every source read, then every
destination written), ``"load"`` and ``"after_load"`` one copy after another (forwards and
backwards: they are documented as "any order"). Host memory holds every expert; a shrinking GPU's
given-up slots hold their old experts until the plan is done; a lost GPU is not readable at all.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.serving.transfer import AFTER_LOAD, COPY, FROM_HOST, LOAD, PHASES
from eplb.simulation.synthetic import deepseek_v3_counts, skewed_counts

LOST = -2  # what a read of a lost GPU (or of nothing) returns in the memory model


def execute(plan, old_phy2log, change=None, *, order=PHASES, backwards=False):
    """``[L, S_new]``: the slots after running ``plan`` step by step in ``order`` (the documented
    order unless a test asks for another), starting from what the GPUs hold in ``old_phy2log``
    (the layers of ``plan.layers`` only when it is a chunk)."""
    old_phy2log = np.asarray(old_phy2log)
    if change is None:
        slots, given_up = old_phy2log.copy(), np.full_like(old_phy2log, LOST)
    else:
        slots, given_up = change.carry(old_phy2log), change.given_up(old_phy2log)
        given_up = np.where(given_up < 0, LOST, given_up)
    base = plan.layers[0]
    steps = dict(plan.ordered())
    assert list(steps) == list(PHASES)
    for name in order:
        step = steps[name]
        assert (step.phase == PHASES.index(name)).all()
        indices = range(len(step))[::-1] if backwards else range(len(step))

        def read(c):
            if step.kind[c] == FROM_HOST:
                return step.expert[c]  # host memory holds every expert's weights
            if step.src_slot[c] >= 0:
                return slots[step.layer[c] - base, step.src_slot[c]]
            if step.src_old_slot[c] >= 0:
                return given_up[step.layer[c] - base, step.src_old_slot[c]]
            return LOST

        if name == "copy":  # one bulk step: every source read before any destination is written
            values = [read(c) for c in indices]
            for c, value in zip(indices, values):
                slots[step.layer[c] - base, step.dst_slot[c]] = value
        else:
            for c in indices:
                slots[step.layer[c] - base, step.dst_slot[c]] = read(c)
    return slots


def check_plan_runs(plan, old_phy2log, new_phy2log, change=None):
    """The plan's steps, run as documented (loads and after-load copies in either direction), end
    in ``new_phy2log``; each new slot is written at most once."""
    pairs = plan.layer * (plan.dst_slot.max(initial=0) + 1) + plan.dst_slot
    assert np.unique(pairs).size == len(plan), "a slot is written twice"
    for backwards in (False, True):
        np.testing.assert_array_equal(execute(plan, old_phy2log, change, backwards=backwards), new_phy2log)
    assert ((plan.phase == LOAD) == (plan.kind == FROM_HOST)).all()
    assert ((plan.phase == AFTER_LOAD) == plan.after_load).all()


def test_item11_the_documented_order_is_right_and_loads_first_is_not():
    """A hand-made change where the order matters: GPU 1 (experts 2, 3) lost; slot 1 is both a
    load's destination (expert 2) and the source of a local copy (expert 1 into slot 0)."""
    old = eplb.Deployment.of(4, num_slots=6, num_gpus=3, num_nodes=1)
    change = eplb.DeploymentChange.lose(old, [1])
    in_service = np.array([[0, 1, 2, 3, 0, 1]])
    new = np.array([[1, 2, 3, 0]])  # new slots: GPU 0 -> 0, 1; GPU 2 -> 2, 3
    plan = eplb.transfer_plan(in_service, new, change)
    assert [(name, len(step)) for name, step in plan.ordered()] == [("copy", 2), ("load", 2), ("after_load", 0)]
    check_plan_runs(plan, in_service, new, change)
    # the order the docs used to give (loads first) overwrites slot 1 before expert 1 is read from it
    wrong = execute(plan, in_service, change, order=("load", "copy", "after_load"))
    assert not np.array_equal(wrong, new)
    # the cost model prices the steps one after another
    cost = eplb.CostModel.preset("H100")
    steps = [cost.transfer_time(step) for _, step in plan.ordered()]
    assert cost.transfer_time(plan) == pytest.approx(sum(steps)) and min(steps[:2]) > 0


def test_item11_swaps_and_chains_run_in_one_bulk_step():
    """Same deployment: two slots swapping experts and a chain (a destination that is another copy's
    source) are right only as one bulk step; every copy is in step ``"copy"``."""
    deployment = eplb.Deployment.of(3, num_slots=4, num_gpus=2, num_nodes=1)
    old, new = np.array([[0, 1, 2, 0]]), np.array([[1, 0, 0, 2]])
    plan = eplb.transfer_plan(old, new, deployment)
    assert (plan.phase == COPY).all() and len(plan) == 4
    check_plan_runs(plan, old, new)
    one_by_one = old.copy()
    for c in range(len(plan)):
        one_by_one[0, plan.dst_slot[c]] = one_by_one[0, plan.src_slot[c]]
    assert not np.array_equal(one_by_one, new)  # why step "copy" must read everything first


def test_item11_deepseek_v3_one_gpu_lost_runs_in_the_documented_order():
    """288 slots / 32 GPUs / 4 nodes / 8 groups, GPU 5 lost, re-planned from the placement in
    service: the issue's case, where loads first left a quarter of the GPU copies reading a slot a
    load had overwritten. Run as documented, every slot ends with its planned expert, and the plan
    needs every step (it has copies, loads and copies after loads)."""
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)
    counts = deepseek_v3_counts(0)
    in_service = eplb.plan(counts, deployment)
    change = eplb.DeploymentChange.lose(deployment, [5])
    with pytest.warns(RuntimeWarning, match="relaxed"):
        placement = eplb.plan(counts, change, previous=in_service)
    plan = eplb.transfer_plan(in_service, placement, change, expert_bytes=44 << 20)
    base = plan.layers[0]
    steps = dict(plan.ordered())
    assert len(steps["copy"]) > 100 and len(steps["load"]) == int(change.orphans(in_service.phy2log).sum()) > 0
    check_plan_runs(plan, in_service.phy2log, placement.phy2log, change)
    # loads first is wrong here: that is the defect the order fixes
    wrong = execute(plan, in_service.phy2log, change, order=("load", "copy", "after_load"))
    assert (wrong != placement.phy2log).sum() > 50
    # and so for every chunk of layers, each run in its own three steps
    for chunk in plan.chunks(8):
        start, stop = chunk.layers
        np.testing.assert_array_equal(execute(chunk, in_service.phy2log[start:stop], change),
                                      placement.phy2log[start:stop])


# -- Hypothesis: every change, every plan ----------------------------------------------------------
@st.composite
def deployment_changes(draw):
    """A deployment (sometimes hierarchical), a change of it (GPUs lost, added, renumbered, slots
    per GPU grown or shrunk, or lost as a masked GPU by ``lose``) and two count matrices."""
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.integers(1, 4))
    groups = draw(st.sampled_from([None, num_nodes, 2 * num_nodes]))
    experts = (groups or 1) * draw(st.integers(1, 6)) if groups else draw(st.integers(2, 14))
    k = -(-experts // num_gpus) + draw(st.integers(0, 2))
    old = eplb.Deployment.of(experts, num_slots=num_gpus * k, num_gpus=num_gpus, num_nodes=num_nodes,
                             num_groups=groups)
    if num_gpus > 1 and draw(st.booleans()):
        lost = draw(st.lists(st.integers(0, num_gpus - 1), min_size=1, max_size=num_gpus - 1, unique=True))
        survivors = num_gpus - len(lost)
        slots = draw(st.sampled_from([None, max(-(-experts // survivors), k + draw(st.integers(-1, 2)))]))
        try:
            change = eplb.DeploymentChange.lose(old, lost, slots_per_gpu=slots)
        except ValueError:  # the survivors cannot hold every expert
            change = eplb.DeploymentChange.lose(old, lost, slots_per_gpu=-(-experts // survivors))
    else:
        new_gpus = num_nodes * draw(st.integers(1, 4))
        new_k = max(-(-experts // new_gpus), k + draw(st.integers(-2, 2)))
        new = eplb.Deployment.of(experts, num_slots=new_gpus * new_k, num_gpus=new_gpus, num_nodes=num_nodes)
        pool = draw(st.permutations(list(range(new_gpus))))
        keep = draw(st.lists(st.booleans(), min_size=num_gpus, max_size=num_gpus))
        change = eplb.DeploymentChange(old, new, [pool[i] if keep[i] and i < new_gpus else -1
                                                  for i in range(num_gpus)])
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    return change, rng.gamma(0.7, 100.0, (2, experts)), rng.gamma(0.7, 100.0, (2, experts)), seed


def random_placement(deployment, num_layers, seed):
    """A valid ``phy2log [L, S]`` on ``deployment``, drawn at random (every expert at least once)."""
    rng = np.random.default_rng(seed)
    experts, slots = deployment.num_experts, deployment.num_slots
    rows = [rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
            for _ in range(num_layers)]
    return np.array(rows, np.int64)


@settings(max_examples=60)
@given(deployment_changes())
def test_item11_every_plan_across_a_change_runs_in_the_documented_order(case):
    """Re-plans (near the placement in service, from the counts it was planned for and from new
    ones) and arbitrary placements on the new deployment: each transfer plan, run as documented,
    ends in its placement."""
    change, counts, later, seed = case
    in_service = eplb.plan(counts, change.old)
    targets = [random_placement(change.new, 2, seed)]
    for window in (counts, later):
        with warnings.catch_warnings():  # a relaxed hierarchy warns; this test is about the copies
            warnings.simplefilter("ignore", RuntimeWarning)
            targets.append(eplb.plan(window, change, previous=in_service).phy2log)
    for target in targets:
        plan = eplb.transfer_plan(in_service, target, change)
        check_plan_runs(plan, in_service.phy2log, target, change)


@settings(max_examples=60)
@given(st.integers(2, 12), st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**16))
def test_item11_every_plan_on_one_deployment_runs_in_the_documented_order(experts, gpus, extra, seed):
    """Without a change every copy is in step ``"copy"``; run as one bulk step it ends in the new
    placement, for a rebalance near the placement in service and for arbitrary placements."""
    k = -(-experts // gpus) + extra
    deployment = eplb.Deployment.of(experts, num_slots=gpus * k, num_gpus=gpus, num_nodes=1)
    counts = skewed_counts(2, experts, seed=seed)
    old = eplb.plan(counts, deployment)
    targets = [random_placement(deployment, 2, seed), eplb.plan(skewed_counts(2, experts, seed=seed + 1),
                                                                deployment, previous=old).phy2log]
    for target in targets:
        plan = eplb.transfer_plan(old, target)
        assert (plan.phase == COPY).all()
        check_plan_runs(plan, old.phy2log, target)



@pytest.mark.parametrize("layout, lost", [
    (dict(num_slots=288, num_gpus=72), [5]),                                 # one GPU of an NVL72 rack (4 slots each)
    (dict(num_slots=288, num_gpus=144, num_nodes=2), list(range(72, 144))),  # a rack of two lost (2 slots each)
])
def test_item11_rack_scale_changes_run_in_the_documented_order(layout, lost):
    """At rack scale (2-4 slots a GPU) a copy moves a quarter to half of a GPU's experts: the plan
    across a lost GPU or a lost rack, run in its documented steps, still ends in the placement."""
    deployment = eplb.Deployment.of(256, **layout)
    counts = deepseek_v3_counts(0)
    in_service = eplb.plan(counts, deployment)
    slots_per_gpu = 4 if len(lost) > 1 else None   # the 72 survivors of a lost rack take 4 slots each
    change = eplb.DeploymentChange.lose(deployment, lost, slots_per_gpu=slots_per_gpu)
    placement = eplb.plan(counts, change, previous=in_service)
    plan = eplb.transfer_plan(in_service, placement, change)
    check_plan_runs(plan, in_service.phy2log, placement.phy2log, change)

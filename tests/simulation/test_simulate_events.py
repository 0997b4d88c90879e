"""Deployment changes in the simulator (issue 42): GPUs lost, nodes added and removed mid-series.

Every answer is a valid placement of the new deployment, its recovery never reads a lost GPU and
loads from host memory exactly the experts the change orphaned (once each); the engines' answers
(from scratch, donor repair) and eplb's re-plan are compared on the same series from the same start.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.model.cost import CostModel
from eplb.serving.policy import (DonorRepair, FromScratch, PolicyError, RecentCounts, Replan, donor_repair,
                                 policy_by_name)
from eplb.serving.transfer import FROM_HOST, transfer_plan
from eplb.simulation.events import Event, Resize, TooFewSlots, parse_event, schedule
from eplb.simulation.simulate import simulate
from eplb.simulation.synthetic import drifting_counts

# 0.1 s per routed token; copies: 100 bytes at 50 B/s over NVLink, 10 B/s over the network, 20 B/s from host
COMPUTE = CostModel(expert_bytes=100, flops_per_token=10, token_bytes=1, flops=100, hbm_bandwidth=100,
                    nvlink_bandwidth=50, network_bandwidth=10, host_bandwidth=20, regime="compute")


class Recording(eplb.Policy):
    """Wraps a policy and keeps what it was shown and answered at every deployment change."""

    def __init__(self, inner):
        self.inner, self.name, self.changes = inner, eplb.serving.policy.policy_label(inner), []

    def start(self, placement, deployment):
        self.changes = []
        self.inner.start(placement, deployment)

    def observe(self, step, counts):
        return self.inner.observe(step, counts)

    def redeploy(self, step, change, placement, deployment):
        answer = self.inner.redeploy(step, change, placement, deployment)
        self.changes.append((step, change, placement, answer))
        return answer


def _series(steps=40, layers=3, experts=16, seed=0):
    return drifting_counts(steps, layers, experts, drift=0.1, tokens=256, seed=seed)


# -- the invariants, over generated sequences of losses and growth ----------------------------------------------

@st.composite
def change_sequences(draw):
    """A deployment (16 experts, 2 nodes of 2 GPUs, 6 slots each) and up to 4 changes, each possible
    on the deployment the one before left: a GPU or a node lost (survivors with enough slots), a node
    added or the last removed."""
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2, num_groups=draw(st.sampled_from([None, 4])))
    steps = sorted(draw(st.sets(st.integers(0, 28), min_size=1, max_size=4)))
    current, changes = deployment, []
    for step in steps:
        slots = current.topology.slots_per_gpu
        serving = np.flatnonzero(slots > 0)
        options = ["add-nodes"] + (["remove-nodes"] if current.num_nodes > 1 else []) + \
                  (["fail-gpu", "fail-node"] if serving.size > 1 else [])
        kind = draw(st.sampled_from(options))
        if kind == "fail-gpu":
            value = (int(draw(st.sampled_from(serving.tolist()))),)
        elif kind == "fail-node":
            nodes = np.unique(current.topology.node_of_gpu[serving])
            if nodes.size < 2:
                kind, value = "add-nodes", 1
            else:
                value = int(draw(st.sampled_from(nodes.tolist())))
        else:
            value = 1
        resize = Resize(kind, value, slots_per_gpu=draw(st.sampled_from([None, 8])))
        try:
            change = resize(current, deployment.num_groups)
        except ValueError:  # e.g. too few slots left, no GPU with slots in the nodes kept
            continue
        changes.append((step, change))
        current = change.new
    return deployment, changes


@settings(max_examples=25)
@given(case=change_sequences(), which=st.sampled_from(["donor-repair", "from-scratch", "replan", "none", "vllm"]),
       seed=st.integers(0, 3))
def test_every_answer_is_valid_and_reads_no_lost_gpu(case, which, seed):
    deployment, changes = case
    series = _series(seed=seed)
    policy = Recording(policy_by_name(which) if which != "vllm" else eplb.FixedInterval(7))
    result = simulate(series, deployment, policy=policy, cost_model=COMPUTE, events=changes)
    assert [c[0] for c in policy.changes] == [step for step, _ in changes] == [e["step"] for e in result.events]
    for (step, change, placement, answer), report in zip(policy.changes, result.events):
        new = answer if isinstance(answer, eplb.Placement) else eplb.Placement(answer, 16, change.new.topology)
        assert new.topology == change.new.topology and (new.logcnt >= 1).all()  # every expert in every layer
        recovery = transfer_plan(placement, new, change, expert_bytes=100)
        serving = change.new.topology.slots_per_gpu > 0
        gpu_copies = recovery.kind != FROM_HOST
        assert serving[recovery.src_gpu[gpu_copies]].all()                # never a lost GPU (new numbering)
        carried = gpu_copies & ~recovery.after_load                          # reads what a survivor carried
        assert (change.source_gpu[recovery.src_gpu[carried]] >= 0).all()
        assert set(recovery.src_slot[recovery.after_load].tolist()) <= set(recovery.dst_slot[~gpu_copies].tolist())
        loaded = {(int(l), int(e)) for l, e in zip(recovery.layer[~gpu_copies], recovery.expert[~gpu_copies])}
        orphans = {(int(l), int(e)) for l, e in zip(*np.nonzero(change.orphans(placement.phy2log)))}
        assert loaded == orphans and (~gpu_copies).sum() == len(orphans)  # host loads: the orphans, once each
        assert report["copies"] == recovery.counts() and report["orphans"] == len(orphans)
        assert report["copies"]["total"] >= report["copy_floor"]
    assert result.final_placement.topology == (changes[-1][1].new.topology if changes else deployment.topology)
    assert result.summary()["host_loads"] == sum(e["copies"]["from_host"] for e in result.events)


def test_the_same_run_twice_is_the_same():
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2)
    events = {10: Resize("fail-gpu", 1), 20: Resize("add-nodes", 1)}
    runs = [simulate(_series(), deployment, policy=Replan(window=5), cost_model=COMPUTE, events=events) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].copies, runs[1].copies)
    np.testing.assert_array_equal(runs[0].layer_time, runs[1].layer_time)
    np.testing.assert_array_equal(runs[0].final_placement.phy2log, runs[1].final_placement.phy2log)


# -- pricing the recovery ------------------------------------------------------------------------------------

def test_a_loss_by_hand():
    """Experts 0..3 on 4 GPUs of 2 slots each, GPU 3 holding expert 3 twice. GPU 3 is lost after
    step 0: expert 3 has no replica left, so it loads from host memory once, into a donor slot."""
    deployment = eplb.Deployment.of(4, num_slots=8, num_gpus=4)
    initial = [[0, 1, 0, 2, 1, 2, 3, 3]]  # GPU 3 holds expert 3 twice
    series = np.ones((3, 1, 4))
    result = simulate(series, deployment, policy=DonorRepair(), cost_model=COMPUTE, initial=initial,
                      events={0: Resize("fail-gpu", 3)})
    [event] = result.events
    assert event["orphans"] == 1 and event["copy_floor"] == 1 and event["lost_gpus"] == [3]
    assert event["copies"] == {"intra_gpu": 0, "intra_node": 0, "cross_node": 0, "from_host": 1, "total": 1}
    np.testing.assert_array_equal(result.copies[0], [0, 0, 0, 1])
    assert event["recovery_s"] == pytest.approx(100 / 20)  # one expert over host memory
    assert result.stall_time[0] == pytest.approx(5.0) and event["stall_s"] == pytest.approx(5.0)
    # the donor: expert 3 went into the first slot of an expert with two replicas (slot 0, expert 0)
    np.testing.assert_array_equal(result.final_placement.phy2log, [[3, 1, 0, 2, 1, 2]])
    # the balanced time spreads the work over the 3 GPUs left
    np.testing.assert_allclose(result.balanced_time[:, 0], [0.4 / 4, 0.4 / 3, 0.4 / 3])


def test_free_copies_do_not_stall_and_no_change_means_no_host_load():
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    free = COMPUTE.with_(copy_mode="free")
    result = simulate(_series(), deployment, policy=Replan(window=5), cost_model=free, events={5: Resize("fail-gpu", 2)})
    assert result.stall_time.sum() == 0 and result.events[0]["recovery_s"] > 0 and result.events[0]["stall_s"] == 0
    plain = simulate(_series(), deployment, cost_model=COMPUTE)
    assert plain.copies[:, 3].sum() == 0 and plain.events == () and plain.summary()["recovery_s"] == 0


def test_token_imbalance_per_step_by_hand():
    series = np.array([[[3, 1]], [[2, 2]], [[0, 0]]])
    result = simulate(series, eplb.Deployment.of(2, num_slots=2, num_gpus=2), cost_model=COMPUTE, initial=[[0, 1]])
    np.testing.assert_allclose(result.imbalance[:2], [(3 - 2) / 2, 0.0])
    assert np.isnan(result.imbalance[2])  # no token, nothing to balance


def test_before_during_after_spans():
    """The answer serves from the change until the policy's next placement (during); after is every
    step until the next change."""
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    result = simulate(_series(30), deployment, policy=eplb.FixedInterval(10), cost_model=COMPUTE,
                      events={4: Resize("fail-gpu", 0), 24: Resize("add-nodes", 1)})
    first, second = result.events
    assert (first["steps_before"], first["steps_during"], first["steps_after"]) == (5, 5, 20)  # next plan after 9
    assert (second["steps_before"], second["steps_during"], second["steps_after"]) == (20, 5, 5)
    assert first["imbalance_during"] == pytest.approx(np.nanmean(result.imbalance[5:10]))
    assert second["imbalance_before"] == pytest.approx(np.nanmean(result.imbalance[5:25]))


# -- the policies compared -----------------------------------------------------------------------------------

def test_replan_moves_far_less_than_from_scratch_and_balances_better_than_donor_repair():
    series = drifting_counts(60, 6, 64, drift=0.05, tokens=4096, seed=5)
    deployment = eplb.Deployment.of(64, num_slots=80, num_gpus=16, num_nodes=2)
    events = {30: Resize("fail-gpu", 5)}
    runs = {name: simulate(series, deployment, policy=policy, cost_model=COMPUTE, events=events)
            for name, policy in (("scratch", FromScratch(window=30)), ("donor", DonorRepair()),
                                 ("replan", Replan(window=30)))}
    recovery = {name: r.events[0] for name, r in runs.items()}
    assert len({r["imbalance_before"] for r in recovery.values()}) == 1  # the same start
    assert {r["orphans"] for r in recovery.values()} == {recovery["donor"]["copies"]["from_host"]}
    assert recovery["donor"]["copies"]["total"] == recovery["donor"]["copy_floor"]  # the floor: orphans only
    assert recovery["replan"]["bytes"]["total"] <= recovery["scratch"]["bytes"]["total"] / 4
    assert recovery["replan"]["imbalance_after"] < recovery["donor"]["imbalance_after"]


def test_the_engine_timers_and_the_balancer_plan_on_after_a_loss_in_a_hierarchical_deployment():
    """After a GPU is lost, its node cannot hold its group whole: plans are made on the surviving GPUs
    (in one node: their nodes now differ in size) or across the change with the groups relaxed, and
    later rebalances keep working."""
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2, num_groups=2)
    for policy in (eplb.FixedInterval(5), eplb.BalancerPolicy(check_every=5, min_gain=0.0, cost_model=None)):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "hierarchical deployment relaxed", RuntimeWarning)
            result = simulate(_series(), deployment, policy=policy, cost_model=COMPUTE,
                              events={7: Resize("fail-gpu", 0)})
        assert result.final_placement.topology.slots_per_gpu.tolist() == [0, 6, 6, 6]
        assert (result.rebalance_steps > 7).any()


def test_the_balancer_policy_keeps_its_window_across_a_change():
    """The Balancer re-plans across the change itself (``rebalance(deployment=)``): the traffic it
    saw before the loss still counts in its decisions after it."""
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    policy = eplb.BalancerPolicy(check_every=5, window=100, min_gain=0.0, cost_model=None)
    series = _series(steps=30)
    result = simulate(series, deployment, policy=policy, cost_model=COMPUTE, events={12: Resize("fail-gpu", 2)})
    balancer = policy.balancer
    assert balancer.topology.slots_per_gpu.tolist() == result.final_placement.topology.slots_per_gpu.tolist()
    assert balancer.steps == 30  # one Balancer from the first step to the last
    np.testing.assert_allclose(balancer.window_counts(), np.sum(series, axis=0), rtol=1e-9)


def test_a_policy_without_redeploy_gets_the_donor_repair():
    class Quiet:
        def start(self, placement, deployment):
            pass

        def observe(self, step, counts):
            return None

    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    change = {3: Resize("fail-gpu", 1)}
    quiet = simulate(_series(), deployment, policy=Quiet(), cost_model=COMPUTE, events=change)
    donor = simulate(_series(), deployment, policy=DonorRepair(), cost_model=COMPUTE, events=change)
    np.testing.assert_array_equal(quiet.final_placement.phy2log, donor.final_placement.phy2log)


def test_an_answer_on_the_old_deployment_is_refused():
    class Stale(DonorRepair):
        def redeploy(self, step, change, placement, deployment):
            return placement

    with pytest.raises(PolicyError, match="redeploy returned at step 3"):
        simulate(_series(), eplb.Deployment.of(16, num_slots=24, num_gpus=4), policy=Stale(), cost_model=COMPUTE,
                 events={3: Resize("fail-gpu", 1)})


# -- the donor repair, by hand ------------------------------------------------------------------------------

def test_donor_repair_by_hand():
    old = eplb.Deployment.of(4, num_slots=6, num_gpus=3)
    placement = np.array([[0, 0, 1, 2, 3, 1]])  # GPU 0: 0, 0; GPU 1: 1, 2; GPU 2: 3, 1
    change = eplb.DeploymentChange.lose(old, [1])
    repaired = donor_repair(placement, change)
    # expert 2 lost its only replica: into the first slot of an expert with two (slot 0, expert 0)
    np.testing.assert_array_equal(repaired.phy2log, [[2, 0, 3, 1]])
    # a new GPU's empty slots take orphans first, then the fewest-replica experts not on that GPU
    grown = eplb.DeploymentChange(old, eplb.Deployment.of(4, num_slots=8, num_gpus=4), [0, -1, 1])
    np.testing.assert_array_equal(donor_repair(placement, grown).phy2log, [[0, 0, 3, 1, 2, 1, 2, 3]])


def test_recent_counts_keep_about_the_window():
    recent = RecentCounts(10, (1, 1))
    for step in range(25):
        recent.add(np.array([[1.0]]))
    assert 10 <= recent.total()[0, 0] <= 11  # blocks of one step: exactly the window


# -- building events and refusing bad ones ------------------------------------------------------------------

def test_parse_event():
    assert parse_event("fail-gpu", "5,6@2000") == (2000, Resize("fail-gpu", (5, 6)))
    assert parse_event("fail-node", "3@2000:11") == (2000, Resize("fail-node", 3, 11))
    assert parse_event("add-nodes", "1@3000") == (3000, Resize("add-nodes", 1))
    for kind, text in [("fail-gpu", "5"), ("fail-gpu", "a@3"), ("add-nodes", "1@2:x"), ("fail-node", "1,2@3")]:
        with pytest.raises(ValueError, match=f"--{kind} WHAT@STEP"):
            parse_event(kind, text)


def test_schedules_chain_and_bring_back_groups():
    deployment = eplb.Deployment.of(16, num_slots=32, num_gpus=8, num_nodes=2, num_groups=4)
    events = schedule(deployment, {30: Resize("remove-nodes", 1), 10: Resize("add-nodes", 1)})
    assert [e.step for e in events] == [10, 30] and [e.label for e in events] == ["1 node added", "1 node removed"]
    assert events[0].change.new.num_groups is None  # 4 groups do not divide over 3 nodes: global
    assert events[1].change.new.num_groups == 4 and events[1].change.old is events[0].change.new


@pytest.mark.parametrize("events, match", [
    ({39: Resize("fail-gpu", 1)}, r"a change comes after a step in \[0, 39\)"),
    ([(3, Resize("fail-gpu", 1)), (3, Resize("fail-gpu", 2))], "two deployment changes after step 3"),
    ({3: Resize("fail-gpu", 4)}, "GPUs are 0 ... 3"),
    ([(3, Resize("fail-gpu", 1)), (5, Resize("fail-gpu", 1))], "GPU 1 holds no slots already"),
    ({3: Resize("remove-nodes", 2)}, "at least one must stay"),
    ({3: Resize("fail-gpu", (0, 1, 2))}, "6 slots for 16 experts; give the GPUs that serve 16 slots each"),
    ([Event(3, eplb.DeploymentChange.lose(eplb.Deployment.of(16, num_slots=32, num_gpus=4, num_nodes=2), [1]))],
     "must start from the deployment in service"),
])
def test_bad_events_are_refused(events, match):
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2)
    with pytest.raises(ValueError, match=match):
        simulate(_series(), deployment, cost_model=COMPUTE, events=events)


def test_too_few_slots_says_how_many():
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2)
    with pytest.raises(TooFewSlots) as caught:
        Resize("fail-node", 0)(deployment)
    assert caught.value.slots_per_gpu == 8
    assert Resize("fail-node", 0, slots_per_gpu=8)(deployment).new.num_slots == 16


def test_events_are_reported_in_events_csv(tmp_path):
    from eplb.io.simulation_report import write_tables

    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    results = [simulate(_series(), deployment, policy=policy, cost_model=COMPUTE, events={5: Resize("fail-gpu", 2)})
               for policy in (DonorRepair(), Replan(window=5))]
    paths = write_tables(results, tmp_path)
    rows = (tmp_path / "events.csv").read_text().splitlines()
    assert paths[-1].name == "events.csv" and len(rows) == 3
    header = rows[0].split(",")
    assert {"policy", "step", "copies_from_host", "bytes_total", "recovery_s", "imbalance_after"} <= set(header)
    assert rows[1].startswith("donor repair,5,GPU 2 lost")


# -- issue 47 items 13 and 20: every default policy through a lost GPU under optimal dispatch; labels ----------

@pytest.mark.parametrize("name", ["replan", "balancer", "from-scratch", "donor-repair", "vllm", "none"])
def test_item13_every_policy_answers_a_lost_gpu_under_optimal_dispatch(name):
    """``simulate(..., dispatch="optimal")`` with a GPU lost: the re-plan policy raised (a plan near
    the placement in service is made for an even split); every policy now answers with a valid
    placement on the GPUs left, priced under optimal dispatch."""
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2, dispatch="optimal")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the timers never act on 40 steps
        result = simulate(_series(), deployment, policy=policy_by_name(name, check_every=10),
                          events={10: Resize("fail-gpu", (1,))})
    event, = result.events
    final = result.final_placement.phy2log
    assert final.shape == (3, 18) and all(set(row.tolist()) == set(range(16)) for row in final)
    assert event["copies"]["from_host"] == event["orphans"] and event["copies"]["total"] >= event["copy_floor"]
    if name == "replan":
        plain = simulate(_series(), eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2),
                         policy=policy_by_name(name), events={10: Resize("fail-gpu", (1,))})
        np.testing.assert_array_equal(final, plain.final_placement.phy2log)  # the same plan, priced otherwise


def test_item20_the_re_plan_policy_label_says_the_tolerance_it_plans_with():
    """The re-plan policy said "tolerance 0.005" and planned with 0.01 (eplb.plan's default across a
    change); the label and the plan now give one value, the default named in eplb.model.defaults."""
    from eplb.model.defaults import CHANGE_TOLERANCE

    policy = Replan(window=5)
    assert policy.tolerance == CHANGE_TOLERANCE and policy.name == f"eplb re-plan (tolerance {CHANGE_TOLERANCE})"
    assert Replan(tolerance=0.05).name == "eplb re-plan (tolerance 0.05)"
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    recording = Recording(Replan(window=5, tolerance=0.05))
    simulate(_series(), deployment, policy=recording, cost_model=COMPUTE, events={5: Resize("fail-gpu", 2)})
    (_, _, _, answer), = recording.changes
    assert answer.info["tolerance"] == 0.05
    with pytest.raises(ValueError, match="tolerance"):
        Replan(tolerance=-1)


@pytest.mark.parametrize("change, message", [
    (Resize("add-nodes", 2000), "2000 nodes added: the number of GPUs is 8,008, above the limit of 4,096"),
    (Resize("fail-gpu", (1,), 40_000), "GPU 1 lost: the number of slots is 280,000, above the limit of 100,000"),
    (Resize("add-nodes", 1, 30_000), "1 node added: the number of slots is 360,000, above the limit of 100,000"),
])
def test_item16_simulated_changes_beyond_the_limits_are_refused_before_the_run(change, message, monkeypatch):
    """``--add-nodes 2000@3`` simulated 8,008 GPUs past the 4,096 limit and ``--fail-gpu 5@3:99999999``
    was killed for memory: a change whose deployment exceeds a limit is one ValueError, before a step."""
    monkeypatch.setenv("EPLB_MAX_SLOTS", "100000")
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=8, num_nodes=2)
    with pytest.raises(ValueError, match=message):
        simulate(_series(), deployment, policy=DonorRepair(), events={3: change})
    with pytest.raises(ValueError, match="slots_per_gpu is 99,999,999, above the limit of 100,000"):
        Resize("fail-gpu", (5,), 99_999_999)
    with pytest.raises(ValueError, match="add-nodes: the number of nodes is 5,000, above the limit of 4,096"):
        Resize("add-nodes", 5000)

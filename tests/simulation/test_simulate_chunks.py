"""A rebalance applied in chunks of layers (``simulate(..., layers_per_step=k)``): cases by hand in
every copy mode, the per-layer mix in service against a plain step-by-step reference, a new plan
arriving mid-application, all-at-once unchanged, bad values, the CLI flag and the report."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from click.testing import CliRunner

import eplb
from eplb.cli import main
from eplb.model.cost import CostModel
from eplb.simulation.simulate import FixedInterval, simulate
from eplb.simulation.synthetic import drifting_counts

# 0.1 s per routed token (compute-bound); copies: 100 bytes at 50 B/s over NVLink, 10 B/s over the
# network, a local copy reads and writes 100 bytes at 100 B/s (2 s)
SIMPLE = dict(expert_bytes=100, flops_per_token=10, token_bytes=1, flops=100, hbm_bandwidth=100,
              nvlink_bandwidth=50, network_bandwidth=10)
COMPUTE = CostModel(**SIMPLE, regime="compute")

# Three layers, two GPUs on two nodes, two experts: A holds expert 0 twice on GPU 0, B spreads both
# experts over both GPUs (per layer one cross-node copy each way: 10 s), C swaps within each GPU
# (two local copies per GPU: 4 s).
A, B, C = [0, 0, 1, 1], [0, 1, 0, 1], [1, 0, 1, 0]
BY_HAND = eplb.Deployment.of(2, num_slots=4, num_gpus=2, num_nodes=2)


class Plans:
    """A policy returning the given ``{step: phy2log [L, S]}``."""

    name = "plans"

    def __init__(self, plans: dict):
        self.plans = plans

    def start(self, placement, deployment):
        pass

    def observe(self, step, counts):
        plan = self.plans.get(step)
        return None if plan is None else np.array(plan)


def hot_expert(steps=16, layers=3):
    """Every step routes 10 tokens to expert 0 in every layer: 1 s on one GPU under A, 0.5 s each
    under B or C."""
    return np.tile(np.array([[10, 0]]), (steps, layers, 1))


def run(layers_per_step, mode="stall", plans=None, steps=16):
    plans = {0: [B, B, B]} if plans is None else plans
    return simulate(hot_expert(steps), BY_HAND, cost_model=COMPUTE.with_(copy_mode=mode), policy=Plans(plans),
                    initial=[A, A, A], layers_per_step=layers_per_step)


def assert_same(a, b):
    for name in ("layer_time", "balanced_time", "stall_time", "copies", "copy_time", "rebalance_steps"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.final_placement.phy2log, b.final_placement.phy2log)


# ------------------------------------------------------------------------------------ by hand

def test_all_at_once_by_hand_is_the_default():
    """The default switches every layer after the step the plan came: one stall of 3 x 10 s."""
    result = run(None)
    np.testing.assert_allclose(result.step_time, [3.0] + [1.5] * 15)
    np.testing.assert_allclose(result.stall_time, [30.0] + [0.0] * 15)
    np.testing.assert_array_equal(result.copies[0], [0, 0, 6, 0])
    assert result.copies[1:].sum() == 0
    assert result.summary()["max_stall_s"] == pytest.approx(30.0)
    assert result.extra == {}


@pytest.mark.parametrize("k, stalls", [(1, [10.0, 10.0, 10.0]), (2, [20.0, 10.0])])
def test_stall_mode_spreads_the_copies_over_steps(k, stalls):
    """Layer by layer: the same copies and copy time in all as at once, in ceil(L / k) stalls."""
    chunked, whole = run(k), run(None)
    expected_stall = np.zeros(16)
    expected_stall[:len(stalls)] = stalls
    np.testing.assert_allclose(chunked.stall_time, expected_stall)
    np.testing.assert_array_equal(chunked.copies.sum(axis=0), whole.copies.sum(axis=0))
    np.testing.assert_array_equal(chunked.copies[:len(stalls)].sum(axis=1), [2 * min(k, 3 - i * k)
                                                                               for i in range(len(stalls))])
    assert chunked.copy_time.sum() == pytest.approx(whole.copy_time.sum())
    assert chunked.stall_time.sum() == pytest.approx(whole.stall_time.sum())
    assert chunked.summary()["max_stall_s"] == pytest.approx(max(stalls))
    assert max(stalls) < whole.summary()["max_stall_s"]
    assert np.count_nonzero(chunked.stall_time) == math.ceil(3 / k)
    np.testing.assert_array_equal(chunked.rebalance_steps, [0])
    assert chunked.extra == {"layers_per_step": k}


def test_stall_mode_serves_the_per_layer_mix():
    """k = 1: after step 0 layer 0 switches, after step 1 layer 1, after step 2 layer 2."""
    result = run(1)
    np.testing.assert_allclose(result.layer_time[:4], [[1.0, 1.0, 1.0], [0.5, 1.0, 1.0], [0.5, 0.5, 1.0],
                                                       [0.5, 0.5, 0.5]])
    np.testing.assert_allclose(result.step_time[4:], 1.5)
    np.testing.assert_array_equal(result.final_placement.phy2log, [B, B, B])


def test_overlap_mode_starts_each_chunk_when_the_last_is_done():
    """Chunk 0 starts after step 0 (3 s of serving) and lands at 13 s: during step 4 (15 s), so layer
    0 switches after step 4 and chunk 1 starts then (lands at 25 s, after step 8); chunk 2 lands at
    35 s, after step 13."""
    result = run(1, "overlap")
    np.testing.assert_allclose(result.step_time, [3.0] * 5 + [2.5] * 4 + [2.0] * 5 + [1.5] * 2)
    assert result.stall_time.sum() == 0
    np.testing.assert_array_equal(np.flatnonzero(result.copy_time), [0, 4, 8])
    np.testing.assert_allclose(result.copy_time[[0, 4, 8]], 10.0)
    np.testing.assert_array_equal(result.copies[[0, 4, 8]], [[0, 0, 2, 0]] * 3)
    np.testing.assert_array_equal(result.final_placement.phy2log, [B, B, B])


def test_free_mode_switches_one_chunk_per_step():
    result = run(1, "free")
    np.testing.assert_allclose(result.step_time, [3.0, 2.5, 2.0] + [1.5] * 13)
    assert result.stall_time.sum() == 0
    np.testing.assert_array_equal(np.flatnonzero(result.copies.sum(axis=1)), [0, 1, 2])


def test_layers_the_plan_leaves_alone_take_no_turn():
    result = run(1, plans={0: [B, A, B]})  # layer 1 unchanged
    np.testing.assert_allclose(result.stall_time[:3], [10.0, 10.0, 0.0])
    np.testing.assert_allclose(result.layer_time[1], [0.5, 1.0, 1.0])
    np.testing.assert_allclose(result.layer_time[2], [0.5, 1.0, 0.5])


def test_an_unfinished_application_ends_on_a_mix():
    result = run(1, steps=2)  # layer 0 switched after step 0, layer 1 after step 1, layer 2 never
    np.testing.assert_array_equal(result.final_placement.phy2log, [B, B, A])
    assert result.final_placement.method == "mixed"
    assert run(None, steps=2).final_placement.method == "given"


# ------------------------------------------------------------------------------------ a new plan mid-way

def test_a_new_plan_mid_application_stall():
    """B after step 0 (layer 0 switched to B then), C' = [C, B, A] after step 1: layer 0 goes B -> C
    (4 local copies), layer 1 straight A -> B (B's copies of layer 1 are never made), layer 2
    already holds A and takes no turn."""
    result = run(1, plans={0: [B, B, B], 1: [C, B, A]})
    np.testing.assert_array_equal(result.rebalance_steps, [0, 1])
    np.testing.assert_allclose(result.stall_time[:4], [10.0, 4.0, 10.0, 0.0])
    np.testing.assert_array_equal(result.copies[:4], [[0, 0, 2, 0], [4, 0, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(result.layer_time[:4], [[1.0, 1.0, 1.0], [0.5, 1.0, 1.0], [0.5, 1.0, 1.0],
                                                       [0.5, 0.5, 1.0]])
    np.testing.assert_array_equal(result.final_placement.phy2log, [C, B, A])
    assert result.final_placement.method == "given"


def test_a_new_plan_mid_application_overlap():
    """Layer 0's copies to B are in flight when C' comes (after step 1, 6 s): counted as landed, so
    layer 0 costs B -> C (4 local copies, 4 s: lands at 10 s, after step 3) and switches from A to
    C directly; layer 1 A -> B starts then (12 s) and lands at 22 s, after step 7."""
    result = run(1, "overlap", plans={0: [B, B, B], 1: [C, B, A]})
    np.testing.assert_allclose(result.step_time[:10], [3.0] * 4 + [2.5] * 4 + [2.0] * 2)
    np.testing.assert_array_equal(result.copies[[0, 1, 3]], [[0, 0, 2, 0], [4, 0, 0, 0], [0, 0, 2, 0]])
    assert result.copies.sum() == 8
    np.testing.assert_array_equal(result.final_placement.phy2log, [C, B, A])


@pytest.mark.parametrize("k", [None, 1])
def test_a_new_plan_keeping_layers_in_flight_still_switches_them(k):
    """B's copies are in flight when B' = [B, B, C] comes after step 1 (6 s). All at once: layers 0
    and 1 need no more copies, layer 2 needs B -> C (4 local copies, 4 s: lands at 10 s, after step
    3), then every layer serves B'. k = 1: layer 0 (held B, in flight) takes its turn with no copy
    and switches after step 1; layer 1 A -> B starts after step 2 (8.5 s) and lands at 18.5 s,
    after step 6; layer 2 A -> C (2 cross-node copies) lands at 28.5 s, after step 11."""
    result = run(k, "overlap", plans={0: [B, B, B], 1: [B, B, C]})
    if k is None:
        np.testing.assert_allclose(result.step_time, [3.0] * 4 + [1.5] * 12)
        np.testing.assert_array_equal(result.copies[:2], [[0, 0, 6, 0], [4, 0, 0, 0]])
    else:
        np.testing.assert_allclose(result.step_time, [3.0] * 2 + [2.5] * 5 + [2.0] * 5 + [1.5] * 4)
        np.testing.assert_array_equal(np.flatnonzero(result.copies.sum(axis=1)), [0, 2, 6])
        np.testing.assert_array_equal(result.copies[[0, 2, 6]], [[0, 0, 2, 0]] * 3)
    np.testing.assert_array_equal(result.final_placement.phy2log, [B, B, C])


# ------------------------------------------------------------------------------------ against a reference

def direct_layer_time(counts: np.ndarray, phy2log: np.ndarray, cost: CostModel, num_gpus: int) -> np.ndarray:
    """``[L]`` compute-bound layer time of ``counts [L, E]`` under ``phy2log [L, S]``, even split."""
    layers, slots = phy2log.shape
    times = np.empty(layers)
    for layer in range(layers):
        replicas = np.bincount(phy2log[layer], minlength=counts.shape[1])
        tokens = counts[layer, phy2log[layer]] / replicas[phy2log[layer]]
        per_gpu = tokens.reshape(num_gpus, slots // num_gpus).sum(axis=1)
        times[layer] = cost.layer_time(per_gpu, np.zeros(num_gpus))
    return times


def reference(series, initial, plans, k, cost, num_gpus):
    """A plain step-by-step replay (stall or free): ``(layer_time [T, L], stall [T], copies [T])``."""
    serving = np.array(initial)
    target, queue = serving.copy(), []
    steps = series.shape[0]
    layer_time, stall, copies = np.zeros((steps, serving.shape[0])), np.zeros(steps), np.zeros(steps, int)
    for t in range(steps):
        layer_time[t] = direct_layer_time(series[t].astype(float), serving, cost, num_gpus)
        if t in plans:
            target = np.array(plans[t])
            queue = [layer for layer in range(serving.shape[0]) if (serving[layer] != target[layer]).any()]
        if queue:
            chunk, queue = queue[:k], queue[k:]
            after = serving.copy()
            after[chunk] = target[chunk]
            topology = eplb.Topology(np.full(num_gpus, serving.shape[1] // num_gpus), 2)
            transfer = eplb.transfer_plan(serving, after, eplb.Deployment.of(series.shape[2], topology=topology))
            copies[t] = len(transfer)
            stall[t] = cost.transfer_time(transfer) if cost.copy_mode == "stall" else 0.0
            serving = after
    return layer_time, stall, copies


class Recording:
    """Wraps a policy and keeps the placements it returns, ``{step: phy2log [L, S]}``."""

    def __init__(self, policy):
        self.policy, self.plans = policy, {}

    def start(self, placement, deployment):
        self.policy.start(placement, deployment)

    def observe(self, step, counts):
        new = self.policy.observe(step, counts)
        if new is not None:
            self.plans[step] = np.array(new.phy2log)
        return new


@pytest.mark.parametrize("mode", ["stall", "free"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_mix_in_service_matches_a_step_by_step_reference(k, mode):
    """Five layers, a from-scratch plan every 3 steps (so plans often arrive mid-application; the
    plans depend on the counts alone, never on what serves)."""
    series = drifting_counts(30, 5, 12, drift=0.4, tokens=200, seed=7)
    cost = COMPUTE.with_(copy_mode=mode)
    initial = eplb.plan(series[0], num_slots=16, num_gpus=4, num_nodes=2, method="greedy").phy2log
    policy = Recording(FixedInterval(3, method="greedy"))
    result = simulate(series, eplb.Deployment.of(12, num_slots=16, num_gpus=4, num_nodes=2), cost_model=cost,
                      policy=policy, initial=initial, layers_per_step=k)
    assert len(policy.plans) == 10
    layer_time, stall, copies = reference(series, initial, policy.plans, k, cost, num_gpus=4)
    np.testing.assert_allclose(result.layer_time, layer_time, rtol=1e-12)
    np.testing.assert_allclose(result.stall_time, stall, rtol=1e-12)
    np.testing.assert_array_equal(result.copies.sum(axis=1), copies)
    if k < 5:
        assert np.count_nonzero(copies) > len(policy.plans)  # chunks really spread over steps


def test_chunked_copies_equal_all_at_once_and_never_take_less_time():
    """One random plan: the same copies, spread over ceil(L / k) steps; each chunk waits for its own
    slowest GPU, so the chunks' total is at least the all-at-once time, and no stall is longer."""
    rng = np.random.default_rng(3)
    layers = 6
    series = rng.integers(0, 30, (12, layers, 16))
    start = eplb.plan(series[0], num_slots=24, num_gpus=4, num_nodes=2, method="greedy").phy2log
    new = eplb.plan(rng.integers(0, 30, (layers, 16)), num_slots=24, num_gpus=4, num_nodes=2, method="greedy").phy2log
    assert (start != new).any(axis=1).all()
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4, num_nodes=2)
    options = dict(cost_model=CostModel.preset(regime="compute"), initial=start)
    whole = simulate(series, deployment, policy=Plans({2: new}), **options)
    for k in (1, 2, 4):
        chunked = simulate(series, deployment, policy=Plans({2: new}), layers_per_step=k, **options)
        np.testing.assert_array_equal(chunked.copies.sum(axis=0), whole.copies.sum(axis=0))
        np.testing.assert_array_equal(np.flatnonzero(chunked.stall_time), np.arange(2, 2 + math.ceil(layers / k)))
        assert chunked.copy_time.sum() >= whole.copy_time.sum() * (1 - 1e-12)
        assert chunked.summary()["max_stall_s"] < whole.summary()["max_stall_s"]
        np.testing.assert_array_equal(chunked.final_placement.phy2log, new)


# ------------------------------------------------------------------------------------ all at once unchanged

@pytest.mark.parametrize("mode", ["stall", "overlap", "free"])
def test_layers_per_step_of_at_least_l_is_all_at_once(mode):
    """Identical arrays, also when plans supersede copies still in flight (slow network)."""
    series = drifting_counts(40, 4, 12, drift=0.4, tokens=200, seed=2)
    cost = CostModel(**dict(SIMPLE, network_bandwidth=0.5), regime="compute", copy_mode=mode)
    deployment = eplb.Deployment.of(12, num_slots=16, num_gpus=4, num_nodes=2)
    whole = simulate(series, deployment, policy=FixedInterval(2, method="greedy"), cost_model=cost)
    assert whole.num_rebalances == 20
    for k in (4, 100):
        assert_same(simulate(series, deployment, policy=FixedInterval(2, method="greedy"), layers_per_step=k,
                             cost_model=cost), whole)
    chunked = simulate(series, deployment, policy=FixedInterval(2, method="greedy"), layers_per_step=1, cost_model=cost)
    assert not np.array_equal(chunked.layer_time, whole.layer_time)


@pytest.mark.parametrize("value, rule", [(0, ">= 1"), (-2, ">= 1"), (1.5, "integer"), ("2", "integer"),
                                         (True, "integer")])
def test_bad_layers_per_step(value, rule):
    with pytest.raises(ValueError, match=f"layers_per_step must .*{rule}"):
        run(value)


# ------------------------------------------------------------------------------------ CLI and report

def test_cli_layers_per_step(tmp_path):
    steps = tmp_path / "steps.npy"
    np.save(steps, drifting_counts(70, 4, 32, drift=0.3, tokens=512, seed=5))  # every application ends
    runner = CliRunner()
    summaries = {}
    for label, extra in (("whole", []), ("chunked", ["--layers-per-step", "1"])):
        out = tmp_path / label
        result = runner.invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "-n", "2", "-p", "every:20",
                                      "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        assert "max stall" in result.output
        summaries[label] = next(csv.DictReader(open(out / "simulate.csv")))
    assert "applied 1 layer(s) per step" in result.output
    assert float(summaries["chunked"]["max_stall_s"]) < float(summaries["whole"]["max_stall_s"])
    assert summaries["chunked"]["copies"] == summaries["whole"]["copies"]
    bad = runner.invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "--layers-per-step", "0",
                               "-o", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--layers-per-step" in bad.output


def test_report_shows_the_longest_stall(tmp_path):
    pytest.importorskip("matplotlib")
    from eplb.io.simulation_report import write_simulation_report

    written = write_simulation_report([run(None), run(1)], tmp_path)
    page = written["html"].read_text()
    assert "<th>max_stall_s</th><td>30 s</td><td>10 s</td>" in page

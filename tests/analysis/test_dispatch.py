"""Optimal dispatch: the shares that minimise the max GPU load, checked against an LP and a
brute-force min-cut bound; validity, never worse than uniform, determinism, input checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import eplb
from eplb.analysis.dispatch import check_shares, dispatch, optimal_dispatch, uniform_shares
from eplb.analysis.loads import gpu_loads
from eplb.analysis.placement import Placement
from eplb.simulation.synthetic import deepseek_v3_counts, drifting_counts
from eplb.model.topology import Topology


def lp_peak(weights: np.ndarray, phy2log: np.ndarray, topology: Topology) -> float:
    """min T s.t. each expert's shares sum to 1 and every GPU's load <= T (GLOP), solved on the
    weights scaled to a largest of 1 (GLOP gives up on rows spanning ten orders of magnitude at
    their own scale: 3.2e5 beside 6.1e-5), the optimum scaled back."""
    from ortools.linear_solver import pywraplp

    scale = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
    weights = weights / scale

    solver = pywraplp.Solver.CreateSolver("GLOP")
    peak = solver.NumVar(0.0, solver.infinity(), "peak")
    share = [solver.NumVar(0.0, 1.0, f"x{s}") for s in range(phy2log.size)]
    for expert in range(weights.size):
        row = solver.Constraint(1.0, 1.0)
        for s in np.flatnonzero(phy2log == expert):
            row.SetCoefficient(share[s], 1.0)
    gpu_of_slot = topology.gpu_of_slot
    for gpu in range(topology.num_gpus):
        row = solver.Constraint(-solver.infinity(), 0.0)
        row.SetCoefficient(peak, -1.0)
        for s in np.flatnonzero(gpu_of_slot == gpu):
            row.SetCoefficient(share[s], float(weights[phy2log[s]]))
    solver.Minimize(peak)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    return peak.solution_value() * scale


def hall_bound(weights: np.ndarray, phy2log: np.ndarray, topology: Topology) -> float:
    """The optimum by max-flow/min-cut, enumerating every set of experts with replicas on 2+ GPUs."""
    gpu_of_slot = topology.gpu_of_slot
    gpus_of = [set(gpu_of_slot[phy2log == e]) for e in range(weights.size)]
    free = [e for e in range(weights.size) if len(gpus_of[e]) > 1 and weights[e] > 0]
    fixed = np.zeros(topology.num_gpus)
    for e in range(weights.size):
        if e not in free:
            fixed[next(iter(gpus_of[e]))] += weights[e]
    best = fixed.max()
    for size in range(1, len(free) + 1):
        for subset in itertools.combinations(free, size):
            gpus = sorted(set().union(*(gpus_of[e] for e in subset)))
            best = max(best, (weights[list(subset)].sum() + fixed[gpus].sum()) / len(gpus))
    return best


@st.composite
def instances(draw):
    """A random placement (every expert has a slot; some GPUs may be masked) and integer or real counts."""
    num_gpus = draw(st.integers(1, 5))
    slots_per_gpu = np.array(draw(st.lists(st.integers(0, 4), min_size=num_gpus, max_size=num_gpus)), np.int64)
    if slots_per_gpu.sum() == 0:
        slots_per_gpu[0] = 1
    topology = Topology(slots_per_gpu)
    num_slots = topology.num_slots
    num_experts = draw(st.integers(1, min(num_slots, 8)))
    extra = draw(st.lists(st.integers(0, num_experts - 1), min_size=num_slots - num_experts,
                          max_size=num_slots - num_experts))
    order = draw(st.permutations(list(range(num_slots))))
    phy2log = np.array(list(range(num_experts)) + extra, np.int64)[np.array(order)]
    integer = draw(st.booleans())
    if integer:
        values = st.integers(0, 1000)
    else:
        values = st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)
    weights = np.array(draw(st.lists(values, min_size=num_experts, max_size=num_experts)), np.float64)
    return weights, phy2log, topology


def check_valid(shares: np.ndarray, phy2log: np.ndarray, num_experts: int):
    assert shares.dtype == np.float64
    assert (shares >= 0).all()
    sums = np.zeros((phy2log.shape[0], num_experts))
    np.add.at(sums, (np.arange(phy2log.shape[0])[:, None], phy2log), shares)
    np.testing.assert_allclose(sums, 1.0, rtol=0, atol=1e-12)


@given(instances())
@example((np.array([3.20847e5, 6.103515625e-05, 3.20847e5]), np.array([0, 2, 0, 1, 0, 0, 0]),
          Topology(np.array([3, 4]))))  # loads ten orders of magnitude apart: the LP oracle's conditioning
def test_random_instances_reach_the_lp_optimum(instance):
    weights, phy2log, topology = instance
    shares, peak = optimal_dispatch(weights[None], phy2log[None], topology)
    check_valid(shares, phy2log[None], weights.size)
    loads = gpu_loads(weights[None], phy2log[None], topology, shares=shares)
    assert loads.max() == pytest.approx(peak[0], rel=1e-12, abs=1e-9)
    expected = lp_peak(weights, phy2log, topology)
    assert peak[0] == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert peak[0] == pytest.approx(hall_bound(weights, phy2log, topology), rel=1e-12, abs=1e-9)
    uniform = gpu_loads(weights[None], phy2log[None], topology, shares=uniform_shares(phy2log[None], _logcnt(phy2log, weights.size)))
    assert peak[0] <= uniform.max() * (1 + 1e-12) + 1e-12


def _logcnt(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    return np.bincount(phy2log, minlength=num_experts)[None].astype(np.int64)


def test_deepseek_sized_layers_match_the_lp_in_and_out_of_sample():
    series = drifting_counts(4, 6, 256, drift=0.5, num_groups=8, seed=3)
    placement = eplb.plan(series[:3].sum(axis=0), num_slots=288, num_gpus=32)
    for window in (series[0], series[3]):
        _, peak = optimal_dispatch(window, placement.phy2log, placement.topology)
        for layer in range(window.shape[0]):
            expected = lp_peak(window[layer], placement.phy2log[layer], placement.topology)
            assert peak[layer] == pytest.approx(expected, rel=1e-9)
        # out of sample the freedom matters: the optimal split beats uniform somewhere
    assert (peak < placement.gpu_loads(series[3]).max(axis=1) * (1 - 1e-6)).any()


@pytest.mark.parametrize("name, slots, gpus", [
    ("olmoe_1b7b_domains_layers0-7-15.npz", 80, 8),
    ("gpt_oss_20b_benchmark_windows.npz", 40, 8),
])
def test_real_traces_match_the_lp_on_a_window_left_out(trace_counts, name, slots, gpus):
    counts = trace_counts(name)[:6]
    placement = eplb.plan(counts[1:].sum(axis=0), num_slots=slots, num_gpus=gpus)
    shares, peak = optimal_dispatch(counts[0], placement.phy2log, placement.topology)
    check_valid(shares, placement.phy2log, counts.shape[-1])
    for layer in range(counts.shape[1]):
        expected = lp_peak(counts[0, layer], placement.phy2log[layer], placement.topology)
        assert peak[layer] == pytest.approx(expected, rel=1e-9)
    assert (peak <= placement.gpu_loads(counts[0]).max(axis=1) * (1 + 1e-12)).all()


def test_dispatch_on_a_placement_is_valid_deterministic_and_few_split():
    counts = deepseek_v3_counts(1)
    placement = eplb.plan(counts, num_slots=288, num_gpus=32)
    shares = dispatch(counts, placement)
    check_valid(shares, placement.phy2log, 256)
    np.testing.assert_array_equal(shares, dispatch(counts.copy(), placement))
    # a forest of split experts: fewer split experts than GPUs in every layer
    split = np.zeros(placement.num_layers, np.int64)
    for layer in range(placement.num_layers):
        taken = shares[layer] > 0
        split[layer] = (np.bincount(placement.phy2log[layer][taken], minlength=256) > 1).sum()
    assert (split <= placement.num_gpus - 1).all()
    optimal = gpu_loads(counts, placement.phy2log, placement.topology, shares=shares).max(axis=1)
    assert (optimal <= placement.gpu_loads(counts).max(axis=1) * (1 + 1e-12)).all()


def test_series_gives_shares_per_window():
    series = drifting_counts(3, 4, 16, drift=0.5, seed=1)
    placement = eplb.plan(series.sum(axis=0), num_slots=24, num_gpus=4)
    shares = dispatch(series, placement)
    assert shares.shape == (3, 4, 24)
    for t in range(3):
        np.testing.assert_array_equal(shares[t], dispatch(series[t], placement))
    loads = gpu_loads(series, placement.phy2log, placement.topology, shares=shares)
    assert loads.shape == (3, 4, 4)
    np.testing.assert_allclose(loads[1], gpu_loads(series[1], placement.phy2log, placement.topology, shares=shares[1]))


def test_masked_gpus_and_dense_layers():
    topology = Topology.from_layout(20, 5, masked_gpus=[2])
    counts = np.array([[50.0, 10, 10, 10, 5, 5, 5, 5], [0.0] * 8])
    phy2log = np.array([[0, 1, 2, 3, 0, 4, 5, 6, 7, 0, 1, 2, 0, 3, 4, 5, 6, 7, 0, 1]] * 2)
    placement = Placement(phy2log=phy2log, num_experts=8, topology=topology)
    shares = dispatch(counts, placement)
    check_valid(shares, phy2log, 8)
    loads = gpu_loads(counts, phy2log, topology, shares=shares)
    assert loads[0, 2] == 0.0 and loads[1].max() == 0.0
    np.testing.assert_array_equal(shares[1], uniform_shares(phy2log, placement.logcnt)[1])
    assert loads[0].max() == pytest.approx(lp_peak(counts[0], phy2log[0], topology), rel=1e-9)


def test_uniform_shares_reproduce_the_placement_loads():
    counts = deepseek_v3_counts(2)
    placement = eplb.plan(counts, num_slots=288, num_gpus=32)
    shares = uniform_shares(placement.phy2log, placement.logcnt)
    np.testing.assert_allclose(gpu_loads(counts, placement.phy2log, placement.topology, shares=shares),
                               placement.gpu_loads(counts), rtol=1e-12)


def test_bad_input_raises_value_errors():
    counts = deepseek_v3_counts(0)[:2]
    placement = eplb.plan(counts, num_slots=288, num_gpus=32)
    with pytest.raises(ValueError, match="counts must have shape"):
        dispatch(counts[:, :100], placement)
    with pytest.raises(ValueError, match="non-negative"):
        dispatch(-counts, placement)
    with pytest.raises(ValueError, match="placement must be an eplb.Placement"):
        dispatch(counts, placement.phy2log)
    shares = uniform_shares(placement.phy2log, placement.logcnt)
    with pytest.raises(ValueError, match="sum to 1"):
        check_shares(shares * 0.5, placement.phy2log, 256)
    with pytest.raises(ValueError, match="shares must have shape"):
        check_shares(shares[:, :10], placement.phy2log, 256)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        bad = shares.copy()
        bad[0, 0] = -0.5
        check_shares(bad, placement.phy2log, 256)
    with pytest.raises(ValueError, match="sum to 1"):
        eplb.Placement(placement.phy2log, 256, placement.topology, shares=shares * 0.5)

"""The exact branch and bound for tiny instances: its optimum is the brute-force optimum, the CP-SAT
solver's proven optimum at Mixtral size, and the default method's plan on such instances."""

import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.analysis.bounds import lower_bounds
from eplb.kernels.search.tiny import tiny_optimum

sys.path.insert(0, str(Path(__file__).parent.parent))
from brute_force import optimum as brute_force_optimum  # noqa: E402


def row_peak(row, w, slots_per_gpu):
    counts = np.bincount(row, minlength=len(w))
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    return max(sum(Fraction(float(w[e])) / counts[e] for e in row[offsets[g]:offsets[g + 1]])
               for g in range(len(slots_per_gpu)))


@st.composite
def tiny(draw):
    slots = np.array(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)), np.int64)
    if slots.sum() == 0:
        slots[0] = 1
    num_experts = draw(st.integers(1, min(4, int(slots.sum()))))
    loads = draw(st.lists(st.integers(0, 30), min_size=num_experts, max_size=num_experts))
    return slots, np.array(loads, dtype=np.float64)


@settings(max_examples=60, deadline=None)
@given(tiny())
def test_the_search_finds_the_brute_force_optimum(case):
    slots, w = case
    row = np.empty(int(slots.sum()), np.int64)
    value, found, proven = tiny_optimum(w, slots, False, np.inf, 10**6, row)
    assert found and proven
    optimum = brute_force_optimum(w, slots)
    assert abs(value - float(optimum)) <= 1e-9 * max(1.0, float(optimum))
    assert (np.bincount(row, minlength=len(w)) >= 1).all()  # a placement: every expert at least once
    assert abs(float(row_peak(row, w, slots)) - value) <= 1e-9 * max(1.0, value)


@settings(max_examples=60, deadline=None)
@given(tiny())
def test_spread_placements_keep_every_replica_on_its_own_gpu(case):
    slots, w = case
    row = np.empty(int(slots.sum()), np.int64)
    value, found, proven = tiny_optimum(w, slots, True, np.inf, 10**6, row)
    assert proven
    if found:
        offsets = np.concatenate([[0], np.cumsum(slots)])
        for g in range(len(slots)):
            gpu = row[offsets[g]:offsets[g + 1]]
            assert len(set(gpu.tolist())) == len(gpu)
        assert value >= float(brute_force_optimum(w, slots)) * (1 - 1e-9)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["lognormal", "hot"]))
def test_mixtral_sized_bound_is_the_exact_solvers_optimum(seed, kind):
    """8 experts on 12 slots, 4 GPUs: the bound every plan reports is the optimum of every placement
    (the search's), at most the optimum CP-SAT proves among the placements that keep the spread rule
    (here: every expert's replicas on different GPUs), which is the best spread placement the search
    finds; the default plan is that placement (unless the published greedy's, which may not spread
    its replicas, is lighter still)."""
    rng = np.random.default_rng(seed)
    weights = np.round(rng.lognormal(0, 0.6 if kind == "lognormal" else 1.5, (1, 8)) * 1000)
    config = dict(num_slots=12, num_gpus=4)
    exact = eplb.plan(weights, method="exact", deterministic_time=5.0, progress=False, **config)
    if not exact.info["optimal"][0]:
        return
    row = np.empty(12, np.int64)
    anywhere, _, _ = tiny_optimum(weights[0], np.full(4, 3, np.int64), False, np.inf, 10**6, row)
    spread, _, proven = tiny_optimum(weights[0], np.full(4, 3, np.int64), True, np.inf, 10**6, row)
    assert proven and abs(exact.max_load[0] - spread) <= 1e-9 * spread
    default = eplb.plan(weights, **config)
    assert abs(default.lower_bound[0] - anywhere) <= 1e-8 * anywhere
    assert default.lower_bound[0] <= exact.max_load[0] * (1 + 1e-12)
    if default.info["layers_from_greedy"]:  # greedy's placement (sharing a GPU) was lighter still
        return
    assert (default.replicas_sharing_a_gpu() == 0).all()
    assert abs(default.max_load[0] - spread) <= 1e-9 * spread


def test_the_search_bound_stays_out_of_large_instances():
    """Above 16 slots the search is not run (its entry falls back to the average bound)."""
    weights = np.random.default_rng(0).random((2, 16)) * 100
    topology = eplb.Topology.uniform(20, 4)
    bounds = lower_bounds(weights, eplb.Deployment.of(weights.shape[-1], topology=topology))
    np.testing.assert_array_equal(bounds["search"], bounds["average"])

"""Lower bounds never exceed the optimum (brute force on tiny instances) nor any method's max load."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import problems

import eplb
from eplb.analysis.bounds import BOUNDS, hierarchical_bound, lower_bound, lower_bounds

METHODS = [m for m in eplb.METHODS if m != "exact"]


def brute_force_optimum(weights, topology, num_groups=None):
    """``[L]`` smallest max GPU load over every placement (every expert at least once; with
    ``num_groups``, every group's replicas on one node)."""
    num_layers, num_experts = weights.shape
    num_slots = topology.num_slots
    all_p = np.array(list(itertools.product(range(num_experts), repeat=num_slots)), dtype=np.int64)
    counts = np.stack([(all_p == e).sum(axis=1) for e in range(num_experts)], axis=1)  # [M, E]
    keep = (counts > 0).all(axis=1)
    if num_groups is not None:
        size = num_experts // num_groups
        node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
        for g in range(num_groups):
            nodes = np.where(all_p // size == g, node_of_slot[None, :], -1)
            first = nodes.max(axis=1)
            keep &= ((nodes == -1) | (nodes == first[:, None])).all(axis=1)
    all_p, counts = all_p[keep], counts[keep]
    best = np.empty(num_layers)
    offsets = topology.slot_offsets
    for layer in range(num_layers):
        per_slot = weights[layer][all_p] / np.take_along_axis(counts, all_p, axis=1)
        cum = np.concatenate([np.zeros((len(all_p), 1)), np.cumsum(per_slot, axis=1)], axis=1)
        loads = cum[:, offsets[1:]] - cum[:, offsets[:-1]]
        best[layer] = loads.max(axis=1).min()
    return best


@st.composite
def tiny_cases(draw, hierarchical=False):
    num_nodes = 2 if hierarchical else 1
    slots = np.array(draw(st.lists(st.integers(0, 3), min_size=2, max_size=3)), np.int64)
    if hierarchical:
        slots = np.array(draw(st.lists(st.integers(1, 2), min_size=4, max_size=4)), np.int64)
    if slots.sum() == 0:
        slots[0] = 1
    slots = slots[: len(slots) - len(slots) % num_nodes]
    num_slots = int(slots.sum())
    if num_slots > 6:
        slots[np.argmax(slots)] -= num_slots - 6
    topology = eplb.Topology(slots, num_nodes)
    if hierarchical:
        size = 1
        num_groups = 2
        num_experts = 2
        if min(topology.slots_per_node) >= 2 and draw(st.booleans()):
            size, num_experts = 2, 4
        return topology, num_experts, num_groups
    num_experts = draw(st.integers(1, min(4, topology.num_slots)))
    return topology, num_experts, None


def tiny_weights(draw_seed, num_experts):
    rng = np.random.default_rng(draw_seed)
    kind = draw_seed % 3
    if kind == 0:
        return rng.integers(0, 20, (2, num_experts)).astype(float)
    if kind == 1:
        return np.floor(rng.pareto(0.7, (2, num_experts)) * 10)
    return rng.random((2, num_experts)) * 100


@pytest.mark.slow  # brute force over 40 cases: 26 s; the fast tier keeps the other bound checks
@settings(max_examples=40)
@given(tiny_cases(), st.integers(0, 2**32 - 1))
def test_every_bound_is_at_most_the_brute_force_optimum(case, seed):
    topology, num_experts, _ = case
    weights = tiny_weights(seed, num_experts)
    optimum = brute_force_optimum(weights, topology)
    for name, bound in lower_bounds(weights, eplb.Deployment.of(weights.shape[-1], topology=topology)).items():
        assert (bound <= optimum * (1 + 1e-9) + 1e-12).all(), name
    for method in METHODS:
        if method == "greedy" and not topology.is_uniform:
            continue  # the published algorithm needs equal slots per GPU
        placement = eplb.plan(weights, topology=topology, method=method)
        assert (placement.max_load >= optimum * (1 - 1e-9)).all()
        assert (placement.lower_bound <= optimum * (1 + 1e-9) + 1e-12).all()


@settings(max_examples=25)
@given(tiny_cases(hierarchical=True), st.integers(0, 2**32 - 1))
def test_the_hierarchical_bound_is_at_most_the_brute_force_optimum(case, seed):
    topology, num_experts, num_groups = case
    weights = tiny_weights(seed, num_experts)
    optimum = brute_force_optimum(weights, topology, num_groups)
    bound = hierarchical_bound(weights, topology, num_groups)
    assert (bound <= optimum * (1 + 1e-9) + 1e-12).all()
    assert (bound >= lower_bound(weights, eplb.Deployment.of(weights.shape[-1], topology=topology)) * (1 - 1e-12)).all()
    placement = eplb.plan(weights, topology=topology, num_groups=num_groups)
    assert (placement.max_load >= optimum * (1 - 1e-9)).all()


@given(problems())
def test_the_reported_bound_is_below_every_methods_max_load(deployment):
    config, counts = deployment
    kwargs = {k: v for k, v in config.items() if k != "num_experts"}
    for method in METHODS:
        placement = eplb.plan(counts, method=method, **kwargs)
        assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all(), method


def test_the_bounds_are_listed_by_name():
    assert set(BOUNDS) == {"average", "replica", "cardinality", "pigeonhole", "threshold", "tier", "search", "pairs", "heads"}


def test_threshold_bound_sees_what_the_average_misses():
    """6 slots on 3 GPUs (2 each) for 4 experts, 2 of them hot: whatever the replication, some GPU
    carries two big replicas (or one whole hot expert); the optimum is 10, the average 7.33."""
    weights = np.array([[10.0, 10, 1, 1]])
    topology = eplb.Topology.uniform(6, 3)
    bounds = lower_bounds(weights, eplb.Deployment.of(weights.shape[-1], topology=topology))
    optimum = brute_force_optimum(weights, topology)[0]
    assert optimum == 10.0
    assert bounds["average"][0] < 7.4 and optimum * (1 - 1e-6) < bounds["threshold"][0] <= optimum


def test_tier_bound_sees_the_lightest_experts_the_hot_gpus_must_take():
    """8 slots on 4 GPUs (2 each), one hot expert (40) and six of 10: the hot expert's replicas
    need GPUs that also hold a 10 each, so the optimum is 30; the other simple bounds stay at <= 25
    (the exact search of tiny instances finds 30 too)."""
    weights = np.array([[40.0, 10, 10, 10, 10, 10, 10]])
    topology = eplb.Topology.uniform(8, 4)
    bounds = lower_bounds(weights, eplb.Deployment.of(weights.shape[-1], topology=topology))
    optimum = brute_force_optimum(weights, topology)[0]
    assert optimum == 30.0
    assert max(v[0] for name, v in bounds.items() if name not in ("tier", "search", "pairs")) <= 25.0
    assert bounds["pairs"][0] <= optimum * (1 + 1e-9)
    assert optimum * (1 - 1e-6) < bounds["tier"][0] <= optimum
    assert lower_bound(weights, eplb.Deployment.of(weights.shape[-1], topology=topology))[0] >= bounds["tier"][0]


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(2, 3), st.integers(0, 4), st.integers(1, 2), st.integers(0, 2**32 - 1))
def test_tier_bound_is_at_most_the_exact_optimum_with_hot_experts(gpus, k, spare, hot, seed):
    """A few hot experts over more slots than brute force reaches: the tier bound never exceeds the
    optimum the CP-SAT solver proves."""
    rng = np.random.default_rng(seed)
    num_slots = gpus * k
    num_experts = max(hot + 1, num_slots - spare)
    weights = rng.integers(1, 20, (1, num_experts)).astype(float)
    weights[0, :hot] *= rng.integers(3, 12, hot)
    topology = eplb.Topology.uniform(num_slots, gpus)
    exact = eplb.plan(weights, topology=topology, method="exact", deterministic_time=2.0, progress=False)
    if exact.info["optimal"][0]:
        assert lower_bounds(weights, eplb.Deployment.of(weights.shape[-1], topology=topology))["tier"][0] <= exact.max_load[0] * (1 + 1e-9)


def test_pigeonhole_sees_the_hot_gpus_without_redundant_slots():
    """No redundant slot (S = E = 128 on 8 GPUs, 4 hot experts): the 4 GPUs holding a hot expert
    also hold 15 others each, which the average over all 8 GPUs misses."""
    from eplb.simulation.synthetic import skewed_counts

    counts = skewed_counts(4, 128, family="hot", skew=1.0, seed=3).astype(float)
    topology = eplb.Topology.uniform(128, 8)
    bounds = lower_bounds(counts, eplb.Deployment.of(counts.shape[-1], topology=topology))
    assert (bounds["pigeonhole"] > bounds["average"] * 1.1).all()
    best = eplb.plan(counts, topology=topology, method="best")
    assert (bounds["pigeonhole"] <= best.max_load).all()
    assert best.gap.mean() < 1e-3


def test_hierarchical_bound_on_deepseek_v3_sized_loads_is_tight():
    """Greedy and the default both land above it; the default within 0.5%."""
    from eplb.simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts

    counts = deepseek_v3_counts(seed=2)
    config = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
    ours = eplb.plan(counts, **config)
    greedy = eplb.plan(counts, method="greedy", **config)
    assert (ours.lower_bound > lower_bound(counts.astype(float), eplb.Deployment.of(counts.shape[-1], topology=ours.topology))).any()
    assert (greedy.max_load >= ours.lower_bound).all()
    assert ours.gap.mean() < 5e-3

"""GPUs of one or two slots: the pairing bound never exceeds the optimum, the sorted-pairing
construction is a valid placement that keeps the spread rule, and ``method="exact"`` proves
optimality without CP-SAT where they meet.

The oracle for two slots a GPU: every replication ``r`` (``r_e >= 1``, ``sum r = S``), each paired
heaviest replica with lightest (optimal for fixed counts), the lightest peak; checked against the
independent brute force of ``tests/brute_force.py`` on the smallest instances.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brute_force
from strategies import small_loads
import eplb
from eplb.analysis.bounds import lower_bounds, pairs, strongest_bound
from eplb.kernels.bounds.pairs import capped_counts, pair_search
from eplb.planning.methods.exact_pairs import DEFAULT_PAIR_DONORS, DEFAULT_PAIR_STEPS, few_slot_plans, pair_counts
from eplb.simulation.synthetic import skewed_counts
from eplb.planning.spread import avoidable_doubled


def sorted_pairing_optimum(w, num_gpus: int, cap: int | None = None) -> Fraction:
    """The optimum with two slots on each of ``num_gpus`` GPUs (replica counts at most ``cap``)."""
    w = [Fraction(int(v)) for v in w]
    num_slots, num_experts = 2 * num_gpus, len(w)
    best = None
    for extra in product(range(num_slots - num_experts + 1), repeat=num_experts):
        if sum(extra) != num_slots - num_experts:
            continue
        r = [1 + x for x in extra]
        if cap is not None and max(r) > cap:
            continue
        items = sorted(v / c for v, c in zip(w, r) for _ in range(c))
        peak = max(items[i] + items[-1 - i] for i in range(num_gpus))
        best = peak if best is None or peak < best else best
    return best


@st.composite
def two_slot_layers(draw):
    """Small integer loads with zeros, ties and hot experts, on ``G`` GPUs of two slots."""
    num_experts = draw(st.integers(2, 5))
    num_gpus = draw(st.integers(max(1, (num_experts + 1) // 2), min(5, num_experts + 2)))
    return small_loads(draw, num_experts, 50, 5), num_gpus


@settings(max_examples=150, deadline=None)
@given(two_slot_layers())
def test_pair_bound_never_exceeds_the_optimum_and_the_construction_never_beats_it(instance):
    w, num_gpus = instance
    deployment = eplb.Deployment.of(len(w), num_slots=2 * num_gpus, num_gpus=num_gpus)
    optimum = float(sorted_pairing_optimum(w, num_gpus))
    bound = float(strongest_bound(w[None, :], deployment)[0])
    assert bound <= optimum * (1 + 1e-9) + 1e-12
    assert float(pairs(w[None, :], deployment.topology)[0]) <= optimum * (1 + 1e-9) + 1e-12
    rows, made = few_slot_plans(w[None, :], deployment)
    _, peaks = pair_counts(w[None, :], deployment)
    assert peaks[0] >= optimum * (1 - 1e-9)
    if made[0]:
        row = rows[0]
        counts = np.bincount(row, minlength=len(w))
        assert (counts >= 1).all() and row.shape == (2 * num_gpus,)
        peak = max(w[a] / counts[a] + w[b] / counts[b] for a, b in row.reshape(-1, 2))
        assert peak >= optimum * (1 - 1e-9)
        assert avoidable_doubled(row[None, :], deployment)[0] == 0


@pytest.mark.parametrize("w, num_gpus", [([5, 1, 1], 2), ([4, 4, 1], 2), ([9, 0, 0], 2), ([3, 3, 3], 3), ([7, 2, 2, 1], 3)])
def test_the_sorted_pairing_oracle_is_the_brute_force_optimum(w, num_gpus):
    assert sorted_pairing_optimum(w, num_gpus) == brute_force.optimum(w, [2] * num_gpus)


def test_pair_bound_raises_the_bound_where_a_hot_expert_needs_light_partners():
    # 3 experts on 3 GPUs of 2: the optimum pairs the hot expert's replicas with the light ones
    w = np.array([[90.0, 10.0, 10.0, 1.0]])
    deployment = eplb.Deployment.of(4, num_slots=6, num_gpus=3)
    optimum = float(sorted_pairing_optimum(w[0], 3))
    named = lower_bounds(w, deployment)
    others = max(float(v[0]) for name, v in named.items() if name != "pairs")
    assert float(named["pairs"][0]) <= optimum * (1 + 1e-9)
    assert float(strongest_bound(w, deployment)[0]) >= others


def test_one_slot_construction_is_the_replica_bound_and_brute_force():
    w = np.array([[9.0, 5.0, 1.0], [4.0, 4.0, 4.0], [0.0, 7.0, 0.0]])
    deployment = eplb.Deployment.of(3, num_slots=5, num_gpus=5)
    rows, made = few_slot_plans(w, deployment)
    assert made.all()
    for layer in range(3):
        counts = np.bincount(rows[layer], minlength=3)
        peak = (w[layer] / counts).max()
        assert peak == pytest.approx(float(brute_force.optimum(w[layer], [1] * 5)))
        assert peak == pytest.approx(float(strongest_bound(w[layer:layer + 1], deployment)[0]))


def test_exact_proves_two_slot_layers_in_closed_form_and_keeps_the_rule():
    counts = np.array([[40, 30, 20, 10, 8, 6, 4, 2], [10, 10, 10, 10, 10, 10, 10, 10]])
    deployment = eplb.Deployment.of(8, num_slots=12, num_gpus=6)
    placement = eplb.plan(counts, deployment, method="exact", time_limit=5)
    for layer in range(2):
        optimum = float(sorted_pairing_optimum(counts[layer], 6, cap=6))
        assert placement.max_load[layer] == pytest.approx(optimum)
    assert (avoidable_doubled(placement.phy2log, deployment) == 0).all()
    closed = placement.info["closed_form"]
    assert all(placement.info["status"][i] == "OPTIMAL" for i in np.flatnonzero(closed))


def test_the_count_search_is_deterministic_and_keeps_the_cap():
    rng = np.random.default_rng(3)
    desc = -np.sort(-rng.lognormal(0, 1, size=(4, 40)), axis=1)
    first = pair_search(desc, 64, 32, 256, 6)
    second = pair_search(desc.copy(), 64, 32, 256, 6)
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert (first[0].sum(axis=1) == 64).all() and first[0].max() <= 32 and first[0].min() >= 1
    assert (capped_counts(desc, 64, 32).sum(axis=1) == 64).all()


def test_hierarchical_two_slot_bound_stays_below_the_hierarchical_optimum():
    w = np.array([[12.0, 1.0, 6.0, 5.0]])
    deployment = eplb.Deployment.of(4, num_slots=8, num_gpus=4, num_nodes=2, num_groups=2)
    optimum = float(brute_force.optimum(w[0], [2] * 4, num_nodes=2, num_groups=2))
    assert float(strongest_bound(w, deployment)[0]) <= optimum * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(two_slot_layers())
def test_the_default_at_two_slots_is_never_heavier_than_its_pairing_construction(instance):
    w, num_gpus = instance
    deployment = eplb.Deployment.of(len(w), num_slots=2 * num_gpus, num_gpus=num_gpus)
    placement = eplb.plan(w[None, :], deployment)
    optimum = float(sorted_pairing_optimum(w, num_gpus))
    assert placement.max_load[0] >= optimum * (1 - 1e-9)
    rows, made = few_slot_plans(w[None, :], deployment, DEFAULT_PAIR_DONORS, DEFAULT_PAIR_STEPS)
    if made[0]:
        counts = np.bincount(rows[0], minlength=len(w))
        construction = max(w[a] / counts[a] + w[b] / counts[b] for a, b in rows[0].reshape(-1, 2))
        assert placement.max_load[0] <= construction * (1 + 1e-12)
    assert avoidable_doubled(placement.phy2log, deployment)[0] == 0


def test_the_default_at_deepseek_decode_size_pairs_lighter_than_greedy():
    """288 slots on 144 GPUs: the default's other steps end at greedy's loads; the pairing
    construction lightens most layers, and no GPU holds an expert twice."""
    counts = np.asarray(skewed_counts(8, 256, family="lognormal", skew=0.7, num_groups=8, seed=1), float)
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    default = eplb.plan(counts, deployment)
    greedy = eplb.plan(counts, deployment, method="greedy")
    assert (default.max_load <= greedy.max_load * (1 + 1e-12)).all()
    assert default.info["layers_paired"] >= 4 and (default.max_load < greedy.max_load).sum() >= 4
    assert avoidable_doubled(default.phy2log, deployment).sum() == 0

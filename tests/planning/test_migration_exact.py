"""The fewest-changes model (eplb.planning.exact_migration, plan(previous=..., method="exact")) against brute
force on tiny instances, and its invariants."""

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.planning.api import make_deployment

# Marked slow test by test (CP-SAT models and brute force); the unmarked tests check
# this module in the fast tier (pytest -m "not slow").

pytest.importorskip("ortools", reason="the fewest-changes model is CP-SAT: pip install 'eplb[exact]'")
from eplb.planning.exact_migration import fewest_changes_layer  # noqa: E402


def exact_peak(row, w, slots_per_gpu):
    """Max GPU load of ``row`` in exact rational arithmetic."""
    counts = np.bincount(row, minlength=len(w))
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    return max(sum((Fraction(float(w[e])) / int(counts[e]) for e in row[a:b]), Fraction(0))
               for a, b in zip(offsets[:-1], offsets[1:]))


def changed_slots(row, previous, slots_per_gpu):
    """Changed slots when each GPU keeps what it can (slots on a GPU are interchangeable)."""
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    total = 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        new, old = np.bincount(row[a:b], minlength=64), np.bincount(previous[a:b], minlength=64)
        total += (b - a) - int(np.minimum(new, old).sum())
    return total


def brute_force(w, previous, slots_per_gpu, cap, num_nodes=1, num_groups=None, shared=False):
    """Fewest changed slots over every placement with max load <= cap (None if there is none);
    unless ``shared``, no GPU holds more replicas of an expert than max(1, what it held before)."""
    num_experts, num_slots = len(w), int(sum(slots_per_gpu))
    gpu_node = np.repeat(np.arange(num_nodes), len(slots_per_gpu) // num_nodes)
    node_of_slot = np.repeat(gpu_node, slots_per_gpu)
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    best = None
    for row in itertools.product(range(num_experts), repeat=num_slots):
        row = np.array(row)
        if len(set(row.tolist())) < num_experts:
            continue
        if num_groups:
            size = num_experts // num_groups
            if any(len(set(node_of_slot[row // size == q].tolist())) > 1 for q in range(num_groups)):
                continue
        if not shared and any(
                (np.bincount(row[a:b], minlength=num_experts) > np.maximum(
                    1, np.bincount(previous[a:b], minlength=num_experts))).any()
                for a, b in zip(offsets[:-1], offsets[1:])):
            continue
        if exact_peak(row, w, slots_per_gpu) > cap:
            continue
        c = changed_slots(row, previous, slots_per_gpu)
        best = c if best is None else min(best, c)
    return best


tiny = st.sampled_from([
    # (experts, slots per GPU, nodes, groups)
    (3, (2, 2), 1, None),
    (4, (2, 2, 2), 1, None),
    (3, (2, 1, 2), 1, None),
    (4, (3, 3), 1, None),
    (4, (2, 2, 2, 2), 2, 2),
])


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(tiny, st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.005, 0.1]), st.booleans())
def test_fewest_changes_match_brute_force(config, seed, tolerance, shared):
    num_experts, slots, num_nodes, num_groups = config
    slots = np.array(slots)
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 50, num_experts).astype(float)
    topology = eplb.Topology(slots, num_nodes)
    deployment = make_deployment(num_experts, num_groups=num_groups, topology=topology)
    old_w = rng.integers(1, 50, num_experts).astype(float)
    previous = eplb.plan(old_w, topology=topology, num_groups=num_groups).phy2log[0]
    scratch = eplb.plan(w, topology=topology, num_groups=num_groups)
    cap = float(scratch.max_load[0]) * (1 + tolerance)
    near = eplb.plan(w, topology=topology, num_groups=num_groups, previous=previous[None], tolerance=tolerance)
    result = fewest_changes_layer(w, deployment, previous, near.phy2log[0], cap=cap, max_moves=None, time_limit=5.0,
                                  shared=shared)
    # cap is a float (a plan at exactly the reference max load may round just above it): a hair of slack
    expected = brute_force(w, previous, slots, Fraction(cap) * Fraction(1 + 1e-12), num_nodes, num_groups, shared)
    heuristic_changes = int((near.phy2log[0] != previous).sum())
    if expected is None or expected > heuristic_changes:  # only the heuristic's plan (a shared GPU) fits
        assert not shared and result.changes == heuristic_changes
        return
    assert result.proven
    assert result.changes == expected == result.lower_bound
    assert result.changes == int((result.slots != previous).sum())  # kept experts stay in their slots
    assert exact_peak(result.slots, w, slots) <= Fraction(cap) * Fraction(1 + 1e-12)
    assert result.changes <= int((near.phy2log[0] != previous).sum())  # never worse than the heuristic


def drifting(seed, num_layers=2, num_experts=8):
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0, 1, (num_layers, num_experts)) * 100
    return np.round(base), np.round(base * rng.lognormal(0, 0.4, base.shape))


CONFIG = dict(num_slots=12, num_gpus=4, num_nodes=1)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.005, 0.05]))
def test_exact_plan_is_within_tolerance_and_no_worse_than_the_heuristic(seed, tolerance):
    old, new = drifting(seed)
    previous = eplb.plan(old, **CONFIG)
    heuristic = eplb.plan(new, previous=previous, tolerance=tolerance, **CONFIG)
    exact = eplb.plan(new, previous=previous, tolerance=tolerance, method="exact", time_limit=5.0, **CONFIG)
    reference = eplb.plan(new, method="exact", time_limit=5.0, **CONFIG)  # optimal from scratch
    assert (exact.max_load <= reference.max_load * (1 + tolerance) * (1 + 1e-12)).all()
    changed = (exact.phy2log != previous.phy2log).sum(axis=1)
    np.testing.assert_array_equal(exact.info["slots_changed"], changed)
    proven = exact.info["fewest_changes_proven"]
    np.testing.assert_array_equal(exact.info["fewest_changes_bound"][proven], changed[proven])
    # unproven only where the plan kept is one the model excludes: a GPU with a new second replica
    for layer in np.flatnonzero(~proven):
        row, old_row = exact.phy2log[layer], previous.phy2log[layer]
        assert any((np.bincount(row[g:g + 3], minlength=8) > np.maximum(1, np.bincount(old_row[g:g + 3], minlength=8))).any()
                   for g in range(0, 12, 3))
    # the heuristic's reference is the default method, never better than the optimum: its cap is looser
    assert (changed <= heuristic.info["slots_changed"]).all() or (reference.max_load < heuristic.info[
        "scratch_max_load"]).any()


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 4))
def test_budget_of_moves_is_never_exceeded_and_max_load_is_lowest(seed, budget):
    old, new = drifting(seed, num_layers=1)
    previous = eplb.plan(old, **CONFIG)
    exact = eplb.plan(new, previous=previous, tolerance=None, max_moves=budget, method="exact", time_limit=5.0,
                      **CONFIG)
    heuristic = eplb.plan(new, previous=previous, tolerance=None, max_moves=budget, **CONFIG)
    assert ((exact.phy2log != previous.phy2log).sum(axis=1) <= budget).all()
    assert (exact.max_load <= heuristic.max_load * (1 + 1e-12)).all()
    if exact.info["fewest_changes_proven"].all():  # then no plan within the budget has a lower max load
        assert (exact.max_load <= exact.info["fewest_changes_bound"] * (1 + 1e-9)).all()


@pytest.mark.slow
def test_exact_migration_is_deterministic():
    old, new = drifting(7, num_layers=2, num_experts=16)
    config = dict(num_slots=24, num_gpus=4, num_nodes=2)
    previous = eplb.plan(old, **config)
    a = eplb.plan(new, previous=previous, method="exact", time_limit=0.2, **config)
    b = eplb.plan(new, previous=previous, method="exact", time_limit=0.2, **config)
    np.testing.assert_array_equal(a.phy2log, b.phy2log)


def test_exact_migration_needs_a_cap_or_a_budget():
    w = np.array([1.0, 2.0, 3.0])
    deployment = make_deployment(3, 4, 2)
    with pytest.raises(ValueError, match="cap"):
        fewest_changes_layer(w, deployment, np.array([0, 1, 2, 0]), np.array([0, 1, 2, 0]), cap=None, max_moves=None)


@pytest.mark.slow
def test_balancer_with_the_exact_method_rebalances_with_the_fewest_changes():
    old, new = drifting(3)
    balancer = eplb.Balancer(2, eplb.Deployment.of(8, **CONFIG), window=1, method="exact", options={"time_limit": 5.0, "progress": False})
    balancer.record(old)
    balancer.rebalance()
    balancer.record(new)
    placement, transfer = balancer.rebalance()
    assert placement.info["fewest_changes_proven"].all()
    assert len(transfer) == int(placement.info["slots_changed"].sum())


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(tiny.filter(lambda c: c[3] is None), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.005, 0.1]))
def test_exhaustive_search_of_small_layers_finds_the_fewest_changes(config, seed, tolerance):
    from eplb.kernels.search.tiny_changes import fewest_changes_search

    num_experts, slots, num_nodes, _ = config
    slots = np.array(slots)
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 50, num_experts).astype(float)
    topology = eplb.Topology(slots, num_nodes)
    previous = eplb.plan(rng.integers(1, 50, num_experts).astype(float), topology=topology).phy2log[0]
    cap = float(eplb.plan(w, topology=topology).max_load[0]) * (1 + tolerance)
    expected = brute_force(w, previous, slots, Fraction(cap) * Fraction(1 + 1e-12), num_nodes)
    row, changes = fewest_changes_search(w, previous, topology.slot_offsets, cap, len(previous) + 1, 10**7)
    if expected == 0:  # the previous placement fits: the search looks for 1 change or more
        return
    assert changes == (-1 if expected is None else expected)
    if changes > 0:
        assert int((row != previous).sum()) == changes
        assert exact_peak(row, w, slots) <= Fraction(cap) * (1 + Fraction(1, 10**12))
        assert (np.bincount(row, minlength=num_experts) > 0).all()


@pytest.mark.slow
def test_small_layers_change_no_more_than_the_exhaustive_search_allows():
    old, new = drifting(11, num_layers=3)
    previous = eplb.plan(old, **CONFIG)
    near = eplb.plan(new, previous=previous, tolerance=0.005, **CONFIG)
    exact = eplb.plan(new, previous=previous, tolerance=0.005, method="exact", time_limit=5.0, **CONFIG)
    scratch = eplb.plan(new, **CONFIG)
    assert (near.max_load <= scratch.max_load * 1.005 * (1 + 1e-12)).all()
    # within the same reference, the search (up to 4 changes per layer here) reaches the proven minimum
    from eplb.planning.api import make_deployment
    from eplb.planning.exact_migration import fewest_changes

    _, info = fewest_changes(new, make_deployment(8, 12, 4), previous.phy2log.copy(), near.phy2log.copy(),
                             cap=scratch.max_load * 1.005, max_moves=None, time_limit=5.0)
    assert info["proven"].all()
    small = info["slots_changed"] <= 4
    np.testing.assert_array_equal(near.info["slots_changed"][small], info["slots_changed"][small])
    assert exact.info["fewest_changes_proven"].all()

"""The exact fewest-changes search (bench/fewest_changes_search, research code used by
bench/fewest_changes.py; tests/conftest.py puts bench/ on the path) against an
independent brute force on tiny layers, against the CP-SAT model on small ones, and its bounds
when the work runs out."""

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.planning.api import make_deployment

pytestmark = pytest.mark.slow  # CP-SAT models and brute force

pytest.importorskip("ortools", reason="the fewest-changes model is CP-SAT: pip install 'eplb[exact]'")
from eplb.planning.exact_migration import fewest_changes_layer  # noqa: E402
from fewest_changes_search import FOUND, OUT_OF_WORK, REFUTED, fewest_changes_exact, follows_rules, \
    prove_fewest_changes, prove_layer


def peak(row, w, slots_per_gpu):
    """Max GPU load of ``row`` in exact rational arithmetic."""
    counts = np.bincount(row, minlength=len(w))
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    return max(sum((Fraction(float(w[e])) / int(counts[e]) for e in row[a:b]), Fraction(0))
               for a, b in zip(offsets[:-1], offsets[1:]))


def fewest_by_brute_force(w, previous, slots_per_gpu, cap, shared):
    """Fewest changed slots (``row != previous``) over every row with every expert, max load <= cap
    and (unless shared) no GPU holding more of an expert than max(1, what it held); None if none."""
    num_experts, num_slots = len(w), len(previous)
    offsets = np.concatenate([[0], np.cumsum(slots_per_gpu)])
    best = None
    for row in itertools.product(range(num_experts), repeat=num_slots):
        row = np.array(row)
        changes = int((row != previous).sum())
        if best is not None and changes >= best:
            continue
        if len(set(row.tolist())) < num_experts:
            continue
        if not shared and any((np.bincount(row[a:b], minlength=num_experts) > np.maximum(
                1, np.bincount(previous[a:b], minlength=num_experts))).any() for a, b in zip(offsets[:-1], offsets[1:])):
            continue
        if peak(row, w, slots_per_gpu) > cap:
            continue
        best = changes
    return best


TINY = [(3, (2, 2)), (4, (2, 2, 2)), (3, (2, 1, 2)), (4, (3, 3)), (3, (3, 0, 2))]


def tiny_case(config, seed, tolerance):
    num_experts, slots = config
    slots = np.array(slots)
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 50, num_experts).astype(float)
    topology = eplb.Topology(slots, 1)
    previous = eplb.plan(rng.integers(1, 50, num_experts).astype(float), topology=topology).phy2log[0]
    cap = float(eplb.plan(w, topology=topology).max_load[0]) * (1 + tolerance)
    return w, topology, previous.astype(np.int64), cap


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TINY), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.005, 0.1]), st.booleans())
def test_proven_fewest_changes_match_brute_force(config, seed, tolerance, shared):
    w, topology, previous, cap = tiny_case(config, seed, tolerance)
    expected = fewest_by_brute_force(w, previous, topology.slots_per_gpu, Fraction(cap) * Fraction(1 + 1e-12), shared)
    proof = prove_layer(w, topology, previous, cap=cap, shared=shared, work=10**6)
    if expected is None:  # nothing within the rules fits (the cap came from a plan sharing a GPU)
        assert proof.changes == topology.num_slots + 1 and proof.lower_bound == topology.num_slots + 1
        assert proof.proven  # proven infeasible
        return
    assert proof.proven
    assert proof.changes == proof.lower_bound == expected
    assert int((proof.slots != previous).sum()) == proof.changes
    # checked in floats like every eplb plan: exactly, a plan at the cap may exceed it by a rounding
    assert peak(proof.slots, w, topology.slots_per_gpu) <= Fraction(cap) * Fraction(1 + 1e-12)
    assert follows_rules(proof.slots, previous, len(w), topology, shared)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TINY), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.005]), st.integers(1, 60))
def test_bounds_stay_valid_when_the_work_runs_out(config, seed, tolerance, work):
    w, topology, previous, cap = tiny_case(config, seed, tolerance)
    expected = fewest_by_brute_force(w, previous, topology.slots_per_gpu, Fraction(cap) * Fraction(1 + 1e-12), False)
    num_experts = len(w)
    status, row, bound, nodes = fewest_changes_exact(w, previous, topology.slot_offsets, cap, 0,
                                                     topology.num_slots + 1, False, work, np.ones(num_experts, np.int64),
                                                     np.full(num_experts, topology.num_slots, np.int64))
    assert status in (FOUND, REFUTED, OUT_OF_WORK)
    assert nodes <= work + 1
    if expected is None:
        assert status != FOUND
    else:
        assert bound <= expected  # a proven lower bound, however little work was done
        if status == FOUND:
            assert int((row != previous).sum()) == expected  # iterative deepening: the first found is the fewest
    if status == REFUTED:
        assert expected is None


def drifting(seed, num_experts=8):
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0, 1, num_experts) * 100
    return np.round(base), np.round(base * rng.lognormal(0, 0.4, num_experts))


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.005, 0.05]))
def test_same_minimum_as_the_cp_sat_model_on_twelve_slots(seed, tolerance):
    old, new = drifting(seed)
    config = dict(num_slots=12, num_gpus=4, num_nodes=1)
    previous = eplb.plan(old, **config).phy2log[0]
    near = eplb.plan(new, previous=previous[None], tolerance=tolerance, **config).phy2log[0]
    cap = float(eplb.plan(new, **config).max_load[0]) * (1 + tolerance)
    deployment = make_deployment(8, **config)
    model = fewest_changes_layer(new, deployment, previous, near, cap=cap, max_moves=None, time_limit=5.0)
    proof = prove_layer(new, deployment.topology, previous, cap=cap, incumbent=near, work=10**7)
    assert proof.proven
    assert proof.changes <= int((near != previous).sum())  # never worse than the incumbent
    if model.proven:
        assert proof.changes == model.changes


def test_deterministic_and_checked_per_layer():
    rng = np.random.default_rng(5)
    old, new = rng.lognormal(0, 1, (3, 8)) * 100, rng.lognormal(0, 1, (3, 8)) * 100
    new[1] = 0.0  # a dense layer: nothing changes
    config = dict(num_slots=12, num_gpus=4, num_nodes=1)
    previous = eplb.plan(old, **config)
    scratch = eplb.plan(new, **config)
    deployment = make_deployment(8, **config)
    a = prove_fewest_changes(new, deployment, previous.phy2log, cap=scratch.max_load * 1.005, work=10**6)
    b = prove_fewest_changes(new, deployment, previous.phy2log, cap=scratch.max_load * 1.005, work=10**6)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1]["lower_bound"], b[1]["lower_bound"])
    assert a[1]["slots_changed"][1] == 0 and a[1]["proven"][1]
    np.testing.assert_array_equal(a[1]["slots_changed"], (a[0] != previous.phy2log).sum(axis=1))
    loads = eplb.Placement(a[0], 8, deployment.topology).gpu_loads(new).max(axis=1)
    assert (loads <= scratch.max_load * 1.005).all()


def test_clear_errors():
    config = dict(num_slots=8, num_gpus=4, num_nodes=2)
    w = np.ones((1, 8))
    previous = eplb.plan(w, **config).phy2log
    with pytest.raises(ValueError, match="global mode"):
        prove_fewest_changes(w, make_deployment(8, **config, num_groups=2), previous, cap=np.ones(1))
    with pytest.raises(ValueError, match="previous"):
        prove_fewest_changes(w, make_deployment(8, **config), previous[:, :4], cap=np.ones(1))
    with pytest.raises(ValueError, match="every expert"):
        prove_fewest_changes(w, make_deployment(8, **config), np.zeros_like(previous), cap=np.ones(1))
    with pytest.raises(ValueError, match="slots per GPU"):
        big = dict(num_slots=40, num_gpus=2, num_nodes=1)
        prove_fewest_changes(np.ones((1, 8)), make_deployment(8, **big), eplb.plan(np.ones(8), **big).phy2log,
                             cap=np.ones(1))
    with pytest.raises(ValueError, match="work"):
        prove_fewest_changes(w, make_deployment(8, **config), previous, cap=np.ones(1), work=0)


def test_gpt_oss_layer_needs_far_fewer_changes_than_the_heuristic(trace_counts):
    """gpt-oss-20b, 40 slots / 8 GPUs, the sequence of bench/serving.py: on rebalance 6, layer 14
    eplb's search changes 11 slots; the proven minimum within the same cap is 2."""
    counts = trace_counts("gpt_oss_20b_benchmark_windows.npz")
    series = np.stack([counts[t:t + 40].sum(axis=0) for t in range(0, 35, 5)])
    config = dict(num_slots=40, num_gpus=8, num_nodes=2)
    current = eplb.plan(series[0], **config)
    for t in range(1, len(series)):
        near = eplb.plan(series[t], previous=current, tolerance=0.005, **config)
        if t < len(series) - 1:
            current = near
    layer = 14
    cap = float(eplb.plan(series[-1], **config).max_load[layer]) * 1.005
    heuristic = int(near.info["slots_changed"][layer])
    proof = prove_layer(series[-1][layer], near.topology, np.asarray(current.phy2log[layer], np.int64), cap=cap,
                        incumbent=np.asarray(near.phy2log[layer], np.int64), work=10**6)
    assert proof.proven
    assert proof.changes <= heuristic
    assert proof.changes == proof.lower_bound


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(TINY[:4]), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.1]))
def test_fixed_replica_counts_are_kept_and_never_beat_the_minimum(config, seed, tolerance):
    w, topology, previous, cap = tiny_case(config, seed, tolerance)
    expected = fewest_by_brute_force(w, previous, topology.slots_per_gpu, Fraction(cap) * Fraction(1 + 1e-12), False)
    scratch = eplb.plan(w, topology=topology).phy2log[0]
    counts = np.bincount(scratch, minlength=len(w)).astype(np.int64)
    status, row, _, _ = fewest_changes_exact(w, previous, topology.slot_offsets, cap, 0, topology.num_slots + 1,
                                             False, 10**6, counts, counts)
    if status == FOUND:
        np.testing.assert_array_equal(np.bincount(row, minlength=len(w)), counts)
        assert peak(row, w, topology.slots_per_gpu) <= Fraction(cap) * Fraction(1 + 1e-12)
        assert expected is not None and int((row != previous).sum()) >= expected
    proof = prove_layer(w, topology, previous, cap=cap, hints=(scratch,), work=10**6)
    assert proof.changes >= (topology.num_slots + 1 if expected is None else expected)

"""Fuzz of every kernel with nasty shapes and values, through the entry points that drive them.

Shapes: one layer, as many slots as experts (S == E), many slots per GPU, one GPU, one expert per
GPU, groups and nodes; values: all zero, a single hot expert, ties, tiny (1e-300) and huge (1e300)
counts. CI runs this file under ``NUMBA_BOUNDSCHECK=1`` (.ci/run), where an index outside an
array raises ``IndexError`` instead of reading or writing past it; without bounds checks the
properties still hold (a valid placement, the same answer twice, no load below the bound).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.kernels.plumbing.layout import replica_counts, slots_of_experts

from checks import assert_valid, assert_valid_arrays


@st.composite
def nasty_configs(draw):
    """A valid ``dict(num_experts, num_slots, num_gpus, num_nodes, num_groups)`` at the edges."""
    shape = draw(st.sampled_from(["one_gpu", "s_equals_e", "many_slots", "one_slot_per_gpu", "any"]))
    num_nodes = draw(st.sampled_from([1, 1, 2, 4]))
    if shape == "one_gpu":
        num_nodes, num_gpus = 1, 1
    else:
        num_gpus = num_nodes * draw(st.integers(1, 8 // num_nodes))
    num_groups = draw(st.sampled_from([None, 1, 2, 4]))
    unit = num_groups or 1
    if shape == "s_equals_e":
        k = draw(st.integers(1, 4))
        num_experts = num_gpus * k
        if num_experts % unit:
            num_groups, unit = None, 1
    elif shape == "one_slot_per_gpu":
        k = 1
        num_experts = draw(st.integers(1, num_gpus))
        if num_experts % unit:
            num_groups, unit = None, 1
    else:
        num_experts = unit * draw(st.integers(1, 24 // unit))
        min_k = -(-num_experts // num_gpus)
        top = 40 if shape == "many_slots" else min_k + 4
        k = draw(st.integers(max(min_k, 10 if shape == "many_slots" else 1), max(min_k, top)))
    return dict(num_experts=num_experts, num_slots=num_gpus * k, num_gpus=num_gpus, num_nodes=num_nodes,
                num_groups=num_groups)


@st.composite
def nasty_counts(draw, num_experts):
    """``[L, E]`` float64 counts, ``L`` in 1..3, each layer of its own kind."""
    num_layers = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(num_layers):
        kind = draw(st.sampled_from(["zeros", "one_hot", "ties", "tiny", "huge", "skewed", "mixed"]))
        if kind == "zeros":
            row = np.zeros(num_experts)
        elif kind == "one_hot":
            row = np.zeros(num_experts)
            row[rng.integers(num_experts)] = 1e6
        elif kind == "ties":
            row = rng.choice([1.0, 7.0], num_experts)
        elif kind == "tiny":
            row = rng.integers(0, 5, num_experts) * 1e-300
        elif kind == "huge":
            row = rng.random(num_experts) * 1e300
        elif kind == "skewed":
            row = np.floor(rng.pareto(0.7, num_experts) * 100)
        else:  # tiny, huge and zero in one layer
            row = rng.choice([0.0, 1e-300, 1.0, 1e300], num_experts)
        rows.append(row)
    return np.stack(rows)


@st.composite
def nasty_problems(draw):
    config = draw(nasty_configs())
    return config, draw(nasty_counts(config["num_experts"]))


def _plan(counts, config, **kwargs):
    return eplb.plan(counts, **{k: v for k, v in config.items() if k != "num_experts"}, **kwargs)


@settings(max_examples=60, deadline=None)
@given(nasty_problems(), st.sampled_from(["greedy", "balanced", "best"]))
def test_every_method_and_the_bound_on_nasty_inputs(problem, method):
    config, counts = problem
    placement = _plan(counts, config, method=method)
    assert_valid(placement, config["num_experts"])
    bound = placement.lower_bound
    assert np.all(placement.max_load >= bound * (1 - 1e-9))
    again = _plan(counts, config, method=method)
    assert np.array_equal(again.phy2log, placement.phy2log)


@settings(max_examples=40, deadline=None)
@given(nasty_problems(), st.data())
def test_migration_transfer_and_balancer_on_nasty_inputs(problem, data):
    config, counts = problem
    later = data.draw(nasty_counts(config["num_experts"]), label="later")
    later = np.resize(later, counts.shape)  # as many layers as the first counts
    first = _plan(counts, config)
    near = _plan(later, config, previous=first, max_moves=data.draw(st.sampled_from([None, 0, 1, 3])))
    assert_valid(near, config["num_experts"])
    transfer = eplb.transfer_plan(first, near)
    assert transfer.counts() is not None
    balancer = eplb.Balancer(counts.shape[0], eplb.Deployment.of(**config), window=2, min_gain=0.0, move_cost=0.0)
    for c in (counts, later):
        balancer.record(c, physical=False)  # explicit: with E == S the shape cannot tell
        balancer.should_rebalance()
        placement, _ = balancer.rebalance()
        assert_valid(placement, config["num_experts"])


@settings(max_examples=40, deadline=None)
@given(nasty_configs(), st.integers(0, 2**32 - 1))
def test_greedy_entry_point_and_layout_kernels(config, seed):
    rng = np.random.default_rng(seed)
    experts, slots = config["num_experts"], config["num_slots"]
    weight = rng.integers(0, 50, (2, experts)).astype(np.float64)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, slots, config["num_groups"] or 1,
                                                      config["num_nodes"], config["num_gpus"], method="greedy")
    assert_valid_arrays(phy2log, log2phy, logcnt, experts, slots)
    # the layout kernels on any valid phy2log, including the widest log2phy
    row = np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)])
    table = np.stack([row, rng.permutation(row)]).astype(np.int64)
    counts = replica_counts(table, experts)
    assert (counts.sum(axis=1) == slots).all()
    width = int(counts.max()) + data_extra(seed)
    l2p = slots_of_experts(table, experts, width)
    assert ((l2p >= 0).sum(axis=2) == counts).all()


def data_extra(seed: int) -> int:
    """Extra ``-1`` columns of log2phy (a caller may ask for a fixed width)."""
    return seed % 3

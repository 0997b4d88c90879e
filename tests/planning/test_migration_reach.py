"""Searches skipped where their result cannot fit the move budget (:func:`eplb.planning.move_reach.beyond_budget`):
the test never calls a budget out of reach when a placement within it exists (brute force), and
skipping changes no plan (the same plans with the test switched off), including where it skips
most layers (a DeepSeek-V3-sized decode pool at 2 slots per GPU)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import problems

import eplb
from eplb.analysis.loads import gpu_loads
from eplb.model.topology import Topology
from eplb.planning import move_reach


def brute_force_best_peak(weights, previous, topology, budget):
    """The lowest max GPU load of any placement (every expert present) that changes at most
    ``budget`` slots of ``previous [S]``."""
    num_slots, num_experts = previous.shape[0], weights.shape[0]
    best = np.inf
    for size in range(budget + 1):
        for slots in itertools.combinations(range(num_slots), size):
            choices = [[e for e in range(num_experts) if e != previous[s]] for s in slots]
            for experts in itertools.product(*choices):
                row = previous.copy()
                row[list(slots)] = experts
                if np.unique(row).size < num_experts:
                    continue
                best = min(best, float(gpu_loads(weights[None], row[None], topology).max()))
    return best


@st.composite
def small_layers(draw):
    num_gpus = draw(st.integers(1, 5))
    per_gpu = draw(st.integers(1, 2))
    num_slots = num_gpus * per_gpu
    num_experts = draw(st.integers(1, min(num_slots, 4)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    previous = rng.permutation(np.concatenate([np.arange(num_experts),
                                               rng.integers(0, num_experts, num_slots - num_experts)]))
    kind = draw(st.sampled_from(["random", "ties", "skewed", "zeros"]))
    weights = {"random": rng.random(num_experts) * 100, "ties": rng.choice([0.0, 3.0, 6.0], num_experts),
               "skewed": np.floor(rng.pareto(0.8, num_experts) * 100), "zeros": np.zeros(num_experts)}[kind]
    return weights.astype(np.float64), previous.astype(np.int64), num_gpus, per_gpu, draw(st.integers(0, 2))


@settings(max_examples=150, deadline=None)
@given(small_layers())
def test_a_budget_called_out_of_reach_is_out_of_reach(case):
    weights, previous, num_gpus, per_gpu, budget = case
    topology = Topology.uniform(num_gpus * per_gpu, num_gpus)
    best = brute_force_best_peak(weights, previous, topology, budget)
    # at the best peak reachable within the budget (and above it) the test must not call it out of reach
    for cap in (best, best * 1.5 + 1.0):
        assert not move_reach.beyond_budget(weights[None], previous[None], topology, np.array([cap]), budget)[0]


def test_a_budget_out_of_reach_is_called_so():
    """4 GPUs of one slot, 4 equal experts, a cap of half a GPU's load: one changed slot can relieve
    at most 2 GPUs (its own and the holder of the expert it copies), not 4; without a budget the
    test cannot tell."""
    topology = Topology.uniform(4, 4)
    weights, previous = np.full((1, 4), 10.0), np.arange(4, dtype=np.int64)[None]
    assert move_reach.beyond_budget(weights, previous, topology, np.array([5.0]), 1)[0]
    assert not move_reach.beyond_budget(weights, previous, topology, np.array([5.0]), 4)[0]
    assert not move_reach.beyond_budget(weights, previous, topology, np.array([10.0]), 1)[0]


def _plans(counts, config, previous, tolerance, max_moves):
    placement = eplb.plan(counts, previous=previous, tolerance=tolerance, max_moves=max_moves, **config)
    return placement.phy2log, np.asarray(placement.info["slots_changed"])


def _without_the_test(monkeypatch):
    monkeypatch.setattr(move_reach, "beyond_budget",
                        lambda weights, *args: np.zeros(weights.shape[0], bool))


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.02, None]), st.integers(0, 3))
def test_skipping_changes_no_plan(deployment, seed, tolerance, max_moves):
    config, counts = deployment
    config = {k: v for k, v in config.items() if k != "num_experts"}
    rng = np.random.default_rng(seed)
    num_experts, num_slots = counts.shape[1], config["num_slots"]
    previous = np.array([rng.permutation(np.concatenate([np.arange(num_experts),
                                                         rng.integers(0, num_experts, num_slots - num_experts)]))
                         for _ in range(counts.shape[0])], dtype=np.int64)
    with_test = _plans(counts, config, previous, tolerance, max_moves)
    with pytest.MonkeyPatch.context() as patch:
        _without_the_test(patch)
        without = _plans(counts, config, previous, tolerance, max_moves)
    np.testing.assert_array_equal(with_test[0], without[0])
    np.testing.assert_array_equal(with_test[1], without[1])


def test_a_decode_pool_at_two_slots_per_gpu_skips_most_layers_for_the_same_plan(monkeypatch):
    """288 slots on 144 GPUs, prefill loads' plan in service, decode loads to plan for, the
    Balancer's budget (2 slots per layer, tolerance 0): the relabelled fresh plan is skipped on
    most layers, and the plan is the one made without skipping."""
    from eplb.simulation.synthetic import drifting_counts

    series = drifting_counts(2, 12, 256, drift=2.0, seed=4)  # [2, L, E]: loads that moved far
    config = dict(num_slots=288, num_gpus=144)
    previous = eplb.plan(series[0], **config).phy2log
    calls = []
    real = move_reach.beyond_budget

    def counted(*args):
        hopeless = real(*args)
        calls.append(hopeless)
        return hopeless

    monkeypatch.setattr(move_reach, "beyond_budget", counted)
    with_test = _plans(series[1], config, previous, 0.0, 2)
    assert sum(int(h.sum()) for h in calls) >= series.shape[1]  # most of the 12 layers, in one search or the other
    _without_the_test(monkeypatch)
    without = _plans(series[1], config, previous, 0.0, 2)
    np.testing.assert_array_equal(with_test[0], without[0])
    np.testing.assert_array_equal(with_test[1], without[1])

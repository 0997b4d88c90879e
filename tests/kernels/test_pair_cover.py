"""The count search by bisection for GPUs of two slots (:mod:`eplb.kernels.bounds.pair_cover`): its
counts are valid (``1 .. cap`` each, ``S`` in all), its reported peak is their sorted pairing's,
it is never heavier than the move search it starts from, never below the optimum (brute force
over every replication on small instances), deterministic, and quiet on zeros, ties and one hot
expert. At DeepSeek-V3 size it is lighter than the move search on most layers."""

from __future__ import annotations

from itertools import product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import small_loads
from eplb.kernels.bounds.pair_cover import pair_cover
from eplb.kernels.bounds.pairs import pair_search
from eplb.simulation.synthetic import skewed_counts


def sorted_peak(w: np.ndarray, counts: np.ndarray) -> float:
    """The heaviest pair when the ``i``-th heaviest replica is paired with the ``i``-th lightest."""
    items = np.sort(np.repeat(w / counts, counts))
    half = len(items) // 2
    return float((items[:half] + items[::-1][:half]).max())


def optimum(w: np.ndarray, num_gpus: int, cap: int) -> float:
    """The lightest sorted pairing over every replication (``1 .. cap`` replicas, ``2 G`` in all)."""
    best = np.inf
    extra = 2 * num_gpus - len(w)
    for add in product(range(extra + 1), repeat=len(w)):
        counts = 1 + np.array(add)
        if counts.sum() == 2 * num_gpus and counts.max() <= cap:
            best = min(best, sorted_peak(w, counts))
    return best


@st.composite
def two_slot_rows(draw):
    """1-3 layers of small integer loads (zeros, ties, one hot expert...), decreasing, on ``G`` GPUs
    of two slots, with a replica cap."""
    num_experts = draw(st.integers(2, 6))
    num_gpus = draw(st.integers(max(1, (num_experts + 1) // 2), num_experts + 2))
    layers = draw(st.integers(1, 3))
    rows = [-np.sort(-small_loads(draw, num_experts, 50, 5)) for _ in range(layers)]
    cap = draw(st.integers(-(-2 * num_gpus // num_experts), 2 * num_gpus))
    return np.ascontiguousarray(rows, dtype=np.float64), num_gpus, cap


def searched(desc: np.ndarray, num_gpus: int, cap: int, steps: int):
    counts, peaks = pair_search(desc, 2 * num_gpus, cap, 256, 6)
    return (counts, peaks), pair_cover(desc, 2 * num_gpus, cap, counts, peaks, steps)


@settings(max_examples=200, deadline=None)
@given(two_slot_rows(), st.integers(0, 20))
def test_counts_are_valid_never_heavier_than_the_search_and_never_below_the_optimum(instance, steps):
    desc, num_gpus, cap = instance
    assert_valid_and_never_heavier(desc, num_gpus, cap, *searched(desc, num_gpus, cap, steps))


def assert_valid_and_never_heavier(desc, num_gpus, cap, start, found):
    """``found = (counts [L, E], peaks [L])`` from ``start`` (the same): valid counts (``1 .. cap``,
    ``2 G`` in all), peaks their sorted pairing's, never heavier than the start and strictly lighter
    where the counts changed, and never below the brute-force optimum on small instances."""
    (old_counts, old_peaks), (counts, peaks) = start, found
    assert counts.dtype == np.int64 and counts.shape == desc.shape
    assert (counts >= 1).all() and (counts <= cap).all() and (counts.sum(axis=1) == 2 * num_gpus).all()
    for layer in range(len(desc)):
        assert peaks[layer] <= old_peaks[layer]
        if not np.array_equal(counts[layer], old_counts[layer]):
            assert peaks[layer] < old_peaks[layer]
        assert np.isclose(peaks[layer], sorted_peak(desc[layer], counts[layer]), rtol=1e-12, atol=0)
        if desc.shape[1] <= 5 and num_gpus <= 5:
            assert peaks[layer] >= optimum(desc[layer], num_gpus, cap) * (1 - 1e-12)


@settings(max_examples=50, deadline=None)
@given(two_slot_rows())
def test_the_search_is_deterministic_and_leaves_its_inputs_alone(instance):
    desc, num_gpus, cap = instance
    counts, peaks = pair_search(desc, 2 * num_gpus, cap, 256, 6)
    kept = (desc.copy(), counts.copy(), peaks.copy())
    first = pair_cover(desc, 2 * num_gpus, cap, counts, peaks, 12)
    second = pair_cover(desc.copy(), 2 * num_gpus, cap, counts.copy(), peaks.copy(), 12)
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert all(np.array_equal(a, b) for a, b in zip(kept, (desc, counts, peaks)))


def test_nasty_rows_all_zero_one_hot_expert_and_ties():
    desc = np.array([[0.0] * 6, [600.0, 1, 1, 1, 1, 0], [5.0] * 6, [9.0, 9, 9, 3, 3, 3]])
    for num_gpus, cap in ((3, 3), (5, 5), (5, 10), (6, 2)):
        (_, old_peaks), (counts, peaks) = searched(desc, num_gpus, cap, 16)
        assert (counts.sum(axis=1) == 2 * num_gpus).all() and counts.min() >= 1 and counts.max() <= cap
        assert (peaks <= old_peaks).all() and peaks[0] == 0.0
        for layer in range(len(desc)):
            assert peaks[layer] >= optimum(desc[layer], num_gpus, cap) * (1 - 1e-12)


def test_at_deepseek_size_the_bisection_pairs_lighter_than_the_move_search():
    """512 slots on 256 GPUs, lognormal DeepSeek-V3-sized loads: where the moves stall about 4%
    above the average pair, the bisection gets within about 2%."""
    counts = np.asarray(skewed_counts(8, 256, family="lognormal", skew=0.7, num_groups=8, seed=1), float)
    desc = np.ascontiguousarray(-np.sort(-counts, axis=1))
    (_, old_peaks), (_, peaks) = searched(desc, 256, 256, 6)
    average = desc.sum(axis=1) / 256
    assert (peaks <= old_peaks).all() and (peaks < old_peaks).sum() >= 6
    assert np.mean(peaks / average) - 1 < 0.6 * (np.mean(old_peaks / average) - 1)


def test_the_pairing_step_with_the_bisection_is_never_heavier_than_without_it():
    """``keep_lighter`` at two slots a GPU (step 9 of the default, ``best``'s last step) with the
    bisection after the move search, against the move search alone, from the same plan: never
    heavier on a layer, lighter on most, and no expert twice on a GPU."""
    import eplb
    from eplb.analysis.loads import slot_order_peaks
    from eplb.planning.methods.exact_pairs import DEFAULT_PAIR_DONORS, keep_lighter
    from eplb.planning.spread import avoidable_doubled

    counts = np.asarray(skewed_counts(6, 256, family="zipf", skew=0.5, seed=3), float)
    deployment = eplb.Deployment.of(256, num_slots=512, num_gpus=256)
    start = eplb.plan(counts, deployment, method="greedy").phy2log
    old, _ = keep_lighter(counts, deployment, start, DEFAULT_PAIR_DONORS, slots=(2,), steps=0)
    new, _ = keep_lighter(counts, deployment, start, DEFAULT_PAIR_DONORS, slots=(2,), steps=3)
    old_peaks = slot_order_peaks(counts, old, deployment.topology)
    new_peaks = slot_order_peaks(counts, new, deployment.topology)
    assert (new_peaks <= old_peaks).all() and (new_peaks < old_peaks).sum() >= 4
    assert avoidable_doubled(new, deployment).sum() == 0

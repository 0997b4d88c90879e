"""The count search from the weighting bound's prices for GPUs of two slots
(:mod:`eplb.kernels.bounds.pair_starts`): its counts are valid (``1 .. cap`` each, ``S`` in all),
its reported peak is their sorted pairing's, it is never heavier than the counts it starts from and
never below the optimum (brute force over every replication on small instances), deterministic,
and quiet on zeros, ties and one hot expert. On DeepSeek-decode-sized layers (288 slots on 144 GPUs)
it pairs lighter than the move search, and ``method="best"`` with it is never heavier than without."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from test_pair_cover import assert_valid_and_never_heavier, optimum, two_slot_rows
from eplb.kernels.bounds.pair_starts import price_search
from eplb.kernels.bounds.pairs import pair_search
from eplb.simulation.synthetic import skewed_counts

FRACTIONS = np.array([0.5, 0.85])


def searched(desc: np.ndarray, num_gpus: int, cap: int, lower: np.ndarray, fractions=FRACTIONS, every: int = 40):
    """The move search's counts, and the price search from them (400 ascent steps a target)."""
    counts, peaks = pair_search(desc, 2 * num_gpus, cap, 256, 6)
    return (counts, peaks), price_search(desc, counts, peaks, lower, 2 * num_gpus, cap, fractions,
                                         (400, 10.0, every), 256, 6)


@settings(max_examples=200, deadline=None)
@given(two_slot_rows(), st.sampled_from([1, 7, 40]), st.sampled_from([(0.5,), (0.1, 0.5, 0.9), (0.0, 1.0)]))
def test_counts_are_valid_never_heavier_than_the_start_and_never_below_the_optimum(instance, every, fractions):
    desc, num_gpus, cap = instance
    lower = np.ascontiguousarray(desc.sum(axis=1) / num_gpus)  # the average pair: a valid lower bound
    found = searched(desc, num_gpus, cap, lower, np.array(fractions), every)
    assert_valid_and_never_heavier(desc, num_gpus, cap, *found)


@settings(max_examples=50, deadline=None)
@given(two_slot_rows())
def test_the_search_is_deterministic_and_leaves_its_inputs_alone(instance):
    desc, num_gpus, cap = instance
    counts, peaks = pair_search(desc, 2 * num_gpus, cap, 256, 6)
    lower = np.zeros(len(desc))
    kept = (desc.copy(), counts.copy(), peaks.copy(), lower.copy())
    first = price_search(desc, counts, peaks, lower, 2 * num_gpus, cap, FRACTIONS, (400, 10.0, 40), 256, 6)
    second = price_search(desc.copy(), counts.copy(), peaks.copy(), lower.copy(), 2 * num_gpus, cap, FRACTIONS,
                          (400, 10.0, 40), 256, 6)
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert all(np.array_equal(a, b) for a, b in zip(kept, (desc, counts, peaks, lower)))


def test_nasty_rows_all_zero_one_hot_expert_and_ties():
    desc = np.array([[0.0] * 6, [600.0, 1, 1, 1, 1, 0], [5.0] * 6, [9.0, 9, 9, 3, 3, 3]])
    for num_gpus, cap in ((3, 3), (5, 5), (5, 10), (6, 2)):
        lower = np.ascontiguousarray(desc.sum(axis=1) / num_gpus)
        (_, old_peaks), (counts, peaks) = searched(desc, num_gpus, cap, lower, every=1)
        assert (counts.sum(axis=1) == 2 * num_gpus).all() and counts.min() >= 1 and counts.max() <= cap
        assert (peaks <= old_peaks).all() and peaks[0] == 0.0
        for layer in range(len(desc)):
            assert peaks[layer] >= optimum(desc[layer], num_gpus, cap) * (1 - 1e-12)


def test_at_deepseek_decode_size_the_prices_pair_lighter_than_the_move_search():
    """288 slots on 144 GPUs, Zipf 0.5 DeepSeek-V3-sized loads: where the single moves stall (a
    lighter replication is several moves away), the prices' starts find it on most layers."""
    from eplb.analysis.bounds import average_bound
    import eplb

    counts = np.asarray(skewed_counts(8, 256, family="zipf", skew=0.5, seed=3), float)
    desc = np.ascontiguousarray(-np.sort(-counts, axis=1))
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    lower = np.ascontiguousarray(average_bound(counts, deployment.topology))
    bound = eplb.lower_bound(counts, deployment)
    (_, old_peaks), (_, peaks) = searched(desc, 144, 144, np.maximum(lower, bound))
    assert (peaks <= old_peaks).all() and (peaks < old_peaks).sum() >= 4
    assert np.mean(peaks / bound) - 1 < 0.8 * (np.mean(old_peaks / bound) - 1)


def test_best_with_the_price_search_is_never_heavier_than_without_and_keeps_the_spread_rule():
    """``keep_lighter`` at two slots a GPU (``best``'s last step) with and without the price search,
    from the same plan: never heavier on a layer, lighter on some, and no expert twice on a GPU."""
    import eplb
    from eplb.analysis.loads import slot_order_peaks
    from eplb.planning.methods.exact_pairs import keep_lighter
    from eplb.planning.spread import avoidable_doubled

    counts = np.asarray(skewed_counts(6, 256, family="zipf", skew=0.5, seed=3), float)
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    start = eplb.plan(counts, deployment).phy2log
    old, _ = keep_lighter(counts, deployment, start, prices=False)
    new, _ = keep_lighter(counts, deployment, start, prices=True)
    old_peaks = slot_order_peaks(counts, old, deployment.topology)
    new_peaks = slot_order_peaks(counts, new, deployment.topology)
    assert (new_peaks <= old_peaks).all() and (new_peaks < old_peaks).sum() >= 2
    assert avoidable_doubled(new, deployment).sum() == 0

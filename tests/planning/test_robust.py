"""The expected-peak search for uniform split (:mod:`eplb.planning.robust`): valid placements, never worse
than the start on the windows, deterministic, experts stay on their node, and a case where the
plan of the summed counts is provably not the best for the windows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.planning.api import make_deployment
from eplb.planning.methods import get_method
from eplb.planning.objectives import window_peaks
from eplb.planning.robust import improve_expected_peak
from eplb.model.topology import Topology

from strategies import configs


@st.composite
def series_for(draw, num_experts):
    """``[T, L, E]`` float64: skewed windows whose hot experts differ, with empty experts, an
    all-zero (dense) layer and all-zero windows now and then."""
    num_windows = draw(st.integers(1, 4))
    num_layers = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    series = np.floor(rng.lognormal(0.0, draw(st.sampled_from([0.3, 1.0, 2.0])),
                                    (num_windows, num_layers, num_experts)) * 100)
    series *= rng.random(series.shape) > draw(st.sampled_from([0.0, 0.3]))
    if draw(st.booleans()):
        series[:, rng.integers(num_layers)] = 0.0
    if num_windows > 1 and draw(st.booleans()):
        series[rng.integers(num_windows)] = 0.0
    return series


def _multiplicity(phy2log, topology, num_experts):
    """``[L, G, E]`` replicas of each expert on each GPU."""
    out = np.zeros((phy2log.shape[0], topology.num_gpus, num_experts), np.int64)
    for layer in range(phy2log.shape[0]):
        np.add.at(out[layer], (topology.gpu_of_slot, phy2log[layer]), 1)
    return out


def _check_valid(phy2log, start, deployment, num_experts):
    """Same shape, every expert has a replica, no new second replica on a GPU, and every expert stays
    inside the nodes it started on when groups must stay on their node."""
    assert phy2log.shape == start.shape and phy2log.dtype == np.int64
    assert phy2log.min() >= 0 and phy2log.max() < num_experts
    topology = deployment.topology
    after = _multiplicity(phy2log, topology, num_experts)
    before = _multiplicity(start, topology, num_experts)
    assert (after.sum(axis=1) >= 1).all()
    assert (after <= np.maximum(before, 1)).all()
    if deployment.hierarchical:
        node = topology.node_of_gpu[topology.gpu_of_slot]
        for layer in range(start.shape[0]):
            for e in range(num_experts):
                assert set(node[phy2log[layer] == e]) <= set(node[start[layer] == e])


def _objective(series, phy2log, deployment, weights=None):
    """``[L]`` weighted mean over windows with tokens of the uniform-split ``peak / mean``."""
    peaks = window_peaks(series, phy2log, deployment.topology, "uniform")
    weights = np.ones(series.shape[0]) if weights is None else weights
    live = (series.sum(axis=-1) > 0) * weights[:, None]  # [T, L]
    total = live.sum(axis=0)
    return np.divide((live * peaks).sum(axis=0), total, out=np.ones(series.shape[1]), where=total > 0)


def draw_case(data):
    """A drawn deployment, a series ``[T, L, E]`` for it and the default method's plan of its sum:
    ``(problem, series, start [L, S])``."""
    config = data.draw(configs(max_experts=16, max_gpus=8, max_slots_per_gpu=4))
    num_experts = config.pop("num_experts")
    deployment = make_deployment(num_experts, **config)
    series = data.draw(series_for(num_experts))
    return deployment, series, get_method("balanced")(series.sum(axis=0), deployment)[0]


@given(st.data())
def test_search_is_valid_never_worse_and_deterministic(data):
    deployment, series, start = draw_case(data)
    num_experts = series.shape[-1]
    iterations = data.draw(st.sampled_from([0, 50, 400]))
    swaps = data.draw(st.sampled_from([0, 3, 40]))
    replica_moves = data.draw(st.booleans())
    kept = (series.copy(), start.copy())
    phy2log, (before, after) = improve_expected_peak(series, start, deployment, swaps=swaps, iterations=iterations,
                                                     replica_moves=replica_moves, anchor=0.0, folds=0)
    np.testing.assert_array_equal(series, kept[0])
    np.testing.assert_array_equal(start, kept[1])
    _check_valid(phy2log, start, deployment, num_experts)
    if not replica_moves:  # swaps only: the replica counts do not change
        for layer in range(start.shape[0]):
            np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=num_experts),
                                          np.bincount(start[layer], minlength=num_experts))
    # never worse than the start on the windows, and the reported objective is the real one
    np.testing.assert_allclose(before, _objective(series, start, deployment), rtol=1e-9)
    np.testing.assert_allclose(after, _objective(series, phy2log, deployment), rtol=1e-9)
    assert (after <= before * (1 + 1e-12)).all()
    if iterations == 0 and swaps == 0:
        np.testing.assert_array_equal(phy2log, start)
    again, _ = improve_expected_peak(series.copy(), start.copy(), deployment, swaps=swaps, iterations=iterations,
                                     replica_moves=replica_moves, anchor=0.0, folds=0)
    np.testing.assert_array_equal(phy2log, again)
    # with the cross-validation check: per layer the start, or some steps of the search (valid, never worse)
    checked, (checked_before, checked_after) = improve_expected_peak(
        series, start, deployment, swaps=swaps, iterations=iterations, replica_moves=replica_moves, anchor=0.0, folds=3)
    _check_valid(checked, start, deployment, num_experts)
    np.testing.assert_array_equal(checked_before, before)
    np.testing.assert_allclose(checked_after, _objective(series, checked, deployment), rtol=1e-9)
    assert (checked_after <= before * (1 + 1e-12)).all()
    kept = (checked == start).all(axis=1)
    np.testing.assert_allclose(checked_after[kept], before[kept], rtol=1e-12)


@given(st.integers(0, 10**6), st.sampled_from([(16, 24, 4, 2, 4), (32, 40, 8, 2, 8), (32, 48, 8, 4, 8),
                                               (16, 32, 8, 4, 4)]))
def test_experts_stay_on_their_node_when_hierarchical(seed, config):
    num_experts, num_slots, num_gpus, num_nodes, num_groups = config
    deployment = make_deployment(num_experts, num_slots, num_gpus, num_nodes, num_groups)
    assert deployment.hierarchical
    rng = np.random.default_rng(seed)
    series = rng.lognormal(0.0, 1.0, (5, 2, num_experts)) * 100
    start = get_method("balanced")(series.sum(axis=0), deployment)[0]
    phy2log, (before, after) = improve_expected_peak(series, start, deployment, iterations=2000, folds=0)
    _check_valid(phy2log, start, deployment, num_experts)
    assert (after <= before * (1 + 1e-12)).all()


def test_the_anchored_search_never_worsens_its_objective_with_the_summed_window():
    rng = np.random.default_rng(3)
    series = rng.lognormal(0.0, 1.0, (4, 3, 24)) * 100
    deployment = make_deployment(24, 32, 8)
    start = get_method("balanced")(series.sum(axis=0), deployment)[0]
    phy2log, (before, after) = improve_expected_peak(series, start, deployment, iterations=3000, anchor=2.0, folds=0)
    with_sum = np.concatenate([series, series.sum(axis=0)[None]])
    weights = np.array([1.0, 1.0, 1.0, 1.0, 8.0])
    np.testing.assert_allclose(before, _objective(with_sum, start, deployment, weights), rtol=1e-9)
    np.testing.assert_allclose(after, _objective(with_sum, phy2log, deployment, weights), rtol=1e-9)
    assert (after <= before).all() and (after < before).any()


def test_two_windows_with_different_hot_experts():
    """Two GPUs of three slots, four experts. Window 1 sends 6 tokens to expert 0, window 2 to
    expert 1; both send 3 to experts 2 and 3. The start (GPU 0: experts 0, 2, 3; GPU 1: 1, 2, 3)
    balances the summed counts exactly, yet each window puts 9 of its 12 tokens on one GPU (peak
    / mean 1.5). Replicating the experts that take turns being hot (GPU 0: 0, 1, 2; GPU 1: 0, 1,
    3) balances both windows exactly: the search gets there."""
    deployment = make_deployment(4, 6, 2)
    series = np.array([[[6.0, 0.0, 3.0, 3.0]], [[0.0, 6.0, 3.0, 3.0]]])
    start = np.array([[0, 2, 3, 1, 2, 3]])
    assert window_peaks(series.sum(axis=0)[None], start, deployment.topology)[0, 0] == pytest.approx(1.0)
    assert window_peaks(series, start, deployment.topology)[:, 0] == pytest.approx([1.5, 1.5])
    for anchor in (0.0, 1.0):
        phy2log, (before, after) = improve_expected_peak(series, start, deployment, iterations=200, anchor=anchor,
                                                         folds=0)
        assert window_peaks(series, phy2log, deployment.topology)[:, 0] == pytest.approx([1.0, 1.0])
        assert window_peaks(series.sum(axis=0)[None], phy2log, deployment.topology)[0, 0] == pytest.approx(1.0)
        assert sorted(phy2log[0, :3]) == [0, 1, 2] or sorted(phy2log[0, :3]) == [0, 1, 3]
        assert after[0] == pytest.approx(1.0) and before[0] > after[0]
    # swaps alone cannot: the replica counts of the start are the wrong ones
    _, (_, swapped) = improve_expected_peak(series, start, deployment, iterations=200, replica_moves=False, anchor=0.0,
                                              folds=0)
    assert swapped[0] == pytest.approx(1.5)


def test_the_check_keeps_a_search_that_serves_unseen_windows():
    """Eight windows take turns sending most tokens to expert 0 or expert 1: every fold of the
    cross-validation sees both, so the search that replicates both serves the held-out windows
    better than the start, which balances only the summed counts."""
    deployment = make_deployment(4, 6, 2)
    # 120 tokens a window: 12 would be too few to tell the turns from sampling noise
    hot = 10.0 * np.array([[6.0, 0.0, 3.0, 3.0], [0.0, 6.0, 3.0, 3.0]])
    series = hot[np.arange(8) % 2][:, None, :]
    start = np.array([[0, 2, 3, 1, 2, 3]])
    phy2log, (before, after) = improve_expected_peak(series, start, deployment, iterations=200, folds=4)
    assert window_peaks(series, phy2log, deployment.topology)[:, 0] == pytest.approx(np.ones(8))
    assert after[0] < before[0]


def test_a_window_of_weight_zero_changes_nothing():
    rng = np.random.default_rng(5)
    series = rng.lognormal(0.0, 1.0, (3, 2, 16)) * 100
    deployment = make_deployment(16, 24, 4)
    start = get_method("balanced")(series.sum(axis=0), deployment)[0]
    plain, _ = improve_expected_peak(series, start, deployment, iterations=500, folds=0)
    extra = np.concatenate([series, rng.lognormal(0.0, 3.0, (1, 2, 16))])
    weighted, _ = improve_expected_peak(extra, start, deployment, window_weights=[1.0, 1.0, 1.0, 0.0], iterations=500,
                                        folds=0)
    np.testing.assert_array_equal(plain, weighted)


def test_uneven_and_masked_gpus():
    topology = Topology(np.array([3, 0, 5, 4, 4]))
    deployment = make_deployment(12, topology=topology)
    rng = np.random.default_rng(8)
    series = rng.lognormal(0.0, 1.0, (4, 2, 12)) * 100
    start = get_method("balanced")(series.sum(axis=0), deployment)[0]
    phy2log, (before, after) = improve_expected_peak(series, start, deployment, iterations=1000, anchor=0.0, folds=0)
    _check_valid(phy2log, start, deployment, 12)
    assert (after <= before).all()
    np.testing.assert_allclose(after, _objective(series, phy2log, deployment), rtol=1e-9)


def test_bad_input_raises_value_errors():
    deployment = make_deployment(8, 12, 4)
    series = np.ones((2, 1, 8))
    start = get_method("balanced")(series.sum(axis=0), deployment)[0]
    bad = [
        dict(series=-series),
        dict(series=np.ones((2, 1, 1, 8))),
        dict(phy2log=start[:, :10]),
        dict(phy2log=np.zeros_like(start)),  # experts without a slot
        dict(phy2log=start + 8),
        dict(phy2log=start.astype(float)),
        dict(window_weights=[1.0]),
        dict(window_weights=[-1.0, 1.0]),
        dict(iterations=-1),
        dict(iterations=1.5),
        dict(seed=0),
        dict(anchor=-1.0),
        dict(anchor=float("nan")),
        dict(folds=-1),
    ]
    for change in bad:
        args = dict(series=series, phy2log=start, window_weights=None)
        options = {k: v for k, v in change.items() if k not in args}
        args.update({k: v for k, v in change.items() if k in args})
        with pytest.raises(ValueError):
            improve_expected_peak(args["series"], args["phy2log"], deployment, args["window_weights"], **options)


def test_a_layer_searched_after_one_with_more_active_windows_is_still_searched():
    """The pair search bounds a swap's objective by the pair's outside loads summed over the layer's
    own active windows: a layer searched after one with more active windows (here 3 of 8 windows
    route tokens in it) must not count the earlier layer's windows. That stale sum once made the
    search refuse nearly every swap of such a layer."""
    from eplb.kernels.split.expected_peak import InService, pair_descent
    from eplb.simulation.synthetic import drifting_counts

    base = drifting_counts(8, 3, 32, drift=0.5, tokens=2048, seed=1).astype(np.float64)
    second = base[:, 2].copy()
    second[:5] = 0
    placement = eplb.plan(base.sum(axis=0), num_slots=40, num_gpus=8)
    fractions = 1.0 / placement.logcnt[np.arange(3)[:, None], placement.phy2log]
    topology = placement.topology
    windows = np.ascontiguousarray(np.stack([base[:, 0], second], axis=1))  # [8, 2, 32]
    _, _, before, after = pair_descent(windows, np.ones(8), np.ascontiguousarray(placement.phy2log[1:]),
                                       np.ascontiguousarray(fractions[1:]), topology.gpu_of_slot,
                                       topology.slot_offsets, np.zeros(8, np.int64), 200, 1,
                                       InService(np.zeros((2, 40), np.int64), 0.0))
    assert after[1] < before[1] - 0.05, (before, after)

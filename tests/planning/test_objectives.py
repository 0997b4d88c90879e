"""Objectives over windows: how a series combines into planning weights, and per-layer selection."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import eplb
from eplb.planning.api import make_deployment
from eplb.planning.methods import get_method
from eplb.planning.objectives import (
    CANDIDATES,
    OBJECTIVES,
    SEARCHES,
    combine,
    link_replicas,
    made_for_dispatch,
    plan_estimated,
    recency_weights,
    select_per_layer,
    window_peaks,
)
from eplb.simulation.synthetic import drifting_counts

series_strategy = arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 9)),
                         elements=st.floats(0, 1e4, allow_nan=False, allow_infinity=False))


@given(series_strategy)
def test_sum_is_todays_sum_and_estimates_keep_the_weighted_total(series):
    np.testing.assert_allclose(combine(series, "sum"), series.sum(axis=0))
    total = series.sum(axis=(0, 2))
    for objective in ("quantile", "max_share"):
        weights = combine(series, objective)
        assert weights.shape == series.shape[1:]
        assert (weights >= 0).all()
        # a layer with tokens keeps the same total to plan on; an all-zero layer stays zero
        np.testing.assert_allclose(weights.sum(axis=1), total, rtol=1e-9, atol=1e-9)


def test_max_share_and_quantile_hedge_an_expert_hot_in_one_window():
    # expert 0 is hot in one window out of ten: the sum sees it lukewarm, max_share sees it hot
    series = np.ones((10, 1, 4))
    series[3, 0, 0] = 7.0
    total = series.sum()
    shares = combine(series, "sum")[0] / total
    hedged = combine(series, "max_share")[0] / total
    assert hedged[0] > shares[0] * 1.3  # 0.48 (0.7, renormalised) against 0.35
    np.testing.assert_allclose(combine(series, "quantile", quantile=1.0), combine(series, "max_share"))
    # the 0.9 quantile of ten equal-weight windows is the 9th smallest: the outlier is not it
    np.testing.assert_allclose(combine(series, "quantile", quantile=0.9)[0], np.full(4, total / 4))


def test_window_weights_weigh_the_windows():
    series = np.array([[[10.0, 0.0]], [[0.0, 10.0]]])
    np.testing.assert_allclose(combine(series, "sum", [0.0, 1.0]), [[0.0, 10.0]])
    np.testing.assert_allclose(combine(series, "max_share", [0.0, 1.0]), [[0.0, 10.0]])
    np.testing.assert_allclose(combine(series, "quantile", [3.0, 1.0], quantile=0.5), [[40.0, 0.0]])  # weighted total 40
    weights = recency_weights(4, half_life=1.0)
    np.testing.assert_allclose(weights, [0.125, 0.25, 0.5, 1.0])


def test_selection_keeps_per_layer_the_best_candidate_on_the_windows():
    series = drifting_counts(6, 5, 32, drift=0.4, seed=2).astype(np.float64)
    deployment = make_deployment(32, 40, 8)
    method = get_method("greedy")
    for dispatch in ("uniform", "optimal"):
        for objective in ("expected_peak", "worst_window"):
            phy2log, info = plan_estimated(series, deployment, method, objective, dispatch=dispatch)
            chosen = info["candidate_of_layer"]
            assert chosen.shape == (5,) and ((0 <= chosen) & (chosen < len(CANDIDATES))).all()
            peaks = window_peaks(series, phy2log, deployment.topology, dispatch)
            value = peaks.mean(axis=0) if objective == "expected_peak" else peaks.max(axis=0)
            for name, q in CANDIDATES:
                other = method(combine(series, name, quantile=q or 0.9), deployment)[0]
                other_peaks = window_peaks(series, other, deployment.topology, dispatch)
                other_value = other_peaks.mean(axis=0) if objective == "expected_peak" else other_peaks.max(axis=0)
                assert (value <= other_value + 1e-12).all()


def test_select_per_layer_mixes_layers_from_different_candidates():
    series = np.array([[[9.0, 1, 1, 1], [1, 1, 1, 9]]])
    topology = make_deployment(4, 6, 3).topology
    spread_0 = [0, 1, 0, 2, 0, 3]  # expert 0 on every GPU: balances layer 0 ([9, 1, 1, 1])
    spread_3 = [3, 0, 3, 1, 3, 2]  # expert 3 on every GPU: balances layer 1 ([1, 1, 1, 9])
    first = [spread_0, spread_0]
    second = [spread_3, spread_3]
    for dispatch in ("uniform", "optimal"):
        phy2log, chosen, scores = select_per_layer(series, [first, second], topology, "worst_window",
                                                   dispatch=dispatch)
        np.testing.assert_array_equal(chosen, [0, 1])
        np.testing.assert_array_equal(phy2log, [spread_0, spread_3])
        np.testing.assert_allclose(scores[[0, 1], [0, 1]], 1.0)
    assert scores.shape == (2, 2)


def test_plan_estimated_is_deterministic_and_sum_matches_planning_the_sum():
    series = drifting_counts(4, 3, 16, drift=0.3, seed=5).astype(np.float64)
    deployment = make_deployment(16, 24, 4)
    method = get_method("balanced")
    for objective in OBJECTIVES:
        if objective in SEARCHES:
            continue  # a search, not an estimate (the pipeline's hedge stage)
        for dispatch in ("uniform", "optimal"):
            first, _ = plan_estimated(series, deployment, method, objective, dispatch=dispatch)
            again, _ = plan_estimated(series.copy(), deployment, method, objective, dispatch=dispatch)
            np.testing.assert_array_equal(first, again)
    summed, _ = plan_estimated(series, deployment, method, "sum")
    np.testing.assert_array_equal(summed, method(series.sum(axis=0), deployment)[0])


def _for_optimal_dispatch(series, deployment, objective, iterations):
    """The estimate-then-made-for-dispatch plan the pipeline makes for dispatch="optimal"."""
    phy2log, info = plan_estimated(series, deployment, get_method("balanced"), objective, dispatch="optimal")
    phy2log, (before, after) = made_for_dispatch(series, phy2log, deployment, iterations=iterations,
                                                 keep_replicas=True)
    return phy2log, {**info, "dispatch_objective_before": before, "dispatch_objective_after": after}


def test_made_for_dispatch_lowers_the_optimal_dispatch_peaks_and_keeps_replicas_and_nodes():
    series = drifting_counts(6, 4, 64, drift=0.3, num_groups=8, seed=4).astype(np.float64)
    for deployment in (make_deployment(64, 80, 8), make_deployment(64, 80, 8, 2, 8)):
        start = get_method("balanced")(series.sum(axis=0), deployment)[0]
        phy2log, (before, after) = made_for_dispatch(series, start, deployment, iterations=200)
        assert (after <= before).all() and (after < before - 1e-4).any()
        # the objective it reports is the optimal-dispatch one, on these windows
        np.testing.assert_allclose(window_peaks(series, phy2log, deployment.topology, "optimal").mean(axis=0), after,
                                   rtol=1e-9)
        np.testing.assert_allclose(window_peaks(series, start, deployment.topology, "optimal").mean(axis=0), before,
                                   rtol=1e-9)
        # swaps: same replica counts; in a hierarchical problem every slot keeps its expert's node
        np.testing.assert_array_equal(np.sort(phy2log, axis=1), np.sort(start, axis=1))
        if deployment.hierarchical:
            node = deployment.topology.node_of_gpu[deployment.topology.gpu_of_slot]
            for layer in range(4):
                for n in range(2):
                    np.testing.assert_array_equal(np.sort(phy2log[layer, node == n]), np.sort(start[layer, node == n]))
        again, _ = made_for_dispatch(series.copy(), start.copy(), deployment, iterations=200)
        np.testing.assert_array_equal(phy2log, again)
    placement = eplb.plan(series, num_slots=80, num_gpus=8, dispatch="optimal", objective="expected_peak")
    info = placement.info
    assert (info["dispatch_objective_after"] <= info["dispatch_objective_before"]).all()


def test_bad_input_raises_value_errors():
    series = np.ones((3, 2, 4))
    deployment = make_deployment(4, 8, 2)
    with pytest.raises(ValueError, match="objective must be one of"):
        combine(series, "median")
    with pytest.raises(ValueError, match="objective must be one of"):
        plan_estimated(series, deployment, get_method("greedy"), "median")
    with pytest.raises(ValueError, match="window_weights must have shape"):
        combine(series, "sum", [1.0, 2.0])
    with pytest.raises(ValueError, match="non-negative"):
        combine(series, "sum", [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="not all be zero"):
        combine(series, "max_share", [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="quantile must be in"):
        combine(series, "quantile", quantile=1.5)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        plan_estimated(series, deployment, get_method("greedy"), "worst_window", dispatch="random")
    with pytest.raises(ValueError, match=r"counts must have shape \[T, L, E\]"):
        plan_estimated(series[0], deployment, get_method("greedy"), "sum")
    with pytest.raises(ValueError, match="half_life"):
        recency_weights(3, 0.0)
    with pytest.raises(ValueError, match="iterations must be"):
        made_for_dispatch(series, np.array([[0, 1, 2, 3, 0, 1, 2, 3]] * 2), deployment, iterations=-1)


def test_plan_takes_objectives_window_weights_and_dispatch():
    import eplb
    from eplb.simulation.synthetic import drifting_counts

    series = drifting_counts(6, 3, 64, drift=0.2, seed=3)
    summed = eplb.plan(series, num_slots=80, num_gpus=8, objective="sum")
    np.testing.assert_array_equal(summed.phy2log, eplb.plan(series.sum(axis=0), num_slots=80, num_gpus=8).phy2log)
    assert eplb.plan(series, num_slots=80, num_gpus=8).info["objective"] == "expected_peak_search"
    weighted = eplb.plan(series, num_slots=80, num_gpus=8, objective="expected_peak",
                         window_weights=eplb.planning.objectives.recency_weights(6, 2.0))
    assert weighted.info["objective"] == "expected_peak"
    made = eplb.plan(series, num_slots=80, num_gpus=8, dispatch="optimal")
    # made for optimal dispatch: its mean optimal-dispatch peak on the windows is no worse than the summed plan's
    peak = lambda p: (p.gpu_loads(series, "optimal").max(axis=-1) / series.sum(axis=-1)).mean()  # noqa: E731
    assert peak(made) <= peak(summed) * (1 + 1e-9)
    with pytest.raises(ValueError, match="dispatch"):
        eplb.plan(series, num_slots=80, num_gpus=8, dispatch="shares")
    with pytest.raises(ValueError, match="previous"):
        eplb.plan(series, num_slots=80, num_gpus=8, objective="quantile", previous=summed)
    with pytest.raises(ValueError, match="window_weights"):
        eplb.plan(series, num_slots=80, num_gpus=8, window_weights=[1.0, 2.0])


def _check_valid(phy2log, start, deployment):
    """Every expert keeps a replica; groups stay on their node when the problem is hierarchical."""
    num_experts = int(start.max()) + 1
    counts = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
    assert phy2log.shape == start.shape and (counts >= 1).all()
    if deployment.hierarchical:
        node = deployment.topology.node_of_gpu[deployment.topology.gpu_of_slot]
        for layer in range(phy2log.shape[0]):
            for e in range(num_experts):
                np.testing.assert_array_equal(np.unique(node[phy2log[layer] == e]), np.unique(node[start[layer] == e]))


@given(st.integers(0, 10**6), st.sampled_from([(16, 20, 4, 1, None), (16, 24, 4, 2, 4), (8, 16, 4, 1, None),
                                               (8, 12, 2, 1, None), (32, 40, 8, 2, 8), (12, 36, 3, 1, None)]))
def test_linked_replicas_are_valid_rings_and_deterministic(seed, config):
    num_experts, num_slots, num_gpus, num_nodes, num_groups = config
    deployment = make_deployment(num_experts, num_slots, num_gpus, num_nodes, num_groups)
    weights = drifting_counts(1, 3, num_experts, drift=0.3, seed=seed)[0].astype(np.float64)
    weights[1] = 0.0  # a dense layer
    start = get_method("balanced")(weights, deployment)[0]
    phy2log, linked = link_replicas(weights, start, deployment)
    _check_valid(phy2log, start, deployment)
    again, _ = link_replicas(weights.copy(), start.copy(), deployment)
    np.testing.assert_array_equal(phy2log, again)
    if num_slots > 2 * num_experts:  # more redundant slots than experts: the layer keeps its plan
        assert not linked.any()
        np.testing.assert_array_equal(phy2log, start)
        return
    # a layer keeps its plan when a node holds fewer experts than redundant slots (hierarchical
    # plans may give a node few groups, and a dense layer's plan need not keep groups on one node)
    if not deployment.hierarchical:
        assert linked[[0, 2]].all()
    counts = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
    gpu = deployment.topology.gpu_of_slot
    for layer in np.nonzero(linked)[0]:
        assert counts[layer].max() <= 2 and (counts[layer] == 2).sum() == num_slots - num_experts
        # the heaviest experts (of their node, when hierarchical) hold the replicas, each pair on two GPUs
        hot = np.argsort(-weights[layer], kind="stable")[: num_slots - num_experts]
        if not deployment.hierarchical:
            assert (counts[layer, hot] == 2).all()
        for e in np.nonzero(counts[layer] == 2)[0]:
            assert len(np.unique(gpu[phy2log[layer] == e])) == 2


def test_linked_replicas_on_uneven_and_masked_gpus():
    from eplb.model.topology import Topology

    topology = Topology(np.array([3, 0, 5, 4, 4]))
    deployment = make_deployment(12, topology=topology)
    weights = drifting_counts(1, 2, 12, drift=0.3, seed=5)[0].astype(np.float64)
    start = get_method("balanced")(weights, deployment)[0]
    phy2log, linked = link_replicas(weights, start, deployment)
    assert linked.all()
    _check_valid(phy2log, start, deployment)


def test_keep_replicas_moves_only_single_replica_experts_and_never_worsens():
    series = drifting_counts(6, 3, 64, drift=0.3, num_groups=8, seed=6).astype(np.float64)
    for deployment in (make_deployment(64, 72, 8), make_deployment(64, 72, 8, 2, 8)):
        start = get_method("balanced")(series.sum(axis=0), deployment)[0]
        start, _ = link_replicas(series.sum(axis=0), start, deployment)
        phy2log, (before, after) = made_for_dispatch(series, start, deployment, iterations=200, keep_replicas=True)
        assert (after <= before).all()
        np.testing.assert_allclose(window_peaks(series, phy2log, deployment.topology, "optimal").mean(axis=0), after,
                                   rtol=1e-9)
        _check_valid(phy2log, start, deployment)
        for layer in range(3):
            counts = np.bincount(start[layer], minlength=64)
            replicated = counts[start[layer]] > 1
            np.testing.assert_array_equal(phy2log[layer, replicated], start[layer, replicated])
        again, _ = made_for_dispatch(series.copy(), start.copy(), deployment, iterations=200, keep_replicas=True)
        np.testing.assert_array_equal(phy2log, again)


def test_plan_for_optimal_dispatch_links_replicas():
    series = drifting_counts(5, 3, 64, drift=0.3, num_groups=8, seed=7).astype(np.float64)
    for deployment in (make_deployment(64, 80, 8), make_deployment(64, 80, 8, 2, 8)):
        for objective in ("sum", "expected_peak"):
            phy2log, info = _for_optimal_dispatch(series, deployment, objective, iterations=100)
            start = get_method("balanced")(series.sum(axis=0), deployment)[0]
            _check_valid(phy2log, start, deployment)
            assert (info["dispatch_objective_after"] <= info["dispatch_objective_before"]).all()
            assert info["linked"].shape == (3,) and info["linked"].dtype == bool
            counts = np.stack([np.bincount(row, minlength=64) for row in phy2log])
            assert (counts[info["linked"]] <= 2).all()

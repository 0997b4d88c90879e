"""Metrics: loads, balancedness, imbalance, gap, wasted replicas, moves."""

import numpy as np
import pytest
from hypothesis import given
from strategies import problems

import eplb
from eplb.analysis import metrics
from eplb.analysis.loads import gpu_loads
from eplb.model.topology import Topology


def test_gpu_loads_by_hand():
    topology = Topology.uniform(4, 2)
    phy2log = np.array([[0, 1, 0, 2]])  # GPU 0: experts 0, 1; GPU 1: experts 0, 2
    logcnt = np.array([[2, 1, 1]])
    counts = np.array([[10.0, 3.0, 4.0]])
    loads = gpu_loads(counts, phy2log, topology, logcnt=logcnt)
    np.testing.assert_allclose(loads, [[8.0, 9.0]])
    np.testing.assert_allclose(metrics.balancedness(loads), [8.5 / 9.0])
    np.testing.assert_allclose(metrics.imbalance(loads), [(9.0 - 8.5) / 8.5])
    assert metrics.replicas_sharing_a_gpu(phy2log, topology).tolist() == [0]
    series = np.stack([counts, 2 * counts])
    np.testing.assert_allclose(gpu_loads(series, phy2log, topology, logcnt=logcnt), [[[8.0, 9.0]], [[16.0, 18.0]]])
    np.testing.assert_allclose(metrics.mean_peak(gpu_loads(series, phy2log, topology, logcnt=logcnt)), [13.5])


def test_uneven_topology_sums_each_gpus_own_slots():
    topology = Topology(np.array([3, 0, 1]))
    phy2log = np.array([[0, 1, 2, 3]])
    loads = gpu_loads(np.array([[1.0, 2.0, 4.0, 8.0]]), phy2log, topology, logcnt=np.ones((1, 4), np.int64))
    np.testing.assert_allclose(loads, [[7.0, 0.0, 8.0]])


def test_zero_load_is_perfectly_balanced_and_has_no_gap():
    assert metrics.balancedness(np.zeros((2, 4))).tolist() == [1.0, 1.0]
    assert metrics.imbalance(np.zeros((1, 4))).tolist() == [0.0]
    assert metrics.gap(np.array([0.0, 2.0]), np.array([0.0, 1.0])).tolist() == [0.0, 1.0]


def test_static_loads_spread_experts_in_order():
    loads = metrics.static_gpu_loads(np.arange(8.0)[None], 4)
    np.testing.assert_allclose(loads, [[1.0, 5.0, 9.0, 13.0]])


def test_shared_gpu_replicas_are_counted():
    topology = Topology.uniform(4, 2)
    assert metrics.replicas_sharing_a_gpu(np.array([[0, 0, 1, 2], [0, 1, 2, 0]]), topology).tolist() == [1, 0]


def test_moves_count_slots_copies_and_cross_node_copies():
    topology = Topology.uniform(4, 4, num_nodes=2)  # one slot per GPU; GPUs 0,1 on node 0
    a = np.array([[0, 1, 2, 3]])
    assert metrics.moves(a, a, topology).slots_changed == 0
    swap_in_node = metrics.moves(a, np.array([[1, 0, 2, 3]]), topology)
    assert (swap_in_node.slots_changed, swap_in_node.gpu_copies, swap_in_node.cross_node_copies) == (2, 2, 0)
    swap_across = metrics.moves(a, np.array([[2, 1, 0, 3]]), topology)
    assert (swap_across.slots_changed, swap_across.gpu_copies, swap_across.cross_node_copies) == (2, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        metrics.moves(a, np.array([[0, 1]]), topology)


@given(problems())
def test_loads_conserve_tokens_and_balancedness_is_a_fraction(deployment):
    config, counts = deployment
    placement = eplb.plan(counts, method="greedy", **{k: v for k, v in config.items() if k != "num_experts"})
    loads = placement.gpu_loads(counts)
    np.testing.assert_allclose(loads.sum(axis=1), counts.sum(axis=1), rtol=1e-9)
    b = placement.balancedness(counts)
    assert ((b > 0) & (b <= 1.0 + 1e-12)).all()


def test_masked_gpus_do_not_count_in_balancedness_or_imbalance():
    topology = Topology.from_layout(76, 8, 2, masked_gpus=(3,))  # 7 GPUs hold 11, 11, 11, 11, 11, 11, 10 slots
    phy2log = np.arange(76)[None]
    counts = np.ones((1, 76))
    counts[0, topology.slot_offsets[7]:] = 1.1  # the 10-slot GPU's experts: every GPU carries 11
    loads = gpu_loads(counts, phy2log, topology, logcnt=np.ones((1, 76), np.int64))
    assert loads[0, 3] == 0.0
    np.testing.assert_allclose(metrics.balancedness(loads, topology), [1.0])
    np.testing.assert_allclose(metrics.imbalance(loads, topology), [0.0], atol=1e-12)
    np.testing.assert_allclose(metrics.mean_balancedness(loads, topology), 1.0)
    with pytest.raises(ValueError, match="one column per GPU"):
        metrics.balancedness(loads[:, :7], topology)


def test_dense_layers_do_not_count_in_means_over_layers():
    loads = np.array([[3.0, 1.0], [0.0, 0.0], [2.0, 2.0]])  # layer 1 is dense
    assert metrics.moe_layers(loads).tolist() == [True, False, True]
    assert metrics.balancedness(loads).tolist() == [2.0 / 3.0, 1.0, 1.0]  # per layer: unchanged
    np.testing.assert_allclose(metrics.mean_balancedness(loads), (2.0 / 3.0 + 1.0) / 2)
    np.testing.assert_allclose(metrics.moe_mean(metrics.imbalance(loads), loads), 0.25)
    series = np.stack([loads, np.zeros_like(loads)])  # the second window records nothing
    means = metrics.mean_balancedness(series)
    assert means.shape == (2,) and np.isclose(means[0], 5.0 / 6.0) and np.isnan(means[1])
    with pytest.raises(ValueError, match="per_layer"):
        metrics.moe_mean(np.ones(2), loads)


def test_loads_of_denormal_counts_are_exact():
    tiny = np.finfo(np.float64).smallest_subnormal
    topology = Topology.uniform(6, 2)
    phy2log = np.array([[0, 0, 0, 1, 1, 1]])  # each GPU holds all 3 replicas of one expert
    counts = np.array([[tiny, 2 * tiny]])  # a third of either is below the smallest denormal
    loads = gpu_loads(counts, phy2log, topology, logcnt=np.array([[3, 3]]))
    assert loads.tolist() == [[tiny, 2 * tiny]]
    assert metrics.balancedness(loads).tolist() == [0.75]


def test_balancedness_of_huge_loads_is_finite():
    topology = Topology.uniform(8, 4)
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 0, 1]])
    logcnt = np.array([[2, 2, 1, 1, 1, 1]])
    base = np.array([[8.0, 6.0, 3.0, 3.0, 2.0, 2.0]])  # GPU loads 7, 6, 4, 7
    loads = gpu_loads(base * 2e307, phy2log, topology, logcnt=logcnt)  # each GPU finite, their sum is not
    assert np.isfinite(loads).all()
    np.testing.assert_allclose(metrics.balancedness(loads), [24.0 / 28.0], rtol=1e-15)
    np.testing.assert_allclose(metrics.imbalance(loads), [4.0 / 24.0], rtol=1e-14)


def test_gap_clamps_rounding_only_never_a_bound_error():
    tiny = np.finfo(np.float64).smallest_subnormal
    assert metrics.gap(np.array([1.0 - 1e-15]), np.array([1.0])).tolist() == [0.0]
    assert metrics.gap(np.array([10 * tiny]), np.array([11 * tiny])).tolist() == [0.0]
    assert metrics.gap(np.array([0.999]), np.array([1.0]))[0] < -1e-4  # a bound above the load stays visible


def test_a_perfect_plan_with_a_masked_gpu_reports_perfect_balance():
    topology = Topology.from_layout(70, 8, 2, masked_gpus=(3,))  # 7 GPUs of 10 slots
    counts = np.ones((1, 70))
    placement = eplb.plan(counts, topology=topology)
    loads = placement.gpu_loads(counts)
    assert loads[0, 3] == 0 and np.ptp(np.delete(loads[0], 3)) == 0
    np.testing.assert_allclose(placement.balancedness(counts), [1.0])
    np.testing.assert_allclose(metrics.imbalance(loads, placement.topology), [0.0], atol=1e-15)

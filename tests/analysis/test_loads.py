"""The one load function (eplb/analysis/loads.py): per slot under a split, then per GPU and node,
and the callers that go through it give the same numbers bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb.analysis import loads
from eplb.kernels.plumbing.layout import replica_counts


def small():
    topology = eplb.Topology.uniform(8, 4, 2)
    phy2log = np.array([[0, 1, 2, 0, 3, 4, 5, 0]], np.int64)  # expert 0 on three GPUs
    counts = np.array([[6.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    return topology, phy2log, counts


def test_slot_gpu_and_node_loads_under_both_splits():
    topology, phy2log, counts = small()
    logcnt = replica_counts(phy2log, 6)
    even = loads.slot_loads(counts, phy2log, logcnt=logcnt)
    np.testing.assert_array_equal(even, [[2.0, 1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 2.0]])
    gpu = loads.gpu_loads(counts, phy2log, topology)
    np.testing.assert_array_equal(gpu, [[3.0, 4.0, 7.0, 7.0]])
    np.testing.assert_array_equal(loads.node_loads(gpu, topology), [[7.0, 14.0]])
    shares = np.array([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]])  # expert 0 served by slot 0 only
    np.testing.assert_array_equal(loads.slot_loads(counts, phy2log, shares=shares), [[6, 1, 2, 0, 3, 4, 5, 0]])
    np.testing.assert_array_equal(loads.gpu_loads(counts, phy2log, topology, shares=shares), [[7.0, 2.0, 7.0, 5.0]])
    np.testing.assert_array_equal(loads.peak_loads(counts, phy2log, topology, shares=shares), [7.0])
    series = np.stack([counts, 2 * counts])  # [T, L, E] with one split, or one a window
    np.testing.assert_array_equal(loads.gpu_loads(series, phy2log, topology, shares=shares),
                                  [[[7.0, 2.0, 7.0, 5.0]], [[14.0, 4.0, 14.0, 10.0]]])
    np.testing.assert_array_equal(loads.gpu_loads(series, phy2log, topology, shares=np.stack([shares, shares])),
                                  loads.gpu_loads(series, phy2log, topology, shares=shares))


def test_callers_agree_bit_for_bit():
    rng = np.random.default_rng(3)
    topology = eplb.Topology.from_layout(14, 4, 2, masked_gpus=())
    counts = rng.random((3, 5, 10)) * 1000
    phy2log = np.stack([rng.permutation(np.r_[np.arange(10), rng.integers(0, 10, 4)]) for _ in range(5)])
    placement = eplb.Placement(phy2log, 10, topology)
    phy2log, logcnt = placement.phy2log, placement.logcnt
    np.testing.assert_array_equal(loads.gpu_loads(counts, phy2log, topology, logcnt=logcnt),
                                  loads.gpu_loads(counts, phy2log, topology))
    np.testing.assert_array_equal(placement.gpu_loads(counts), loads.gpu_loads(counts, phy2log, topology))
    shares = eplb.dispatch(counts, placement)  # [T, L, S]
    tokens, active = loads.gpu_work(counts, phy2log, topology, shares, loads.FIXED_SPLIT)
    np.testing.assert_array_equal(tokens, loads.gpu_loads(counts, phy2log, topology, shares=shares))
    assert active.shape == tokens.shape


def test_bad_input_names_the_argument():
    topology, phy2log, counts = small()
    with pytest.raises(ValueError, match="exactly one of logcnt"):
        loads.slot_loads(counts, phy2log)
    with pytest.raises(ValueError, match="loads must have one column per GPU"):
        loads.node_loads(np.ones((1, 3)), topology)


def test_the_planners_peaks_are_the_loads_summed_in_slot_order():
    """``slot_order_peaks`` (what the planners compare candidates by) is each GPU's slots added in
    order, and within a rounding of the metrics' loads, on uneven topologies and replicated experts."""
    rng = np.random.default_rng(7)
    topology = eplb.Topology.from_layout(14, 4, 2, masked_gpus=())
    counts = rng.random((5, 10)) * 1000
    phy2log = np.stack([rng.permutation(np.r_[np.arange(10), rng.integers(0, 10, 4)]) for _ in range(5)])
    peaks = loads.slot_order_peaks(counts, phy2log, topology)
    for layer in range(5):
        per_replica = counts[layer] / np.bincount(phy2log[layer], minlength=10)
        by_gpu = [0.0] * topology.num_gpus
        for slot, expert in enumerate(phy2log[layer]):
            by_gpu[topology.gpu_of_slot[slot]] += per_replica[expert]
        assert peaks[layer] == max(by_gpu)
    np.testing.assert_allclose(peaks, loads.peak_loads(counts, phy2log, topology), rtol=1e-14)

"""Assertions shared by the tests: what makes a placement valid."""

import numpy as np

import eplb


def assert_valid(placement: eplb.Placement, num_experts: int):
    """Every expert >= 1 replica per layer, exactly k slots per GPU, the three arrays consistent."""
    phy2log, log2phy, logcnt = placement.phy2log, placement.log2phy, placement.logcnt
    assert_valid_arrays(phy2log, log2phy, logcnt, num_experts, placement.topology.num_slots)
    assert placement.topology.slot_offsets[-1] == phy2log.shape[1]


def assert_valid_arrays(phy2log, log2phy, logcnt, num_experts, num_slots):
    num_layers = phy2log.shape[0]
    assert phy2log.shape == (num_layers, num_slots)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape[:2] == (num_layers, num_experts)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    assert (logcnt >= 1).all(), "every expert needs a replica"
    assert (logcnt.sum(axis=1) == num_slots).all()
    for layer in range(num_layers):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        for e in range(num_experts):
            slots = log2phy[layer, e]
            held = slots[slots >= 0]
            assert len(held) == logcnt[layer, e]
            assert (slots[len(held):] == -1).all(), "padding comes after the slots"
            assert (phy2log[layer, held] == e).all()

"""Counts are scale-free: scaling every count by a power of two scales every load, bound and
placement decision exactly, so placements must not change and diagnostics must stay finite and
true from denormal to near-overflow totals."""

import numpy as np
import pytest

import eplb

LAYOUT = dict(num_slots=24, num_gpus=4)


def _counts():
    return np.random.default_rng(2).integers(1, 1000, (3, 16)).astype(np.float64)


def test_best_placements_do_not_change_under_power_of_two_scaling():
    counts = _counts()
    reference = eplb.plan(counts, method="best", **LAYOUT).phy2log
    for k in range(-60, 61, 3):
        scaled = eplb.plan(counts * 2.0 ** k, method="best", **LAYOUT)
        assert (scaled.phy2log == reference).all(), f"best changed its placement at scale 2**{k}"


@pytest.mark.parametrize("scale", [2.0 ** k for k in range(-60, 61, 12)] + ["tiny"])
def test_best_never_heavier_than_the_default_at_any_scale(scale):
    counts = _counts()
    counts = counts / counts.sum(axis=1, keepdims=True) * 1e-12 if scale == "tiny" else counts * scale
    best = eplb.plan(counts, method="best", **LAYOUT)
    default = eplb.plan(counts, **LAYOUT)
    assert (best.max_load <= default.max_load).all(), (best.gap, default.gap)

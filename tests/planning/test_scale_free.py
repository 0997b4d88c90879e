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


@pytest.mark.parametrize("hierarchical", [False, True])
def test_bounds_scale_exactly_from_denormal_to_huge_counts(hierarchical):
    from eplb.analysis.bounds import lower_bound

    counts = _counts()
    topology = eplb.Topology.from_layout(24, 4, 2)
    groups = 4 if hierarchical else None
    reference = lower_bound(counts, eplb.Deployment.of(counts.shape[-1], topology=topology, num_groups=groups))
    for k in (-1070, -1060, -1030, -500, -40, 40, 500, 1000):
        scaled = lower_bound(counts * 2.0 ** k, eplb.Deployment.of(counts.shape[-1], topology=topology, num_groups=groups))
        assert np.isfinite(scaled).all()
        np.testing.assert_allclose(np.ldexp(scaled, -k), reference, rtol=1e-9 if k > -1060 else 1e-3)


@pytest.mark.parametrize("scale", [1e-320, 1e-310, 1e300])
def test_plan_diagnostics_stay_finite_and_gaps_non_negative_at_extreme_magnitudes(scale):
    counts = _counts()
    counts = counts / counts.sum(axis=1, keepdims=True) * scale
    for method in ("balanced", "best"):
        placement = eplb.plan(counts, method=method, num_slots=24, num_gpus=4, num_nodes=2, num_groups=4)
        assert np.isfinite(placement.max_load).all() and np.isfinite(placement.lower_bound).all()
        assert (placement.lower_bound > 0).all()
        assert (placement.gap >= 0).all() and np.isfinite(placement.gap).all(), placement.gap
        reference = eplb.plan(counts / scale, method=method, num_slots=24, num_gpus=4, num_nodes=2, num_groups=4)
        np.testing.assert_allclose(placement.gap, reference.gap, atol=1e-6 if scale > 1e-300 else 0.05)


def test_each_named_bound_is_scale_free_down_to_denormal_loads():
    from eplb.analysis import bounds

    counts = _counts()
    topology = eplb.Topology.from_layout(24, 4)
    for name, bound in bounds.BOUNDS.items():
        reference = bound(counts, topology)
        for k in (-1040, -1000, 1000):
            np.testing.assert_allclose(np.ldexp(bound(counts * 2.0 ** k, topology), -k), reference, rtol=1e-9,
                                       err_msg=f"{name} at 2**{k}")

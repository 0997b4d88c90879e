"""``copy_counts``: the one-pass staging kernel a balancer's ``record`` runs on the engine's thread
gives the same float64 window as numpy's cast and flags exactly the values the check refuses."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eplb.kernels.plumbing.load_window import STAGED_DTYPES, copy_counts, first_bad_count


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(STAGED_DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=9))),
    st.sampled_from([np.finfo(np.float64).max, 1e300, 1000.0, 0.5, 0.0]))
def test_copy_matches_numpy_cast_and_flags_what_the_check_refuses(counts, limit):
    out = np.full(counts.shape, -7.0)
    bad = copy_counts(counts, out, limit)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = counts.astype(np.float64)
    np.testing.assert_array_equal(out, expected)  # NaN where NaN, the same rounding of wide integers
    assert bad == (first_bad_count(expected, limit) >= 0)
    assert bad == bool(np.isnan(expected).any() or (expected < 0).any() or (expected > limit).any())

"""bench/serving.py's proven-fewest-changes study and rebalance() timing, on tiny inputs."""

import importlib

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs the serving benchmark section at small sizes

serving = importlib.import_module("serving")


def test_fewest_changes_rows_never_exceed_eplb_and_bound_them():
    rng = np.random.default_rng(0)
    base = rng.lognormal(0, 0.5, (2, 8)) * 1000
    series = np.round(np.stack([base * rng.lognormal(0, 0.3, base.shape) for _ in range(3)]))
    seqs = [("tiny, 12 slots / 4 GPUs", series, dict(num_slots=12, num_gpus=4, num_nodes=1))]
    rows = serving.fewest_changes_rows(seqs, quick=True)
    assert [r["window"] for r in rows] == [1, 2]
    for r in rows:
        assert r["proven_default"]  # tiny layers: CP-SAT proves the minimum
        assert r["bound_default"] == r["fewest_default"] <= r["eplb"] <= r["slots"]
        if r["fewest_optimum"] != "":
            assert r["default_over_optimum"] >= 1.0


def test_rebalance_times_report_both_modes_and_the_split():
    rows = serving.rebalance_times(1)
    assert [r["mode"] for r in rows] == ["hierarchical", "global"]
    for r in rows:
        for key in ("rebalance", "method", "migration", "transfer + Placement"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_cpu_ms"] > 0

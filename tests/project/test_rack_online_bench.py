"""bench/rack_online.py on tiny sizes, so that it keeps running as the package changes (figures are
not asserted: they belong to bench/results)."""

import csv
import importlib

import pytest

pytestmark = pytest.mark.slow  # replays DeepSeek-V3-sized passes at 72 and 144 GPUs


def test_rack_online_runs_every_policy_and_reports_the_targets(tmp_path):
    bench = importlib.import_module("rack_online")
    names = ("global 288/72", "global 288/144", "racks as nodes 288/144")
    text = bench.run(True, tmp_path, blocks=2, every=10, deployments=names, kinds=("held out",), workers=1)
    with open(tmp_path / "rack_online.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["deployment"] for r in rows} == set(names)
    for name in names:
        keys = {r["key"] for r in rows if r["deployment"] == name}
        assert {"vllm", "sglang", "defaults", "before"} <= keys
        assert ("reference" in keys) == name.startswith("global")  # the free re-plan at the global rack deployments
    # the frontier: the other budgets beside the defaults' one
    assert {r["key"] for r in rows if r["deployment"] == "global 288/144"} >= {"budget_4", "budget_8"}
    defaults = {r["deployment"]: r["settings"] for r in rows if r["key"] == "defaults"}
    assert defaults["global 288/72"] == "tolerance 0, at most 4 slots per layer"
    assert defaults["global 288/144"] == "tolerance 0, at most 2 slots per layer"
    assert all(int(r["copies"]) == 0 for r in rows if r["key"] in ("vllm", "sglang"))  # 20 steps: no timer fired
    assert "## Rack-scale online loop" in text and "Held out series:" in text
    assert "racks as nodes 288/144: defaults lose" in text and "the global Balancer's time lost" in text
    assert (tmp_path / "rack_online.md").read_text() == text

"""bench/simulate.py on tiny sizes, so that it keeps running as the package changes (figures are
not asserted: they belong to bench/results)."""

import csv
import importlib

bench = importlib.import_module("simulate")


def test_simulate_bench_runs_every_policy_and_reports_targets(tmp_path):
    text = bench.run(True, tmp_path, blocks=2, timing_steps=30)
    with open(tmp_path / "simulate.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    keys = {r["policy_key"] for r in rows}
    assert {"none", "vllm", "sglang", "balancer", "reference"} <= keys
    deepseek = [r for r in rows if r["series"].startswith("DeepSeek-V3")]
    assert {r["deployment"] for r in deepseek} == {"global 288/32", "hierarchical 4 nodes"}
    reference = [r for r in rows if r["policy_key"] == "reference"]
    assert all(int(r["rebalances"]) == 2 and float(r["stall_s"]) == 0 for r in reference)
    assert all(int(r["copies"]) == 0 for r in rows if r["policy_key"] == "none")
    assert "## Simulate" in text and "Targets (issue 13" in text and "Timing, 30" in text
    assert (tmp_path / "simulate.md").read_text() == text
    assert bench.headline(tmp_path) and all(len(row) == 3 for row in bench.headline(tmp_path))
    assert "Balancer trade-off" in text
    assert {f"balancer_tolerance_{t}" for t in bench.TOLERANCES} <= keys

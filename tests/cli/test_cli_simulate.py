"""eplb simulate: policies side by side on one series, a user's own planning function, clear errors."""

from __future__ import annotations

import csv

import numpy as np
from click.testing import CliRunner

from eplb.cli import main
from eplb.simulation.synthetic import drifting_counts


def test_simulate_compares_policies_and_writes_the_report(tmp_path):
    steps = tmp_path / "steps.npy"
    np.save(steps, drifting_counts(120, 3, 32, drift=0.1, tokens=512, seed=5))
    out = tmp_path / "sim"
    result = CliRunner().invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "-p", "none", "-p", "every:40/20",
                                       "-p", "balancer", "--check-every", "20", "--copy-mode", "free", "-o", str(out)])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(open(out / "simulate.csv")))
    assert len(rows) == 3
    lost = {r["policy"]: float(r["lost_share"]) for r in rows}
    assert lost["no rebalancing"] >= min(lost.values())
    assert (out / "index.html").stat().st_size > 0 and (out / "time_lost.png").exists()


def test_simulate_takes_a_function_with_the_published_signature(tmp_path):
    steps = tmp_path / "steps.npy"
    np.save(steps, drifting_counts(60, 2, 32, tokens=512, seed=6))
    runner = CliRunner()
    own = runner.invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "-p", "every:20", "--rebalance-fn",
                               "eplb:rebalance_experts", "-o", str(tmp_path / "a"), "--quiet"])
    assert own.exit_code == 0, own.output
    bad = runner.invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "--rebalance-fn", "nowhere",
                               "-o", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "MODULE:FUNCTION" in bad.output
    missing = runner.invoke(main, ["simulate", str(steps), "-s", "48", "-g", "8", "--rebalance-fn", "eplb:nothing",
                                   "-o", str(tmp_path / "c")])
    assert missing.exit_code == 1 and "Traceback" not in missing.output

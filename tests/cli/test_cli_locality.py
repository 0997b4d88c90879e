"""The command line with a cap on off-node tokens: plan --max-off-node, validate and report."""

from __future__ import annotations

import json
import re

import numpy as np
from click.testing import CliRunner

from eplb.cli import main
from test_locality import group_skewed


def gap_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("gap"))


def test_plan_with_a_cap_keeps_its_shares_and_validate_agrees(tmp_path):
    counts = tmp_path / "counts.npy"
    np.save(counts, group_skewed(4, 64, 8, 2, 0.4, seed=7))
    out = tmp_path / "plan.json"
    runner = CliRunner()
    planned = runner.invoke(main, ["plan", str(counts), "-s", "96", "-g", "16", "-n", "4", "-k", "8",
                                   "--max-off-node", "0.1", "-o", str(out)])
    assert planned.exit_code == 0, planned.output
    share = float(re.search(r"off node\s+([\d.]+)% of the tokens", planned.output).group(1))
    assert share <= 10.0
    assert json.loads(out.read_text())["placement"]["shares"] is not None
    checked = runner.invoke(main, ["validate", str(out), "--counts", str(counts)])
    assert checked.exit_code == 0, checked.output
    plan_gap = float(re.search(r"([\d.]+)% mean", gap_line(planned.output)).group(1))
    validate_gap = float(re.search(r"([\d.]+)% mean", gap_line(checked.output)).group(1))
    assert validate_gap <= plan_gap + 0.01  # the file's own off-node share bounds at least as tightly
    balance = float(re.search(r"balance\s+([\d.]+) mean", checked.output).group(1))
    assert balance > 0.97, "validate measures the plan with its shares"


def test_cap_needs_groups_on_nodes_and_a_plan_from_scratch(tmp_path):
    counts = tmp_path / "counts.npy"
    np.save(counts, group_skewed(2, 64, 8, 2, 0.4, seed=8))
    runner = CliRunner()
    no_groups = runner.invoke(main, ["plan", str(counts), "-s", "96", "-g", "16", "-n", "4", "--max-off-node", "0.1",
                                     "-o", str(tmp_path / "a.json")])
    assert no_groups.exit_code == 2 and "--max-off-node" in no_groups.output
    too_big = runner.invoke(main, ["plan", str(counts), "-s", "96", "-g", "16", "-n", "4", "-k", "8",
                                   "--max-off-node", "1.5", "-o", str(tmp_path / "b.json")])
    assert too_big.exit_code == 2


def test_report_draws_the_off_node_curve_for_a_hierarchical_deployment(tmp_path):
    counts = tmp_path / "counts.npy"
    np.save(counts, group_skewed(3, 64, 8, 2, 0.4, seed=9))
    runner = CliRunner()
    assert runner.invoke(main, ["plan", str(counts), "-s", "96", "-g", "16", "-n", "4", "-k", "8",
                                "-o", str(tmp_path / "plan.json")]).exit_code == 0
    result = runner.invoke(main, ["report", str(counts), str(tmp_path / "plan.json"), "-o", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "locality.png").stat().st_size > 0
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "off-node trade-off" in page and "cap 10%" in page

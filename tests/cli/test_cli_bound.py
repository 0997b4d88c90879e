"""One bound, one truth: ``plan``, ``validate`` and ``report`` judge a placement against the same
lower bound whatever file it travelled in, say which bound it is, and show what is hidden: what the
hierarchy costs, how the deployed plan does on the new counts, and no credit for dense layers."""

import re

import numpy as np
import pytest

import eplb
from eplb.io.formats import read_counts, read_placement
from eplb.analysis.metrics import moe_mean
from eplb.io.report import bound_for

from test_cli import invoke

CONFIG = ["--slots", "24", "--gpus", "4", "--nodes", "2", "--groups", "4"]


def _skewed_counts(seed=0, num_layers=4):
    """[L, 16]: group 0 (experts 0-3) carries most tokens, so keeping it on one node costs a lot and
    the hierarchical bound is far above the global one; layer 1 is dense (all zero)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(10, 100, (num_layers, 16)).astype(float)
    counts[:, :4] *= 20
    counts[1] = 0
    return counts


def _line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(key))


def _number(line: str, index: int = 0) -> float:
    return float(re.findall(r"\d+\.\d+", line)[index])


@pytest.mark.parametrize("output, fmt, extra", [("p.json", [], []), ("sglang.json", ["-f", "sglang"], []),
                                                ("p.yaml", [], []), ("p.npz", [], [])])
def test_validate_reports_the_gap_plan_reports_whatever_the_format(tmp_path, output, fmt, extra):
    counts = _skewed_counts()
    np.save(tmp_path / "c.npy", counts)
    planned, _ = invoke("plan", "c.npy", *CONFIG, "-o", output, *fmt, cwd=tmp_path)
    checked, _ = invoke("validate", output, "--counts", "c.npy", *extra, cwd=tmp_path)
    assert _line(planned, "gap") == _line(checked, "gap")
    assert _line(planned, "bound") == _line(checked, "bound") == "bound    hierarchical: 4 groups on 2 nodes"
    # and it is the bound eplb.plan proves for this configuration
    placement = eplb.plan(counts, num_slots=24, num_gpus=4, num_nodes=2, num_groups=4)
    bound = bound_for(counts, read_placement(tmp_path / output).placement)
    assert np.allclose(bound.values, placement.lower_bound)
    glob = eplb.lower_bound(counts, eplb.Deployment.of(counts.shape[-1], topology=placement.topology))
    assert (bound.values > 1.05 * glob)[counts.sum(axis=1) > 0].all()        # the case where it matters


def test_sglang_without_side_file_takes_groups_from_the_command_line(tmp_path):
    np.save(tmp_path / "c.npy", _skewed_counts())
    planned, _ = invoke("plan", "c.npy", *CONFIG, "-o", "s.json", "-f", "sglang", cwd=tmp_path)
    (tmp_path / "s.eplb.json").unlink()
    bare, _ = invoke("validate", "s.json", "--counts", "c.npy", "--gpus", "4", "--nodes", "2", cwd=tmp_path)
    assert _line(bare, "bound") == "bound    global (no expert groups)"
    told, _ = invoke("validate", "s.json", "--counts", "c.npy", "--gpus", "4", "--nodes", "2", "--groups", "4",
                     cwd=tmp_path)
    assert _line(told, "gap") == _line(planned, "gap")


def test_groups_that_a_file_contradicts_are_refused(tmp_path):
    np.save(tmp_path / "c.npy", _skewed_counts())
    invoke("plan", "c.npy", *CONFIG, "-o", "p.json", cwd=tmp_path)
    _, err = invoke("validate", "p.json", "--groups", "2", cwd=tmp_path, expect=1)
    assert "p.json" in err and "records 4 expert groups" in err


def test_a_placement_that_spreads_a_group_is_judged_by_the_global_bound(tmp_path):
    counts = _skewed_counts()
    flat = eplb.plan(counts, num_slots=24, num_gpus=4, num_nodes=2)           # groups ignored
    claimed = eplb.Placement(flat.phy2log, 16, flat.topology, num_groups=4)
    bound = bound_for(counts, claimed)
    assert bound.kind == "hierarchical" and "judged by the global bound" in bound.description
    gap = eplb.analysis.metrics.gap(claimed.gpu_loads(counts).max(axis=1), bound.values)
    assert (gap >= -1e-12).all()                                                # never a negative gap


def test_report_compares_with_greedy_on_the_recorded_groups(tmp_path):
    pytest.importorskip("matplotlib")
    from eplb.io.report import make_report

    counts = _skewed_counts()
    np.save(tmp_path / "c.npy", counts)
    invoke("plan", "c.npy", *CONFIG, "-o", "s.json", "-f", "sglang", cwd=tmp_path)
    (tmp_path / "out").mkdir()
    result = make_report(read_counts(tmp_path / "c.npy"), read_placement(tmp_path / "s.json"), tmp_path / "out")
    greedy = eplb.plan(counts, num_slots=24, num_gpus=4, num_nodes=2, num_groups=4, method="greedy")
    row = result.summary["balancedness (mean over layers)"]
    assert f"greedy on the same configuration {moe_mean(greedy.balancedness(counts), counts):.4f}" in row
    assert result.summary["lower bound"] == "hierarchical: 4 groups on 2 nodes"
    out, _ = invoke("report", "c.npy", "s.json", "-o", "out2", cwd=tmp_path)
    assert "index.html" in out


def test_plan_shows_what_the_hierarchy_costs_and_the_deployed_plan_on_new_counts(tmp_path):
    counts = _skewed_counts()
    np.save(tmp_path / "c.npy", counts)
    out, _ = invoke("plan", "c.npy", *CONFIG, "-o", "old.json", cwd=tmp_path)
    free = eplb.plan(counts, num_slots=24, num_gpus=4, num_nodes=2)
    assert _number(_line(out, "global")) == pytest.approx(moe_mean(free.balancedness(counts), counts), abs=1e-4)
    assert _number(_line(out, "global")) > _number(_line(out, "balance"), 1) + 0.05     # it costs here

    drifted = _skewed_counts(seed=1)
    np.save(tmp_path / "d.npy", drifted)
    out, _ = invoke("plan", "d.npy", *CONFIG, "-o", "new.json", "--previous", "old.json", cwd=tmp_path)
    old = read_placement(tmp_path / "old.json").placement
    assert _number(_line(out, "deployed")) == pytest.approx(moe_mean(old.balancedness(drifted), drifted), abs=1e-4)


def test_dense_layers_do_not_count_as_perfectly_balanced(tmp_path):
    counts = _skewed_counts()
    np.save(tmp_path / "c.npy", counts)
    out, _ = invoke("plan", "c.npy", "--slots", "24", "--gpus", "4", "--method", "greedy", "-o", "p.json",
                    cwd=tmp_path)
    balance = _line(out, "balance")
    assert "3 MoE layers; 1 all-zero layers left out" in balance
    placement = read_placement(tmp_path / "p.json").placement
    per_layer = placement.balancedness(counts)
    assert _number(balance, 1) == pytest.approx(per_layer[[0, 2, 3]].mean(), abs=1e-4)
    assert _number(balance, 1) < per_layer.mean() - 1e-3                    # all-layer mean credits the dense layer


def test_warmup_command_reports_what_it_compiled(tmp_path):
    out, _ = invoke("warmup", "--experts", "16", "--slots", "24", "--gpus", "4", "--nodes", "2", "--groups", "4",
                    "--method", "greedy", "--no-balancer", cwd=tmp_path)
    assert "methods greedy" in out and "plan greedy" in out and "rebalance_experts greedy" in out
    assert "Balancer" not in out and out.splitlines()[-1].startswith("time")
    _, err = invoke("warmup", "--experts", "16", "--slots", "20", "--gpus", "3", cwd=tmp_path, expect=1)
    assert "divisible" in err


def test_two_slots_a_gpu_plan_validate_and_the_api_agree_on_the_weighting_bound(tmp_path):
    """DeepSeek's decode unit (288 slots on 144 GPUs): the bound aimed at the plan (the weighting
    bound) is what the API reports, and ``plan`` and ``validate`` print the same gap from it."""
    from eplb.simulation.synthetic import skewed_counts

    counts = np.asarray(skewed_counts(4, 256, family="lognormal", skew=0.7, num_groups=8, seed=1), float)
    np.save(tmp_path / "c.npy", counts)
    config = ["--slots", "288", "--gpus", "144"]
    planned, _ = invoke("plan", "c.npy", *config, "-o", "p.json", cwd=tmp_path)
    checked, _ = invoke("validate", "p.json", "--counts", "c.npy", cwd=tmp_path)
    assert _line(planned, "gap") == _line(checked, "gap")
    decode = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    placement = eplb.plan(counts, decode)
    bound = bound_for(counts, read_placement(tmp_path / "p.json").placement)
    assert np.allclose(bound.values, placement.lower_bound)
    assert (bound.values <= placement.max_load * (1 + 1e-12)).all()
    assert (bound.values > eplb.lower_bound(counts, decode)).any()  # the plan-free bound is weaker there

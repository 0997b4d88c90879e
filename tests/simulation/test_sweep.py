"""What-if sweeps: every combination simulated on the same series, the knee, the command."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from click.testing import CliRunner

import eplb
from eplb.cli import main
from eplb.model.deployment import slots_for
from eplb.simulation.sweep import knee, sweep
from eplb.simulation.synthetic import drifting_counts

COST = eplb.CostModel.preset("H100", "gpt-oss-20b", regime="compute")


@pytest.fixture(scope="module")
def series():
    return drifting_counts(60, 2, 32, drift=0.1, tokens=512, num_groups=8, seed=4)


def test_every_combination_once_and_the_same_in_a_pool(series):
    grid = eplb.Deployment.grid(32, extra_slots_per_gpu=(0, 2), num_gpus=(8, 6), num_nodes=(1, 2), num_groups=8)
    kwargs = dict(policies=("none", "balancer"), cost_model=COST)
    alone = sweep(series, grid, workers=1, **kwargs)
    # 6 GPUs on 2 nodes is a valid pair too; every (extra, GPUs, nodes, policy) appears once
    assert len(alone) == 2 * 2 * 2 * 2
    for r in alone:
        assert r["num_slots"] == slots_for(32, r["num_gpus"], r["extra_slots_per_gpu"])
        assert r["num_slots"] % r["num_gpus"] == 0 and r["num_slots"] >= 32
        assert r["lost_with_stalls_share"] >= r["lost_share"] >= 0
        assert r["hierarchical"]  # 8 groups divide over 1 and 2 nodes (the published rule)
        if r["policy"] == "no rebalancing":
            assert r["copies"] == 0 and r["rebalances"] == 0
    pooled = sweep(series, grid, workers=2, **kwargs)
    timed = ("wall_time_s", "host_ms_mean", "host_ms_p99", "host_ms_max")  # measured, not computed
    drop = lambda rows: [{k: v for k, v in r.items() if k not in timed} for r in rows]  # noqa: E731
    assert drop(pooled) == drop(alone), "a process pool gives the same rows in the same order"


def test_more_replica_memory_for_more_extra_slots(series):
    grid = eplb.Deployment.grid(32, extra_slots_per_gpu=(0, 1, 3), num_gpus=(8,))
    rows = sweep(series, grid, policies=("none",), cost_model=COST, workers=1)
    memory = [r["replica_memory_per_gpu_bytes"] for r in rows]
    assert memory[0] == 0 and memory[1] < memory[2]
    assert memory[1] == pytest.approx(2 * COST.expert_bytes)   # one replica per GPU in each of 2 layers


def test_a_policy_from_outside_plugs_in(series):
    own = functools.partial(eplb.FixedInterval, 20, 20, eplb.rebalance_experts)
    rows = sweep(series, eplb.Deployment.of(32, num_slots=40, num_gpus=8), policies=(own, "none"), cost_model=COST,
                 workers=2)
    assert rows[0]["rebalances"] >= 2 and rows[1]["rebalances"] == 0


def test_knee_is_where_one_more_slot_stops_paying():
    rows = [{"num_gpus": 8, "num_nodes": 1, "dispatch": "uniform", "policy": "p", "extra_slots_per_gpu": e,
             "lost_with_stalls_share": lost} for e, lost in ((0, 0.40), (1, 0.20), (2, 0.15), (3, 0.145))]
    assert knee(rows, threshold=0.01) == {(8, 1, "uniform", "p"): 2}
    assert knee(rows, threshold=0.3) == {(8, 1, "uniform", "p"): 0}


@pytest.mark.parametrize("bad, message", [
    (dict(num_gpus=(0,)), "num_gpus entry"), (dict(num_gpus=(6,), num_nodes=(4,)), "no deployment left"),
    (dict(extra_slots_per_gpu=()), "extra_slots_per_gpu must be a non-empty list"),
    (dict(num_gpus=8), "num_gpus must be a non-empty list"),
])
def test_bad_grids_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        eplb.Deployment.grid(32, **{"num_gpus": (8,), **bad})


@pytest.mark.parametrize("bad, message", [
    (dict(deployments=eplb.Deployment.of(32, num_slots=32, num_gpus=8, dispatch="shares")), "dispatch"),
    (dict(deployments=eplb.Deployment.of(16, num_slots=16, num_gpus=8)), "the counts' 32 experts"),
    (dict(deployments=[]), "at least one"), (dict(deployments=[(32, 8)]), "eplb.Deployment values"),
    (dict(deployments=None), "needs the deployments"), (dict(policies=("fast",)), "policies entries"),
    (dict(policies="none"), "policies must be a non-empty list"),
])
def test_bad_sweeps_are_refused_by_name(series, bad, message):
    arguments = {"deployments": eplb.Deployment.of(32, num_slots=32, num_gpus=8), **bad}
    with pytest.raises(ValueError, match=message):
        sweep(series, cost_model=COST, workers=1, **arguments)


def test_the_grid_keywords_still_sweep_the_same_with_a_warning(series):
    grid = eplb.Deployment.grid(32, extra_slots_per_gpu=(0, 1), num_gpus=(8,), dispatch=("uniform", "optimal"))
    new = sweep(series, grid, policies=("none",), cost_model=COST, workers=1)
    with pytest.warns(DeprecationWarning, match=r"Deployment.grid\(32"):
        old = sweep(series, extra_slots_per_gpu=(0, 1), num_gpus=(8,), dispatch=("uniform", "optimal"),
                    policies=("none",), cost_model=COST, workers=1)
    measured = ("wall_time_s", "host_ms_mean", "host_ms_p99", "host_ms_max")
    drop = lambda rows: [{k: v for k, v in r.items() if k not in measured} for r in rows]  # noqa: E731
    assert drop(old) == drop(new)
    assert [(r["extra_slots_per_gpu"], r["dispatch"]) for r in new] == [(0, "uniform"), (0, "optimal"),
                                                                        (1, "uniform"), (1, "optimal")]


def test_sweep_command_writes_the_table_and_the_knee_plot(tmp_path, series):
    steps = tmp_path / "steps.npy"
    np.save(steps, series)
    runner = CliRunner()
    result = runner.invoke(main, ["sweep", str(steps), "--extra-slots", "0,1", "--gpus", "8", "--nodes", "1,2",
                                  "--groups", "8", "-p", "none", "--model", "gpt-oss-20b", "--workers", "1",
                                  "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "knee" in result.output
    assert (tmp_path / "out" / "sweep.csv").read_text().count("\n") == 1 + 4
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0
    bad = runner.invoke(main, ["sweep", str(steps), "--gpus", "eight", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--gpus" in bad.output

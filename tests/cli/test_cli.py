"""The ``eplb`` console script, run as a user runs it: a subprocess on files in a temporary folder."""

import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import eplb
from eplb.io.formats import read_placement, write_placement

from cli_runner import invoke
from test_formats import write_trtllm_statistics

EPLB = shutil.which("eplb")
pytestmark = pytest.mark.skipif(EPLB is None, reason="the eplb console script is not installed (pip install -e .)")

COUNTS = np.random.default_rng(3).integers(0, 1000, size=(5, 6, 32))       # [T, L, E]


def run(*args, cwd=None, expect=0, python=None):
    """Run ``eplb ARGS`` (or ``python -c PYTHON ARGS``); check the exit code; return (stdout, stderr)."""
    command = [sys.executable, "-c", python, *args] if python else [EPLB, *args]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == expect, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout, done.stderr


def test_help_on_every_command(tmp_path):
    out, _ = run("--help")
    for command in ("plan", "report", "validate", "warmup", "demo"):
        assert command in out
    for command, words in [("plan", ["--slots", "--gpus", "--previous", "--format", "--input-format", "sglang"]),
                           ("report", ["--previous", "index.html", "--groups"]),
                           ("validate", ["--counts", "--gpus", "--groups", "--transpose", "--allow-shape"]),
                           ("warmup", ["--experts", "--slots", "--gpus", "--nodes", "--groups", "--method"]),
                           ("demo", ["--method"])]:
        out, _ = invoke(command, "--help", cwd=tmp_path)
        assert all(word in out for word in words), out


def test_plan_writes_eplb_json_with_summary_and_matches_the_library(tmp_path):
    np.save(tmp_path / "counts.npy", COUNTS)
    out, err = run("plan", "counts.npy", "--slots", "40", "--gpus", "8", "--nodes", "2", "--groups", "4",
                   "--method", "greedy", "-o", "plan.json", cwd=tmp_path)
    assert err == ""                                          # no progress bar when stderr is not a terminal
    assert "5 windows x 6 layers x 32 experts" in out
    assert "without rebalancing ->" in out and "above the proven lower bound" in out and "time" in out

    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["format"] == "eplb-placement" and document["eplb_version"] == eplb.__version__
    config = document["configuration"]
    assert (config["num_slots"], config["num_gpus"], config["num_nodes"], config["num_groups"]) == (40, 8, 2, 4)
    assert config["counts_format"] == "npy" and config["counts_shape"] == [5, 6, 32]
    diagnostics = document["diagnostics"]
    assert len(diagnostics["balancedness"]) == 6 and len(diagnostics["gap"]) == 6
    assert np.mean(diagnostics["balancedness"]) > np.mean(diagnostics["balancedness_no_rebalancing"])
    # the same plan as the library computes in this process (deterministic across processes)
    expected = eplb.plan(COUNTS, num_slots=40, num_gpus=8, num_nodes=2, num_groups=4, method="greedy")
    assert read_placement(tmp_path / "plan.json").placement == expected
    assert f"{np.mean(diagnostics['balancedness']):.4f}" in out

    # the summary can be silenced; CSV input with an explicit format; npz output
    np.savetxt(tmp_path / "counts.txt", COUNTS.sum(axis=0), delimiter=",")
    out, err = run("plan", "counts.txt", "--input-format", "csv", "-s", "40", "-g", "8", "-n", "2", "-k", "4",
                   "-m", "greedy", "-o", "plan.npz", "--quiet", cwd=tmp_path)
    assert out == "" and err == ""
    summed = eplb.plan(COUNTS.sum(axis=0), num_slots=40, num_gpus=8, num_nodes=2, num_groups=4, method="greedy")
    assert read_placement(tmp_path / "plan.npz").placement == summed


def test_sglang_dump_in_sglang_placement_out(tmp_path):
    pytest.importorskip("torch", reason="torch is an optional extra")
    import torch

    torch.save(dict(rank=0, logical_count=torch.tensor(COUNTS, dtype=torch.int32),
                    average_utilization_rate_over_window=None), tmp_path / "expert_distribution_recorder_1.pt")
    out, _ = run("plan", "expert_distribution_recorder_1.pt", "--slots", "48", "--gpus", "8", "--format", "sglang",
                 "-o", "init_expert_location.json", cwd=tmp_path)
    assert "sglang-dump" in out and "(sglang)" in out
    document = json.loads((tmp_path / "init_expert_location.json").read_text())
    assert list(document) == ["physical_to_logical_map"]
    phy2log = np.array(document["physical_to_logical_map"])
    assert phy2log.shape == (6, 48)
    assert all(set(row) == set(range(32)) for row in phy2log.tolist())   # every expert in every layer

    np.save(tmp_path / "counts.npy", COUNTS)
    out, _ = run("validate", "init_expert_location.json", "--gpus", "8", "--counts", "counts.npy", cwd=tmp_path)
    assert "valid" in out and "6 layers x 32 experts, 48 slots on 8 GPUs" in out and "balance" in out
    assert "windows  5" in out


def test_trtllm_statistics_in_yaml_out_and_previous(tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is an optional extra")
    yaml = pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    write_trtllm_statistics(tmp_path / "expert_statistic", COUNTS, layer_ids=[3, 4, 5, 6, 7, 8])
    out, _ = run("plan", "expert_statistic", "--slots", "40", "--gpus", "8", "-o", "moe_load_balancer.yaml",
                 cwd=tmp_path)
    assert "trtllm-stats" in out
    config = yaml.safe_load((tmp_path / "moe_load_balancer.yaml").read_text())
    assert set(config) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert list(config["initial_global_assignments"]) == [3, 4, 5, 6, 7, 8]   # the model's layer indices
    assert all(len(row) == 40 for row in config["initial_global_assignments"].values())

    # re-plan on new counts from the deployed YAML: moves are counted; npz out keeps the layer ids
    drifted = COUNTS[::-1].copy()
    drifted[:, :, :4] *= 3
    np.savez(tmp_path / "new.npz", counts=drifted, layer_ids=np.arange(3, 9))
    out, _ = run("plan", "new.npz", "--slots", "40", "--gpus", "8", "--previous", "moe_load_balancer.yaml",
                 "-o", "next.npz", cwd=tmp_path)
    assert "moves" in out and "of 240 slots changed" in out
    if "previous" in inspect.signature(eplb.plan).parameters:
        assert "(migration-aware)" in out
    previous = read_placement(tmp_path / "moe_load_balancer.yaml").placement
    new = read_placement(tmp_path / "next.npz")
    changed = eplb.analysis.metrics.moves(previous.phy2log, new.placement.phy2log, new.placement.topology).slots_changed
    assert f"{changed} of 240 slots changed" in out
    assert new.layer_ids.tolist() == [3, 4, 5, 6, 7, 8]
    out, _ = run("validate", "moe_load_balancer.yaml", "--counts", "expert_statistic", cwd=tmp_path)
    assert "8 GPUs" in out and "balance" in out


ERROR_CASES = [  # (args, exit code, words the message must hold, run as a real subprocess)
    (["plan", "missing.npy", "-s", "40", "-g", "8", "-o", "p.json"], 1, ["missing.npy", "no such file"], True),
    (["plan", "nan.npy", "-s", "40", "-g", "8", "-o", "p.json"], 1, ["nan.npy", "NaN"], True),
    (["plan", "cube.npy", "-s", "40", "-g", "8", "-o", "p.json"], 1, ["cube.npy", "shape"], False),
    (["plan", "garbage.npz", "-s", "40", "-g", "8", "-o", "p.json"], 1, ["garbage.npz", "not a readable"], True),
    (["plan", "good.npy", "-s", "16", "-g", "8", "-o", "p.json"], 1, ["incompatible configuration", "num_slots"], True),
    (["plan", "good.npy", "-s", "40", "-g", "6", "-o", "p.json"], 1, ["incompatible configuration", "divisible"], False),
    (["plan", "good.npy", "-s", "40", "-g", "8", "-o", "p.json", "--previous", "small.json"], 1,
     ["small.json", "incompatible configuration", "slots 24 vs 40"], False),
    (["plan", "good.npy", "-s", "40", "-g", "8", "-o", "p.txt"], 2, ["--format"], False),
    (["plan", "good.npy", "-s", "forty", "-g", "8", "-o", "p.json"], 2, ["--slots"], True),
    (["plan", "good.npy", "-g", "8", "-o", "p.json"], 2, ["--slots"], False),
    (["plan", "good.npy", "-s", "40", "-g", "8", "-o", "p.json", "--time-limit", "1"], 2, ["--time-limit"], False),
    (["plan", "good.npy", "-s", "40", "-g", "8", "-o", "p.json", "--method", "nope"], 2, ["--method"], False),
    (["plan", "good.npy", "-s", "40", "-g", "8", "-o", "nowhere/p.json"], 1, ["p.json", "does not exist"], False),
    (["validate", "broken.json", "--gpus", "2"], 1, ["broken.json", "expert 1 has none in layer 0"], False),
    (["validate", "broken.json"], 1, ["broken.json", "--gpus"], False),
    (["validate", "small.json", "--counts", "good.npy"], 1, ["good.npy", "6 layers x 32 experts"], False),
    (["report", "good.npy", "small.json", "-o", "out"], 1, ["good.npy", "6 layers x 32 experts"], False),
]


@pytest.mark.parametrize("args, code, words, subprocess_run", ERROR_CASES)
def test_errors_name_the_file_and_the_problem(tmp_path, args, code, words, subprocess_run):
    np.save(tmp_path / "good.npy", COUNTS[0])
    np.save(tmp_path / "nan.npy", np.where(COUNTS[0] > 900, np.nan, COUNTS[0]))
    np.save(tmp_path / "cube.npy", COUNTS[None])
    (tmp_path / "garbage.npz").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "broken.json").write_text(json.dumps({"physical_to_logical_map": [[0, 0, 2, 2]]}))
    small = eplb.plan(COUNTS[0, :2, :8], num_slots=24, num_gpus=8)
    (tmp_path / "small.json").write_text(json.dumps({"placement": small.to_dict()}))
    if subprocess_run:
        _, err = run(*args, cwd=tmp_path, expect=code)
    else:
        _, err = invoke(*args, cwd=tmp_path, expect=code)
    for word in words:
        assert word in err, err
    if code == 1:
        assert err.startswith("Error: ") and err.count("\n") == 1     # one line, no traceback


def test_missing_optional_dependency_says_which_extra(tmp_path):
    np.save(tmp_path / "counts.npy", COUNTS[0])
    write_placement(eplb.plan(COUNTS[0], num_slots=40, num_gpus=8), tmp_path / "p.json")
    hide = "import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'eplb'; from eplb.cli import main; main()"
    _, err = run("report", "counts.npy", "p.json", "-o", "report", python=hide, cwd=tmp_path, expect=1)
    assert "pip install 'eplb[report]'" in err


def test_demo_still_runs():
    out, _ = run("demo")
    assert "no rebalancing" in out and "greedy" in out and "balancedness" in out


def test_progress_goes_to_the_method_or_a_timer_and_never_changes_the_plan(monkeypatch, capsys):
    """A method with its own per-layer bar gets ``progress``; another slow method runs under a
    timer on stderr. Either way the plan is the one eplb.plan returns, and nothing is drawn
    without progress."""
    from eplb.model._validation import Option
    from eplb.cli import plan_with_progress
    from eplb.planning.methods import METHODS, OPTIONS

    greedy = METHODS["greedy"]
    seen = []

    def with_own_bar(weights, problem, progress=None):
        seen.append(progress)
        return greedy(weights, problem)

    monkeypatch.setitem(METHODS, "slow", lambda weights, problem: greedy(weights, problem))
    monkeypatch.setitem(METHODS, "own_bar", with_own_bar)
    monkeypatch.setitem(OPTIONS, "slow", {})
    monkeypatch.setitem(OPTIONS, "own_bar", {"progress": Option("bool", allow_none=True)})
    weights = COUNTS.sum(axis=0).astype(float)
    kwargs = dict(num_slots=40, num_gpus=8, num_nodes=2, num_groups=4)
    expected = eplb.plan(weights, method="greedy", **kwargs)
    placement, used_previous = plan_with_progress(weights, method="slow", progress=True, **kwargs)
    assert "planning 6 layers (slow)" in capsys.readouterr().err
    assert placement == expected and not used_previous
    placement, _ = plan_with_progress(weights, method="own_bar", progress=True, **kwargs)
    assert placement == expected and seen == [True]
    for method in ("slow", "own_bar"):
        assert plan_with_progress(weights, method=method, progress=False, **kwargs)[0] == expected
    assert seen == [True, False] and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="num_slots"):               # errors come back from the worker thread
        plan_with_progress(weights, method="slow", progress=True, **{**kwargs, "num_slots": 16})


def test_plan_from_a_series_objective_and_for_optimal_dispatch(tmp_path):
    from eplb.simulation.synthetic import drifting_counts

    series = drifting_counts(5, 3, 16, drift=0.4, seed=2).astype(np.float64)
    np.save(tmp_path / "series.npy", series)
    deployment = ["--slots", "20", "--gpus", "4", "--nodes", "2"]
    for extra, kwargs in ((["--objective", "expected_peak_search"], dict(objective="expected_peak_search")),
                          (["--dispatch", "optimal"], dict(dispatch="optimal"))):
        invoke("plan", "series.npy", *deployment, *extra, "-o", "p.json", cwd=tmp_path)
        expected = eplb.plan(series, num_slots=20, num_gpus=4, num_nodes=2, **kwargs)
        np.testing.assert_array_equal(read_placement(tmp_path / "p.json").placement.phy2log, expected.phy2log)
    # the default plans from the windows exactly as eplb.plan does with a series; --objective sum opts out
    out, _ = invoke("plan", "series.npy", *deployment, "-o", "p.json", cwd=tmp_path)
    np.testing.assert_array_equal(read_placement(tmp_path / "p.json").placement.phy2log,
                                  eplb.plan(series, num_slots=20, num_gpus=4, num_nodes=2).phy2log)
    assert "held out" in out and "in sample" in out
    summed = eplb.plan(series.sum(axis=0), num_slots=20, num_gpus=4, num_nodes=2)
    invoke("plan", "series.npy", *deployment, "--objective", "sum", "-o", "p.json", cwd=tmp_path)
    np.testing.assert_array_equal(read_placement(tmp_path / "p.json").placement.phy2log, summed.phy2log)
    invoke("plan", "series.npy", *deployment, "--objective", "sum", "-o", "q.json", cwd=tmp_path)
    _, err = invoke("plan", "series.npy", *deployment, "--objective", "quantile", "--previous", "q.json",
                    "-o", "p.json", cwd=tmp_path, expect=1)
    assert "objective" in err and "previous" in err

"""eplb compare: methods (eplb's and foreign ones) judged alike; figures checked against an
independent computation from each plan's phy2log; broken methods cost only their row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

import eplb
from eplb.method_comparison import compare
from eplb.io.comparison_report import format_table
from eplb.io.workloads import read_workload, tile_experts
from eplb.simulation.comparison import BROKEN, OK, Workload, check_plan, fold_edges
from eplb.simulation.method_runner import parse_method
from eplb.model.deployment import make_deployment
from cli_runner import invoke

# Marked slow test by test (each comparison runs its methods in fresh worker processes); the
# unmarked tests check this module in the fast tier (pytest -m "not slow").

HERE = Path(__file__).resolve().parents[1]  # tests/, where the helper modules are
PUBLISHED = str(HERE / "published_eplb.py")
BROKEN_METHODS = str(HERE / "compare_methods.py")
SMALL = dict(num_slots=40, num_gpus=8, num_nodes=2, num_groups=4)  # hierarchical: 4 groups on 2 nodes
WORKLOAD = "synthetic:lognormal:4x32x6"
TIMING = ("first_call_s", "warm_call_s")


def foreign(name: str) -> str:
    return f"{BROKEN_METHODS}:{name}"


# -- an independent computation of the figures from phy2log -----------------------------------------

def loads_from_phy2log(phy2log: np.ndarray, weights: np.ndarray, slots_per_gpu: int) -> np.ndarray:
    """``[L, G]`` GPU loads, each replica carrying ``w_e / r_e``, in plain loops."""
    num_layers, num_slots = phy2log.shape
    loads = np.zeros((num_layers, num_slots // slots_per_gpu))
    for layer in range(num_layers):
        replicas = np.bincount(phy2log[layer], minlength=weights.shape[1])
        for slot, expert in enumerate(phy2log[layer]):
            loads[layer, slot // slots_per_gpu] += weights[layer, expert] / replicas[expert]
    return loads


def mean_balance(loads: np.ndarray) -> float:
    """Mean over the layers carrying load of mean / max (NaN when none does)."""
    moe = loads.max(axis=1) > 0
    return float((loads[moe].mean(axis=1) / loads[moe].max(axis=1)).mean()) if moe.any() else np.nan


def check_row_independently(result, counts: np.ndarray, deployment: dict) -> None:
    k = deployment["num_slots"] // deployment["num_gpus"]
    weights = counts.sum(axis=0)
    loads = loads_from_phy2log(result.placement.phy2log, weights, k)
    moe = loads.max(axis=1) > 0
    f = result.figures
    assert f["balancedness"] == pytest.approx(mean_balance(loads), abs=1e-9)
    groups = deployment["num_groups"] if f["bound"] == "hierarchical" else None
    bound = eplb.lower_bound(weights, eplb.Deployment.of(weights.shape[-1], **{**deployment, "num_groups": groups}))
    assert f["gap"] == pytest.approx(float((loads.max(axis=1)[moe] / bound[moe] - 1).mean()), abs=1e-9)
    assert f["gap"] >= -1e-12  # the bound is proven: no plan beats it
    edges = fold_edges(counts.shape[0], f["folds"])
    scores = []
    for plan, lo, hi in zip(result.held_out_plans, edges[:-1], edges[1:]):
        per_window = [mean_balance(loads_from_phy2log(plan, counts[t], k)) for t in range(lo, hi)]
        scores.append(np.nanmean(per_window))
    assert f["held_out"] == pytest.approx(float(np.mean(scores)), abs=1e-9)
    # doubled replicas: per layer and GPU, its slots minus the distinct experts it holds
    per_gpu = result.placement.phy2log.reshape(-1, k)
    assert f["doubled"] == sum(k - len(set(block.tolist())) for block in per_gpu)


# -- one comparison with every kind of method -------------------------------------------------------

@pytest.fixture(scope="module")
def mixed():
    methods = ["greedy", "balanced", foreign("round_robin"), foreign("doubled"), foreign("wrong_shape"),
               foreign("missing_expert"), foreign("float_ids"), foreign("bad_logcnt"), foreign("raises"),
               foreign("returns_none"), foreign("dies"), str(HERE / "no_such_file.py")]
    comparison = compare(methods, [WORKLOAD], [SMALL], folds=3, warm_calls=1, array_type="numpy")
    return comparison, {r.method.rpartition(":")[2] if ":" in r.method else Path(r.method).name: r
                        for r in comparison.results}


@pytest.mark.slow
def test_figures_agree_with_an_independent_computation_from_phy2log(mixed):
    comparison, rows = mixed
    counts = read_workload(WORKLOAD).counts
    for name in ("greedy", "balanced", "round_robin", "doubled"):
        assert rows[name].status == OK, rows[name].reason
        check_row_independently(rows[name], counts, SMALL)


@pytest.mark.slow
def test_held_out_of_eplb_methods_is_eplb_held_out_from_the_sum(mixed):
    _, rows = mixed
    counts = read_workload(WORKLOAD).counts
    for name in ("greedy", "balanced"):
        expected = eplb.held_out(counts, method=name, objective="sum", folds=3, **SMALL)
        assert rows[name].figures["held_out"] == pytest.approx(float(expected.mean()), abs=1e-9)
        assert rows[name].figures["held_out_worst"] == pytest.approx(float(expected.min()), abs=1e-9)


@pytest.mark.parametrize("name, reason", [
    ("wrong_shape", "phy2log has shape [4, 39], expected [L, S] = [4, 40]"),
    ("missing_expert", "expert 1 has no replica in layer 0"),
    ("float_ids", "float64 values, expected integer expert ids"),
    ("bad_logcnt", "logcnt disagrees"),
    ("raises", "raised RuntimeError: this method is broken on purpose"),
    ("returns_none", "expected phy2log [L, S] or a tuple"),
    ("dies", "the worker process died (exit code 3)"),
    ("no_such_file.py", "could not load: FileNotFoundError"),
])
@pytest.mark.slow
def test_a_broken_method_gets_a_row_with_its_reason(mixed, name, reason):
    _, rows = mixed
    assert rows[name].status == BROKEN
    assert reason in rows[name].reason and "\n" not in rows[name].reason
    assert rows[name].placement is None


@pytest.mark.slow
def test_doubled_replicas_and_groups_off_their_node_are_flagged_not_refused(mixed):
    _, rows = mixed
    doubled, spread, greedy = rows["doubled"], rows["round_robin"], rows["greedy"]
    assert doubled.status == spread.status == OK
    # 5 slots a GPU: GPU 6 holds experts 30, 31, 0, 0, 0 (2 doubled), GPU 7 expert 0 five times (4), in 4 layers
    assert doubled.figures["doubled"] == 4 * (2 + 4)
    assert spread.figures["groups_off_node"] == 4 and spread.figures["bound"] == "global"
    assert greedy.figures["groups_off_node"] == 0 and greedy.figures["bound"] == "hierarchical"


def test_the_table_shows_every_methods_doubled_replicas_beside_the_gap(mixed):
    comparison, rows = mixed
    table = format_table(comparison.results).splitlines()
    head = table[0].index("method") + 28  # workload, deployment and method columns
    figures = table[0][head:].replace("held out", "held_out").replace("step ms", "step_ms").split()
    for name in ("greedy", "balanced", "round_robin", "doubled"):  # eplb's methods and foreign ones
        line = next(line for line in table[1:] if line[:head].rstrip().endswith(name))
        cells = dict(zip(figures, line[head:].split()))
        assert cells["gap"] == f"{100 * rows[name].figures['gap']:.2f}%"
        assert int(cells["doubled"]) == rows[name].figures["doubled"]
    assert figures.index("doubled") > figures.index("gap")


@pytest.mark.slow
def test_a_hanging_method_is_killed_at_the_time_limit():
    comparison = compare([foreign("loops"), foreign("round_robin")], [WORKLOAD], [SMALL], folds=2, warm_calls=0,
                         time_limit=10, array_type="numpy")
    hung, fine = comparison.results
    assert hung.status == BROKEN and hung.reason == "timed out after 10 s (killed)"
    assert fine.status == OK


@pytest.mark.slow
def test_the_published_algorithm_from_a_torch_file_equals_eplb_greedy_on_a_real_trace():
    """The target: the published greedy as a user has it (torch in and out, loaded from its file)
    beside greedy, balanced and best on the gpt-oss-20b trace, at a DeepSeek-V3-sized deployment
    (288 slots, 32 GPUs, 4 nodes, 8 groups of 32 experts: the trace's 32 experts tiled to 256 by
    interleaving 8 recorded layers, so each group holds 4 experts of each) and at the trace's own
    size (32 experts, 40 slots, 8 GPUs on 4 nodes, 8 groups): same loads, so the same
    balancedness, gap and held-out figures as eplb's greedy."""
    pytest.importorskip("torch")
    cases = [(256, dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)),
             (None, dict(num_slots=40, num_gpus=8, num_nodes=4, num_groups=8))]
    for tile, deployment in cases:
        try:
            comparison = compare([PUBLISHED, "greedy", "balanced", "best"], ["trace:gpt-oss-20b"], [deployment],
                                 tile_experts=tile, quick=True, array_type="torch")
        except ValueError as exc:
            if "trace:gpt-oss-20b" in str(exc) and "absent" in str(exc):
                pytest.skip(str(exc))
            raise
        published, greedy, balanced, best = comparison.results
        assert [r.status for r in comparison.results] == [OK] * 4, [r.reason for r in comparison.results]
        weights = read_workload("trace:gpt-oss-20b").counts
        weights = (tile_experts(Workload("t", weights), tile).counts if tile else weights)
        np.testing.assert_array_equal(published.placement.gpu_loads(weights.sum(axis=0)),
                                      greedy.placement.gpu_loads(weights.sum(axis=0)))
        for figure in ("balancedness", "gap", "worst_gap", "held_out", "step_ms", "doubled"):
            assert published.figures[figure] == greedy.figures[figure], figure
        assert best.figures["gap"] <= greedy.figures["gap"] + 1e-12
        for row in comparison.results:
            check_row_independently(row, weights, deployment)


# -- the command ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_every_output_and_exits_0_with_a_broken_row(tmp_path):
    counts = read_workload(WORKLOAD).counts
    np.save(tmp_path / "counts.npy", counts)
    out, err = invoke("compare", "counts.npy", "-m", "greedy", "-m", foreign("raises"), "--slots", "40",
                      "--gpus", "8", "--nodes", "2", "--groups", "4", "--folds", "2", "--warm-calls", "1",
                      "--array", "numpy", "-o", "report", cwd=tmp_path)
    lines = out.splitlines()
    assert any("greedy" in line and "BROKEN" not in line for line in lines)
    assert any("BROKEN: the in-sample plan: raised RuntimeError" in line for line in lines)
    report = tmp_path / "report"
    assert {"compare.csv", "run.json", "index.html"} <= {p.name for p in report.iterdir()}
    record = json.loads((report / "run.json").read_text())
    assert record["versions"]["eplb"] == eplb.__version__ and record["versions"]["numpy"] == np.__version__
    assert record["config"]["seed"] == 0 and record["config"]["deployments"][0]["num_groups"] == 4
    assert record["config"]["command"].startswith("eplb compare")
    assert [row["status"] for row in record["rows"]] == [OK, BROKEN]
    assert "BROKEN" not in (report / "compare.csv").read_text()  # status column says broken
    assert "broken" in (report / "compare.csv").read_text()


@pytest.mark.slow
def test_a_file_named_eplb_py_in_the_working_folder_shadows_nothing(tmp_path):
    """DeepSeek's file is eplb.py: compared from its own folder, it must not stand in for the
    package in the workers (every row broke with "'eplb' is not a package")."""
    (tmp_path / "eplb.py").write_text(
        "import numpy as np\n\n"
        "def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):\n"
        "    layers, experts = np.asarray(weight).shape\n"
        "    return np.tile(np.arange(num_replicas) % experts, (layers, 1))\n")
    np.save(tmp_path / "counts.npy", read_workload(WORKLOAD).counts)
    out, _ = invoke("compare", "counts.npy", "-m", "eplb.py", "-m", "greedy", "--deployment", "40:8", "--folds", "2",
                    "--warm-calls", "1", "--array", "numpy", cwd=tmp_path)
    rows = [line for line in out.splitlines() if "40 slots" in line]
    assert len(rows) == 2 and not any("BROKEN" in row for row in rows), out


@pytest.mark.slow
def test_cli_refuses_a_bad_deployment_spec_in_one_line(tmp_path):
    _, err = invoke("compare", WORKLOAD, "--deployment", "40:x", cwd=tmp_path, expect=1)
    assert "--deployment must be SLOTS:GPUS[:NODES[:GROUPS]]" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_notes_a_deployment_that_does_not_fit_and_fails_when_nothing_does(tmp_path):
    _, err = invoke("compare", WORKLOAD, "-m", "greedy", "--deployment", "16:8", cwd=tmp_path, expect=1)
    assert "nothing to compare" in err and "num_slots (16) must be >= the number of experts (32)" in err


# -- reruns and inputs -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rerun_gives_the_same_figures_bit_for_bit():
    def figures(comparison):
        return [{k: v for k, v in row.items() if k not in TIMING} for row in comparison.rows()]

    first = compare(["greedy"], ["synthetic:zipf:3x32x4"], [SMALL], folds=2, warm_calls=0, seed=7)
    second = compare(["greedy"], ["synthetic:zipf:3x32x4"], [SMALL], folds=2, warm_calls=0, seed=7)
    assert json.dumps(figures(first)) == json.dumps(figures(second))
    assert first.config == second.config and first.config["seed"] == 7


@pytest.mark.parametrize("spec, message", [
    ("greedy ", "MODULE:FUNCTION or FILE.py[:FUNCTION]"),
    ("pkg.mod:", "MODULE:FUNCTION"),
    ("", "non-empty"),
])
def test_parse_method_refuses_what_names_no_method(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_method(spec)


def test_compare_refuses_a_function_a_worker_cannot_import():
    with pytest.raises(ValueError, match="cannot be imported by a worker process"):
        compare([lambda *args: None], [WORKLOAD], [SMALL])


@pytest.mark.parametrize("spec, message", [
    ("synthetic:pareto", "family must be one of"),
    ("synthetic:zipf:4x32", "size must be LxExT"),
    ("trace:deepseek", "the trace must be one of"),
])
def test_read_workload_names_the_rule(spec, message):
    with pytest.raises(ValueError, match=message):
        read_workload(spec)


@given(windows=st.integers(1, 3), layers=st.integers(1, 7), experts=st.integers(1, 5), factor=st.integers(1, 4))
def test_tile_experts_interleaves_consecutive_layers(windows, layers, experts, factor):
    counts = np.arange(windows * layers * experts, dtype=np.float64).reshape(windows, layers, experts)
    workload = Workload("w", counts)
    if layers < factor:
        with pytest.raises(ValueError, match="needs at least"):
            tile_experts(workload, factor * experts)
        return
    tiled = tile_experts(workload, factor * experts).counts
    assert tiled.shape == (windows, layers // factor, factor * experts)
    for j in range(layers // factor):
        for i in range(factor):
            np.testing.assert_array_equal(tiled[:, j, i::factor], counts[:, j * factor + i])


def test_check_plan_accepts_a_valid_plan_and_names_an_id_out_of_range():
    problem = make_deployment(4, 8, 2)
    phy2log = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    np.testing.assert_array_equal(check_plan((phy2log, None, None), 1, 4, problem), phy2log)
    with pytest.raises(ValueError, match="ids 0..4, expected 0..3"):
        check_plan((phy2log + (phy2log == 3), None, None), 1, 4, problem)

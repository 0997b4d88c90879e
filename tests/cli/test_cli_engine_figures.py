"""The figures a person reads (issue 29, items 5, 6, 7 and 13): with ``--engine`` every figure of
``plan``, ``validate`` and ``report`` is judged under the engine's dispatch rule against a bound
that holds under it; held-out estimates leave out windows carrying no load; ``--previous`` says
when the deployed placement serves better; ``sweep`` checks its flags, takes ``--check-every``
and says each warning once."""

from __future__ import annotations

import csv
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb
from cli_runner import invoke
from eplb.analysis.metrics import moe_mean
from eplb.analysis.placement import Placement
from eplb.io.formats import read_counts, read_placement
from eplb.io.report import bound_for
from eplb.model.topology import Topology
from eplb.simulation.sweep import sweep
from eplb.simulation.synthetic import drifting_counts
from strategies import configs, counts_for

DEPLOYMENT = ("-s", "48", "-g", "8", "-n", "2")


def series(windows=4, layers=3, experts=32, seed=4):
    return drifting_counts(windows, layers, experts, drift=0.3, tokens=4000, num_groups=8, seed=seed).astype(np.int64)


def figure(out: str, prefix: str, after: str = "") -> float:
    """The first number after ``after`` on the line of ``out`` starting with ``prefix``."""
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return float(re.search(r"-?\d+\.\d+", line[line.index(after) + len(after):] if after else line[len(prefix):])[0])


# ----------------------------------------------------------------------------- item 5: --engine

@pytest.fixture(scope="module")
def static_plan(tmp_path_factory):
    """A plan made with ``--engine sglang-static`` from a series, its files and the command's output."""
    folder = tmp_path_factory.mktemp("engine")
    np.save(folder / "series.npy", series())
    out, _ = invoke("plan", "series.npy", *DEPLOYMENT, "--engine", "sglang-static", "-o", "p.json", cwd=folder)
    return folder, out


def static_figures(folder):
    """The static plan's series ``[T, L, E]``, summed weights, placement and balancedness under SGLang's static table."""
    counts = np.load(folder / "series.npy").astype(float)
    weights = counts.sum(axis=0)
    placement = read_placement(folder / "p.json").placement
    return counts, weights, placement, moe_mean(placement.balancedness(weights, "sglang-static"), weights)


def test_plan_with_engine_judges_headline_held_out_and_gap_under_the_rule(static_plan):
    folder, out = static_plan
    counts, weights, placement, static = static_figures(folder)
    even = moe_mean(placement.balancedness(weights, "uniform"), weights)
    assert abs(static - even) > 1e-4  # the rule makes a difference here, so the test tells them apart
    balance = next(x for x in out.splitlines() if x.startswith("balance"))
    assert f"{static:.4f} with the plan" in balance and "under SGLang static dispatch" in balance
    assert "every figure of this summary is judged under this rule" in out
    assert f"split evenly among replicas: {even:.4f}" in out
    held = eplb.held_out(counts, num_slots=48, num_gpus=8, num_nodes=2, dispatch="sglang-static")
    assert f"held out {held.mean():.4f} mean" in out
    # the gap is measured on the loads under the rule against a bound that holds under it
    bound = bound_for(weights, placement, "sglang-static")
    gap = placement.gpu_loads(weights, "sglang-static").max(axis=-1) / bound.values - 1
    assert (gap >= -1e-12).all()
    assert f"{100 * gap.mean():.2f}% mean" in out and "(any split)" in out


def test_a_plan_file_made_for_an_engine_is_judged_under_its_rule_without_engine(static_plan):
    folder, _ = static_plan
    _, weights, placement, static = static_figures(folder)
    assert placement.dispatch == "sglang-static"  # eplb JSON records the rule the plan was made for
    even = moe_mean(placement.balancedness(weights, "vllm"), weights)
    assert abs(static - even) > 1e-4
    checked, _ = invoke("validate", "p.json", "--counts", "series.npy", cwd=folder)
    assert "the rule p.json records the plan was made for" in checked
    assert figure(checked, "balance") == pytest.approx(static, abs=5e-5)
    evenly, _ = invoke("validate", "p.json", "--counts", "series.npy", "--engine", "vllm", cwd=folder)
    assert "records the plan" not in evenly and figure(evenly, "balance") == pytest.approx(even, abs=5e-5)
    reported, _ = invoke("report", "series.npy", "p.json", "-o", "recorded", cwd=folder)
    assert "the rule p.json records the plan was made for" in reported and f"in sample {static:.4f}" in reported


def test_validate_and_report_with_engine_judge_every_figure_under_the_rule(static_plan):
    folder, _ = static_plan
    counts, weights, placement, static = static_figures(folder)
    checked, _ = invoke("validate", "p.json", "--counts", "series.npy", "--engine", "sglang-static", cwd=folder)
    assert figure(checked, "balance") == pytest.approx(static, abs=5e-5)
    assert "under SGLang static dispatch" in next(x for x in checked.splitlines() if x.startswith("balance"))
    assert figure(checked, "gap") >= 0
    windows = moe_mean(placement.balancedness(counts, "sglang-static"), counts)
    assert f"{windows.min():.4f}..{windows.max():.4f}" in checked

    reported, _ = invoke("report", "series.npy", "p.json", "-o", "rep", "--engine", "sglang-static", cwd=folder)
    assert f"in sample {static:.4f} on the summed windows" in reported
    assert f"each of the 4 windows: {np.nanmean(windows):.4f} mean" in reported
    held = eplb.held_out(counts, topology=placement.topology, dispatch="sglang-static")
    assert f"{held.mean():.4f} mean" in reported
    page = (folder / "rep" / "index.html").read_text()
    greedy = eplb.plan(weights, method="greedy", topology=placement.topology)
    judged = moe_mean(greedy.balancedness(weights, "sglang-static"), weights)
    # headline and greedy's comparison both under the rule, and the page says so
    assert "balancedness under SGLang static dispatch (mean over layers)" in page
    assert f"plan {static:.4f} · greedy on the same configuration {judged:.4f}" in page
    assert "every figure is under SGLang static dispatch" in page


def test_make_report_under_an_engine_uses_the_rule_for_the_figures(static_plan, tmp_path):
    from eplb.io.report import make_report

    folder, _ = static_plan
    data, plan = read_counts(folder / "series.npy"), read_placement(folder / "p.json")
    (tmp_path / "under").mkdir()
    (tmp_path / "even").mkdir()
    under = make_report(data, plan, tmp_path / "under", engine="sglang-static")
    even = make_report(data, plan, tmp_path / "even")
    assert under.summary["lower bound"].startswith("any split among replicas")
    assert not even.summary["lower bound"].startswith("any split")
    assert under.summary["per window"] != even.summary["per window"]  # the windows figure follows the rule
    for path in under.figures:
        assert path.stat().st_size > 0


def test_the_even_split_bound_does_not_hold_under_sglang_static_dispatch():
    """Why the gap under an engine's rule needs its own bound: SGLang's static table splits expert
    2 between GPUs 1 and 2 as 2/3 : 1/3 (GPU 0 holds no replica and sends its tokens to one), so
    this placement serves below the proven optimum of every even-split placement."""
    weights = np.array([[159.0, 6.0, 370.0, 251.0, 59.0]])
    placement = Placement(phy2log=np.array([[3, 1, 2, 4, 2, 0]]), num_experts=5, topology=Topology.uniform(6, 3))
    static_peak = placement.gpu_loads(weights, "sglang-static").max(axis=-1)
    assert (bound_for(weights, placement).values > static_peak * 1.1).all()   # a negative gap of over 10%
    assert (bound_for(weights, placement, "sglang-static").values <= static_peak).all()
    assert (bound_for(weights, placement, "vllm").values == bound_for(weights, placement).values).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(max_experts=16, max_gpus=8, max_slots_per_gpu=4), data=st.data(),
       rule=st.sampled_from(["sglang-static", "sglang-dynamic", "optimal"]), planned_for_it=st.booleans())
def test_the_gap_under_a_rule_is_never_negative(config, data, rule, planned_for_it):
    """For any counts and deployment, planned for the rule or not, read back without home nodes or
    not: the bound the summaries judge a placement by under a rule is never above its max GPU load."""
    weights = data.draw(counts_for(config["num_experts"]))
    deployment = {k: v for k, v in config.items() if k != "num_experts"}
    if deployment["num_groups"] is not None and deployment["num_groups"] % deployment["num_nodes"]:
        deployment["num_groups"] = None
    options = {"dispatch": rule} if planned_for_it and rule != "optimal" else {}
    placement = eplb.plan(weights, **deployment, **options)
    if data.draw(st.booleans()):  # as read from an engine's file: no home nodes recorded
        placement = Placement(phy2log=placement.phy2log, num_experts=placement.num_experts,
                              topology=placement.topology, num_groups=placement.num_groups)
    peak = placement.gpu_loads(weights, rule).max(axis=-1)
    bound = bound_for(weights, placement, rule).values
    assert (bound <= peak * (1 + 1e-9) + 1e-9).all()


# ----------------------------------------------------------------------------- item 7: held out

def test_held_out_skips_windows_carrying_no_load_and_says_so(tmp_path):
    counts = series(windows=4)
    counts[2] = 0  # an idle pass
    np.save(tmp_path / "idle.npy", counts)
    out, _ = invoke("plan", "idle.npy", *DEPLOYMENT, "-o", "p.json", cwd=tmp_path)
    assert "nan" not in out
    api = eplb.held_out(counts, num_slots=48, num_gpus=8, num_nodes=2)
    assert np.isnan(api).sum() == 1
    held = next(x for x in out.splitlines() if x.startswith("held out"))
    assert f"{np.nanmean(api):.4f} mean, {np.nanmin(api):.4f} worst" in held
    assert "each of 3 blocks" in held and "1 block of windows carrying no load left out" in held
    reported, _ = invoke("report", "idle.npy", "p.json", "-o", "rep", cwd=tmp_path)
    assert "nan" not in reported
    assert f"{np.nanmean(api):.4f} mean" in reported and "1 block of windows carrying no load left out" in reported


# ----------------------------------------------------------------------------- item 7: --previous

def test_previous_regrouping_is_one_line_and_a_better_deployed_plan_is_said(tmp_path):
    counts = series(windows=4, layers=3, experts=32, seed=1)
    np.save(tmp_path / "s.npy", counts)
    # deployed: a global plan for the summed counts, which spreads the groups over the nodes
    invoke("plan", "s.npy", *DEPLOYMENT, "--objective", "sum", "--no-held-out", "-o", "deployed.json", cwd=tmp_path)
    out, err = invoke("plan", "s.npy", *DEPLOYMENT, "-k", "8", "--previous", "deployed.json", "--max-moves", "2",
                      "--no-held-out", "-o", "new.json", cwd=tmp_path)
    assert "Warning" not in err and "[" not in err  # no raw warning and no lists of layers
    weights = counts.sum(axis=0).astype(float)
    deployed = moe_mean(read_placement(tmp_path / "deployed.json").placement.balancedness(weights), weights)
    new = moe_mean(read_placement(tmp_path / "new.json").placement.balancedness(weights), weights)
    assert deployed > new  # a hierarchical plan cannot match the global one here
    warning = next(x for x in out.splitlines() if x.startswith("WARNING"))
    assert f"({deployed:.4f} against {new:.4f})" in warning and "every expert group on one node" in warning
    regroup = next(x for x in out.splitlines() if x.startswith("regroup"))
    assert "more than --max-moves 2" in regroup
    # and no warning when the deployed placement is the one the plan keeps
    same, _ = invoke("plan", "s.npy", *DEPLOYMENT, "--objective", "sum", "--previous", "deployed.json",
                     "--no-held-out", "-o", "again.json", cwd=tmp_path)
    assert "WARNING" not in same and "regroup" not in same


# ----------------------------------------------------------------------------- item 6: the time line

def test_plan_time_line_says_what_it_measures(tmp_path):
    np.save(tmp_path / "s.npy", series())
    out, _ = invoke("plan", "s.npy", *DEPLOYMENT, "-o", "p.json", cwd=tmp_path)
    line = next(x for x in out.splitlines() if x.startswith("time"))
    planning, whole = (float(v) for v in re.findall(r"(\d+\.\d+) s", line))
    assert "reading and planning" in line and "whole command" in line
    assert whole >= planning  # the held-out estimate, the bound and writing come on top


# ----------------------------------------------------------------------------- sweep

@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    np.save(folder / "steps.npy", drifting_counts(60, 2, 32, drift=0.1, tokens=512, num_groups=8, seed=4))
    return folder


@pytest.mark.parametrize("flags, named", [
    (("--gpus", "0"), "--gpus"), (("--gpus", "8", "--nodes", "0"), "--nodes"), (("--gpus", "8,8"), "--gpus"),
    (("--gpus", "6", "--nodes", "4"), "--nodes"), (("--gpus", "8", "-k", "5"), "--groups"),
    (("--gpus", "8", "--extra-slots", "-1"), "--extra-slots"), (("--gpus", "8", "--check-every", "0"), "--check-every"),
    (("--gpus", "8", "--workers", "0"), "--workers"),
])
def test_sweep_flags_get_a_usage_error(steps, flags, named):
    _, err = invoke("sweep", "steps.npy", *flags, "-o", "out", cwd=steps, expect=2)
    assert named in err and "Traceback" not in err


@pytest.mark.slow  # two simulated sweeps: 25 s
def test_sweep_says_a_runs_warning_once_and_check_every_makes_the_balancer_act(steps):
    args = ("sweep", "steps.npy", "--extra-slots", "0,1", "--gpus", "8", "--nodes", "1,2", "-p", "balancer",
            "--model", "gpt-oss-20b", "--workers", "2")
    _, err = invoke(*args, "-o", "idle", cwd=steps)
    assert err.count("never acts") == 1 and "RuntimeWarning" not in err
    _, err = invoke(*args, "--check-every", "10", "-o", "acting", cwd=steps)
    assert "never acts" not in err
    rebalances = lambda name: [int(row["rebalances"]) for row in  # noqa: E731
                               csv.DictReader((steps / name / "sweep.csv").open())]
    assert rebalances("idle") == [0, 0, 0, 0]
    assert all(n > 0 for n in rebalances("acting"))


@pytest.mark.slow  # a simulated sweep (12 s on an empty cache)
def test_sweep_raises_each_warning_once_in_the_caller():
    counts = drifting_counts(30, 2, 16, drift=0.1, tokens=256, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = sweep(counts, eplb.Deployment.grid(16, extra_slots_per_gpu=(0, 1), num_gpus=(4,), num_nodes=(1, 2)),
                     policies=("balancer",), workers=2)
    assert len(rows) == 4
    assert sum("never acts" in str(w.message) for w in caught) == 1
    acting = sweep(counts, eplb.Deployment.of(16, num_slots=20, num_gpus=4), policies=("balancer",), workers=1,
                   check_every=5)
    assert acting[0]["rebalances"] > 0
    with pytest.raises(ValueError, match="check_every"):
        sweep(counts, eplb.Deployment.of(16, num_slots=20, num_gpus=4), workers=1, check_every=0)

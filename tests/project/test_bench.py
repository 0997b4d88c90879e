"""The benchmark scripts on tiny sizes, so that ``bench/`` keeps running as the package changes.

Timings are not asserted (they belong to ``bench/results``); the tests check that every section
runs, writes its CSV / PNG files and reports what it should.
"""

import csv
import importlib

import pytest


pytestmark = pytest.mark.slow  # runs the benchmark sections at small sizes

speed = importlib.import_module("speed")
startup = importlib.import_module("startup")
runner = importlib.import_module("run")


def read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_speed_times_greedy_and_the_numpy_port_side_by_side(tmp_path):
    text = speed.run(True, tmp_path, sweeps=(("layers", (1, 2), (1, 2)),), methods=["greedy"])
    rows = read(tmp_path / "speed.csv")
    assert {r["method"] for r in rows} == {"greedy", speed.NUMPY_PORT}
    assert sorted({int(r["layers"]) for r in rows}) == [1, 2]
    assert all(float(r["median_ms"]) > 0 and float(r["speedup_vs_numpy_port"]) > 0 for r in rows)
    deepseek = {r["method"]: r for r in read(tmp_path / "speed_deepseek_v3.csv")}
    assert {"greedy", speed.NUMPY_PORT, "plan(greedy)"} <= set(deepseek)
    assert (deepseek["greedy"]["experts"], deepseek["greedy"]["slots"], deepseek["greedy"]["gpus"]) == ("256", "288", "32")
    assert (tmp_path / "speed.png").stat().st_size > 0
    assert "## Speed" in text and "<= 2 ms" in text
    assert any("greedy" in figure for figure, _, _ in speed.headline(tmp_path))


def test_sweep_points_are_valid_deployments():
    for axis, values, quick_values in speed.SWEEPS:
        assert set(quick_values) <= set(values)
        for value in values:
            c = speed.point_config(axis, value)
            assert c[axis] == value
            assert c["slots"] >= c["experts"] and c["slots"] % c["gpus"] == 0
            assert c["experts"] % c["groups"] == 0 and c["gpus"] % c["nodes"] == 0


def test_startup_measures_fresh_processes(tmp_path):
    # the cold compile (an empty cache folder) takes tens of seconds here: the full bench run measures it
    text = startup.run(True, tmp_path, entries=("plan greedy", "rebalance_experts greedy"), cold=False,
                       warm_folder=str(tmp_path))  # not the user's quick-run cache
    rows = read(tmp_path / "startup.csv")
    assert [(r["kind"], r["entry"]) for r in rows] == [("warm cache", "plan greedy"),
                                                      ("warm cache", "rebalance_experts greedy")]
    for r in rows:
        assert float(r["import_s"]) > 0 and float(r["first_call_s"]) > 0
        assert float(r["process_wall_s"]) >= float(r["import_plus_first_call_s"])
    assert "## Start-up" in text and (tmp_path / "startup.png").exists()
    assert len(startup.headline(tmp_path)) == 2


def test_runner_reports_absent_and_failing_sections_and_keeps_going(tmp_path, monkeypatch):
    (tmp_path / "broken_section.py").write_text("def run(quick, results_dir):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runner, "BENCH", tmp_path)
    (tmp_path / "fine_section.py").write_text(
        "def run(quick, results_dir):\n    return '## Fine'\n"
        "def headline(results_dir):\n    return [('a figure', '1 ms', '<= 2 ms')]\n")
    records = runner.run_sections(["not_there", "broken_section", "fine_section"], True, tmp_path)
    assert [r["status"] for r in records] == ["absent", "FAILED", "ok"]
    assert "boom" in records[1]["markdown"]
    text = runner.summary(records, True, "now", 1.0, tmp_path)
    assert "| a figure | 1 ms | <= 2 ms |" in text and "## Fine" in text


def _recorded_section(folder, monkeypatch):
    """A section ``recorded`` in ``folder`` with one headline row, and ``runner`` pointed at it."""
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(runner, "BENCH", folder)
    (folder / "recorded.py").write_text(
        "def run(quick, results_dir):\n    return '## Recorded\\n\\nbody'\n"
        "def headline(results_dir):\n    return [('recorded figure', '3 ms', '<= 5 ms')]\n")
    monkeypatch.setattr(runner, "SECTIONS", (("recorded", "Recorded", "a section recorded earlier"),))


def test_partial_rerun_keeps_the_other_sections_headlines(tmp_path, monkeypatch):
    _recorded_section(tmp_path, monkeypatch)
    runner.run_sections(["recorded"], True, tmp_path)  # recorded earlier
    records = runner.run_sections(["not_there"], True, tmp_path)
    runner.collect_headlines(records, tmp_path)
    by_name = {r["name"]: r for r in records}
    assert by_name["recorded"]["status"].startswith("not run") and by_name["recorded"]["headline"]
    table = runner.headline_table(records, True, "now", tmp_path)
    assert "| recorded figure | 3 ms | <= 5 ms |" in table
    assert "Recorded: figures recorded by an earlier run" in table


def test_runner_main_writes_the_summary(tmp_path, monkeypatch):
    _recorded_section(tmp_path, monkeypatch)
    status = runner.main(["--quick", "--only", "recorded", "--results-dir", str(tmp_path), "--no-readme"])
    assert status == 0
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "## Recorded" in summary and "## Headline" in summary
    assert (tmp_path / "section_recorded.md").read_text().startswith("## Recorded")


def test_research_sections_are_the_scripts_in_bench_research():
    research = [name for name, _, _ in runner.SECTIONS if name.startswith("research.")]
    assert research and all(runner.section_path(name).exists() for name in research)
    assert all(runner.section_path(name).parent.name == "research" for name in research)
    assert {runner.short_name(name) for name in research}.isdisjoint(
        name for name, _, _ in runner.SECTIONS if "." not in name)  # their files keep one name each


def test_readme_table_takes_the_sections_readme_rows_and_at_most_twelve(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runner, "BENCH", tmp_path)
    (tmp_path / "user_section.py").write_text(
        "def run(quick, results_dir):\n    return '## User'\n"
        "def readme_rows(results_dir):\n    return [('plan time', '1 ms', 'the published greedy: 9 ms')]\n")
    monkeypatch.setattr(runner, "SECTIONS", (("user_section", "User", "rows for the README"),))
    assert runner.readme_sections() == ["user_section"]
    records = runner.run_sections(["user_section"], False, tmp_path)
    table = runner.readme_table(records, "now", "abc1234")
    assert "| plan time | 1 ms | the published greedy: 9 ms |" in table and "abc1234" in table
    with pytest.raises(ValueError, match="at most 12"):
        runner.readme_table([{**records[0], "readme": records[0]["readme"] * 13}], "now", "abc1234")


@pytest.mark.parametrize("has_markers", [False, True])
def test_readme_headline_goes_between_markers_above_design(tmp_path, has_markers):
    readme = tmp_path / "README.md"
    original = "# eplb\n\n## Use\n\ntext\n\n## Design\n\nmore\n"
    readme.write_text(original)
    if has_markers:
        runner.update_readme(readme, "old table")
    runner.update_readme(readme, "| figure | measured | target |")
    text = readme.read_text()
    assert text.count(runner.START) == 1 and text.count(runner.END) == 1 and "old table" not in text
    assert text.index("## Use") < text.index("## Benchmarks") < text.index(runner.START) < text.index("## Design")
    assert "| figure | measured | target |" in text and text.endswith("## Design\n\nmore\n")


def test_every_section_records_the_commit_it_ran_at(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runner, "BENCH", tmp_path)
    (tmp_path / "stamped_section.py").write_text("def run(quick, results_dir):\n    return '## Stamped\\n\\nbody'\n")
    records = runner.run_sections(["stamped_section"], True, tmp_path, "at commit abc1234, today")
    assert records[0]["markdown"].splitlines()[:3] == ["## Stamped", "", "_at commit abc1234, today_"]
    assert "body" in records[0]["markdown"]


def test_engine_dispatch_bench_scores_every_engine_mode(tmp_path):
    engines = importlib.import_module("engine_dispatch")
    text = engines.run(True, tmp_path)
    with open(tmp_path / "engine_dispatch.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["dispatch"] for r in rows} == set(engines.MODES)
    for key in {(r["series"], r["deployment"]) for r in rows}:
        block = {r["dispatch"]: r for r in rows if (r["series"], r["deployment"]) == key}
        # optimal dispatch is the min-max split: no engine's fixed split serves a window better
        assert all(float(block["optimal"]["held_out_mean"]) >= float(r["held_out_mean"]) - 1e-9 for r in block.values())
    assert "Engine dispatch" in text and engines.headline(tmp_path)


def test_robust_default_section_on_tiny_sizes():
    """The robust-default bench: its families have the promised shapes, its held-out protocols
    score every held-out window, and the markdown reports the smallest gain over the summed plan."""
    import numpy as np
    import robust_default

    phases = robust_default.phase_workloads(1, 2, 16, 4)
    assert phases.shape == (12, 2, 16)
    np.testing.assert_allclose(phases.sum(axis=2), 1.0)
    windows = robust_default._sampled(phases[:4], seed=2, tokens=5000)
    deployment = dict(num_slots=20, num_gpus=4)
    loo = robust_default.held_out(windows, "leave-one-out", deployment, {})
    assert loo.shape == (4,) and ((loo > 0) & (loo <= 1)).all()
    series = np.concatenate([windows] * 6)  # 24 windows: plan on 16, serve 8
    assert robust_default.held_out(series, "next-window", deployment, {"objective": "sum"}).shape == (8,)
    row = {"family": "tiny", "protocol": "leave-one-out", "deployment": "20/4", "shift_structure": 0.5,
           **{label: (float(loo.mean()), float(loo.min())) for label in robust_default.PLANS}}
    text = robust_default.markdown([row], [], [], 1.0)
    assert "+0.0000" in text and "tiny" in text


def test_engine_planning_bench_judges_plans_under_sglang_static(tmp_path):
    engine_planning = importlib.import_module("engine_planning")
    tiny = dict(num_layers=2, num_experts=32, num_groups=8, top_k=4, tokens=2000,
                deployments={"global 48/8/2": dict(num_slots=48, num_gpus=8, num_nodes=2, num_groups=None),
                             "hierarchical 48/8/2": dict(num_slots=48, num_gpus=8, num_nodes=2, num_groups=8)})
    text = engine_planning.run(True, tmp_path, shape=tiny, traces=False)
    rows = read(tmp_path / "engine_planning.csv")
    assert {(r["series"].split(" ")[0], r["deployment"]) for r in rows} == {
        (s, d) for s in ("workloads", "mixture") for d in tiny["deployments"]}
    for r in rows:
        assert int(r["folds"]) == 3
        for column in engine_planning.COLUMNS:
            assert 0 < float(r[f"{column} worst"]) <= float(r[f"{column} mean"]) <= 1
    assert "## Engine planning" in text and "at commit" in text
    assert (tmp_path / "engine_planning.md").read_text().strip() == text.strip()
    assert len(engine_planning.headline(tmp_path)) == 2


def test_elastic_measures_every_change_beside_the_engines_answers(tmp_path):
    elastic = importlib.import_module("elastic")
    text = elastic.run(True, tmp_path)
    rows = read(tmp_path / "elastic.csv")
    assert {"before the change", "from scratch", "donor repair"} <= {r["plan"] for r in rows}
    assert sum(r["plan"].endswith("(default)") for r in rows) == len({(r["configuration"], r["family"]) for r in rows})
    assert all(r["valid"] == "True" for r in rows)
    for r in rows:
        if r["plan"] == "donor repair":  # the engines' repair copies exactly the floor
            assert r["copies"] == r["floor"]
        elif r["plan"].startswith("eplb"):
            assert int(r["copies"]) >= int(r["floor"]) and float(r["balance_in_sample"]) > 0
    steps = read(tmp_path / "elastic_sequence.csv")
    assert len(steps) == 4 * len({r["family"] for r in steps}) and all(r["valid"] == "True" for r in steps)
    assert len(read(tmp_path / "elastic_time.csv")) == 4
    assert "## Elastic" in text and "### The tolerance across a change" in text
    assert any("Warm re-plan" in figure for figure, _, _ in elastic.headline(tmp_path))

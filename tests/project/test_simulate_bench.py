"""bench/simulate.py on tiny sizes, so that it keeps running as the package changes (figures are
not asserted: they belong to bench/results)."""

import csv
import importlib
import pytest

pytestmark = pytest.mark.slow  # runs the simulation benchmark sections at small sizes

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


def test_decision_rule_bench_tunes_on_one_series_and_reports_the_other(tmp_path):
    decision = importlib.import_module("decision_rule")
    text = decision.run(True, tmp_path, blocks=2)
    with open(tmp_path / "decision_rule.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    synthetic = {(s, p) for s in decision.SERIES_SEEDS for p in decision.PHASES}
    real = {(decision.REAL, "prefill")} if decision.real_trace_series(2) else set()
    assert {(r["series"], r["phase"]) for r in rows} == synthetic | real
    assert {r["key"] for r in rows} == {"none"} | {key for key, _, _ in decision.CANDIDATES}
    assert decision.chosen(rows)[0] in {key for key, _, _ in decision.CANDIDATES}
    assert "Least time lost with stalls on the tuning series" in text
    assert len(decision.headline(tmp_path)) == len(decision.PHASES) * len(decision.DEPLOYMENTS)


def test_decision_rule_changes_a_default_only_when_the_winner_also_wins_held_out():
    decision = importlib.import_module("decision_rule")

    def rows(held_out, real):
        return [{"series": series, "key": key, "lost_with_stalls_share": str(lost), "copies": "10"}
                for series, losses in (("held out", held_out), (decision.REAL, real))
                for key, lost in zip(("defaults", "winner"), losses)]

    assert "so the defaults should become it" in decision.held_out_verdict(rows((0.2, 0.1), (0.2, 0.1)), "winner")
    assert "so the defaults stay" in decision.held_out_verdict(rows((0.2, 0.1), (0.1, 0.2)), "winner")
    assert "defaults are that candidate" in decision.held_out_verdict(rows((0.2, 0.1), (0.2, 0.1)), "defaults")


def test_decision_rule_falls_back_to_the_fastest_when_no_candidate_plans_in_time():
    """Issue 22, item 14: on a busy machine every candidate may plan above the target."""
    decision = importlib.import_module("decision_rule")
    rows = [{"series": "tuning", "key": key, "plan_ms": str(decision.PLAN_MS + 10.0 + i), "lost_with_stalls_share": str(0.1 - 0.01 * i)}
            for i, (key, _, _) in enumerate(decision.CANDIDATES)]
    winner, note = decision.chosen(rows)
    assert winner == decision.CANDIDATES[0][0] and "no candidate planned within" in note
    rows[3]["plan_ms"] = "1.0"
    assert decision.chosen(rows) == (decision.CANDIDATES[3][0], "")


def test_chunks_bench_applies_the_same_copies_at_every_chunk_size(tmp_path):
    chunks = importlib.import_module("simulate_chunks")
    text = chunks.run(True, tmp_path, blocks=20)
    with open(tmp_path / "simulate_chunks.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for deployment in {r["deployment"] for r in rows}:
        mine = [r for r in rows if r["deployment"] == deployment]
        assert len(mine) == len(chunks.LAYERS_PER_STEP)
        whole = next(r for r in mine if r["layers_per_step"] == "")
        assert {r["rebalances"] for r in mine} == {whole["rebalances"]}  # the same decisions
        # the same plans' copies, spread over steps (fewer only where the series ends mid-application)
        assert all(0 < int(r["copies"]) <= int(whole["copies"]) for r in mine)
        assert all(float(r["max_stall_ms"]) <= float(whole["max_stall_ms"]) + 1e-9 for r in mine)
    assert "chunks of layers" in text


def test_loop_frontier_bench_measures_every_policy_against_the_limit_and_keeps_budgets(tmp_path):
    frontier = importlib.import_module("loop_frontier")
    text = frontier.run(True, tmp_path, blocks=3, every=10)
    with open(tmp_path / "loop_frontier.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for deployment in frontier.DEPLOYMENTS:
        mine = {r["key"]: r for r in rows if r["deployment"] == deployment}
        assert set(mine) == {key for key, _, _, _ in frontier.policies(None, 10)}
        assert float(mine["reference"]["x_limit"]) == 1.0
        for budget in frontier.BUDGETS:  # a clairvoyant near plan changes at most `budget` slots per layer
            row = mine[f"clairvoyant_budget_{budget}"]
            assert int(row["rebalances"]) == 2  # after passes 10 and 20: the last has no future to plan for
            assert int(row["copies"]) <= budget * 58 * int(row["rebalances"])
        assert f"- {deployment}:" in text
    assert "## Loop frontier" in text and (tmp_path / "loop_frontier.md").read_text() == text
    assert all(len(row) == 3 for row in frontier.headline(tmp_path))

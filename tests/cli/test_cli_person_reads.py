"""Issue 44, "What a person reads" (items 1 to 4): every figure under the rule the engine serves and
named on its line, SGLang rows on the model's layers, the held-out figure first, and units and
words a person reads without a second guess."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cli_runner import invoke
from eplb.analysis.metrics import moe_mean
from eplb.io.formats import read_placement
from eplb.simulation.synthetic import drifting_counts

DEPLOYMENT = ("--slots", "48", "--gpus", "8", "--nodes", "2", "--groups", "8")
FIGURE_LINES = ("balance", "imbalance", "windows", "held out", "global", "deployed", "gap", "in sample")


def series(windows=4, layers=3, experts=32, seed=4):
    return drifting_counts(windows, layers, experts, drift=0.3, tokens=4000, num_groups=8, seed=seed).astype(np.int64)


def figure(out: str, prefix: str) -> float:
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return float(re.search(r"\d+\.\d+", line[len(prefix):])[0])


def figure_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(FIGURE_LINES) and "n/a" not in line]


# ----------------------------------------------------------------------------- item 1

@pytest.fixture(scope="module")
def sglang_static(tmp_path_factory):
    """The issue's example, DeepSeek-V3's shape scaled down: a series planned for SGLang's static
    table and written as SGLang's ``--init-expert-location`` file."""
    folder = tmp_path_factory.mktemp("static")
    np.save(folder / "series.npy", series())
    out, _ = invoke("plan", "series.npy", *DEPLOYMENT, "--engine", "sglang-static", "--format", "sglang",
                    "-o", "init_expert_location.json", cwd=folder)
    weights = np.load(folder / "series.npy").sum(axis=0).astype(float)
    placement = read_placement(folder / "init_expert_location.json").placement
    static = moe_mean(placement.balancedness(weights, "sglang-static"), weights)
    even = moe_mean(placement.balancedness(weights, "uniform"), weights)
    assert abs(static - even) > 1e-3  # the rule makes a difference here, so the test tells them apart
    return folder, out, weights, placement, static, even


def test_item1_the_sglang_side_file_records_the_rule_and_validate_judges_under_it(sglang_static):
    folder, _, _, placement, static, even = sglang_static
    side = json.loads((folder / "init_expert_location.eplb.json").read_text())
    assert side["dispatch"] == "sglang-static" and placement.dispatch == "sglang-static"
    checked, _ = invoke("validate", "init_expert_location.json", "--counts", "series.npy", cwd=folder)
    assert "the rule init_expert_location.json records the plan was made for" in checked
    assert figure(checked, "balance") == pytest.approx(static, abs=5e-5)
    for line in figure_lines(checked):
        assert "under SGLang static dispatch" in line, line
    evenly, _ = invoke("validate", "init_expert_location.json", "--counts", "series.npy", "--engine", "vllm",
                       cwd=folder)
    assert figure(evenly, "balance") == pytest.approx(even, abs=5e-5)
    for line in figure_lines(evenly):
        assert "under vLLM dispatch (an even split)" in line, line


def test_item1_report_judges_the_sglang_file_under_its_recorded_rule(sglang_static):
    folder, _, _, _, static, _ = sglang_static
    reported, _ = invoke("report", "series.npy", "init_expert_location.json", "-o", "rep", cwd=folder)
    assert "the rule init_expert_location.json records the plan was made for" in reported
    assert f"in sample {static:.4f} on the summed windows" in reported
    for line in figure_lines(reported):
        assert "under SGLang static dispatch" in line, line


def test_item1_previous_judges_the_deployed_and_the_new_plan_under_the_deployed_rule(sglang_static):
    folder, _, weights, deployed, static, _ = sglang_static
    out, _ = invoke("plan", "series.npy", *DEPLOYMENT, "--previous", "init_expert_location.json", "--objective",
                    "sum", "-o", "next.json", cwd=folder)
    assert "the rule init_expert_location.json records the plan was made for" in out
    assert f"deployed {static:.4f} with the previous placement" in out
    new = read_placement(folder / "next.json").placement
    assert new.dispatch == "sglang-static"  # written recording the rule the engine serves it by
    balance = next(x for x in out.splitlines() if x.startswith("balance"))
    assert f"{moe_mean(new.balancedness(weights, 'sglang-static'), weights):.4f} with the plan" in balance
    for line in figure_lines(out):
        assert "under SGLang static dispatch" in line, line


def test_item1_every_line_of_a_summary_that_gives_a_figure_names_its_rule(tmp_path):
    np.save(tmp_path / "s.npy", series())
    out, _ = invoke("plan", "s.npy", *DEPLOYMENT, "-o", "p.json", cwd=tmp_path)
    lines = figure_lines(out)
    assert {line.split()[0] for line in lines} >= {"balance", "windows", "held", "global", "gap"}
    for line in lines:
        assert "under an even split" in line, line
    for command in (("validate", "p.json", "--counts", "s.npy"), ("report", "s.npy", "p.json", "-o", "rep")):
        printed, _ = invoke(*command, cwd=tmp_path)
        assert figure_lines(printed)
        for line in figure_lines(printed):
            assert "under an even split" in line, line


# ----------------------------------------------------------------------------- item 2

def test_item2_moe_only_rows_for_more_model_layers_are_refused_asking_which_layers(tmp_path):
    np.save(tmp_path / "moe.npy", series(windows=1, layers=4)[0])
    _, err = invoke("plan", "moe.npy", *DEPLOYMENT, "--format", "sglang", "--num-layers", "7", "-o",
                    "init_expert_location.json", cwd=tmp_path, expect=2)
    error = err.strip().splitlines()[-1]
    assert error.startswith("Error:") and "does not record which model layers they are" in error
    assert "--layer-ids 3..6" in error and "--model" in error
    assert not (tmp_path / "init_expert_location.json").exists()


def test_item2_layer_ids_put_the_rows_on_the_model_layers(tmp_path):
    counts = series(windows=1, layers=4)[0]
    np.save(tmp_path / "moe.npy", counts)
    out, _ = invoke("plan", "moe.npy", *DEPLOYMENT, "--format", "sglang", "--num-layers", "7", "--layer-ids",
                    "3..6", "-o", "init_expert_location.json", cwd=tmp_path)
    table = np.array(json.loads((tmp_path / "init_expert_location.json").read_text())["physical_to_logical_map"])
    assert table.shape == (7, 48)
    np.testing.assert_array_equal(table[:3], np.broadcast_to(np.arange(48) % 32, (3, 48)))  # SGLang's trivial rows
    loaded = read_placement(tmp_path / "init_expert_location.json")
    assert loaded.layer_ids.tolist() == [3, 4, 5, 6]
    np.testing.assert_array_equal(table[3:], loaded.placement.phy2log)
    assert "3..6 planned from the counts, 0..2 (not in the counts) SGLang's trivial placement" in out


@pytest.mark.parametrize("layer_ids, words", [("3..5", "names 3 layers"), ("0..2,x", "ranges like 0..2,5")])
def test_item2_layer_ids_that_do_not_fit_the_rows_are_a_usage_error(tmp_path, layer_ids, words):
    np.save(tmp_path / "moe.npy", series(windows=1, layers=4)[0])
    _, err = invoke("plan", "moe.npy", *DEPLOYMENT, "--layer-ids", layer_ids, "-o", "p.json", cwd=tmp_path, expect=2)
    assert "--layer-ids" in err and words in err


def test_item2_layer_ids_must_agree_with_a_file_that_records_them(tmp_path):
    np.savez(tmp_path / "moe.npz", counts=series(windows=1, layers=4)[0], layer_ids=np.arange(1, 5))
    _, err = invoke("plan", "moe.npz", *DEPLOYMENT, "--layer-ids", "3..6", "-o", "p.json", cwd=tmp_path, expect=2)
    assert "records its rows as model layers 1..4, not 3..6" in err


def test_item2_model_deepseek_v3_knows_its_first_three_layers_are_dense(tmp_path):
    counts = drifting_counts(1, 58, 256, tokens=20000, seed=3)[0]
    np.save(tmp_path / "moe.npy", counts)
    out, _ = invoke("plan", "moe.npy", "--slots", "288", "--gpus", "32", "--method", "greedy", "--format", "sglang",
                    "--model", "deepseek-v3", "-o", "init_expert_location.json", cwd=tmp_path)
    table = np.array(json.loads((tmp_path / "init_expert_location.json").read_text())["physical_to_logical_map"])
    assert table.shape == (61, 288)
    loaded = read_placement(tmp_path / "init_expert_location.json")
    assert loaded.layer_ids.tolist() == list(range(3, 61))
    np.testing.assert_array_equal(table[3:], loaded.placement.phy2log)
    assert "3..60 planned from the counts, 0..2 (not in the counts)" in out
    # a model the counts are not from is refused for an engine's file, naming both shapes
    _, err = invoke("plan", "moe.npy", "--slots", "288", "--gpus", "32", "--method", "greedy", "--format", "sglang",
                    "--model", "mixtral-8x7b", "-o", "other.json", cwd=tmp_path, expect=2)
    assert "Mixtral-8x7B has 32 layers" in err and "58 layers x 256 experts" in err


# ----------------------------------------------------------------------------- item 3

def test_item3_a_series_summary_leads_with_the_held_out_figure(tmp_path):
    np.save(tmp_path / "s.npy", series())
    out, _ = invoke("plan", "s.npy", *DEPLOYMENT, "-o", "p.json", cwd=tmp_path)
    heads = [line.split()[0] for line in out.splitlines()]
    assert heads.index("held") < heads.index("balance") < heads.index("windows")
    reported, _ = invoke("report", "s.npy", "p.json", "-o", "rep", cwd=tmp_path)
    heads = [line.split()[0] for line in reported.splitlines()]
    assert heads.index("held") < heads.index("in")


# ----------------------------------------------------------------------------- item 4

def test_item4_hardware_is_taken_in_any_case_and_printed_as_registered(tmp_path):
    for command in ("plan", "simulate", "sweep", "recommend"):
        out, _ = invoke(command, "--help", cwd=tmp_path)
        flat = " ".join(out.split())
        assert "--hardware [B200|H100|H20|H200]" in flat and "default: H100" in flat, command
    np.save(tmp_path / "s.npy", series(windows=1)[0])
    invoke("plan", "s.npy", *DEPLOYMENT, "-o", "old.json", "-q", cwd=tmp_path)
    out, _ = invoke("plan", "s.npy", *DEPLOYMENT, "--previous", "old.json", "--expert-bytes", "1000",
                    "--hardware", "h200", "-o", "new.json", cwd=tmp_path)
    assert "on H200" in out
    _, err = invoke("plan", "s.npy", *DEPLOYMENT, "--hardware", "h300", "-o", "x.json", cwd=tmp_path, expect=2)
    assert "'B200', 'H100', 'H20', 'H200'" in err


def test_item4_recommend_says_experts_plus_gpus_not_e_plus_g(tmp_path):
    out, _ = invoke("recommend", "--help", cwd=tmp_path)
    flat = " ".join(out.split())
    assert "E + G" not in flat and "the experts plus one slot per GPU" in flat


@pytest.mark.parametrize("command", [("plan", "-o", "p.json"), ("simulate", "-o", "sim")])
def test_item4_no_note_about_ignored_groups_before_a_real_error(tmp_path, command):
    counts = series(windows=2, layers=2).astype(float)
    counts[0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", counts)
    _, err = invoke(command[0], "nan.npy", "--slots", "48", "--gpus", "8", "--nodes", "2", "--groups", "3",
                    *command[1:], cwd=tmp_path, expect=1)
    assert err.startswith("Error: ") and "NaN" in err and "note" not in err and err.count("\n") == 1


def test_item4_the_note_about_ignored_groups_comes_once_the_plan_is_made(tmp_path):
    np.save(tmp_path / "s.npy", series(windows=1)[0])
    _, err = invoke("plan", "s.npy", "--slots", "48", "--gpus", "8", "--nodes", "2", "--groups", "3",
                    "--method", "greedy", "-o", "p.json", cwd=tmp_path)
    assert "--groups 3 is not a multiple of --nodes 2" in err


def test_item4_a_flat_array_is_told_the_shapes_counts_take(tmp_path):
    np.save(tmp_path / "flat.npy", np.ones(58 * 256))
    _, err = invoke("plan", "flat.npy", "--slots", "288", "--gpus", "32", "-o", "p.json", cwd=tmp_path, expect=1)
    assert err.count("\n") == 1 and "one row of 14848 numbers, read as one layer of 14848 experts" in err
    assert "[E] (one layer), [L, E] or [T, L, E]" in err and "[58, 256]" in err


def test_item4_previous_naming_a_counts_file_is_blamed_on_previous(tmp_path):
    np.save(tmp_path / "s.npy", series(windows=1)[0])
    _, err = invoke("plan", "s.npy", *DEPLOYMENT, "--previous", "s.npy", "-o", "p.json", cwd=tmp_path, expect=1)
    assert "s.npy: --previous must be the placement deployed now" in err
    assert ".npy is a counts file" in err and "output" not in err


def test_item4_a_previous_of_more_layers_than_counts_that_do_not_record_theirs_is_refused(tmp_path):
    counts = series(windows=1, layers=7)[0]
    np.save(tmp_path / "all.npy", counts)
    invoke("plan", "all.npy", *DEPLOYMENT, "--method", "greedy", "--format", "sglang", "-o",
           "init_expert_location.json", "-q", cwd=tmp_path)
    np.save(tmp_path / "moe.npy", counts[3:])
    _, err = invoke("plan", "moe.npy", *DEPLOYMENT, "--previous", "init_expert_location.json", "-o", "p.json",
                    cwd=tmp_path, expect=1)
    assert err.count("\n") == 1 and "holds 7 layers (model layers 0..6), the counts moe.npy 4" in err
    assert "--layer-ids 3..6" in err
    out, _ = invoke("plan", "moe.npy", *DEPLOYMENT, "--previous", "init_expert_location.json", "--layer-ids", "3..6",
                    "--method", "greedy", "-o", "p.json", cwd=tmp_path)
    # the deployed rows of layers 3..6, not 0..3, are what the counts are compared with
    deployed = read_placement(tmp_path / "init_expert_location.json").placement
    weights = counts[3:].astype(float)
    rows = type(deployed)(deployed.phy2log[3:], deployed.num_experts, deployed.topology, deployed.num_groups)
    assert f"deployed {moe_mean(rows.balancedness(weights), weights):.4f}" in out
    assert "moves    " in out and "of 192 slots changed" in out

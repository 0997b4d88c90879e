"""Issue 44, items 1, 4 and 13 at the file level: every placement file records the dispatch rule its
plan was made for and reads it back (so its metrics judge under it); ``compare``'s table prints
the gap as a percentage with the deployment whole; a sparse ``logical_count`` is densified."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import eplb
from eplb.io.comparison_report import format_table
from eplb.io.formats import FormatError, read_counts, read_placement, write_placement
from eplb.simulation.comparison import OK, MethodResult
from eplb.simulation.synthetic import drifting_counts

SERIES = drifting_counts(4, 3, 32, drift=0.3, tokens=4000, num_groups=8, seed=4)


@pytest.fixture(scope="module")
def static_plan():
    return eplb.plan(SERIES, num_slots=48, num_gpus=8, num_nodes=2, num_groups=8, dispatch="sglang-static")


@pytest.mark.parametrize("fmt, name", [("eplb", "p.json"), ("npz", "p.npz"), ("sglang", "init_expert_location.json"),
                                       ("trtllm", "p.yaml")])
def test_item1_every_placement_format_records_the_rule_it_was_planned_for(tmp_path, static_plan, fmt, name):
    if fmt == "trtllm":
        pytest.importorskip("yaml")
    write_placement(static_plan, tmp_path / name, fmt)
    back = read_placement(tmp_path / name).placement
    assert back.dispatch == "sglang-static"
    weights = SERIES.sum(axis=0)
    # judged under the rule by default, which differs from an even split here
    np.testing.assert_allclose(back.balancedness(weights), static_plan.balancedness(weights, "sglang-static"))
    assert not np.allclose(back.balancedness(weights), back.balancedness(weights, "uniform"))


def test_item1_a_file_written_before_the_rule_was_recorded_is_an_even_split(tmp_path, static_plan):
    write_placement(static_plan, tmp_path / "init_expert_location.json", "sglang")
    side = tmp_path / "init_expert_location.eplb.json"
    document = json.loads(side.read_text())
    del document["dispatch"]
    side.write_text(json.dumps(document))
    assert read_placement(tmp_path / "init_expert_location.json").placement.dispatch == "uniform"


@pytest.mark.parametrize("bad", ["sglang-fast", 3, "shares"])
def test_item1_a_recorded_rule_eplb_does_not_know_is_refused_naming_it(tmp_path, static_plan, bad):
    write_placement(static_plan, tmp_path / "init_expert_location.json", "sglang")
    side = tmp_path / "init_expert_location.eplb.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "dispatch": bad}))
    with pytest.raises(FormatError, match="dispatch rule") as error:
        read_placement(tmp_path / "init_expert_location.json")
    assert "init_expert_location.eplb.json" in str(error.value) and "sglang-static" in str(error.value)


def _row(deployment: str, gap: float) -> MethodResult:
    figures = dict(balancedness=0.9, gap=gap, held_out=0.8, step_ms=1.0, lost=0.1, copies=3, doubled=0,
                   groups_off_node=0, first_call_s=0.1, warm_call_s=0.001)
    return MethodResult("synthetic:zipf", deployment, "greedy", OK, figures=figures)


def test_item4_compare_prints_the_gap_as_a_percentage_and_the_whole_deployment():
    long = "288 slots / 32 GPUs / 4 nodes / 8 groups / a long deployment label"
    table = format_table([_row(long, 0.0046), _row("8 slots / 2 GPUs / 1 node", math.nan)])
    lines = table.splitlines()
    assert "0.46%" in lines[1] and "0.0046" not in table  # as eplb plan prints it
    assert long in lines[1] and "8 slots / 2 GPUs / 1 node" in lines[2]
    # the columns stay aligned: the figures start where the header's do
    assert lines[1].index("0.9000") == lines[2].index("0.9000")
    assert lines[2].split()[-9] == "-" and "nan" not in table  # an unknown gap is a dash, not "nan%"


torch = pytest.importorskip("torch")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_item13_a_sparse_logical_count_reads_as_its_dense_counts(tmp_path, layout):
    dense = torch.tensor(SERIES[0].astype(np.int64))
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    torch.save({"logical_count": sparse}, tmp_path / "dump.pt")
    np.testing.assert_array_equal(read_counts(tmp_path / "dump.pt").counts[0], SERIES[0])


def test_item13_a_sparse_tensor_with_indices_outside_its_shape_is_refused(tmp_path):
    tampered = torch.sparse_coo_tensor(torch.tensor([[0, 9], [1, 2]]), torch.tensor([3.0, 4.0]), (4, 16),
                                       check_invariants=False)
    torch.save({"logical_count": tampered}, tmp_path / "dump.pt")
    with pytest.raises(FormatError, match="dump.pt: not a SGLang dump readable"):
        read_counts(tmp_path / "dump.pt")


def test_item13_a_huge_sparse_tensor_is_refused_before_densifying(tmp_path):
    huge = torch.sparse_coo_tensor(torch.tensor([[0], [0], [0]]), torch.tensor([1.0]), (1 << 20, 4096, 256))
    torch.save({"logical_count": huge}, tmp_path / "dump.pt")
    with pytest.raises(FormatError, match="densified .* above the limit .*EPLB_MAX_CELLS"):
        read_counts(tmp_path / "dump.pt")

"""Hostile and malformed files through the command line: refused quickly, on one line naming the
file and the rule, with the documented exit code (1 bad input, 2 bad command line), never a
traceback, never a huge allocation from a tiny file."""

import json

import numpy as np
import pytest

import eplb
from eplb.io.formats import FormatError, read_counts, read_placement

from test_cli import invoke

yaml = pytest.importorskip("yaml")
COUNTS = np.random.default_rng(5).integers(0, 100, size=(2, 16))


def _placement_dict(**changes):
    data = eplb.plan(np.ones((2, 16)), num_slots=24, num_gpus=4, method="greedy").to_dict()
    data.update(changes)
    return {"placement": data}


def _billion_laughs(levels: int = 10) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        prev, name = chr(96 + i), chr(97 + i)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return ("# eplb: num_gpus=2\ninitial_global_assignments:\n  0: [0, 1]\nbomb:\n"
            + "".join(f"  {line}\n" for line in lines))


# (file name, content writer, command, words of the one-line message)
HOSTILE = [
    ("laughs.yaml", lambda p: p.write_text(_billion_laughs()), ["validate", "laughs.yaml"],
     ["laughs.yaml", "aliases expand"]),
    ("self.yaml", lambda p: p.write_text("initial_global_assignments: &a\n  0: [0, 1]\n  1: *a\n"),
     ["validate", "self.yaml", "--gpus", "1"], ["self.yaml", "alias to itself"]),
    ("tiny.csv", lambda p: p.write_text("layer,expert,count\n0,20000000,7"),
     ["plan", "tiny.csv", "-s", "8", "-g", "2", "-o", "out.json"], ["tiny.csv", "20,000,001", "EPLB_MAX_EXPERTS"]),
    ("id12.json", lambda p: p.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 10 ** 12]]})),
     ["validate", "id12.json", "--gpus", "2"], ["id12.json", "EPLB_MAX_EXPERTS"]),
    ("id30.json", lambda p: p.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 10 ** 30]]})),
     ["validate", "id30.json", "--gpus", "2"], ["id30.json", "expert id"]),
    ("experts.json", lambda p: p.write_text(json.dumps(_placement_dict(num_experts=10 ** 12))),
     ["validate", "experts.json"], ["experts.json", "num_experts", "limit"]),
    ("digits.json", lambda p: p.write_text('{"logical_count": [[' + "1" * 400 + ", 2]]}"),
     ["plan", "digits.json", "-s", "2", "-g", "1", "-o", "out.json"], ["digits.json", "float64"]),
    ("deep.json", lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
     ["plan", "deep.json", "-s", "2", "-g", "1", "-o", "out.json"], ["deep.json", "nested"]),
    ("nodes.npz", lambda p: np.savez(p, phy2log=np.array([[0, 1, 2, 3]]), slots_per_gpu=np.array([2, 2]),
                                     num_nodes=np.array([1, 2])),
     ["validate", "nodes.npz"], ["nodes.npz", "num_nodes", "one integer"]),
    ("slots.json", lambda p: p.write_text(json.dumps(_placement_dict(
        topology={"slots_per_gpu": [1e20, 6, 6, 6], "num_nodes": 1}))),
     ["validate", "slots.json"], ["slots.json", "slots_per_gpu"]),
    ("layer.csv", lambda p: p.write_text("layer,expert,count\n1e300,1,7\n"),
     ["plan", "layer.csv", "-s", "2", "-g", "1", "-o", "out.json"], ["layer.csv", "layer column"]),
    ("slots.yaml", lambda p: p.write_text("num_slots: '24'\ninitial_global_assignments:\n  0: [0, 1]\n"),
     ["validate", "slots.yaml", "--gpus", "1"], ["slots.yaml", "num_slots must be an integer"]),
    ("abc.json", lambda p: p.write_text(json.dumps(_placement_dict(num_groups="abc"))),
     ["validate", "abc.json"], ["abc.json", "num_groups must be an integer"]),
    ("minus.json", lambda p: p.write_text(json.dumps(_placement_dict(num_groups=-3))),
     ["validate", "minus.json"], ["minus.json", "num_groups must be >= 1"]),
]


@pytest.mark.parametrize("name, write, args, words", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_files_are_refused_on_one_line(tmp_path, name, write, args, words):
    write(tmp_path / name)
    _, err = invoke(*args, cwd=tmp_path, expect=1)
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "out.json").exists()


def test_alias_budget_keeps_safe_load_semantics_for_ordinary_aliases(tmp_path, monkeypatch):
    """A few aliases (a shared list) read as yaml.safe_load reads them; the budget is an option."""
    text = ("# eplb: num_gpus=2\ninitial_global_assignments:\n  0: &row [0, 1, 2, 3]\n  1: *row\n")
    (tmp_path / "ok.yaml").write_text(text)
    placement = read_placement(tmp_path / "ok.yaml").placement
    expected = yaml.safe_load(text)["initial_global_assignments"]
    assert placement.phy2log.tolist() == [expected[0], expected[1]] == [[0, 1, 2, 3]] * 2
    (tmp_path / "laughs.yaml").write_text(_billion_laughs(4))       # 9^4 = 6,561 nodes once expanded
    read_placement(tmp_path / "laughs.yaml")
    monkeypatch.setenv("EPLB_MAX_YAML_NODES", "1000")
    with pytest.raises(FormatError, match="EPLB_MAX_YAML_NODES"):
        read_placement(tmp_path / "laughs.yaml")


def test_sizes_on_the_command_line_are_checked_before_allocating(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    _, err = invoke("plan", "c.npy", "--slots", str(10 ** 12), "--gpus", str(10 ** 12), "-o", "p.json",
                    cwd=tmp_path, expect=2)
    assert "--slots" in err and "EPLB_MAX_SLOTS" in err


def test_limits_can_be_raised(tmp_path, monkeypatch):
    (tmp_path / "wide.csv").write_text("layer,expert,count\n0,70000,7\n")
    with pytest.raises(FormatError, match="EPLB_MAX_EXPERTS"):
        read_counts(tmp_path / "wide.csv")
    monkeypatch.setenv("EPLB_MAX_EXPERTS", "100000")
    assert read_counts(tmp_path / "wide.csv").num_experts == 70001


def test_output_may_not_be_an_input_and_replacing_says_so(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    before = (tmp_path / "c.npy").read_bytes()
    _, err = invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "c.npy", "-f", "npz", cwd=tmp_path, expect=2)
    assert "input file" in err and (tmp_path / "c.npy").read_bytes() == before
    (tmp_path / "link.npz").symlink_to(tmp_path / "c.npy")
    invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "link.npz", cwd=tmp_path, expect=2)
    assert (tmp_path / "c.npy").read_bytes() == before
    _, err = invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "p.json", cwd=tmp_path)
    assert err == ""
    _, err = invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "p.json", cwd=tmp_path)
    assert "replacing the existing file p.json" in err


def test_layer_updates_per_iter_needs_yaml_output(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    _, err = invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "p.json", "--layer-updates-per-iter", "2",
                    cwd=tmp_path, expect=2)
    assert "--layer-updates-per-iter" in err and "TensorRT-LLM" in err
    invoke("plan", "c.npy", "-s", "24", "-g", "4", "-o", "p.yaml", "--layer-updates-per-iter", "2", cwd=tmp_path)
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["layer_updates_per_iter"] == 2


def test_previous_plan_on_another_node_count_names_the_nodes(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    invoke("plan", "c.npy", "-s", "24", "-g", "4", "-n", "2", "-o", "old.json", cwd=tmp_path)
    _, err = invoke("plan", "c.npy", "-s", "24", "-g", "4", "-n", "1", "-o", "new.json", "--previous", "old.json",
                    cwd=tmp_path, expect=1)
    assert "old.json" in err and "nodes 2 vs 1" in err


# -- silent misreads ---------------------------------------------------------------------------


def test_csv_with_an_index_column_is_not_an_expert(tmp_path):
    pd = pytest.importorskip("pandas")
    counts = np.random.default_rng(0).integers(0, 100, (4, 256))
    pd.DataFrame(counts).to_csv(tmp_path / "index.csv")                  # ",0,1,...,255" then "0,..."
    data = read_counts(tmp_path / "index.csv")
    assert data.num_experts == 256 and np.array_equal(data.weights, counts)
    pd.DataFrame(counts, index=pd.Index([3, 4, 5, 6], name="layer_id")).to_csv(tmp_path / "layers.csv")
    data = read_counts(tmp_path / "layers.csv")
    assert data.layer_ids.tolist() == [3, 4, 5, 6] and np.array_equal(data.weights, counts)


@pytest.mark.parametrize("header", [("layer_id", "expert_id", "tokens"), ("layer_idx", "expert", "num_tokens"),
                                    ("layer", "expert_idx", "counts")])
def test_long_csv_spellings_are_recognised(tmp_path, header):
    counts = np.random.default_rng(1).integers(0, 100, (3, 16))
    lines = [",".join(header)] + [f"{l},{e},{counts[l, e]}" for l in range(3) for e in range(16)]
    (tmp_path / "long.csv").write_text("\n".join(lines) + "\n")
    data = read_counts(tmp_path / "long.csv")
    assert (data.num_layers, data.num_experts) == (3, 16) and np.array_equal(data.weights, counts)


def test_transposed_array_is_refused_with_the_flags_that_fix_it(tmp_path):
    counts = np.random.default_rng(2).integers(0, 100, (61, 256))
    np.save(tmp_path / "t.npy", counts.T)
    _, err = invoke("plan", "t.npy", "-s", "288", "-g", "8", "-o", "p.json", cwd=tmp_path, expect=1)
    assert "t.npy" in err and "--transpose" in err and "--allow-shape" in err
    out, _ = invoke("plan", "t.npy", "-s", "288", "-g", "8", "-o", "p.json", "--transpose", "--method", "greedy",
                    cwd=tmp_path)
    assert "61 layers x 256 experts" in out
    out, _ = invoke("plan", "t.npy", "-s", "64", "-g", "8", "-o", "q.json", "--allow-shape", "--method", "greedy",
                    cwd=tmp_path)
    assert "256 layers x 61 experts" in out


def test_one_dimensional_counts_are_one_layer(tmp_path):
    np.save(tmp_path / "one.npy", np.arange(1, 17))
    out, _ = invoke("plan", "one.npy", "-s", "24", "-g", "4", "-o", "p.json", cwd=tmp_path)
    assert "1 layers x 16 experts" in out
    assert read_placement(tmp_path / "p.json").placement == eplb.plan(np.arange(1, 17), num_slots=24, num_gpus=4)


@pytest.mark.parametrize("name", ["c.npy", "c.csv", "c.json", "p.yaml"])
def test_unreadable_input_exits_1(tmp_path, name, monkeypatch):
    """A file that exists but cannot be opened is a failure (1), not a usage error (2). As root the
    permission bits do not stop reading, so the open itself is made to fail."""
    import builtins
    import io
    import os

    np.save(tmp_path / "c.npy", COUNTS)
    (tmp_path / "c.csv").write_text("1,2\n3,4\n")
    (tmp_path / "c.json").write_text(json.dumps({"logical_count": COUNTS.tolist()}))
    eplb.io.formats.write_placement(eplb.plan(COUNTS, num_slots=16, num_gpus=4), tmp_path / "p.yaml")
    target = str(tmp_path / name)
    real_open, real_io_open = builtins.open, io.open

    def refuse(opener):
        def wrapped(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == target:
                raise PermissionError(13, "Permission denied", target)
            return opener(file, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(builtins, "open", refuse(real_open))
    monkeypatch.setattr(io, "open", refuse(real_io_open))
    args = (["validate", name] if name.endswith("yaml") else
            ["plan", name, "-s", "16", "-g", "4", "--method", "greedy", "-o", "out.json"])
    _, err = invoke(*args, cwd=tmp_path, expect=1)
    assert name in err and "ermission denied" in err and err.count("\n") == 1


# -- issue 44, item 12: every size flag has its documented limit --------------------------------------

SIZE_FLAGS = [  # (command line after COUNTS, the flag named, the variable that raises its limit)
    (["recommend", "s.npy", "--gpus", "100000", "--batch", "4"], "--gpus", "EPLB_MAX_GPUS"),
    (["recommend", "s.npy", "--gpus", "8", "--batch", "4", "--deployed-slots", "10000000"], "--deployed-slots",
     "EPLB_MAX_SLOTS"),
    (["recommend", "s.npy", "--gpus", "32", "--batch", "4", "--extra-slots", "200000"], "--extra-slots",
     "EPLB_MAX_SLOTS"),
    (["recommend", "s.npy", "--gpus", "8", "--batch", "4", "--slots", "40,100000000"], "--slots", "EPLB_MAX_SLOTS"),
    (["recommend", "s.npy", "--gpus", "8", "--nodes", "8192", "--batch", "4"], "--nodes", "EPLB_MAX_GPUS"),
    (["recommend", "s.npy", "--gpus", "8", "--batch", str(2 ** 41)], "--batch", "2199023255552"),
    (["plan", "s.npy", "-s", "48", "-g", "5000", "-o", "p.json"], "--gpus", "EPLB_MAX_GPUS"),
    (["plan", "s.npy", "-s", "48", "-g", "8", "--num-layers", "100000", "-f", "sglang", "-o", "p.json"],
     "--num-layers", "EPLB_MAX_LAYERS"),
    (["plan", "s.npy", "-s", "48", "-g", "8", "--layer-ids", "0..99999", "-o", "p.json"], "--layer-ids",
     "EPLB_MAX_LAYERS"),
    (["simulate", "s.npy", "-s", "2000000", "-g", "8", "-o", "sim"], "--slots", "EPLB_MAX_SLOTS"),
    (["simulate", "s.npy", "-s", "48", "-g", "8", "-n", "10000", "-o", "sim"], "--nodes", "EPLB_MAX_GPUS"),
    (["sweep", "s.npy", "--gpus", "8,100000", "-o", "sw"], "--gpus", "EPLB_MAX_GPUS"),
    (["sweep", "s.npy", "--gpus", "8", "--extra-slots", "0,1000000", "-o", "sw"], "--extra-slots", "EPLB_MAX_SLOTS"),
    (["warmup", "--experts", "16", "--slots", "16", "--gpus", "100000"], "--gpus", "EPLB_MAX_GPUS"),
]


@pytest.mark.parametrize("args, flag, limit", SIZE_FLAGS, ids=[f"{a[0]} {f}" for a, f, _ in SIZE_FLAGS])
def test_item12_a_size_flag_beyond_its_limit_is_a_usage_error_on_one_line(tmp_path, args, flag, limit):
    np.save(tmp_path / "s.npy", np.random.default_rng(1).integers(0, 100, (3, 2, 64)))
    _, err = invoke(*args, cwd=tmp_path, expect=2)
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and flag in errors[0] and limit in errors[0], err
    assert not any((tmp_path / name).exists() for name in ("p.json", "sim", "sw"))


def test_item12_the_gpu_limit_can_be_raised(tmp_path, monkeypatch):
    np.save(tmp_path / "s.npy", np.random.default_rng(1).integers(0, 100, (2, 64)))
    monkeypatch.setenv("EPLB_MAX_GPUS", "2")
    _, err = invoke("plan", "s.npy", "-s", "64", "-g", "4", "-o", "p.json", cwd=tmp_path, expect=2)
    assert "--gpus is 4, above the limit of 2" in err


# -- issue 44, item 13: a sparse logical_count in a .pt dump --------------------------------------------

def _sparse_dump(path, counts, layout="coo"):
    torch = pytest.importorskip("torch")
    dense = torch.tensor(counts)
    torch.save({"logical_count": dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()}, path)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_item13_plan_simulate_and_recommend_read_a_sparse_dump_as_its_dense_counts(tmp_path, layout):
    counts = np.random.default_rng(2).integers(0, 100, (3, 2, 64))
    counts[:, :, ::3] = 0  # sparse for real
    np.save(tmp_path / "dense.npy", counts)
    if layout == "coo":
        _sparse_dump(tmp_path / "dump.pt", counts, layout)
    else:  # a CSR tensor is two-dimensional: one window
        counts = counts[0]
        np.save(tmp_path / "dense.npy", counts)
        _sparse_dump(tmp_path / "dump.pt", counts, layout)
    for name in ("dump.pt", "dense.npy"):
        invoke("plan", name, "-s", "72", "-g", "8", "--method", "greedy", "-o", f"{name}.json", "-q", cwd=tmp_path)
    a, b = (read_placement(tmp_path / f"{name}.json").placement for name in ("dump.pt", "dense.npy"))
    np.testing.assert_array_equal(a.phy2log, b.phy2log)
    if layout == "coo":
        out, err = invoke("simulate", "dump.pt", "-s", "72", "-g", "8", "-p", "none", "-o", "sim", cwd=tmp_path)
        assert "3 steps x 2 layers x 64 experts" in out and "wrote    sim/index.html" in out
        out, err = invoke("recommend", "dump.pt", "--gpus", "8", "--batch", "2", "--model", "olmoe-1b-7b",
                          "--extra-slots", "0,1", "--passes", "2", cwd=tmp_path)
        assert "3 windows x 2 layers x 64 experts" in out and "choice" in out


@pytest.mark.parametrize("command", [["plan", "dump.pt", "-s", "24", "-g", "4", "-o", "p.json"],
                                     ["simulate", "dump.pt", "-s", "24", "-g", "4", "-o", "sim"],
                                     ["recommend", "dump.pt", "--gpus", "4", "--batch", "2"]])
def test_item13_a_sparse_dump_with_indices_outside_its_shape_is_refused_on_one_line(tmp_path, command):
    torch = pytest.importorskip("torch")
    tampered = torch.sparse_coo_tensor(torch.tensor([[0, 9], [1, 2], [0, 1]]), torch.tensor([3.0, 4.0]), (2, 4, 16),
                                       check_invariants=False)
    torch.save({"logical_count": tampered}, tmp_path / "dump.pt")
    _, err = invoke(*command, cwd=tmp_path, expect=1)
    assert err.startswith("Error: dump.pt:") and err.count("\n") == 1 and "size is inconsistent with indices" in err

"""eplb.io.formats: every reader on files written the way the engines write them, every placement
format written and read back, and untrusted files refused without running anything."""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.io.formats import (
    FormatError, MissingExtraError, detect_counts_format, detect_placement_format, read_counts, read_placement,
    write_placement,
)
from eplb.model.topology import Topology

from strategies import counts_for, configs

RNG = np.random.default_rng(7)
SERIES = RNG.integers(0, 500, size=(3, 4, 16))            # [T, L, E]


def _needs(module):
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (optional extra)")


# -- counts --------------------------------------------------------------------------------------


def test_numpy_and_csv_counts(tmp_path):
    np.save(tmp_path / "series.npy", SERIES)
    np.save(tmp_path / "one.npy", SERIES[0])
    np.savez(tmp_path / "trace.npz", counts=SERIES, layer_ids=np.array([1, 3, 5, 7]), note=np.array("x"))
    np.savez(tmp_path / "single.npz", SERIES[1])               # its only array, named arr_0
    header = ",".join(f"expert{e}" for e in range(16))
    np.savetxt(tmp_path / "matrix.csv", SERIES[2], delimiter=",", header=header, comments="", fmt="%d")
    rows = ["window,layer,expert,count"] + [f"{t},{l},{e},{SERIES[t, l, e]}" for t in range(3) for l in range(4)
                                            for e in range(16) if SERIES[t, l, e]]
    (tmp_path / "long.csv").write_text("\n".join(rows) + "\n")

    series = read_counts(tmp_path / "series.npy")
    assert series.counts.shape == (3, 4, 16) and series.format == "npy"
    np.testing.assert_array_equal(series.weights, SERIES.sum(axis=0))
    assert read_counts(tmp_path / "one.npy").counts.shape == (1, 4, 16)
    trace = read_counts(tmp_path / "trace.npz")
    assert trace.layer_ids.tolist() == [1, 3, 5, 7]
    np.testing.assert_array_equal(trace.counts, SERIES)
    np.testing.assert_array_equal(read_counts(tmp_path / "single.npz").counts[0], SERIES[1])
    np.testing.assert_array_equal(read_counts(tmp_path / "matrix.csv").counts[0], SERIES[2])
    long = read_counts(tmp_path / "long.csv")
    np.testing.assert_array_equal(long.counts, SERIES)      # zeros left out of the table count 0


def test_sglang_dump_as_written_by_the_engine(tmp_path):
    """SGLang's _StatAccumulator.dump: torch.save(dict(rank, logical_count [T, L, E] int32, avg))."""
    _needs("torch")
    import torch

    dump = dict(rank=0, logical_count=torch.tensor(SERIES, dtype=torch.int32),
                average_utilization_rate_over_window=None)
    torch.save(dump, tmp_path / "expert_distribution_recorder_1700000000.0.pt")
    torch.save({"logical_count": torch.tensor(SERIES[0], dtype=torch.bfloat16)}, tmp_path / "bf16.pt")
    (tmp_path / "logical_count.json").write_text(json.dumps({"logical_count": SERIES.tolist()}))

    data = read_counts(tmp_path / "expert_distribution_recorder_1700000000.0.pt")
    assert data.format == "sglang-dump" and data.metadata["rank"] == 0
    np.testing.assert_array_equal(data.counts, SERIES)
    assert read_counts(tmp_path / "bf16.pt").counts.shape == (1, 4, 16)
    as_json = read_counts(tmp_path / "logical_count.json")
    assert as_json.format == "logical-count-json"
    np.testing.assert_array_equal(as_json.counts, SERIES)


def write_trtllm_statistics(folder: Path, counts, layer_ids, first_iteration=100, ranks=2):
    """What TensorRT-LLM's ExpertStatistic writes: per-rank bincounts keyed "{iteration}_{layer}"
    and rank 0's meta_info.json. The counts are split between ranks (each rank sees its tokens)."""
    import safetensors.numpy

    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": counts.shape[-1], "num_experts_per_token": 2}))
    share = counts // ranks
    for rank in range(ranks):
        part = share if rank < ranks - 1 else counts - share * (ranks - 1)
        records = {f"{first_iteration + t}_{layer}": part[t, i].astype(np.int64)
                   for t in range(counts.shape[0]) for i, layer in enumerate(layer_ids)}
        safetensors.numpy.save_file(records, str(folder / f"rank{rank}.safetensors"))


def test_trtllm_statistics_folder_sums_ranks(tmp_path):
    _needs("safetensors")
    write_trtllm_statistics(tmp_path / "stats", SERIES, [3, 4, 5, 6], ranks=3)
    data = read_counts(tmp_path / "stats")
    assert data.format == "trtllm-stats" and detect_counts_format(tmp_path / "stats") == "trtllm-stats"
    np.testing.assert_array_equal(data.counts, SERIES)
    assert data.layer_ids.tolist() == [3, 4, 5, 6]
    assert data.metadata["num_ranks"] == 3 and data.metadata["iterations"] == [100, 103]


def test_trtllm_statistics_errors(tmp_path):
    _needs("safetensors")
    import safetensors.numpy

    write_trtllm_statistics(tmp_path / "gap", SERIES, [3, 4, 5, 6], ranks=1)
    records = safetensors.numpy.load_file(str(tmp_path / "gap" / "rank0.safetensors"))
    del records["101_5"]                                      # no rank recorded iteration 101, layer 5
    safetensors.numpy.save_file(records, str(tmp_path / "gap" / "rank0.safetensors"))
    with pytest.raises(FormatError, match="incomplete statistics"):
        read_counts(tmp_path / "gap")
    write_trtllm_statistics(tmp_path / "shape", SERIES, [3, 4, 5, 6])
    safetensors.numpy.save_file({"100_3": np.zeros(5, np.int64)}, str(tmp_path / "shape" / "rank1.safetensors"))
    with pytest.raises(FormatError, match=r"rank1.safetensors.*shape \[5\], expected \[16\]"):
        read_counts(tmp_path / "shape")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="meta_info.json"):
        read_counts(tmp_path / "empty")


@pytest.mark.parametrize("array, problem", [
    (np.array([[1.0, np.nan], [2.0, 3.0]]), "NaN"),
    (np.array([[1.0, -2.0]]), "non-negative"),
    (np.zeros((2, 2, 2, 2)), r"shape \[E\], \[L, E\] or \[T, L, E\]"),
    (np.zeros((0, 4)), "empty"),
    (np.array([[1.0, np.inf]]), "infinite"),
])
def test_bad_counts_name_the_file_and_the_problem(tmp_path, array, problem):
    path = tmp_path / "counts.npy"
    np.save(path, array)
    with pytest.raises(FormatError, match=problem) as info:
        read_counts(path)
    assert "counts.npy" in str(info.value)


def test_bad_files(tmp_path):
    (tmp_path / "garbage.npy").write_bytes(b"not numpy at all")
    (tmp_path / "ragged.csv").write_text("1,2,3\n4,5\n")
    (tmp_path / "words.csv").write_text("1,2\n3,many\n")
    (tmp_path / "counts.txt").write_text("1,2\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"something": 1}')
    for name, problem in [("garbage.npy", "not a readable .npy"), ("ragged.csv", "same number of experts"),
                          ("words.csv", "must be a number"), ("counts.txt", "--input-format"),
                          ("bad.json", "not valid JSON"), ("other.json", "logical_count"),
                          ("missing.npz", "no such file")]:
        with pytest.raises(FormatError, match=problem) as info:
            read_counts(tmp_path / name)
        assert name in str(info.value)
    # an explicit format overrides the suffix
    assert read_counts(tmp_path / "counts.txt", "csv").counts.shape == (1, 1, 2)


class Exploit:
    """Unpickling this would create a file: proof that a reader ran code from a file."""

    marker = None

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_untrusted_pickles_are_refused_without_running_them(tmp_path):
    Exploit.marker = str(tmp_path / "pwned")
    np.save(tmp_path / "objects.npy", np.array([Exploit()], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "objects.npz", counts=np.array([Exploit()], dtype=object))
    with pytest.raises(FormatError, match="pickl"):
        read_counts(tmp_path / "objects.npy")
    with pytest.raises(FormatError, match="unpickling"):
        read_counts(tmp_path / "objects.npz")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.save({"logical_count": torch.zeros(2, 4), "payload": Exploit()}, tmp_path / "dump.pt")
        with pytest.raises(FormatError, match="weights_only"):
            read_counts(tmp_path / "dump.pt")
    assert not (tmp_path / "pwned").exists()


# -- placements ----------------------------------------------------------------------------------


def _plan(num_layers=3, num_experts=16, num_slots=24, num_gpus=4, num_nodes=2, num_groups=4):
    counts = RNG.integers(1, 1000, size=(num_layers, num_experts))
    return eplb.plan(counts, num_slots=num_slots, num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups)


def test_engine_placement_files_hold_exactly_what_the_engines_accept(tmp_path):
    _needs("yaml")
    import yaml

    placement = _plan()
    write_placement(placement, tmp_path / "init_expert_location.json", "sglang")
    document = json.loads((tmp_path / "init_expert_location.json").read_text())
    # SGLang passes the dict as keyword arguments to init_by_mapping: one key only
    assert list(document) == ["physical_to_logical_map"]
    assert np.array_equal(document["physical_to_logical_map"], placement.phy2log)

    write_placement(placement, tmp_path / "moe_load_balancer.yaml", layer_ids=[3, 4, 5], layer_updates_per_iter=2)
    text = (tmp_path / "moe_load_balancer.yaml").read_text()
    config = yaml.safe_load(text)
    # MoeLoadBalancerConfig is a strict model: only its three fields
    assert set(config) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert config["num_slots"] == 24 and config["layer_updates_per_iter"] == 2
    assert list(config["initial_global_assignments"]) == [3, 4, 5]
    assert config["initial_global_assignments"][4] == placement.phy2log[1].tolist()
    assert "  3: [" in text                                   # one inline list per layer, as TensorRT-LLM writes

    back = read_placement(tmp_path / "moe_load_balancer.yaml")    # GPUs, nodes, groups from eplb's comment
    assert back.placement == placement and back.layer_ids.tolist() == [3, 4, 5]
    assert back.placement.num_groups == placement.num_groups == 4
    # the configuration SGLang's file cannot hold is in the side file beside it, read back
    side = read_placement(tmp_path / "init_expert_location.json")
    assert side.placement == placement and side.placement.num_groups == 4
    assert (tmp_path / "init_expert_location.eplb.json").is_file()
    (tmp_path / "init_expert_location.eplb.json").unlink()
    with pytest.raises(FormatError, match="--gpus"):
        read_placement(tmp_path / "init_expert_location.json")
    with pytest.raises(FormatError, match="divisible"):
        read_placement(tmp_path / "init_expert_location.json", num_gpus=5)
    assert read_placement(tmp_path / "init_expert_location.json", num_gpus=4, num_nodes=2).placement == placement


def test_uneven_slots_cannot_go_to_sglang_or_trtllm_but_do_go_to_eplb_files(tmp_path):
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 0, 1], [5, 4, 3, 2, 1, 0, 0, 0]])
    placement = eplb.Placement(phy2log, 6, Topology(np.array([3, 2, 0, 3]), 2))   # a drained GPU 2
    for name, fmt in [("a.json", "sglang"), ("a.yaml", "trtllm")]:
        with pytest.raises(FormatError, match="same number of slots"):
            write_placement(placement, tmp_path / name, fmt)
    for name in ("p.json", "p.npz"):
        write_placement(placement, tmp_path / name)
        back = read_placement(tmp_path / name).placement
        assert back == placement and back.topology.slots_per_gpu.tolist() == [3, 2, 0, 3]


def test_invalid_placement_files(tmp_path):
    (tmp_path / "missing_expert.json").write_text(json.dumps({"physical_to_logical_map": [[0, 0, 2, 2]]}))
    (tmp_path / "ragged.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1], [0]]}))
    (tmp_path / "negative.yaml").write_text("num_slots: 2\ninitial_global_assignments:\n  0: [0, -1]\n")
    (tmp_path / "unknown.json").write_text('{"hello": 1}')
    cases = [("missing_expert.json", "expert 1 has none in layer 0"), ("ragged.json", "rectangular"),
             ("negative.yaml", ">= 0"), ("unknown.json", "physical_to_logical_map")]
    for name, problem in cases:
        with pytest.raises(FormatError, match=problem):
            read_placement(tmp_path / name, num_gpus=2)
    assert detect_placement_format(tmp_path / "missing_expert.json") == "sglang"


def test_missing_extra_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "yaml", None)           # as if pyyaml were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'eplb\[trtllm\]'"):
        write_placement(_plan(), tmp_path / "p.yaml")


@settings(max_examples=25)
@given(st.data())
def test_every_placement_format_round_trips(data):
    """Write then read gives back the same placement, in every format, for any configuration."""
    config = data.draw(configs(max_experts=16, max_gpus=8))
    counts = data.draw(counts_for(config["num_experts"]))
    placement = eplb.plan(counts, num_slots=config["num_slots"], num_gpus=config["num_gpus"],
                          num_nodes=config["num_nodes"], num_groups=config["num_groups"])
    layer_ids = np.arange(placement.num_layers) * 2 + 1
    with tempfile.TemporaryDirectory() as folder:
        for name in ("p.json", "p.npz", "p.yaml", "sglang.json"):
            path = Path(folder) / name
            fmt = write_placement(placement, path, "sglang" if name == "sglang.json" else None, layer_ids=layer_ids)
            back = read_placement(path, num_gpus=config["num_gpus"], num_nodes=config["num_nodes"],
                                  num_experts=config["num_experts"])
            assert back.format == fmt
            assert back.placement == placement
            np.testing.assert_array_equal(back.placement.logcnt, placement.logcnt)
            if fmt != "sglang":                                  # SGLang's file has no layer ids
                assert back.layer_ids.tolist() == layer_ids.tolist()
            if fmt in ("eplb", "npz"):
                assert back.placement.num_groups == placement.num_groups
                np.testing.assert_allclose(back.placement.lower_bound, placement.lower_bound)


def test_a_npy_whose_header_is_not_a_closed_literal_is_a_format_error(tmp_path):
    """NumPy reads a .npy header as a Python literal: a damaged one raised tokenize's TokenError
    through every command (found by tests/cli/test_cli_fuzz.py)."""
    from eplb.io.formats import FormatError, read_counts

    path = tmp_path / "c.npy"
    np.save(path, np.ones((3, 4)))
    data = path.read_bytes().replace(b"'descr'", b"('descr'", 1)
    path.write_bytes(data)
    with pytest.raises(FormatError, match="not a readable .npy file"):
        read_counts(path)

"""Fuzzing the command line with malformed files of every format: whatever the bytes, ``eplb``
ends with exit code 0 (the file was still valid), 1 (one line naming the file) or 2 (usage), and
never a Python traceback."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb
from eplb.cli import main
from eplb.io.formats import write_placement

yaml = pytest.importorskip("yaml")

COUNTS = np.random.default_rng(7).integers(0, 50, size=(2, 8))
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _valid_files(folder):
    """One valid file of each format (name -> bytes) and the command that reads it."""
    placement = eplb.plan(COUNTS, num_slots=12, num_gpus=4, num_nodes=2, method="greedy")
    np.save(folder / "c.npy", COUNTS)
    np.savez(folder / "c.npz", counts=COUNTS)
    np.savetxt(folder / "c.csv", COUNTS, delimiter=",", fmt="%d")
    (folder / "c.json").write_text(json.dumps({"logical_count": COUNTS.tolist()}))
    write_placement(placement, folder / "p.json")
    write_placement(placement, folder / "p.npz")
    write_placement(placement, folder / "p.yaml")
    write_placement(placement, folder / "s.json", "sglang")
    plan = ["-s", "12", "-g", "4", "--method", "greedy", "-o", "out.json"]
    return {
        "c.npy": ["plan", "c.npy", *plan], "c.npz": ["plan", "c.npz", *plan], "c.csv": ["plan", "c.csv", *plan],
        "c.json": ["plan", "c.json", *plan], "p.json": ["validate", "p.json", "--counts", "c.npy"],
        "p.npz": ["validate", "p.npz"], "p.yaml": ["validate", "p.yaml"], "s.json": ["validate", "s.json"],
    }


def _run(folder, args):
    import os

    old = os.getcwd()
    os.chdir(folder)
    try:
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(old)
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    assert result.exit_code in (0, 1, 2), output
    if result.exit_code == 1:
        err = result.stderr.strip()
        assert err.startswith("Error: ") and "\n" not in err, err
    return result.exit_code


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10 ** 6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10 ** 6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10 ** 6),
              st.sampled_from([b"-", b"9" * 400, b"1e300", b"nan", b"[[[[", b"&a *a", b"\xff\xfe", b"\x00",
                               b"]]", b"{", b"'24'", b",", b"\n", b"1e20", b"-3", b"\"abc\""])),
)


@pytest.mark.parametrize("name", ["c.npy", "c.npz", "c.csv", "c.json", "p.json", "p.npz", "p.yaml", "s.json"])
@SETTINGS
@given(edits=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_files_never_crash_the_cli(tmp_path, name, edits):
    commands = _valid_files(tmp_path)
    data = bytearray((tmp_path / name).read_bytes())
    for kind, where, what in edits:
        where = where % (len(data) + 1)
        if kind == "flip" and data:
            data[where % len(data)] ^= what
        elif kind == "cut":
            del data[where:]
        elif kind == "insert":
            data[where:where] = what
    (tmp_path / name).write_bytes(bytes(data))
    _run(tmp_path, commands[name])


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 30, 10 ** 30) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=12,
)


@SETTINGS
@given(field=st.sampled_from(["phy2log", "num_experts", "num_groups", "topology", "lower_bound", "method", "info"]),
       value=json_value)
def test_eplb_json_with_any_value_in_any_field(tmp_path, field, value):
    _valid_files(tmp_path)
    document = json.loads((tmp_path / "p.json").read_text())
    document["placement"][field] = value
    (tmp_path / "p.json").write_text(json.dumps(document))
    _run(tmp_path, ["validate", "p.json"])


@SETTINGS
@given(value=json_value)
def test_counts_json_and_sglang_placement_with_any_value(tmp_path, value):
    _valid_files(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps({"logical_count": value}))
    _run(tmp_path, ["plan", "c.json", "-s", "12", "-g", "4", "--method", "greedy", "-o", "out.json"])
    (tmp_path / "s.json").write_text(json.dumps({"physical_to_logical_map": value}))
    _run(tmp_path, ["validate", "s.json"])


@SETTINGS
@given(key=st.sampled_from(["num_slots", "layer_updates_per_iter", "initial_global_assignments"]), value=json_value)
def test_trtllm_yaml_with_any_value(tmp_path, key, value):
    _valid_files(tmp_path)
    text = (tmp_path / "p.yaml").read_text()
    config = yaml.safe_load(text)
    config[key] = value
    comments = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    (tmp_path / "p.yaml").write_text(comments + yaml.safe_dump(config))
    _run(tmp_path, ["validate", "p.yaml"])

"""The format registry (:data:`eplb.io.formats.FORMATS`) is the one list of formats: every name it
registers round-trips where it can, detection agrees with the suffixes and content it declares, the
CLI offers exactly its names, unknown names are refused listing them, and the module docstring's
tables show them."""

from __future__ import annotations

import importlib
import inspect
import json
import re

import click
import numpy as np
import pytest

import eplb
import eplb.io.formats as formats
from eplb.io.formats import (
    COUNTS_FORMATS, FORMATS, PLACEMENT_FORMATS, Format, FormatError, detect_counts_format, detect_placement_format,
    placement_format_for_output, read_counts, read_placement, write_placement,
)
from eplb.io.formats import arrays, eplb_json, sglang, trtllm
from eplb.io.formats.spec import READ_KEYWORDS, WRITE_KEYWORDS
from eplb.model.topology import Topology

#: the format modules, in the registry's order
MODULES = (eplb_json, arrays, sglang, trtllm)
COUNTS = np.arange(2 * 8, dtype=np.float64).reshape(2, 8) + 1  # [L, E]
#: a placement of 8 experts on 4 GPUs x 3 slots, 2 nodes, 4 groups (each group on one node's GPUs)
PLACEMENT = eplb.Placement(np.array([[0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6], [1, 0, 1, 3, 2, 3, 5, 4, 5, 7, 6, 7]]),
                           8, Topology.uniform(12, 4, 2), num_groups=4, method="test")


def _needs(fmt: Format):
    """Skip when an optional dependency of ``fmt`` (yaml, torch, safetensors) is missing."""
    module = {"trtllm": "yaml", "trtllm-stats": "safetensors", "sglang-dump": "torch", "sglang-detail": "torch"}
    if fmt.name in module:
        pytest.importorskip(module[fmt.name])


def _same(a, b):
    assert np.array_equal(a.phy2log, b.phy2log)
    assert (a.num_experts, a.num_groups, a.num_nodes) == (b.num_experts, b.num_groups, b.num_nodes)
    assert a.topology.slots_per_gpu.tolist() == b.topology.slots_per_gpu.tolist()


# -- the registry --------------------------------------------------------------------------------


def test_the_registry_is_each_module_s_own_formats_in_order():
    assert FORMATS == tuple(f for module in MODULES for f in module.FORMATS)
    names = [f.name for f in FORMATS]
    assert len(names) == len(set(names)), "a name is registered twice"
    for module in MODULES:
        for fmt in module.FORMATS:
            functions = [fn for fn in (fmt.read_counts, fmt.read_placement, fmt.write_placement) if fn is not None]
            assert functions, f"{fmt.name} provides nothing"
            for fn in functions:  # each module declares its own formats, with its own functions
                assert getattr(fn, "func", fn).__module__ == module.__name__, (fmt.name, fn)


def test_the_public_names_derive_from_the_registry():
    assert COUNTS_FORMATS == tuple(f.name for f in FORMATS if f.read_counts is not None)
    assert PLACEMENT_FORMATS == tuple(f.name for f in FORMATS if f.read_placement or f.write_placement)
    # the order the names have always been listed in (messages, --help)
    assert COUNTS_FORMATS == ("npy", "npz", "csv", "logical-count-json", "sglang-dump", "sglang-detail",
                              "trtllm-stats")
    assert PLACEMENT_FORMATS == ("eplb", "npz", "sglang", "trtllm")


def test_declarations_are_complete():
    """What detection needs: folder formats and formats sharing a placement suffix recognise their
    content and say what they look for; keywords name only what the registry passes."""
    for fmt in FORMATS:
        assert set(fmt.keywords) <= set(READ_KEYWORDS) | set(WRITE_KEYWORDS)
        if fmt.folder:
            assert fmt.recognise is not None and fmt.recognised_by and not fmt.suffixes
        if fmt.read_counts or fmt.read_placement:
            assert fmt.suffixes or fmt.folder, f"{fmt.name}: no way to detect it"
        if fmt.read_placement is not None and fmt.write_placement is not None:
            assert fmt.writes_to and set(fmt.writes_to) <= set(fmt.suffixes), fmt.name
    readers = [f for f in FORMATS if f.read_placement is not None]
    for suffix in {s for f in readers for s in f.suffixes}:
        claiming = [f for f in readers if suffix in f.suffixes]
        if len(claiming) > 1:
            assert all(f.recognise is not None and f.recognised_by for f in claiming), suffix
    with pytest.raises(ValueError, match="unknown keywords"):
        Format("x", "X", keywords=("num_slots",))
    with pytest.raises(ValueError, match="lower case"):
        Format("x", "X", suffixes=(".JSON",))


def _read_toy_counts(path):
    return formats.CountsFile(np.loadtxt(path, ndmin=2)[None], np.arange(2), "toy", path)


def _write_toy(placement, path):
    np.savetxt(path, placement.phy2log, fmt="%d")


def _read_toy(path, *, num_gpus=None, num_nodes=None, num_experts=None, num_groups=None):
    phy2log = np.loadtxt(path, dtype=np.int64, ndmin=2)
    placement = eplb.Placement(phy2log, num_experts or int(phy2log.max()) + 1,
                               Topology.uniform(phy2log.shape[1], num_gpus or 1, num_nodes or 1), num_groups)
    return formats.PlacementFile(placement, np.arange(len(phy2log)), "toy", path)


def test_a_format_declared_by_a_module_reaches_everything(tmp_path, monkeypatch):
    """A new format is its module's declaration: once registered (here appended to a module's
    ``FORMATS`` and the registry rebuilt), it is detected, read, written and listed with no other change."""
    toy = Format("toy", "toy text", suffixes=(".toy",), read_counts=_read_toy_counts, read_placement=_read_toy,
                 write_placement=_write_toy, keywords=("num_gpus", "num_nodes", "num_experts", "num_groups"))
    monkeypatch.setattr(trtllm, "FORMATS", (*trtllm.FORMATS, toy))
    try:
        importlib.reload(formats)
        assert formats.COUNTS_FORMATS[-1] == formats.PLACEMENT_FORMATS[-1] == "toy"
        path = tmp_path / "p.toy"
        assert formats.placement_format_for_output(path) == "toy"
        assert formats.write_placement(PLACEMENT, path) == "toy"
        assert formats.detect_placement_format(path) == formats.detect_counts_format(path) == "toy"
        _same(formats.read_placement(path, num_gpus=4, num_nodes=2, num_groups=4).placement, PLACEMENT)
        assert formats.read_counts(path).counts.shape == (1, 2, 12)
        with pytest.raises(FormatError, match="one of npy, npz, csv, .*, trtllm-stats, toy$"):
            formats.read_counts(path, "bogus")
        with pytest.raises(FormatError, match="applies to TensorRT-LLM YAML only, not to toy output"):
            formats.write_placement(PLACEMENT, tmp_path / "q.toy", layer_updates_per_iter=1)
    finally:
        monkeypatch.undo()
        importlib.reload(formats)
    assert "toy" not in formats.COUNTS_FORMATS + formats.PLACEMENT_FORMATS


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PLACEMENT_FORMATS)
def test_every_placement_format_round_trips(tmp_path, name):
    """Written by name, read back by name and by detection: the same placement, named the same format."""
    fmt = next(f for f in FORMATS if f.name == name)
    _needs(fmt)
    assert fmt.read_placement is not None and fmt.write_placement is not None
    path = tmp_path / f"placement{fmt.writes_to[0]}"
    assert write_placement(PLACEMENT, path, name, layer_ids=[3, 4]) == name
    assert detect_placement_format(path) == name
    for loaded in (read_placement(path, name), read_placement(path)):
        assert loaded.format == name
        _same(loaded.placement, PLACEMENT)


@pytest.mark.parametrize("name", PLACEMENT_FORMATS)
def test_every_output_suffix_writes_its_format(tmp_path, name):
    fmt = next(f for f in FORMATS if f.name == name)
    _needs(fmt)
    for suffix in fmt.writes_to:
        first = next(f for f in FORMATS if f.write_placement is not None and suffix in f.writes_to)
        path = tmp_path / f"out{suffix}"
        assert placement_format_for_output(path) == placement_format_for_output(tmp_path / f"O{suffix.upper()}")
        assert write_placement(PLACEMENT, path) == first.name
        _same(read_placement(path).placement, PLACEMENT)


@pytest.mark.parametrize("name", COUNTS_FORMATS)
def test_counts_files_named_by_a_suffix_are_detected_as_the_registry_says(tmp_path, name):
    """A counts file is the first counts format claiming its suffix (any case), without being opened."""
    fmt = next(f for f in FORMATS if f.name == name)
    for suffix in fmt.suffixes:
        first = next(f for f in FORMATS if f.read_counts is not None and suffix in f.suffixes)
        for spelled in (suffix, suffix.upper()):
            path = tmp_path / f"counts{spelled}"
            path.write_bytes(b"not opened")
            assert detect_counts_format(path) == first.name


def test_counts_round_trip_through_the_array_formats(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    np.savez(tmp_path / "c.npz", counts=COUNTS)
    np.savetxt(tmp_path / "c.csv", COUNTS, delimiter=",")
    (tmp_path / "c.json").write_text(json.dumps({"logical_count": COUNTS.tolist()}))
    for name in ("c.npy", "c.npz", "c.csv", "c.json"):
        data = read_counts(tmp_path / name)
        assert data.format == detect_counts_format(tmp_path / name) and data.format in COUNTS_FORMATS
        np.testing.assert_array_equal(data.weights, COUNTS)


def test_a_folder_of_counts_is_recognised_by_what_it_holds(tmp_path):
    folders = [f for f in FORMATS if f.read_counts is not None and f.folder]
    assert [f.name for f in folders] == ["trtllm-stats"]
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "meta_info.json").write_text("{}")
    assert detect_counts_format(tmp_path / "stats") == "trtllm-stats"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match=re.escape(folders[0].recognised_by)):
        detect_counts_format(tmp_path / "empty")
    with pytest.raises(FormatError, match="is a folder, not a npy file"):
        read_counts(tmp_path / "stats", "npy")


def test_json_placements_are_told_apart_by_their_content(tmp_path):
    """eplb and SGLang both claim ``.json``: the content decides, SGLang's key first (eplb, the
    format ``.json`` is written in, is asked last), and neither names both."""
    (tmp_path / "both.json").write_text(json.dumps({"physical_to_logical_map": [[0]], "placement": {}}))
    assert detect_placement_format(tmp_path / "both.json") == "sglang"
    (tmp_path / "bare.json").write_text(json.dumps(PLACEMENT.to_dict()))
    assert detect_placement_format(tmp_path / "bare.json") == "eplb"
    (tmp_path / "other.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(FormatError, match=re.escape("a JSON placement must hold 'physical_to_logical_map' (SGLang) "
                                                    "or an eplb 'placement'")):
        detect_placement_format(tmp_path / "other.json")


# -- names -----------------------------------------------------------------------------------------


def test_the_cli_offers_exactly_the_registry_s_names():
    from eplb.cli import main

    seen = {"--input-format": 0, "--format": 0, "--previous-format": 0}
    for command in main.commands.values():
        for param in command.params:
            for flag, names in (("--input-format", COUNTS_FORMATS), ("--format", PLACEMENT_FORMATS),
                                ("--previous-format", PLACEMENT_FORMATS)):
                if flag in param.opts:
                    assert isinstance(param.type, click.Choice)
                    assert tuple(param.type.choices) == names, (command.name, flag)
                    seen[flag] += 1
    assert all(seen.values()), seen


def test_unknown_names_are_refused_listing_the_registry_s_names(tmp_path):
    np.save(tmp_path / "c.npy", COUNTS)
    write_placement(PLACEMENT, tmp_path / "p.json")
    counts_names, placement_names = ", ".join(COUNTS_FORMATS), ", ".join(PLACEMENT_FORMATS)
    with pytest.raises(FormatError, match=f"unknown counts format 'bogus'; one of {re.escape(counts_names)}$"):
        read_counts(tmp_path / "c.npy", "bogus")
    with pytest.raises(FormatError, match="unknown counts format 'eplb'"):  # a placement format holds no counts
        read_counts(tmp_path / "c.npy", "eplb")
    with pytest.raises(FormatError, match=f"unknown placement format 'bogus'; one of {re.escape(placement_names)}$"):
        read_placement(tmp_path / "p.json", "bogus")
    with pytest.raises(FormatError, match=f"unknown placement format 'npy'; one of {re.escape(placement_names)}$"):
        write_placement(PLACEMENT, tmp_path / "q.json", "npy")
    (tmp_path / "c.txt").write_text("1,2")
    with pytest.raises(FormatError, match=f"pass --input-format \\(one of {re.escape(counts_names)}\\)"):
        detect_counts_format(tmp_path / "c.txt")
    with pytest.raises(FormatError, match=f"pass --format \\(one of {re.escape(placement_names)}\\)"):
        placement_format_for_output(tmp_path / "p.txt")
    takers = [f.title for f in FORMATS if "layer_updates_per_iter" in f.keywords]
    with pytest.raises(FormatError, match=f"applies to {takers[0]} only, not to eplb output"):
        write_placement(PLACEMENT, tmp_path / "r.json", layer_updates_per_iter=2)


def test_the_module_docstring_tables_list_the_registry_s_names():
    """The counts table (first) and the placements table (second) name every registered format, in order."""
    tables = re.findall(r"^=+ +=+\n(.*?)^=+ +=+$", inspect.getdoc(formats), re.S | re.M)
    assert len(tables) == 2
    counts_table, placements_table = (re.findall(r"^``([\w-]+)``", t, re.M) for t in tables)
    assert tuple(counts_table) == COUNTS_FORMATS
    assert tuple(placements_table) == PLACEMENT_FORMATS

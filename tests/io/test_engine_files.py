"""The files an engine loads, as the engine loads them (issue 29, "Files an engine loads").

- SGLang indexes ``physical_to_logical_map`` by model layer over every layer of the model
  (``ModelConfigForExpertLocation.num_layers`` is ``num_hidden_layers``): eplb's file from counts of
  the MoE layers only, of every layer, or from SGLang's own dump is loaded here by SGLang's own
  ``compute_initial_expert_location_metadata`` with a DeepSeek-V3-shaped model (61 layers, the first
  3 dense), and each MoE layer must find its own plan in its row.
- TensorRT-LLM's YAML is keyed by the model's layer ids, whatever the input.
- An output named like SGLang's ``--init-expert-location`` file is written in SGLang's format.
- An off-node plan written for SGLang says what SGLang's static dispatch serves.
- A deployed placement's recorded deployment is checked against the flags, never overridden by
  them; a YAML writing a layer twice (which ``yaml.safe_load`` silently collapses) is refused.
"""

from __future__ import annotations

import ast
import json
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.io.formats import FormatError, placement_format_for_output, read_placement, write_placement

from cli_runner import invoke
from sglang_sources import SKIP_REASON, load_expert_location, sglang_file

MODEL_LAYERS, DENSE, EXPERTS, SLOTS, GPUS = 61, 3, 32, 40, 8   # DeepSeek-V3's layers, fewer experts
MOE_IDS = np.arange(DENSE, MODEL_LAYERS)


def _moe_counts(seed: int = 11) -> np.ndarray:
    """``[58, E]``: skewed counts that differ from layer to layer (a plan shifted by a layer is poor)."""
    rng = np.random.default_rng(seed)
    return np.ceil(rng.pareto(1.2, size=(MODEL_LAYERS - DENSE, EXPERTS)) * 100)


def _write_inputs(tmp_path, kind: str):
    """The counts file of ``kind`` and the model layer ids its rows are: ``(name, extra args, ids)``."""
    moe = _moe_counts()
    if kind == "moe-only npz":                       # [58, E] with layer_ids 3..60
        np.savez(tmp_path / "c.npz", counts=moe, layer_ids=MOE_IDS)
        return "c.npz", [], MOE_IDS
    full = np.zeros((MODEL_LAYERS, EXPERTS))
    full[DENSE:] = moe
    if kind == "every layer npy":                    # [61, E], dense rows all zero
        np.save(tmp_path / "c.npy", full)
        return "c.npy", [], np.arange(MODEL_LAYERS)
    torch = pytest.importorskip("torch", reason="an SGLang dump is a torch file")
    # SGLang's _StatAccumulator.dump: logical_count [T, num_hidden_layers, E], dense layers 0
    series = np.stack([full, 2 * full, full])
    torch.save(dict(rank=0, logical_count=torch.tensor(series, dtype=torch.int32),
                    average_utilization_rate_over_window=None), tmp_path / "expert_distribution_recorder_1.pt")
    return "expert_distribution_recorder_1.pt", ["--no-held-out"], np.arange(MODEL_LAYERS)


INPUTS = ["moe-only npz", "every layer npy", "sglang dump"]


def _plan(tmp_path, counts, extra, output, *more, expect=0):
    return invoke("plan", counts, "--slots", str(SLOTS), "--gpus", str(GPUS), *extra, "-o", output, *more,
                  cwd=tmp_path, expect=expect)


def _eplb_rows(tmp_path) -> dict[int, list[int]]:
    """The plan eplb JSON records, by model layer id."""
    loaded = read_placement(tmp_path / "plan.json")
    return {int(i): row.tolist() for i, row in zip(loaded.layer_ids, loaded.placement.phy2log)}


# -- SGLang's own loader -----------------------------------------------------------------------------------------


def _deepseek_config_for_expert_location(module):
    """``DeepseekV2ForCausalLM.get_model_config_for_expert_location`` from SGLang's own model file,
    executed on its own (the layer count SGLang derives from the model config)."""
    source = sglang_file("sglang/srt/models/deepseek_v2.py")
    tree = ast.parse(source)
    method = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body
                  if isinstance(node, ast.FunctionDef) and node.name == "get_model_config_for_expert_location")
    method.decorator_list = []
    namespace = {"ModelConfigForExpertLocation": module.ModelConfigForExpertLocation}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "deepseek_v2.py", "exec"), namespace)
    return namespace["get_model_config_for_expert_location"]


def _sglang_loads(monkeypatch, path):
    """SGLang's ``compute_initial_expert_location_metadata`` on ``--init-expert-location path`` for
    a DeepSeek-V3-shaped model (61 layers, 3 dense) on ``ep_size = GPUS``, static dispatch."""
    settings = SimpleNamespace(moe=SimpleNamespace(
        init_expert_location=str(path), ep_dispatch_algorithm="static", moe_a2a_backend="deepep",
        ep_join_mode="none", ep_num_redundant_experts=SLOTS - EXPERTS, eplb_algorithm="auto"))
    parallel = SimpleNamespace(ep_size=GPUS, nnodes=1, tp_size=GPUS, elastic_ep_initial_size=None,
                               ep_join_rank_offset=0)
    module = load_expert_location(monkeypatch, settings, parallel)
    if module is None:
        pytest.skip(SKIP_REASON)
    config_for = _deepseek_config_for_expert_location(module)
    model_class = type("DeepseekV3ForCausalLM", (), {"get_model_config_for_expert_location":
                                                     staticmethod(lambda hf: config_for(None, hf))})
    loader = types.ModuleType("sglang.srt.model_loader")
    loader.get_model_architecture = lambda model_config: (model_class, "DeepseekV3ForCausalLM")
    monkeypatch.setitem(sys.modules, loader.__name__, loader)
    hf_config = SimpleNamespace(num_hidden_layers=MODEL_LAYERS, first_k_dense_replace=DENSE, n_routed_experts=EXPERTS,
                                n_group=4, moe_layer_freq=1)
    return module.compute_initial_expert_location_metadata(SimpleNamespace(hf_config=hf_config), moe_ep_rank=0)


@pytest.mark.skipif(sglang_file("sglang/srt/eplb/expert_location.py") is None, reason=SKIP_REASON)
@pytest.mark.parametrize("kind", INPUTS)
def test_sglang_finds_each_moe_layer_plan_in_its_row(monkeypatch, tmp_path, kind):
    pytest.importorskip("torch", reason="SGLang's loader uses torch")
    counts, extra, ids = _write_inputs(tmp_path, kind)
    _plan(tmp_path, counts, extra, "plan.json")
    out, _ = _plan(tmp_path, counts, extra, "init.json", "--format", "sglang")
    assert f"SGLang's map has {MODEL_LAYERS} rows" in out

    metadata = _sglang_loads(monkeypatch, tmp_path / "init.json")
    assert metadata.num_layers == MODEL_LAYERS             # the recorder asserts every MoE layer id is below it
    table = metadata.physical_to_logical_map.numpy()
    planned = _eplb_rows(tmp_path)
    assert sorted(planned) == ids.tolist()
    for layer in MOE_IDS:                                  # each MoE layer reads its own layer's plan
        assert table[layer].tolist() == planned[layer], f"layer {layer}"
    for layer in range(DENSE):                             # dense rows: a valid placement of every expert
        assert set(table[layer].tolist()) == set(range(EXPERTS))
    if kind == "moe-only npz":                             # ... SGLang's own trivial rows where the counts had none
        trivial = np.arange(SLOTS) % EXPERTS
        assert all(table[layer].tolist() == trivial.tolist() for layer in range(DENSE))
    # SGLang's static table serves each MoE layer its own plan: far better than a shifted row would
    moe = _moe_counts()
    rank_table = metadata.logical_to_rank_dispatch_physical_map.numpy()          # [61, E]: rank 0's replica
    assert (np.take_along_axis(table, rank_table, axis=1) == np.arange(EXPERTS)).all()
    placement = eplb.Placement(table[DENSE:], EXPERTS, eplb.Topology.uniform(SLOTS, GPUS))
    shifted = eplb.Placement(np.roll(table[DENSE:], 1, axis=0), EXPERTS, eplb.Topology.uniform(SLOTS, GPUS))
    assert placement.balancedness(moe).mean() > 0.9 > shifted.balancedness(moe).mean()


@pytest.mark.skipif(sglang_file("sglang/srt/eplb/expert_location.py") is None, reason=SKIP_REASON)
def test_num_layers_gives_sglang_the_model_layer_count(monkeypatch, tmp_path):
    pytest.importorskip("torch", reason="SGLang's loader uses torch")
    counts, extra, _ = _write_inputs(tmp_path, "moe-only npz")
    _plan(tmp_path, counts, extra, "init.json", "--format", "sglang", "--num-layers", "62")
    table = np.array(json.loads((tmp_path / "init.json").read_text())["physical_to_logical_map"])
    assert table.shape == (62, SLOTS) and table[61].tolist() == (np.arange(SLOTS) % EXPERTS).tolist()
    back = read_placement(tmp_path / "init.json")           # the side file says which rows were planned
    assert back.layer_ids.tolist() == MOE_IDS.tolist() and back.placement.num_layers == 58


@pytest.mark.parametrize("args, words", [
    (["--format", "sglang", "--num-layers", "60"], ["--num-layers", "60 layers", "model layer 60"]),
    (["--num-layers", "61"], ["--num-layers", "engine output", "eplb"]),          # -o plan.json: eplb's JSON
])
def test_num_layers_that_cannot_hold_the_counts_is_a_usage_error(tmp_path, args, words):
    counts, extra, _ = _write_inputs(tmp_path, "moe-only npz")
    output = "init.json" if "sglang" in args else "plan.json"
    _, err = _plan(tmp_path, counts, extra, output, *args, expect=2)
    assert all(word in err for word in words), err
    assert "Traceback" not in err and not (tmp_path / output).exists()


def test_sglang_writer_places_rows_by_layer_id_or_refuses(tmp_path):
    placement = eplb.plan(_moe_counts()[:4], num_slots=SLOTS, num_gpus=GPUS)
    write_placement(placement, tmp_path / "a.json", "sglang", layer_ids=[1, 3, 5, 7])
    table = np.array(json.loads((tmp_path / "a.json").read_text())["physical_to_logical_map"])
    assert table.shape == (8, SLOTS)
    np.testing.assert_array_equal(table[[1, 3, 5, 7]], placement.phy2log)
    assert read_placement(tmp_path / "a.json").placement == placement
    with pytest.raises(FormatError, match="num_layers"):
        write_placement(placement, tmp_path / "b.json", "sglang", layer_ids=[1, 3, 5, 7], num_layers=7)
    with pytest.raises(FormatError, match="num_layers .* applies to"):
        write_placement(placement, tmp_path / "c.json", "eplb", num_layers=8)


@settings(max_examples=40)
@given(ids=st.lists(st.integers(0, 80), min_size=1, max_size=6, unique=True), extra=st.integers(0, 3),
       experts=st.integers(1, 6), per_gpu=st.integers(1, 4), gpus=st.integers(1, 3), seed=st.integers(0, 9))
def test_sglang_map_puts_every_row_at_its_layer(ids, extra, experts, per_gpu, gpus, seed):
    """For any layer ids (any order, gaps) and model layer count: row ``ids[i]`` is layer ``i``'s plan,
    every other row is SGLang's trivial placement, and the file reads back as the same plan and ids."""
    slots = max(experts, per_gpu * gpus)
    slots += -slots % gpus
    counts = np.random.default_rng(seed).integers(0, 50, size=(len(ids), experts))
    placement = eplb.plan(counts, num_slots=slots, num_gpus=gpus, method="greedy")
    num_layers = max(ids) + 1 + extra
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "init_expert_location.json"
        write_placement(placement, path, layer_ids=ids, num_layers=num_layers)
        table = np.array(json.loads(path.read_text())["physical_to_logical_map"])
        back = read_placement(path)
    assert table.shape == (num_layers, slots)
    np.testing.assert_array_equal(table[ids], placement.phy2log)
    others = np.setdiff1d(np.arange(num_layers), ids)
    assert (table[others] == np.arange(slots) % experts).all()
    assert back.placement == placement and back.layer_ids.tolist() == ids


# -- TensorRT-LLM keeps the model's layer ids ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", INPUTS)
def test_trtllm_yaml_is_keyed_by_model_layer_for_every_input(tmp_path, kind):
    yaml = pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    counts, extra, ids = _write_inputs(tmp_path, kind)
    _plan(tmp_path, counts, extra, "plan.json")
    out, _ = _plan(tmp_path, counts, extra, "moe_load_balancer.yaml")
    assert "the YAML's keys, the model's layer ids" in out
    assignments = yaml.safe_load((tmp_path / "moe_load_balancer.yaml").read_text())["initial_global_assignments"]
    assert list(assignments) == ids.tolist()
    planned = _eplb_rows(tmp_path)
    assert all(assignments[layer] == planned[layer] for layer in MOE_IDS)
    back = read_placement(tmp_path / "moe_load_balancer.yaml")
    assert back.layer_ids.tolist() == ids.tolist()


# -- an engine's file name picks its format -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["init_expert_location.json", "decode-init-expert-location.json",
                                  "Init_Expert_Location_v2.json"])
def test_sglang_file_names_write_sglang_files(tmp_path, name):
    assert placement_format_for_output(tmp_path / name) == "sglang"
    counts, extra, _ = _write_inputs(tmp_path, "every layer npy")
    out, err = _plan(tmp_path, counts, extra, name)
    assert list(json.loads((tmp_path / name).read_text())) == ["physical_to_logical_map"]
    assert f"wrote    {name} (sglang)" in out and "--format eplb" in err
    # asked for by name, eplb's JSON is still written
    out, _ = _plan(tmp_path, counts, extra, name, "--format", "eplb")
    assert read_placement(tmp_path / name).format == "eplb"
    assert placement_format_for_output(tmp_path / "plan.json") == "eplb"
    assert placement_format_for_output(tmp_path / "expert_location.yaml") == "trtllm"


# -- an off-node plan written for SGLang says what SGLang serves --------------------------------------------------


def test_off_node_plan_written_for_sglang_says_what_static_dispatch_serves(tmp_path):
    rng = np.random.default_rng(5)
    counts = np.ceil(rng.pareto(1.0, size=(4, EXPERTS)) * 100)
    counts[:, :8] *= 6                                      # one hot group: off-node replicas pay off
    np.save(tmp_path / "c.npy", counts)
    out, _ = invoke("plan", "c.npy", "--slots", "48", "--gpus", "8", "--nodes", "2", "--groups", "4",
                    "--max-off-node", "0.3", "--format", "sglang", "-o", "init.json", cwd=tmp_path)
    assert "split evenly unless told otherwise" not in out
    note = next(line for line in out.splitlines() if line.startswith("note "))
    served = read_placement(tmp_path / "init.json").placement          # what SGLang loads: no shares
    static = served.balancedness(counts, "sglang-static").mean()
    assert f"balance {static:.4f} under SGLang static dispatch" in note
    assert f"{served.balancedness(counts).mean():.4f} under dynamic dispatch with --moe-a2a-backend none" in note


# -- a deployed placement is read as its file records it -------------------------------------------------------


def _deployed(tmp_path, gpus: int):
    """counts.npy and the plan for ``gpus`` GPUs written as YAML and as SGLang's file."""
    counts = _moe_counts()[:6]
    np.save(tmp_path / "counts.npy", counts)
    placement = eplb.plan(counts, num_slots=48, num_gpus=gpus)
    write_placement(placement, tmp_path / "deployed.yaml")
    write_placement(placement, tmp_path / "deployed.json", "sglang")
    write_placement(placement, tmp_path / "deployed_eplb.json")
    return placement


@pytest.mark.parametrize("previous", ["deployed.yaml", "deployed.json", "deployed_eplb.json"])
def test_previous_planned_for_other_gpus_is_re_planned_across_the_change_in_every_format(tmp_path, previous):
    pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    _deployed(tmp_path, gpus=4)
    out, _ = invoke("plan", "counts.npy", "--slots", "48", "--gpus", "8", "--previous", previous, "-o", "new.json",
                    cwd=tmp_path)
    assert "added" in out and (tmp_path / "new.json").exists()  # a deployment change: grown from 4 to 8 GPUs
    (tmp_path / "new.json").unlink()
    # the same deployment is accepted, and its moves counted against it
    out, _ = invoke("plan", "counts.npy", "--slots", "48", "--gpus", "4", "--previous", previous, "-o", "new.json",
                    cwd=tmp_path)
    assert "of 288 slots changed" in out


def test_flags_fill_in_only_what_a_file_does_not_record(tmp_path):
    pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    placement = _deployed(tmp_path, gpus=4)
    for name in ("deployed.yaml", "deployed.json"):
        with pytest.raises(FormatError, match=r"records 4 GPUs .*not --gpus 8"):
            read_placement(tmp_path / name, num_gpus=8)
        assert read_placement(tmp_path / name, num_gpus=4).placement == placement
    (tmp_path / "deployed.eplb.json").unlink()               # no side file: the flag says what the file cannot
    assert read_placement(tmp_path / "deployed.json", num_gpus=8).placement.num_gpus == 8
    text = (tmp_path / "deployed.yaml").read_text()
    (tmp_path / "bare.yaml").write_text("\n".join(line for line in text.splitlines() if "# eplb:" not in line))
    assert read_placement(tmp_path / "bare.yaml", num_gpus=8).placement.num_gpus == 8


def test_previous_sglang_map_of_every_layer_serves_counts_of_the_moe_layers(tmp_path):
    counts, extra, _ = _write_inputs(tmp_path, "moe-only npz")
    _plan(tmp_path, counts, extra, "deployed.json", "--format", "sglang")
    (tmp_path / "deployed.eplb.json").unlink()               # SGLang's 61 rows alone, layers 0..60
    out, _ = _plan(tmp_path, counts, extra, "next.json", "--previous", "deployed.json")
    assert f"of {58 * SLOTS} slots changed" in out           # compared on layers 3..60, row by row
    # a YAML keyed 3..60 against counts of layers 0..57 (no layer ids): the rows are other layers' plans
    _plan(tmp_path, counts, extra, "deployed.yaml")
    np.save(tmp_path / "other.npy", _moe_counts())
    _, err = invoke("plan", "other.npy", "--slots", str(SLOTS), "--gpus", str(GPUS), "--previous", "deployed.yaml",
                    "-o", "x.json", cwd=tmp_path, expect=1)
    assert "covers model layers 3..60, the counts layers 0..57" in err and err.count("\n") == 1, err


# -- a YAML that writes a layer twice -----------------------------------------------------------------------------


YAML_TWICE = """num_slots: 4
initial_global_assignments:
  0: [0, 1, 2, 3]
  0: [3, 2, 1, 0]
layer_updates_per_iter: 0
"""


def test_yaml_writing_a_layer_twice_is_refused(tmp_path):
    pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    (tmp_path / "twice.yaml").write_text(YAML_TWICE)
    with pytest.raises(FormatError, match=r"the key 0 appears twice .*lines 3 and 4"):
        read_placement(tmp_path / "twice.yaml", num_gpus=2)
    _, err = invoke("validate", "twice.yaml", "--gpus", "2", cwd=tmp_path, expect=1)
    assert err.startswith("Error: ") and err.count("\n") == 1 and "twice" in err
    (tmp_path / "keys.yaml").write_text(YAML_TWICE.replace("num_slots: 4", "num_slots: 4\nnum_slots: 4")
                                        .replace("  0: [3, 2, 1, 0]", "  1: [3, 2, 1, 0]"))
    with pytest.raises(FormatError, match="num_slots"):
        read_placement(tmp_path / "keys.yaml", num_gpus=2)
    # a merge key may be overridden (YAML's own rule), as yaml.safe_load reads it
    (tmp_path / "merge.yaml").write_text("base: &b {num_slots: 4}\nconfig:\n  <<: *b\n  num_slots: 4\n"
                                         "num_slots: 4\ninitial_global_assignments:\n  0: [0, 1, 2, 3]\n")
    assert read_placement(tmp_path / "merge.yaml", num_gpus=2).placement.num_layers == 1


def test_yaml_missing_a_layer_its_eplb_comment_records_is_refused(tmp_path):
    pytest.importorskip("yaml", reason="pyyaml is an optional extra")
    placement = eplb.plan(_moe_counts()[:3], num_slots=SLOTS, num_gpus=GPUS)
    write_placement(placement, tmp_path / "p.yaml", layer_ids=[3, 4, 5])
    text = (tmp_path / "p.yaml").read_text()
    assert "layers=3..5" in text
    lines = text.splitlines()
    (tmp_path / "missing.yaml").write_text("\n".join(line for line in lines if not line.startswith("  4:")) + "\n")
    with pytest.raises(FormatError, match=r"layer 4 missing"):
        read_placement(tmp_path / "missing.yaml")
    renamed = "\n".join(line.replace("  4:", "  9:") for line in lines) + "\n"
    (tmp_path / "renamed.yaml").write_text(renamed)
    with pytest.raises(FormatError, match=r"layer 4 missing, layer 9 not written by eplb"):
        read_placement(tmp_path / "renamed.yaml")

"""``eplb plan --previous`` across a deployment change and ``eplb simulate`` with GPUs lost and nodes
added (issue 42): a test per flag, the engine files of the new deployment through the engines' own
loaders, and every bad input refused on one line with exit code 2 and nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

import eplb
from eplb.io.formats import read_placement
from eplb.simulation.synthetic import drifting_counts, skewed_counts

from cli_runner import invoke
from sglang_sources import SKIP_REASON, sglang_file
from test_engine_files import DENSE, EXPERTS, GPUS, MODEL_LAYERS, MOE_IDS, SLOTS, _moe_counts, _sglang_loads

COUNTS = skewed_counts(6, 64, num_groups=8, seed=2)                    # [L, E]
DEPLOYED = dict(slots=80, gpus=16, nodes=2, groups=8)


@pytest.fixture
def deployed(tmp_path):
    """A folder with counts ``c.npy`` and the placement in service ``dep.json`` (80 slots, 16 GPUs, 2 nodes)."""
    np.save(tmp_path / "c.npy", COUNTS)
    invoke("plan", "c.npy", "--slots", "80", "--gpus", "16", "--nodes", "2", "--groups", "8", "-o", "dep.json", "-q",
           cwd=tmp_path)
    return tmp_path


def _line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(key))


def _previous(folder):
    return read_placement(folder / "dep.json").placement


# -- a test per flag ---------------------------------------------------------------------------------------

def test_lost_gpus_keep_the_survivors_and_match_the_library(deployed):
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "--lost-gpus", "5,6", "-o", "next.json", cwd=deployed)
    previous = _previous(deployed)
    change = eplb.DeploymentChange.lose(previous.deployment, [5, 6])
    expected = eplb.plan(COUNTS, change, previous=previous, tolerance=0.005)  # the CLI's tolerance (issue 47 item 10)
    written = read_placement(deployed / "next.json").placement
    assert written == expected and written.topology.slots_per_gpu.tolist() == [5] * 5 + [0, 0] + [5] * 9
    assert (written.logcnt >= 1).all()                                     # no expert dropped
    orphans = int(change.orphans(previous.phy2log).sum())
    transfer = eplb.transfer_plan(previous, written, change, expert_bytes=44040192)
    assert _line(out, "change").endswith("GPUs 5, 6 lost; 14 GPUs with 70 slots (were 16 with 80)")
    assert f"{orphans:,} experts lost every replica" in _line(out, "orphans")
    copies = _line(out, "copies")
    assert f"{transfer.counts()['total']:,} weight copies" in copies and f"{orphans:,} from host memory" in copies
    before, after = previous.balancedness(COUNTS).mean(), written.balancedness(COUNTS).mean()
    assert _line(out, "balance").startswith(f"balance  {before:.4f} in service before the change -> {after:.4f}")
    assert f"{transfer.bytes()['total'] / 2**30:.3g} GiB" in _line(out, "bytes")
    document = json.loads((deployed / "next.json").read_text())
    assert document["configuration"]["change"]["lost_gpus"] == [5, 6]
    assert document["diagnostics"]["transfer"]["copies"]["from_host"] == orphans


def test_slots_per_gpu_gives_the_survivors_more(deployed):
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "--lost-gpus", "8,9,10,11,12,13,14,15",
                    "--slots-per-gpu", "8", "-o", "next.npz", cwd=deployed)
    written = read_placement(deployed / "next.npz").placement
    assert written.topology.slots_per_gpu.tolist() == [8] * 8 + [0] * 8
    assert "8 GPUs with 64 slots (were 16 with 80)" in _line(out, "change")


def test_more_gpus_grow_the_deployment_in_nodes_of_as_many_gpus(deployed):
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "--gpus", "24", "-o", "grown.json", cwd=deployed)
    written = read_placement(deployed / "grown.json").placement
    assert (written.num_gpus, written.num_slots, written.num_nodes) == (24, 120, 3)
    previous = _previous(deployed)
    floor = int(eplb.DeploymentChange(previous.deployment, written.deployment).floor(previous.phy2log).sum())
    assert floor == 6 * 40                                                 # the new GPUs' slots
    assert f"the floor of {floor:,}" in _line(out, "copies") and "0 from host memory" in _line(out, "copies")
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "--gpus", "20", "--nodes", "4", "-o", "n.json",
                    cwd=deployed)
    assert read_placement(deployed / "n.json").placement.num_nodes == 4


def test_gpu_map_renumbers_the_survivors(deployed):
    mapping = [0, 1, 2, 3, 4, -1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    invoke("plan", "c.npy", "--previous", "dep.json", "--gpus", "15", "--nodes", "1", "--gpu-map",
           ",".join(map(str, mapping)), "-o", "next.json", cwd=deployed)
    previous, written = _previous(deployed), read_placement(deployed / "next.json").placement
    assert written.topology.slots_per_gpu.tolist() == [5] * 15
    expected = eplb.plan(COUNTS, written.deployment, previous=previous, gpu_map=mapping, tolerance=0.005)
    np.testing.assert_array_equal(written.phy2log, expected.phy2log)
    # old GPU 6 is new GPU 5: a slot it kept holds what it held (no copy)
    change = eplb.DeploymentChange(previous.deployment, written.deployment, mapping)
    transfer = eplb.transfer_plan(previous, written, change)
    kept = np.ones(written.phy2log.shape, bool)
    kept[transfer.layer, transfer.dst_slot] = False
    carried = change.carry(previous.phy2log)
    assert (written.phy2log[kept] == carried[kept]).all()


def test_previous_alone_takes_its_deployment(deployed):
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "-o", "same.json", cwd=deployed)
    written = read_placement(deployed / "same.json").placement
    assert written.topology == _previous(deployed).topology
    assert not any(line.startswith("change") for line in out.splitlines())  # nothing changed (issue 47 item 15)


def test_hardware_and_expert_size_price_the_recovery(deployed):
    outs = {hw: invoke("plan", "c.npy", "--previous", "dep.json", "--lost-gpus", "3", "--hardware", hw, "-o",
                       f"{hw}.json", cwd=deployed)[0] for hw in ("H100", "B200")}
    assert "on H100" in _line(outs["H100"], "recovery") and "on B200" in _line(outs["B200"], "recovery")
    out, _ = invoke("plan", "c.npy", "--previous", "dep.json", "--lost-gpus", "3", "--expert-bytes", "1000", "-o",
                    "small.json", cwd=deployed)
    document = json.loads((deployed / "small.json").read_text())
    copies = document["diagnostics"]["transfer"]["copies"]["total"]
    assert document["diagnostics"]["transfer"]["bytes"]["total"] == 1000 * copies
    assert "1,000 bytes per expert" in _line(out, "bytes")


# -- engine files for the new deployment --------------------------------------------------------------------

def test_trtllm_yaml_and_npz_for_a_grown_deployment(deployed):
    yaml = pytest.importorskip("yaml", reason="TensorRT-LLM's YAML needs the optional 'trtllm' extra")
    invoke("plan", "c.npy", "--previous", "dep.json", "--gpus", "24", "-o", "grown.yaml", cwd=deployed)
    config = yaml.safe_load((deployed / "grown.yaml").read_text())
    assert config["num_slots"] == 120 and sorted(config["initial_global_assignments"]) == list(range(6))
    back = read_placement(deployed / "grown.yaml").placement        # the eplb comment records the deployment
    assert (back.num_gpus, back.num_nodes) == (24, 3)
    assert all(sorted(set(row)) == list(range(64)) for row in config["initial_global_assignments"].values())


@pytest.mark.skipif(sglang_file("sglang/srt/eplb/expert_location.py") is None, reason=SKIP_REASON)
@pytest.mark.parametrize("previous_gpus, flags", [
    (10, ["--gpus", "8", "--nodes", "1", "--gpu-map", "0,1,-1,2,3,4,5,-1,6,7"]),   # GPUs 2 and 7 lost, renumbered
    (5, ["--gpus", "8", "--nodes", "1"]),                                          # grown from 5 GPUs to 8
    (8, ["--lost-gpus", "2"]),                  # GPU 2 lost, kept in the map and masked (issue 47 item 2)
])
def test_sglang_loads_the_map_of_the_new_deployment(monkeypatch, tmp_path, previous_gpus, flags):
    """SGLang's own loader (8 ranks, 40 slots, a DeepSeek-V3-shaped model) finds each MoE layer's
    re-planned row in the file written across the change."""
    pytest.importorskip("torch", reason="SGLang's loader uses torch")
    np.savez(tmp_path / "c.npz", counts=_moe_counts(), layer_ids=MOE_IDS)
    invoke("plan", "c.npz", "--slots", str(SLOTS), "--gpus", str(previous_gpus), "-o", "dep.json", "-q", cwd=tmp_path)
    invoke("plan", "c.npz", "--previous", "dep.json", *flags, "--slots-per-gpu", str(SLOTS // GPUS), "--format",
           "sglang", "--num-layers", str(MODEL_LAYERS), "-o", "init.json", cwd=tmp_path)
    metadata = _sglang_loads(monkeypatch, tmp_path / "init.json")
    table = metadata.physical_to_logical_map.numpy()
    planned = read_placement(tmp_path / "init.json")
    assert planned.placement.num_gpus == GPUS and planned.layer_ids.tolist() == MOE_IDS.tolist()
    live = np.ones(SLOTS, bool)                 # a masked rank's slots hold expert 0, as SGLang fills an inactive rank
    for rank in planned.metadata.get("masked_ranks") or []:
        live[rank * (SLOTS // GPUS):(rank + 1) * (SLOTS // GPUS)] = False
    np.testing.assert_array_equal(table[MOE_IDS][:, live], planned.placement.phy2log)
    assert (table[MOE_IDS][:, ~live] == 0).all()
    assert all(set(table[layer][live if layer in MOE_IDS else slice(None)].tolist()) == set(range(EXPERTS))
               for layer in range(MODEL_LAYERS))
    assert DENSE == 3


def test_an_engine_format_after_a_loss_says_how_to_renumber(deployed):
    """TensorRT-LLM's YAML needs the same slots on every rank (SGLang's file keeps the lost rank, masked)."""
    _, err = invoke("plan", "c.npy", "--previous", "dep.json", "--lost-gpus", "5", "--format", "trtllm", "-o",
                    "init.yaml", cwd=deployed, expect=2)
    assert err.count("\n") == 1 and "--gpus 15 --gpu-map 0,1,2,3,4,-1,5,6,7,8,9,10,11,12,13,14" in err
    assert not (deployed / "init.yaml").exists()
    hint = err.split("restarted on them: ")[1].split()
    invoke("plan", "c.npy", "--previous", "dep.json", *hint, "--format", "sglang", "-o", "init.json", cwd=deployed)
    assert read_placement(deployed / "init.json").placement.num_gpus == 15


# -- bad input: one line, exit code 2, nothing written ------------------------------------------------------

@pytest.mark.parametrize("flags, words", [
    (["--lost-gpus", "16"], ["--lost-gpus", "0 ... 15", "16"]),
    (["--lost-gpus", "-1"], ["--lost-gpus", "whole numbers >= 0"]),
    (["--lost-gpus", "1,x"], ["--lost-gpus", "'1,x'"]),
    (["--lost-gpus", "8,9,10,11,12,13,14,15"], ["8 GPUs lost: 40 slots for 64 experts", "--slots-per-gpu 8"]),
    (["--lost-gpus", ",".join(map(str, range(16)))], ["every GPU lost"]),
    (["--lost-gpus", "3", "--gpus", "15"], ["--gpus 15", "keep their index", "--gpu-map"]),
    (["--lost-gpus", "3", "--gpu-map", "0"], ["--lost-gpus and --gpu-map"]),
    (["--lost-gpus", "3", "--slots", "80"], ["--slots 80", "75"]),
    (["--gpu-map", "0,1,2"], ["--gpu-map", "16 entries, got 3"]),
    (["--gpu-map", "0,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14"], ["--gpu-map", "two GPUs", "(0)"]),
    (["--gpu-map", "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,16", "--gpus", "16"], ["--gpu-map", "[16]"]),
    (["--gpus", "20"], ["20 GPUs do not fill nodes of 8 GPUs", "--nodes"]),
    (["--gpus", "24", "--nodes", "5"], ["--nodes 5", "24 GPUs"]),
    (["--gpus", "12", "--slots-per-gpu", "4", "--nodes", "1"], ["48 slots for 64 experts", "--slots-per-gpu 6"]),
    (["--gpus", "24", "--slots", "100"], ["--slots 100", "24 GPUs"]),
])
def test_a_change_that_cannot_be_made_is_one_line_and_writes_nothing(deployed, flags, words):
    _, err = invoke("plan", "c.npy", "--previous", "dep.json", *flags, "-o", "next.json", cwd=deployed, expect=2)
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not (deployed / "next.json").exists()


def test_a_loss_from_an_uneven_previous_keeps_the_spread_rule(tmp_path):
    """``--previous`` on GPUs of 1, 1 and 4 slots (3 experts; a dense layer and a skewed one), GPU 0
    lost: the survivors' 5 slots give no expert more than 2 replicas (one a GPU; the GPU of 4 must
    double one). The re-plan gave the expert it doubles the other survivor's slot as well: 3
    replicas on 2 GPUs in the dense layer."""
    from eplb.io.formats import write_placement
    from eplb.planning.spread import avoidable_doubled

    counts = np.array([[0.0, 0.0, 0.0], [5.0, 40.0, 2.0]])
    np.save(tmp_path / "c.npy", counts)
    in_service = eplb.plan(counts, eplb.Deployment.of(3, topology=eplb.Topology(np.array([1, 1, 4]))))
    write_placement(in_service, tmp_path / "dep.npz")
    invoke("plan", "c.npy", "--previous", "dep.npz", "--lost-gpus", "0", "-o", "next.npz", "-q", cwd=tmp_path)
    written = read_placement(tmp_path / "next.npz").placement
    assert written.topology.slots_per_gpu.tolist() == [0, 1, 4]
    np.testing.assert_array_equal(avoidable_doubled(written.phy2log, written.deployment), 0)
    assert written.logcnt.max() <= 2


def test_another_expert_count_and_a_change_flag_without_previous(deployed):
    np.save(deployed / "c32.npy", skewed_counts(6, 32, seed=1))
    _, err = invoke("plan", "c32.npy", "--previous", "dep.json", "--lost-gpus", "3", "-o", "next.json", cwd=deployed,
                    expect=2)
    assert err.count("\n") == 1 and "places 64 experts and the counts have 32" in err
    for flag, value in (("--lost-gpus", "3"), ("--gpu-map", "0"), ("--slots-per-gpu", "6")):
        _, err = invoke("plan", "c.npy", "--slots", "80", "--gpus", "16", flag, value, "-o", "next.json", cwd=deployed,
                        expect=2)
        assert err.count("\n") == 1 and f"{flag} describes a change" in err and "--previous" in err
    _, err = invoke("plan", "c.npy", "--gpus", "16", "-o", "next.json", cwd=deployed, expect=2)
    assert "Missing option '--slots'" in err
    assert not (deployed / "next.json").exists()


# -- eplb simulate with deployment changes --------------------------------------------------------------------

@pytest.fixture
def steps(tmp_path):
    np.save(tmp_path / "steps.npy", drifting_counts(40, 3, 32, drift=0.05, tokens=1024, seed=1))
    return tmp_path


SIM = ["simulate", "steps.npy", "--slots", "48", "--gpus", "8", "--nodes", "2"]


def test_simulate_fail_gpu_compares_the_answers(steps):
    out, _ = invoke(*SIM, "--fail-gpu", "5@20", "-o", "sim", cwd=steps)
    assert "change   after step 20: GPU 5 lost: 7 GPUs with 42 slots (were 8 with 48)" in out
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    assert [row.split()[0] for row in rows] == ["donor", "from", "eplb"]  # the default policies with a change
    assert all("from host" in row and "imbalance" in row and "during" in row for row in rows)
    events = (steps / "sim" / "events.csv").read_text().splitlines()
    assert len(events) == 4 and all(",20,GPU 5 lost," in row for row in events[1:])


def test_simulate_fail_node_with_survivor_slots(steps):
    out, _ = invoke(*SIM, "--fail-node", "1@10:9", "-p", "replan", "-o", "sim", cwd=steps)
    assert "node 1 lost: 4 GPUs with 36 slots (were 8 with 48)" in out


def test_simulate_nodes_join_and_leave(steps):
    out, _ = invoke(*SIM, "--add-nodes", "2@10", "--remove-nodes", "3@30:8", "-p", "donor-repair", "-p", "balancer",
                    "-o", "sim", cwd=steps)
    assert "after step 10: 2 nodes added: 16 GPUs with 96 slots (were 8 with 48)" in out
    assert "after step 30: 3 nodes removed: 4 GPUs with 32 slots (were 16 with 96)" in out


@pytest.mark.parametrize("flags, words", [
    (["--fail-gpu", "5"], ["--fail-gpu", "WHAT@STEP"]),
    (["--fail-gpu", "8@10"], ["--fail-gpu 8@10", "GPUs are 0 ... 7"]),
    (["--fail-gpu", "5@39"], ["the series has 40 steps", "below 39"]),
    (["--fail-node", "1@10"], ["node 1 lost: 24 slots for 32 experts", "--fail-node 1@10:8"]),
    (["--fail-gpu", "5@10", "--add-nodes", "1@10"], ["another change comes after step 10"]),
    (["--remove-nodes", "2@10"], ["at least one must stay"]),
    (["--fail-gpu", "5@10", "--fail-gpu", "5@20"], ["GPU 5 holds no slots already"]),
])
def test_simulate_bad_changes_are_one_line_and_write_nothing(steps, flags, words):
    _, err = invoke(*SIM, *flags, "-o", "sim", cwd=steps, expect=2)
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not (steps / "sim").exists()

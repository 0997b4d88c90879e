"""Phase-specific pools: SGLang's detail dumps (``per_pass`` / ``per_token``) read as per-pass
counts with the phase of each pass, windows selected by phase, and ``eplb plan --phase``.

The dumps are built in SGLang's structure (``_DetailAccumulator.dump``: ``records`` and
``last_physical_to_logical_map``, tensors saved with ``torch.save``). With SGLang's files at hand
(``EPLB_SGLANG_SOURCES``: a sglang wheel or an unpacked tree, or an installed sglang), SGLang's own
recorder is run on fake forward passes and its dump read back; without them those tests skip.
Checked with sglang 0.5.23.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import types
from contextlib import contextmanager
from enum import IntEnum, auto
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="SGLang's dumps are torch files; torch is not installed")

import eplb  # noqa: E402
from eplb.io.formats import CountsFile, FormatError, detect_counts_format, read_counts  # noqa: E402
from eplb.io.formats.sglang import FORWARD_MODES  # noqa: E402
from cli_runner import invoke  # noqa: E402
from sglang_sources import SKIP_REASON, sglang_file  # noqa: E402

EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY, DRAFT_EXTEND_V2, PREBUILT, SPLIT_PREFILL, DLLM_EXTEND = range(1, 10)
TOP_K_COLUMNS = 8           # _DetailSinglePassGatherer._TOP_K_NUM: the columns of topk_ids_of_layer

# 3 layers (layer 0 dense: no token is routed there), 8 logical experts on 12 slots
PHY2LOG = np.array([list(range(8)) + [0, 1, 2, 3], list(range(8)) + [4, 4, 5, 0], list(range(8)) + [7, 6, 5, 4]])
NUM_LAYERS, NUM_SLOTS = PHY2LOG.shape
NUM_EXPERTS = 8


def routed_slots(rng, num_tokens, top_k=2):
    """``[L, N, 8]`` int32 physical slot ids as the per_token gatherer keeps them: ``top_k`` slots
    per token in the first columns, ``-1`` in the others and in the dense layer 0."""
    ids = np.full((NUM_LAYERS, num_tokens, TOP_K_COLUMNS), -1, dtype=np.int32)
    for layer in range(1, NUM_LAYERS):
        for token in range(num_tokens):
            ids[layer, token, :top_k] = rng.choice(NUM_SLOTS, size=top_k, replace=False)
    return ids


def slot_counts(ids):
    """``[L, S]``: tokens per physical slot, counted one by one."""
    counts = np.zeros((NUM_LAYERS, NUM_SLOTS), dtype=np.int32)
    for layer, token, column in np.ndindex(*ids.shape):
        if ids[layer, token, column] >= 0:
            counts[layer, ids[layer, token, column]] += 1
    return counts


def expert_counts(slots):
    """``[L, E]``: tokens per logical expert from tokens per physical slot ``[L, S]``, one by one."""
    counts = np.zeros((NUM_LAYERS, NUM_EXPERTS))
    for layer, slot in np.ndindex(*slots.shape):
        counts[layer, PHY2LOG[layer, slot]] += slots[layer, slot]
    return counts


def per_token_record(pass_id, mode, ids, rank=0):
    """One record of ``_DetailAccumulator`` fed by ``_DetailSinglePassGatherer`` (per_token)."""
    num_tokens = ids.shape[1]
    return dict(forward_pass_id=pass_id, rank=rank, gatherer_key="primary", input_ids=list(range(100, 100 + num_tokens)),
                positions=list(range(num_tokens)), extend_seq_lens=None if mode == DECODE else [num_tokens],
                forward_mode=mode, topk_ids_of_layer=torch.from_numpy(ids), misc_objects=[],
                global_physical_count=torch.from_numpy(slot_counts(ids)))


def per_pass_record(pass_id, ids, rank=0):
    """One record of ``_DetailAccumulator`` fed by ``_SelectExpertsSinglePassGatherer`` (per_pass)."""
    return dict(forward_pass_id=pass_id, rank=rank, gatherer_key="primary",
                global_physical_count=torch.from_numpy(slot_counts(ids)))


#: (forward mode, tokens) of the passes of the test dump: 3 prefill passes, 3 decode, 1 idle
PASSES = [(EXTEND, 7), (DECODE, 3), (DECODE, 3), (IDLE, 0), (MIXED, 6), (TARGET_VERIFY, 4), (EXTEND, 5)]


def passes(seed=0):
    rng = np.random.default_rng(seed)
    return [(mode, routed_slots(rng, tokens)) for mode, tokens in PASSES]


def save_dump(path, records, phy2log=PHY2LOG):
    torch.save(dict(records=records, last_physical_to_logical_map=torch.as_tensor(phy2log)), path)
    return path


def per_token_dump(path, seed=0):
    return save_dump(path, [per_token_record(i, mode, ids) for i, (mode, ids) in enumerate(passes(seed))])


def per_pass_dump(path, seed=0):
    return save_dump(path, [per_pass_record(i, ids) for i, (_, ids) in enumerate(passes(seed))])


def expected_series(seed=0):
    """``[T, L, E]`` and ``[T]`` phases of :func:`per_token_dump`, computed one token at a time."""
    counts = np.stack([expert_counts(slot_counts(ids)) for _, ids in passes(seed)])
    phases = {EXTEND: "prefill", MIXED: "prefill", DECODE: "decode", TARGET_VERIFY: "decode", IDLE: "other"}
    return counts, [phases[mode] for mode, _ in PASSES]


# -- reading -------------------------------------------------------------------------------------


def test_a_hand_counted_per_token_pass(tmp_path):
    """Two tokens, top-2, through slots that hold replicas: each slot counts for its expert."""
    phy2log = np.array([[0, 1, 2, 0], [2, 1, 0, 1]])
    ids = np.full((2, 2, TOP_K_COLUMNS), -1, dtype=np.int32)
    ids[0, :, :2] = [[0, 3], [1, 3]]        # layer 0: expert 0 via slots 0 and 3, expert 1 via slot 1
    ids[1, :, :2] = [[1, 3], [2, 0]]        # layer 1: expert 1 twice (slots 1, 3), expert 0, expert 2
    record = dict(forward_pass_id=5, rank=3, gatherer_key="primary", input_ids=[11, 12], positions=[0, 1],
                  extend_seq_lens=[2], forward_mode=EXTEND, topk_ids_of_layer=torch.from_numpy(ids), misc_objects=[],
                  global_physical_count=torch.tensor([[1, 1, 0, 2], [1, 1, 1, 1]], dtype=torch.int32))
    data = read_counts(save_dump(tmp_path / "expert_distribution_recorder_1.0_3.pt", [record], phy2log))
    np.testing.assert_array_equal(data.counts, [[[3, 1, 0], [1, 2, 1]]])
    assert data.phases.tolist() == ["prefill"]
    assert data.format == "sglang-detail" and data.layer_ids.tolist() == [0, 1]
    assert data.metadata == {"recorder_mode": "per_token", "rank": 3, "forward_modes": {"EXTEND": 1}}


def test_per_token_dump_gives_per_pass_counts_and_phases(tmp_path):
    path = per_token_dump(tmp_path / "expert_distribution_recorder_1700000000.0_0.pt")
    assert detect_counts_format(path) == "sglang-dump"          # .pt: told apart by its keys when read
    data = read_counts(path)
    counts, phases = expected_series()
    assert data.format == "sglang-detail" and data.counts.shape == (7, NUM_LAYERS, NUM_EXPERTS)
    np.testing.assert_array_equal(data.counts, counts)
    assert data.phases.tolist() == phases
    assert not data.counts[:, 0].any() and not data.counts[3].any()     # dense layer, IDLE pass
    assert data.counts[0].sum() == 7 * 2 * (NUM_LAYERS - 1)              # every token routed to 2 slots
    assert data.metadata["forward_modes"] == {"EXTEND": 2, "DECODE": 2, "MIXED": 1, "IDLE": 1, "TARGET_VERIFY": 1}
    np.testing.assert_array_equal(read_counts(path, "sglang-detail").counts, counts)


def test_per_pass_dump_gives_the_same_counts_and_no_phase(tmp_path):
    data = read_counts(per_pass_dump(tmp_path / "per_pass.pt"))
    np.testing.assert_array_equal(data.counts, expected_series()[0])
    assert data.phases is None and data.metadata["recorder_mode"] == "per_pass"
    with pytest.raises(FormatError, match="records no phase"):
        data.select_phase("prefill")


def test_stat_dumps_are_still_read_and_told_apart(tmp_path):
    counts, _ = expected_series()
    torch.save(dict(rank=0, logical_count=torch.tensor(counts, dtype=torch.int32),
                    average_utilization_rate_over_window=None), tmp_path / "stat.pt")
    data = read_counts(tmp_path / "stat.pt")
    assert data.format == "sglang-dump" and data.phases is None
    np.testing.assert_array_equal(data.counts, counts)
    with pytest.raises(FormatError, match="not a SGLang detail dump.*stat dump"):
        read_counts(tmp_path / "stat.pt", "sglang-detail")
    per_token_dump(tmp_path / "detail.pt")
    assert read_counts(tmp_path / "detail.pt", "sglang-dump").format == "sglang-detail"


def test_every_forward_mode_has_a_phase():
    phases = {value: phase for value, (_, phase) in FORWARD_MODES.items()}
    assert phases == {EXTEND: "prefill", MIXED: "prefill", SPLIT_PREFILL: "prefill", DECODE: "decode",
                      TARGET_VERIFY: "decode", DRAFT_EXTEND_V2: "decode", IDLE: "other", PREBUILT: "other",
                      DLLM_EXTEND: "other"}


def test_transpose_keeps_the_phases(tmp_path):
    data = read_counts(per_token_dump(tmp_path / "d.pt"), transpose=True)
    assert data.counts.shape == (7, NUM_EXPERTS, NUM_LAYERS) and data.phases.tolist() == expected_series()[1]


# -- selecting by phase --------------------------------------------------------------------------


def test_select_phase_keeps_that_phase_in_order(tmp_path):
    data = read_counts(per_token_dump(tmp_path / "d.pt"))
    counts, phases = expected_series()
    for phase, windows in (("prefill", [0, 4, 6]), ("decode", [1, 2, 5])):
        chosen = data.select_phase(phase)
        np.testing.assert_array_equal(chosen.counts, counts[windows])
        np.testing.assert_array_equal(chosen.weights, counts[windows].sum(axis=0))
        assert chosen.phases.tolist() == [phase] * 3
        assert chosen.metadata["windows_selected"] == 3 and chosen.metadata["windows_total"] == 7
        assert chosen.metadata["phase"] == phase and chosen.format == "sglang-detail"
    with pytest.raises(ValueError, match="phase must be one of prefill, decode, got 'other'"):
        data.select_phase("other")
    only_prefill = data.select_phase("prefill")
    with pytest.raises(FormatError, match="no decode pass to select .*3 prefill"):
        only_prefill.select_phase("decode")


def test_counts_file_checks_its_phases():
    counts = np.zeros((2, 1, 4))
    with pytest.raises(ValueError, match=r"phases must have shape \[T\] = \[2\]"):
        CountsFile(counts, np.arange(1), "npy", Path("c.npy"), {}, np.array(["prefill"]))
    with pytest.raises(ValueError, match="phases must hold .*found \\['warmup'\\]"):
        CountsFile(counts, np.arange(1), "npy", Path("c.npy"), {}, np.array(["prefill", "warmup"]))
    assert CountsFile(counts, np.arange(1), "npy", Path("c.npy")).phases is None
    with pytest.raises(FormatError, match="c.npy: records no phase per window"):
        CountsFile(counts, np.arange(1), "npy", Path("c.npy")).select_phase("decode")


# -- malformed dumps -----------------------------------------------------------------------------


def _good_records():
    rng = np.random.default_rng(1)
    return [per_token_record(i, mode, routed_slots(rng, n)) for i, (mode, n) in enumerate([(EXTEND, 3), (DECODE, 2)])]


def _edit(key, value, record=1):
    """A dump whose record ``record`` has ``key`` set to ``value`` (removed when ``value`` is ``...``)."""
    def build():
        records = _good_records()
        if value is ...:
            del records[record][key]
        else:
            records[record][key] = value
        return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))
    return build


def _without(*keys):
    def build():
        records = _good_records()
        for key in keys:
            del records[1][key]
        return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))
    return build


def _mixed_recorders():
    records = _good_records()
    records[1] = per_pass_record(1, records[1]["topk_ids_of_layer"].numpy())
    return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))


def _modes_on_some():
    records = _good_records()
    del records[1]["forward_mode"]
    return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))


def _tokens_in_idle():
    records = _good_records()
    records[1]["forward_mode"] = IDLE
    return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))


def _disagreeing():
    records = _good_records()
    records[1]["global_physical_count"][2, 5] += 1
    return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))


def _ids(edit):
    def build():
        records = _good_records()
        ids = records[1]["topk_ids_of_layer"]
        records[1]["topk_ids_of_layer"] = edit(ids)
        records[1].pop("global_physical_count")
        return dict(records=records, last_physical_to_logical_map=torch.as_tensor(PHY2LOG))
    return build


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


MALFORMED = [  # (what, build the saved object, words the FormatError must hold)
    ("a list, not a dict", lambda: [1, 2], ["expected a dict with 'logical_count'", "or 'records'"]),
    ("records not a list", lambda: dict(records={"0": 1}, last_physical_to_logical_map=torch.as_tensor(PHY2LOG)),
     ["'records' must be a list"]),
    ("no records", lambda: dict(records=[], last_physical_to_logical_map=torch.as_tensor(PHY2LOG)),
     ["'records' is empty", "no forward pass was recorded"]),
    ("no map", lambda: dict(records=_good_records()), ["needs 'last_physical_to_logical_map' [L, S]"]),
    ("map of one axis", lambda: dict(records=_good_records(), last_physical_to_logical_map=torch.arange(4)),
     ["'last_physical_to_logical_map' must be a rectangular [L, S]", "shape [4]"]),
    ("map with a negative id", lambda: dict(records=_good_records(),
                                            last_physical_to_logical_map=torch.as_tensor(PHY2LOG) - 1),
     ["'last_physical_to_logical_map' must hold expert ids >= 0, found -1"]),
    ("map of strings", lambda: dict(records=_good_records(), last_physical_to_logical_map="0,1"),
     ["'last_physical_to_logical_map' must be a tensor, got a str"]),
    ("record not a dict", lambda: dict(records=[_good_records()[0], [1, 2]],
                                       last_physical_to_logical_map=torch.as_tensor(PHY2LOG)),
     ["record 1 of 'records' must be a dict, got a list"]),
    ("no counts in a record", _without("topk_ids_of_layer", "global_physical_count"),
     ["record 1 has neither 'topk_ids_of_layer' [L, N, K] (per_token) nor 'global_physical_count' [L, S]"]),
    ("topk ids of two axes", _ids(lambda ids: ids[0]), ["record 1: 'topk_ids_of_layer' must have shape [L, N, K]"]),
    ("topk ids of other layers", _ids(lambda ids: ids[:2]), ["with L = 3 layers", "got [2, 2, 8]"]),
    ("float topk ids", _ids(lambda ids: ids.float()), ["'topk_ids_of_layer' must hold integer slot ids"]),
    ("topk id past the slots", _ids(lambda ids: _set(ids, (1, 0, 0), NUM_SLOTS)),
     ["holds slot id 12", "-1 (unused) or 0 .. 11"]),
    ("topk id below -1", _ids(lambda ids: _set(ids, (2, 1, 5), -2)), ["holds slot id -2"]),
    ("complex topk ids", _ids(lambda ids: ids.to(torch.complex64)), ["must be real numbers"]),
    ("input ids of another length", _edit("input_ids", [1, 2, 3, 4, 5]),
     ["'topk_ids_of_layer' covers 2 tokens but 'input_ids' lists 5"]),
    ("physical count of other slots", _edit("global_physical_count", torch.zeros(3, 11, dtype=torch.int32)),
     ["'global_physical_count' must have shape [L, S] = [3, 12]", "got [3, 11]"]),
    ("negative physical count", lambda: dict(records=[per_pass_record(0, np.full((3, 1, 8), -1, np.int32))
                                                      | {"global_physical_count": -torch.ones(3, 12)}],
                                             last_physical_to_logical_map=torch.as_tensor(PHY2LOG)),
     ["'global_physical_count' must hold finite non-negative token counts"]),
    ("NaN physical count", lambda: dict(records=[per_pass_record(0, np.full((3, 1, 8), -1, np.int32))
                                                 | {"global_physical_count": torch.full((3, 12), float("nan"))}],
                                        last_physical_to_logical_map=torch.as_tensor(PHY2LOG)),
     ["finite non-negative"]),
    ("counts that disagree", _disagreeing, ["record 1: 'global_physical_count' disagrees", "layer 2, slot 5"]),
    ("forward mode 0", _edit("forward_mode", 0), ["record 1: 'forward_mode' is 0, not one of SGLang's ForwardMode",
                                                  "1 (EXTEND)", "9 (DLLM_EXTEND)"]),
    ("forward mode 10", _edit("forward_mode", 10), ["'forward_mode' is 10, not one of"]),
    ("forward mode by name", _edit("forward_mode", "DECODE"), ["'forward_mode' is 'DECODE', not one of"]),
    ("forward mode True", _edit("forward_mode", True), ["'forward_mode' is True, not one of"]),
    ("forward mode on some records", _modes_on_some, ["record 1 lacks 'forward_mode'", "every record or none"]),
    ("tokens in an idle pass", _tokens_in_idle, ["'forward_mode' 4 (IDLE) is a pass without tokens, but it routes"]),
    ("per_token and per_pass records", _mixed_recorders, ["mix per_token records", "one recorder mode"]),
    ("a rank that is no integer", _edit("rank", "0"), ["record 1: 'rank' must be an integer"]),
]


@pytest.mark.parametrize("what, build, words", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_dumps_are_refused_naming_the_problem(tmp_path, what, build, words):
    path = tmp_path / "dump.pt"
    torch.save(build(), path)
    with pytest.raises(FormatError) as caught:
        read_counts(path)
    assert str(caught.value).startswith(f"{path}: ")
    for word in words:
        assert word in str(caught.value), str(caught.value)


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_dump_is_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(dict(records=_good_records(), last_physical_to_logical_map=torch.as_tensor(PHY2LOG),
                    payload=Exploit()), tmp_path / "dump.pt")
    with pytest.raises(FormatError, match="weights_only"):
        read_counts(tmp_path / "dump.pt")
    assert not (tmp_path / "pwned").exists()


def test_size_limits_are_checked_before_allocating(tmp_path, monkeypatch):
    path = per_token_dump(tmp_path / "d.pt")
    monkeypatch.setenv("EPLB_MAX_WINDOWS", "6")
    with pytest.raises(FormatError, match=r"the number of 'records' \(forward passes\) is 7, above the limit of 6"):
        read_counts(path)
    monkeypatch.setenv("EPLB_MAX_WINDOWS", "7")
    monkeypatch.setenv("EPLB_MAX_CELLS", str(7 * NUM_LAYERS * NUM_EXPERTS - 1))
    with pytest.raises(FormatError, match="the counts array .* above the limit"):
        read_counts(path)
    monkeypatch.delenv("EPLB_MAX_CELLS")
    monkeypatch.setenv("EPLB_MAX_EXPERTS", "7")
    with pytest.raises(FormatError, match="the largest expert id \\+ 1 in 'last_physical_to_logical_map' is 8"):
        read_counts(path)


# -- eplb plan --phase ---------------------------------------------------------------------------


DEPLOYMENT = ["--slots", "12", "--gpus", "4", "--method", "greedy"]


def test_plan_phase_plans_from_that_phase_only(tmp_path):
    per_token_dump(tmp_path / "dump.pt")
    counts, phases = expected_series()
    for phase in ("prefill", "decode"):
        out, _ = invoke("plan", "dump.pt", *DEPLOYMENT, "--phase", phase, "-o", f"{phase}.json", cwd=tmp_path)
        assert f"phase    {phase}: 3 of 7 passes selected" in out
        assert "(sglang-detail): 3 windows x 3 layers x 8 experts" in out
        document = json.loads((tmp_path / f"{phase}.json").read_text())
        assert document["configuration"]["phase"] == phase
        assert document["configuration"]["counts_shape"] == [3, NUM_LAYERS, NUM_EXPERTS]
        weights = counts[[t for t, p in enumerate(phases) if p == phase]].sum(axis=0)
        expected = eplb.plan(weights, num_slots=12, num_gpus=4, method="greedy")
        np.testing.assert_array_equal(document["placement"]["phy2log"], expected.phy2log)
    prefill = json.loads((tmp_path / "prefill.json").read_text())["placement"]["phy2log"]
    decode = json.loads((tmp_path / "decode.json").read_text())["placement"]["phy2log"]
    assert prefill != decode

    out, _ = invoke("plan", "dump.pt", *DEPLOYMENT, "-o", "all.json", cwd=tmp_path)
    assert "phase" not in out and "7 windows" in out
    assert json.loads((tmp_path / "all.json").read_text())["configuration"]["phase"] is None


def test_plan_phase_on_counts_without_phases_is_a_usage_error(tmp_path):
    per_pass_dump(tmp_path / "per_pass.pt")
    np.save(tmp_path / "counts.npy", expected_series()[0])
    torch.save(dict(rank=0, logical_count=torch.tensor(expected_series()[0])), tmp_path / "stat.pt")
    for name in ("per_pass.pt", "counts.npy", "stat.pt"):
        _, err = invoke("plan", name, *DEPLOYMENT, "--phase", "decode", "-o", "p.json", cwd=tmp_path, expect=2)
        error = [line for line in err.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and error[0].startswith("Error: Invalid value for --phase: "), err
        assert f"{name} records no phase per pass" in error[0] and "per_token" in error[0], err
        assert not (tmp_path / "p.json").exists()


def test_plan_phase_with_no_pass_of_that_phase_fails_clearly(tmp_path):
    rng = np.random.default_rng(2)
    save_dump(tmp_path / "prefill_pool.pt", [per_token_record(i, EXTEND, routed_slots(rng, 4)) for i in range(3)])
    _, err = invoke("plan", "prefill_pool.pt", *DEPLOYMENT, "--phase", "decode", "-o", "p.json", cwd=tmp_path,
                    expect=1)
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert "prefill_pool.pt: holds no decode pass to select (its 3 passes: 3 prefill)" in err
    _, err = invoke("plan", "prefill_pool.pt", *DEPLOYMENT, "--phase", "idle", "-o", "p.json", cwd=tmp_path,
                    expect=2)
    assert "--phase" in err and "'idle' is not one of 'prefill', 'decode'" in err, err


def test_plan_refuses_a_malformed_dump_in_one_line(tmp_path):
    torch.save(_edit("forward_mode", 42)(), tmp_path / "bad.pt")
    _, err = invoke("plan", "bad.pt", *DEPLOYMENT, "--phase", "prefill", "-o", "p.json", cwd=tmp_path, expect=1)
    assert err.startswith("Error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "bad.pt: record 1: 'forward_mode' is 42" in err


# -- against SGLang's own recorder ---------------------------------------------------------------

RECORDER = "sglang/srt/eplb/expert_distribution.py"
FORWARD_BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"
UTILS = "sglang/srt/utils/common.py"


def _class_source(source: str, name: str) -> str:
    """The source of the top-level class ``name`` in ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise LookupError(name)


needs_sglang = pytest.mark.skipif(sglang_file(RECORDER) is None,
                                  reason=SKIP_REASON)


@pytest.fixture
def sglang_forward_mode():
    """SGLang's ``ForwardMode`` enum, executed from its source."""
    namespace = {"IntEnum": IntEnum, "auto": auto}
    exec(compile(_class_source(sglang_file(FORWARD_BATCH_INFO), "ForwardMode"), FORWARD_BATCH_INFO, "exec"),
         namespace)
    return namespace["ForwardMode"]


@pytest.fixture
def recorder_module(monkeypatch, tmp_path, sglang_forward_mode):
    """SGLang's ``expert_distribution`` module with its server context replaced by plain values:
    no DeepEP, no two-batch overlap, CPU tensors, dumps written to ``tmp_path``."""
    settings = SimpleNamespace(
        moe=SimpleNamespace(expert_distribution_recorder_mode=None, moe_a2a_backend="none", deepep_mode="auto",
                            elastic_ep_backend=None, expert_distribution_recorder_buffer_size=-1,
                            eplb_min_rebalancing_utilization_threshold=1.0, expert_balancedness_report_mode="off"),
        overlap=SimpleNamespace(enable_two_batch_overlap=False),
    )
    utils_source = sglang_file(UTILS)
    modules = {
        "einops": {},
        "sglang": {}, "sglang.srt": {}, "sglang.srt.layers": {},
        "sglang.srt.environ": {"envs": SimpleNamespace(
            SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR=SimpleNamespace(get=lambda: str(tmp_path)))},
        "sglang.srt.model_executor": {},
        "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": object, "ForwardMode": sglang_forward_mode},
        "sglang.srt.observability": {},
        "sglang.srt.observability.metrics_collector": {"STAT_LOGGER_ROLE_EXPERT_DISPATCH": "expert_dispatch",
                                                        "ExpertDispatchCollector": object,
                                                        "resolve_collector_class": lambda role, default: default},
        "sglang.srt.runtime_context": {
            "get_device": lambda: SimpleNamespace(device="cpu"), "get_exec": lambda: settings,
            "get_platform": lambda: SimpleNamespace(is_hip=False),
            "get_schedule": lambda: SimpleNamespace(chunked_prefill_size=16),
            "logs_expert_balancedness_to_server_log": lambda: False, "reports_expert_balancedness": lambda: False},
        "sglang.srt.layers.moe": {"get_moe_a2a_backend": lambda: SimpleNamespace(is_megamoe=lambda: False)},
        "sglang.srt.utils": {"get_device": lambda: "cpu", "get_int_env_var": lambda name, default=0: default},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    utils = sys.modules["sglang.srt.utils"]
    from typing import Generic, Optional, TypeVar
    utils.__dict__.update(Generic=Generic, Optional=Optional, T=TypeVar("T"), contextmanager=contextmanager)
    exec(compile(_class_source(utils_source, "Withable"), UTILS, "exec"), utils.__dict__)
    module = types.ModuleType("sglang_expert_distribution_under_test")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(sglang_file(RECORDER), RECORDER, "exec"), module.__dict__)
    module.settings = settings
    module.dump_folder = tmp_path
    return module


def _record_with_sglang(module, mode: str, forward_mode, seed=0) -> Path:
    """Run SGLang's recorder in ``mode`` over :data:`PASSES` (each layer's routed slots given to
    ``on_select_experts`` the way the MoE layers do) and return the file it dumps."""
    module.settings.moe.expert_distribution_recorder_mode = mode
    metadata = SimpleNamespace(num_layers=NUM_LAYERS, num_physical_experts=NUM_SLOTS, num_logical_experts=NUM_EXPERTS,
                               ep_size=4, num_local_physical_experts=NUM_SLOTS // 4,
                               physical_to_logical_map=torch.as_tensor(PHY2LOG))
    recorder = module._ExpertDistributionRecorderReal(metadata, rank=0)
    recorder.start_record()
    for pass_id, (mode_value, ids) in enumerate(passes(seed)):
        num_tokens = ids.shape[1]
        batch = SimpleNamespace(input_ids=torch.arange(num_tokens), positions=torch.arange(num_tokens),
                                extend_seq_lens_cpu=[num_tokens], forward_mode=forward_mode(mode_value))
        with recorder.with_forward_pass(pass_id, batch):
            for layer in range(1, NUM_LAYERS):          # layer 0 is dense: no expert selection
                with recorder.with_current_layer(layer):
                    recorder.on_select_experts(topk_ids=torch.from_numpy(ids[layer, :, :2].copy()))
    recorder.stop_record()
    before = set(module.dump_folder.glob("*.pt"))
    recorder.dump_record()
    (path,) = set(module.dump_folder.glob("*.pt")) - before
    return path


@needs_sglang
def test_forward_modes_are_sglangs(sglang_forward_mode):
    """FORWARD_MODES holds every ForwardMode value and name; the phases agree with SGLang's own
    predicates where those are unambiguous."""
    assert {mode.value: mode.name for mode in sglang_forward_mode} == {v: n for v, (n, _) in FORWARD_MODES.items()}
    for mode in sglang_forward_mode:
        phase = FORWARD_MODES[mode.value][1]
        if mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend_v2():
            assert phase == "decode", mode
        elif mode.is_extend_or_draft_extend_or_mixed():
            assert phase == "prefill", mode
        elif mode.is_idle() or mode.is_prebuilt():
            assert phase == "other", mode


@needs_sglang
def test_a_per_token_dump_written_by_sglang(recorder_module, sglang_forward_mode):
    path = _record_with_sglang(recorder_module, "per_token", sglang_forward_mode)
    assert path.name.startswith("expert_distribution_recorder_") and path.name.endswith("_0.pt")
    data = read_counts(path)
    counts, phases = expected_series()
    assert data.format == "sglang-detail" and data.metadata["recorder_mode"] == "per_token"
    np.testing.assert_array_equal(data.counts, counts)
    assert data.phases.tolist() == phases
    np.testing.assert_array_equal(data.select_phase("decode").counts, counts[[1, 2, 5]])


@needs_sglang
def test_a_per_pass_dump_written_by_sglang(recorder_module, sglang_forward_mode):
    path = _record_with_sglang(recorder_module, "per_pass", sglang_forward_mode)
    data = read_counts(path)
    assert data.format == "sglang-detail" and data.metadata["recorder_mode"] == "per_pass"
    np.testing.assert_array_equal(data.counts, expected_series()[0])
    assert data.phases is None

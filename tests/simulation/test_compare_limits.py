"""``eplb compare``'s limits on a foreign method (issue 44, items 10, 11 and 14): its time limit
holds whatever processes the method starts, a file path may hold ``:``, and a return value that is
not the published one is refused. Foreign methods only (no planning kernels), with a short time limit."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from eplb.method_comparison import compare
from eplb.simulation.comparison import BROKEN, OK
from eplb.simulation.method_runner import parse_method
from eplb.io.workloads import read_workload
from cli_runner import invoke

HERE = Path(__file__).resolve().parents[1]
METHODS = str(HERE / "compare_methods.py")
SMALL = dict(num_slots=40, num_gpus=8, num_nodes=2, num_groups=4)
WORKLOAD = "synthetic:lognormal:4x32x6"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended, allowing its new parent a moment to reap it."""
    for _ in range(100):
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_compare_time_limit_holds_when_a_method_starts_a_process_that_inherits_stderr(tmp_path, monkeypatch):
    """Item 10: a method that starts a child holding stderr open and then hangs is killed at the
    time limit with its child (the runner read stderr from a pipe to its end: it waited for the
    child, a minute here, past the limit); a method that leaves such a child behind and returns is
    judged, and its child killed too; the other methods are reported."""
    hung_children, returned_children = tmp_path / "hung", tmp_path / "returned"
    hung_children.mkdir()
    returned_children.mkdir()
    monkeypatch.setenv("EPLB_TEST_CHILDREN", str(hung_children))
    hung, plain = compare([f"{METHODS}:spawns_and_hangs", f"{METHODS}:round_robin"], [WORKLOAD], [SMALL], folds=2,
                          warm_calls=0, time_limit=8, array_type="numpy").results
    assert hung.status == BROKEN and hung.reason == "timed out after 8 s (killed)"
    assert plain.status == OK, plain.reason
    # a generous limit: the method ends on its own, leaving a child per call behind
    monkeypatch.setenv("EPLB_TEST_CHILDREN", str(returned_children))
    returned, = compare([f"{METHODS}:spawns_and_returns"], [WORKLOAD], [SMALL], folds=2, warm_calls=0,
                        time_limit=120, array_type="numpy").results
    assert returned.status == OK, returned.reason
    children = {folder.name: [int(p.stem) for p in folder.glob("*.pid")] for folder in (hung_children,
                                                                                          returned_children)}
    assert len(children["hung"]) == 1 and len(children["returned"]) == 3  # in sample and 2 blocks
    assert [pid for pids in children.values() for pid in pids if not _ended(pid)] == []
    assert list(tmp_path.rglob("*.outlived")) == []  # killed, not waited for


def test_compare_takes_a_method_file_whose_path_holds_a_colon(tmp_path):
    """Item 11: ``-m d:ir/meth.py`` (an existing file) is that file's rebalance_experts, and
    ``d:ir/meth.py:name`` its function ``name``."""
    folder = tmp_path / "d:ir"
    folder.mkdir()
    shutil.copy(METHODS, folder / "meth.py")
    source = (folder / "meth.py").read_text()
    (folder / "meth.py").write_text(source + "\n\nrebalance_experts = round_robin\n")
    assert parse_method("d:ir/meth.py").file == "d:ir/meth.py"
    spec = parse_method("d:ir/meth.py:doubled")
    assert (spec.file, spec.function) == ("d:ir/meth.py", "doubled")
    np.save(tmp_path / "counts.npy", read_workload(WORKLOAD).counts)
    out, err = invoke("compare", "counts.npy", "-m", "d:ir/meth.py", "-m", "d:ir/meth.py:doubled", "--deployment",
                      "40:8", "--folds", "2", "--warm-calls", "0", "--array", "numpy", cwd=tmp_path)
    rows = [line for line in out.splitlines() if "d:ir/meth.py" in line]
    assert len(rows) == 2 and not any("BROKEN" in row for row in rows), out + err


def test_compare_refuses_a_foreign_method_returning_six_values():
    """Item 14: a tuple longer than the published ``(phy2log, log2phy, logcnt)`` gets a BROKEN row
    saying so (its first three were taken and the rest dropped without a word)."""
    comparison = compare([f"{METHODS}:six_values", f"{METHODS}:round_robin"], [WORKLOAD], [SMALL], folds=2,
                         warm_calls=0, array_type="numpy")
    six, plain = comparison.results
    assert six.status == BROKEN and six.placement is None
    assert "returned a tuple of 6 values" in six.reason and "at most 3" in six.reason
    assert plain.status == OK

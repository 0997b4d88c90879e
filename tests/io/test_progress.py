"""Progress of the long commands (issue 44, item 5): a tqdm bar on a terminal, a line per step with
an estimate elsewhere, on stderr only (stdout stays the command's results), nothing when quiet;
and the library functions report every step of what they run."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.io import progress as progress_module
from eplb.io.progress import Progress, duration, offset
from eplb.simulation.synthetic import drifting_counts
from cli_runner import invoke

LINE = re.compile(r"^eplb (\w+): (\d+)/(\d+) (steps|runs|methods)( \(.*\))?; (.*)$")
METHODS = str(Path(__file__).resolve().parents[1] / "compare_methods.py")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_lines_give_the_step_what_runs_and_an_estimate_and_are_spaced(clock):
    stream = io.StringIO()
    progress = Progress("recommend", unit="steps", stream=stream, terminal=False)
    progress(0, 4, "fold 1 of 2")
    clock.now += 3
    progress(1, 4, "fold 1 of 2")
    clock.now += 0.2
    progress(2, 4, "fold 2 of 2")  # within a second of the last line: not written
    clock.now += 3
    progress(3, 4, "fold 2 of 2")
    progress(4, 4, "")  # the last, always
    progress(4, 4, "")  # once
    lines = stream.getvalue().splitlines()
    assert lines == ["eplb recommend: 0/4 steps (fold 1 of 2); 0 s so far",
                     "eplb recommend: 1/4 steps (fold 1 of 2); 3 s so far, about 9 s left",
                     "eplb recommend: 3/4 steps (fold 2 of 2); 6 s so far, about 2 s left",
                     "eplb recommend: 4/4 steps; done in 6 s"]


def test_a_terminal_gets_a_bar_and_quiet_gets_nothing():
    stream = io.StringIO()
    with Progress("sweep", unit="runs", stream=stream, terminal=True) as progress:
        progress(0, 5, "none at 40 slots")
        progress(2, 5, "none at 48 slots")
    drawn = stream.getvalue()
    assert "eplb sweep" in drawn and "2/5" in drawn and "none at 48 slots" in drawn and "\r" in drawn
    quiet = io.StringIO()
    with Progress("sweep", stream=quiet, terminal=True, quiet=True) as progress:
        progress(1, 5)
    with Progress("sweep", stream=quiet, terminal=False, quiet=True) as progress:
        progress(1, 5)
    assert quiet.getvalue() == ""


def test_duration_and_offset():
    assert [duration(s) for s in (0.4, 59.6, 102, 7325)] == ["0 s", "1 min 0 s", "1 min 42 s", "2 h 02 min"]
    seen = []
    part = offset(lambda *args: seen.append(args), 10, 30, "policy vllm")
    part(4, 10, "")
    part(10, 10, "x")
    assert seen == [(14, 30, "policy vllm"), (20, 30, "policy vllm, x")]
    assert offset(None, 0, 1) is None


def record(calls):
    return lambda done, total, note="": calls.append((done, total, note))


def check_steps(calls, total):
    """Every call has the same total, ``done`` never goes back, starts at 0 and ends at the total."""
    assert calls and {c[1] for c in calls} == {total}
    done = [c[0] for c in calls]
    assert done[0] == 0 and done[-1] == total and done == sorted(done)


def test_the_library_reports_every_step_of_recommend_sweep_and_simulate():
    series = drifting_counts(4, 3, 64, tokens=2048, drift=0.3, seed=5)
    calls = []
    result = eplb.recommend(series, eplb.Deployment.of(64, num_slots=72, num_gpus=8), batch=4, model="olmoe-1b-7b",
                            extra_slots_per_gpu=(0, 1), passes=2, progress=record(calls))
    check_steps(calls, result.folds * 2 + 1)
    assert {c[2] for c in calls} >= {"fold 1 of 4", "fold 4 of 4"}
    steps = drifting_counts(600, 2, 32, tokens=512, seed=4)
    calls = []
    eplb.simulate(steps, eplb.Deployment.of(32, num_slots=40, num_gpus=8), progress=record(calls))
    check_steps(calls, 600)
    assert len(calls) == 1 + 3  # the start, then every block of 256 steps
    calls = []
    grid = eplb.Deployment.grid(32, extra_slots_per_gpu=(0, 1), num_gpus=(8,))
    rows = eplb.sweep(steps[:60], grid, policies=("none",), workers=1, progress=record(calls))
    check_steps(calls, len(rows))
    assert calls[-1][2].startswith("no rebalancing at ") and "slots on 8 GPUs" in calls[-1][2]


def _progress_lines(err: str, command: str) -> list[tuple[int, int]]:
    found = [LINE.match(line) for line in err.splitlines()]
    return [(int(m.group(2)), int(m.group(3))) for m in found if m and m.group(1) == command]


def test_every_long_command_shows_progress_on_stderr_and_keeps_stdout_parseable(tmp_path):
    """The CLI runner's stderr is not a terminal: lines, each with its step; stdout holds only the
    results (the same as without progress), and --quiet shows none."""
    np.save(tmp_path / "pool.npy", drifting_counts(4, 3, 64, tokens=2048, drift=0.3, seed=5))
    np.save(tmp_path / "steps.npy", drifting_counts(300, 2, 32, tokens=512, seed=4))
    commands = {
        "recommend": ["pool.npy", "--gpus", "8", "--batch", "4", "--model", "olmoe-1b-7b", "--extra-slots", "0,1",
                      "--passes", "2"],
        "simulate": ["steps.npy", "-s", "40", "-g", "8", "-p", "none", "-p", "every:100", "-o", "sim"],
        "sweep": ["steps.npy", "--extra-slots", "0,1", "--gpus", "8", "-p", "none", "--workers", "1", "-o", "sweep"],
        "compare": ["synthetic:lognormal:4x32x6", "-m", f"{METHODS}:round_robin", "-m", f"{METHODS}:doubled",
                    "--deployment", "40:8", "--folds", "2", "--warm-calls", "0", "--array", "numpy"],
    }
    for command, args in commands.items():
        out, err = invoke(command, *args, cwd=tmp_path)
        lines = _progress_lines(err, command)
        assert lines and lines[-1][0] == lines[-1][1] and [d for d, _ in lines] == sorted(d for d, _ in lines), err
        assert not any(LINE.match(line) for line in out.splitlines()), out  # stdout: the results only
        first = out.splitlines()[0]
        assert first.startswith("counts") or command == "compare", out
        if command == "compare":
            assert [line.split()[0] for line in out.splitlines()[1:3]] == ["synthetic:lognormal:4x32x6"] * 2, out
        quiet_out, quiet_err = invoke(command, *args, "--quiet", cwd=tmp_path)
        assert _progress_lines(quiet_err, command) == [] and quiet_out == ""

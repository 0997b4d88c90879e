"""Issue 44, item 6: when compiling eplb's kernels takes more than a couple of seconds (a checkout,
which ships none compiled), one line on stderr says so, once per process, while the compile runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numba
import pytest
from numba.core import event

from eplb.kernels.plumbing import _compile_notice
from eplb.kernels.plumbing._compile_notice import CompileNotice, notice_text

ROOT = Path(__file__).resolve().parents[2]


def _fresh_function(k: int):
    """A jitted function no cache holds (defined here, compiled in memory), distinct per ``k``."""
    @numba.njit(cache=False)
    def f(x):
        total = 0.0
        for i in range(x.size):
            total += x[i] * k + i
        return total
    return f


def _compile(k: int) -> None:
    import numpy as np

    _fresh_function(k)(np.arange(4.0))


def _compile_event(kind: str) -> event.Event:
    return event.Event("numba:compile", event.EventStatus.START if kind == "start" else event.EventStatus.END,
                       data={"dispatcher": None})


def test_item6_says_it_once_after_the_threshold_however_many_compiles_follow():
    said = []
    notice = CompileNotice(lambda: said.append(1), after=0.0, counts=lambda e: True)
    with event.install_listener("numba:compile", notice):
        for k in range(3):
            _compile(k)
    assert said == [1] and notice.said


def test_item6_says_nothing_when_compiling_stays_under_the_threshold():
    said = []
    notice = CompileNotice(lambda: said.append(1), after=600.0, counts=lambda e: True)
    with event.install_listener("numba:compile", notice):
        _compile(10)
    assert said == [] and not notice.said


def test_item6_says_it_during_a_long_compile_not_after_it():
    fired = threading.Event()
    notice = CompileNotice(fired.set, after=0.05, counts=lambda e: True)
    notice.on_start(_compile_event("start"))       # a compile starts ...
    assert fired.wait(timeout=30)                  # ... and the line comes while it still runs
    notice.on_end(_compile_event("end"))


def test_item6_counts_only_eplbs_kernels_and_nested_compiles_once():
    notice = CompileNotice(lambda: None, after=600.0)
    assert not notice._counts(_compile_event("start"))  # not a function of eplb
    counted = CompileNotice(lambda: None, after=600.0, counts=lambda e: True)
    counted.on_start(_compile_event("start"))
    counted.on_start(_compile_event("start"))      # a callee compiled inside its caller
    counted.on_end(_compile_event("end"))
    assert counted._since is not None              # still inside the outer compile
    counted.on_end(_compile_event("end"))
    assert counted._since is None and counted._timer is None


def test_item6_the_line_says_why_and_whether_this_eplb_ships_compiled_kernels():
    checkout = notice_text(False, "/src/eplb")
    assert checkout.startswith("eplb: compiling Numba kernels on first use") and "\n" not in checkout
    assert "/src/eplb is a checkout or editable install" in checkout and "pip install ." in checkout
    assert "eplb warmup" in notice_text(True, "/site-packages/eplb")


def test_item6_eplb_compile_notice_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("EPLB_COMPILE_NOTICE", "0")
    assert _compile_notice.install(False, "/src/eplb") is None


@pytest.mark.slow  # compiles eplb's kernels in a fresh process with an empty cache
def test_item6_a_checkout_compiling_on_first_call_prints_one_line_on_stderr(tmp_path):
    script = ("import numpy as np, eplb\n"
              "eplb.plan(np.arange(32.0).reshape(2, 16), num_slots=20, num_gpus=4, method='greedy')\n"
              "eplb.plan(np.arange(32.0).reshape(2, 16), num_slots=20, num_gpus=4)\n")
    env = {**os.environ, "EPLB_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("EPLB_COMPILE_NOTICE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == notice_text(False, str(ROOT / "eplb")), done.stderr
    # a second process loads the compiled code from the cache: no line
    again = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0 and again.stderr == "", again.stderr

"""The Balancer in a worker process (``eplb.BalancerProcess``): the same answers as an in-process
Balancer fed the same calls, errors raised in the caller as they would be in process, state round
trips, and a clean end (closed, or its child killed). Small sizes; each worker costs a process start
(about a second of imports), so the tests share them where they can."""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time

import numpy as np
import pytest

import eplb
from eplb.simulation.synthetic import drifting_counts

LAYERS, EXPERTS = 6, 64
LAYOUT = dict(num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
DEPLOYMENT = eplb.Deployment.of(EXPERTS, **LAYOUT)
CONFIG = dict(window=16, compile="lazy")
TIMINGS = ("time_s", "plan_time_s")


@pytest.fixture(scope="module")
def worker():
    with eplb.BalancerProcess(LAYERS, DEPLOYMENT, **CONFIG) as process:
        yield process


def without_timings(entry):
    """A history entry or an ``info`` mapping without its wall times (which differ run to run)."""
    return {key: value for key, value in dict(entry).items() if key not in TIMINGS}


def assert_same_placement(a: eplb.Placement, b: eplb.Placement):
    np.testing.assert_array_equal(a.phy2log, b.phy2log)
    np.testing.assert_array_equal(a.log2phy, b.log2phy)
    np.testing.assert_array_equal(a.logcnt, b.logcnt)
    assert a.method == b.method and a.topology == b.topology and a.num_groups == b.num_groups
    assert not a.phy2log.flags.writeable  # read-only, as placements are
    info_a, info_b = without_timings(a.info), without_timings(b.info)
    assert sorted(info_a) == sorted(info_b)
    for key in info_a:
        np.testing.assert_array_equal(np.asarray(info_a[key]), np.asarray(info_b[key]))


def assert_same_transfer(a: eplb.TransferPlan, b: eplb.TransferPlan):
    for field in ("layer", "expert", "src_slot", "dst_slot", "src_gpu", "dst_gpu", "kind"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.counts() == b.counts() and a.layers == b.layers


def assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


def test_same_answers_as_the_balancer_in_process(worker):
    """A recorded series (per-expert and per-slot passes), decisions every 8 passes, rebalances
    applied two layers at a time: every decision, placement, transfer plan and the final state are
    those of a Balancer in this process fed the same calls."""
    balancer = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    worker.load_state_dict(balancer.state_dict())  # the shared worker starts from scratch
    series = drifting_counts(64, LAYERS, EXPERTS, num_groups=8, drift=0.3, seed=3)
    rebalanced = 0
    for step, counts in enumerate(series):
        if step % 3 == 2:  # per slot, mapped through the placement in service
            rows, phy2log = np.arange(LAYERS)[:, None], balancer.placement.phy2log
            slots = counts[rows, phy2log] / balancer.placement.logcnt[rows, phy2log]
            balancer.record(slots.astype(np.float32))
            worker.record(slots.astype(np.float32))
        else:
            balancer.record(counts.astype(np.int32))
            worker.record(counts.astype(np.int32))
        assert worker.steps == balancer.steps
        if step % 8 != 7:
            continue
        assert worker.should_rebalance() == balancer.should_rebalance()
        assert worker.last_decision == balancer.last_decision
        if not balancer.last_decision["rebalance"]:
            continue
        placement, transfer = balancer.rebalance(commit=False)
        remote, remote_transfer = worker.rebalance(commit=False)
        assert_same_placement(remote, placement)
        assert_same_transfer(remote_transfer, transfer)
        for chunk, remote_chunk in zip(transfer.chunks(2), remote_transfer.chunks(2)):
            balancer.commit(placement, chunk.layers)
            worker.commit(remote, remote_chunk.layers)
            assert_same_placement(worker.placement, balancer.placement)
        assert worker.placement is remote  # every layer committed: the placement returned
        rebalanced += 1
    assert rebalanced >= 2
    assert worker.rebalances == balancer.rebalances == rebalanced  # each counted once, not per chunk
    np.testing.assert_array_equal(worker.window_counts(), balancer.window_counts())
    np.testing.assert_array_equal(worker.planning_counts(), balancer.planning_counts())
    np.testing.assert_array_equal(worker.planning_windows(), balancer.planning_windows())
    assert [without_timings(e) for e in worker.history][-rebalanced:] == [without_timings(e) for e in balancer.history]
    assert_same_state(worker.state_dict(), balancer.state_dict())
    # rebalance(commit=True) and a placement from elsewhere committed
    placement, _ = balancer.rebalance()
    remote, _ = worker.rebalance()
    assert_same_placement(remote, placement)
    assert worker.placement is remote
    start = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG).placement
    balancer.commit(start)
    worker.commit(start)
    assert worker.placement is start and worker.rebalances == balancer.rebalances
    assert_same_state(worker.state_dict(), balancer.state_dict())
    assert worker.compiled and sys.getswitchinterval() == pytest.approx(0.005)


def test_record_beside_a_rebalancing_thread(worker):
    """Passes recorded on one thread while another rebalances (as an engine does) all arrive, in order."""
    import threading

    balancer = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    worker.load_state_dict(balancer.state_dict())
    series = drifting_counts(40, LAYERS, EXPERTS, num_groups=8, drift=0.3, seed=4)
    stop = threading.Event()
    planned = []

    def plan_repeatedly():
        while not stop.is_set():
            if worker.steps:
                planned.append(worker.rebalance(commit=False)[0])

    thread = threading.Thread(target=plan_repeatedly)
    thread.start()
    try:
        for counts in series:
            worker.record(counts)
            balancer.record(counts)
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    assert planned and worker.steps == balancer.steps == len(series)
    np.testing.assert_array_equal(worker.window_counts(), balancer.window_counts())
    assert_same_placement(worker.rebalance(commit=False)[0], balancer.rebalance(commit=False)[0])


def test_bad_input_raises_the_same_value_error(worker):
    with pytest.raises(ValueError, match=r"counts must have shape"):
        worker.record(np.ones((LAYERS + 1, EXPERTS)))
    with pytest.raises(ValueError, match=r"counts must be finite and non-negative, found nan"):
        worker.record(np.full((LAYERS, EXPERTS), np.nan))
    with pytest.raises(ValueError, match=r"counts must hold numbers"):
        worker.record(np.full((LAYERS, EXPERTS), "a"))
    steps = worker.steps
    worker.record(np.ones((LAYERS, EXPERTS)))  # a refused pass is not staged; the next one is
    assert worker.steps == steps + 1 and worker.state_dict()["steps"] == steps + 1
    # errors raised in the worker: same type and message, the worker's traceback as the cause
    with pytest.raises(ValueError, match=r"layers must satisfy 0 <= start < stop <= 6") as caught:
        worker.commit(worker.placement, layers=(4, 2))
    assert "in the eplb worker process" in str(caught.value.__cause__)
    with pytest.raises(ValueError, match=r"placement must be an eplb.Placement, got str"):
        worker.commit("committing")
    with pytest.raises(ValueError, match=r"state is missing the key"):
        worker.load_state_dict({"format_version": 1})
    with pytest.raises(AttributeError):
        worker.no_such_method()
    # the worker is still in service after them
    assert isinstance(worker.should_rebalance(), bool)


def test_record_refuses_counts_whose_window_sums_would_overflow_as_the_balancer_does(worker):
    """Issue 44 item 9: 1e308 is finite, but a window of such passes overflows: refused by record()
    in the caller, with the limit the child's Balancer has."""
    limit = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG).count_limit
    assert worker.count_limit == limit
    huge = np.ones((LAYERS, EXPERTS))
    huge[0, 3] = 1e308
    steps = worker.steps
    with pytest.raises(ValueError, match=r"counts must be at most .* found 1e\+308 at flat index 3"):
        worker.record(huge)
    huge[0, 3] = limit
    worker.record(huge)  # the limit itself is taken
    assert worker.steps == steps + 1 and np.isfinite(worker.planning_counts()).all()


def test_a_balancer_process_cannot_be_copied_and_stays_usable(worker):
    """Issue 44 item 14: a copy shared the child, so close() on it stopped the original's child while
    the original said closed == False. Copying, deepcopy and pickle are refused with a TypeError."""
    import copy
    import pickle

    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*BalancerProcess.from_state_dict"):
            attempt(worker)
    steps = worker.steps
    worker.record(np.ones((LAYERS, EXPERTS)))
    assert not worker.closed and worker.state_dict()["steps"] == steps + 1


def test_bad_configuration_is_refused():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['windows'\]"):
        eplb.BalancerProcess(LAYERS, DEPLOYMENT, windows=3)
    with pytest.raises(ValueError, match=r"context must be one of"):
        eplb.BalancerProcess(LAYERS, DEPLOYMENT, context="fork", **CONFIG)
    with pytest.raises(ValueError, match=r"gil_interval"):
        eplb.BalancerProcess(LAYERS, DEPLOYMENT, gil_interval=0, **CONFIG)
    with pytest.raises(ValueError, match=r"window must be"):  # raised by the worker's Balancer
        eplb.BalancerProcess(LAYERS, DEPLOYMENT, **{**CONFIG, "window": 0})


def test_accepts_every_balancer_keyword():
    balancer = [name for name, p in inspect.signature(eplb.Balancer).parameters.items()
                if p.kind is not inspect.Parameter.VAR_KEYWORD]  # the deprecated deployment keywords
    process = inspect.signature(eplb.BalancerProcess).parameters
    assert balancer == list(process)[:len(balancer)]
    assert {"context", "staging_rows", "gil_interval"} <= set(process)


def test_state_round_trip(worker, tmp_path):
    rng = np.random.default_rng(5)
    for _ in range(5):
        worker.record(rng.integers(0, 50, (LAYERS, EXPERTS)))
    state = worker.state_dict()
    np.savez(tmp_path / "state.npz", **state)
    in_process = eplb.Balancer.from_state_dict(np.load(tmp_path / "state.npz"), compile="lazy")
    assert_same_state(in_process.state_dict(), state)
    with eplb.BalancerProcess.from_state_dict(np.load(tmp_path / "state.npz"), compile="lazy",
                                              staging_rows=2) as restored:
        assert restored.steps == state["steps"] and restored.window == CONFIG["window"]
        assert_same_state(restored.state_dict(), state)
        for _ in range(5):  # more passes than staging rows: record waits for the worker when full
            counts = rng.integers(0, 50, (LAYERS, EXPERTS))
            restored.record(counts)
            in_process.record(counts)
        assert_same_state(restored.state_dict(), in_process.state_dict())


def test_close_releases_the_process_and_shared_memory(monkeypatch):
    monkeypatch.setenv("EPLB_WORKER_TEST", "inherited")
    process = eplb.BalancerProcess(LAYERS, DEPLOYMENT, **CONFIG)
    name = process._channel.shared.shm.name
    child = process._channel.process
    assert os.path.exists(f"/dev/shm/{name}") and child.is_alive()
    with open(f"/proc/{process.pid}/environ", "rb") as environ:  # this environment (EPLB_CACHE_DIR: one cache)
        assert b"EPLB_WORKER_TEST=inherited" in environ.read().split(b"\0")
    process.record(np.ones((LAYERS, EXPERTS)))
    process.close()
    process.close()  # idempotent
    assert process.closed and not child.is_alive() and child.exitcode == 0
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(RuntimeError, match="closed"):
        process.record(np.ones((LAYERS, EXPERTS)))
    with pytest.raises(RuntimeError, match="closed"):
        process.rebalance()


def test_a_dead_worker_raises_runtime_error():
    process = eplb.BalancerProcess(LAYERS, DEPLOYMENT, **CONFIG)
    name = process._channel.shared.shm.name
    process.record(np.ones((LAYERS, EXPERTS)))
    os.kill(process.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="died"):
        process.rebalance()
    assert time.perf_counter() - start < 5.0  # no hang
    with pytest.raises(RuntimeError, match="died"):
        process.should_rebalance()
    process.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_record_into_a_killed_worker_raises_at_once_naming_it_and_its_exit_code():
    process = eplb.BalancerProcess(LAYERS, DEPLOYMENT, **CONFIG)
    child = process._channel.process
    process.record(np.ones((LAYERS, EXPERTS)))
    pid = process.pid
    os.kill(pid, signal.SIGKILL)
    child.join(10.0)  # the death is now detectable
    with pytest.raises(RuntimeError, match=rf"worker process \(pid {pid}\) died \(exit code -9\)"):
        process.record(np.ones((LAYERS, EXPERTS)))  # the first call after the death, not the 256th
    with pytest.raises(RuntimeError, match="died"):
        process.record(np.ones((LAYERS, EXPERTS)))
    process.close()


@pytest.mark.parametrize("kind", ["BalancerProcess", "BackgroundBalancer"])
def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path, kind):
    import subprocess

    script = tmp_path / "serve.py"
    script.write_text("import numpy as np\nimport eplb\n"
                      f"worker = eplb.{kind}({LAYERS}, eplb.Deployment.of({EXPERTS}, **{LAYOUT!r}), **{CONFIG!r})\n"
                      f"worker.record(np.ones(({LAYERS}, {EXPERTS})))\nworker.close()\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: a {kind} was created while its worker process imported the main")
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping phase" not in result.stderr  # not multiprocessing's own traceback
    guarded = tmp_path / "guarded.py"
    body = script.read_text().splitlines()[2:]
    guarded.write_text("import numpy as np\nimport eplb\nif __name__ == '__main__':\n"
                       + "".join(f"    {line}\n" for line in body) + "    print('served')\n")
    result = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "served", result.stderr

"""The serving loop whose caller never waits for a plan (``eplb.BackgroundBalancer``): the same
placements, transfer plans, decisions and state as a synchronous ``Balancer`` fed the same passes,
checks and commits in the same order; stale proposals dropped; bad input refused in the caller; a
worker that died or a closed balancer refused. Small sizes; each worker costs a process start."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

import eplb
from eplb.simulation.synthetic import drifting_counts
from test_worker import assert_same_placement, assert_same_state, assert_same_transfer

LAYERS, EXPERTS = 6, 64
LAYOUT = dict(num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
DEPLOYMENT = eplb.Deployment.of(EXPERTS, **LAYOUT)
CONFIG = dict(window=16, compile="lazy")


def passes(count: int, seed: int) -> list[np.ndarray]:
    """``count`` drifting passes ``[L, E]`` (integer counts, some as float32, some as int64)."""
    windows = drifting_counts(count, LAYERS, EXPERTS, num_groups=8, drift=0.4, tokens=512, seed=seed)
    return [w.astype(np.float32) if i % 3 == 0 else w.astype(np.int64) for i, w in enumerate(windows)]


def run_loop(balancer, counts, *, check_every: int, chunk: int, rng, settle: float = 0.0):
    """Drive ``balancer`` (a BackgroundBalancer) like an engine; return the calls it received, in
    order, for a replay: ``("record", counts, physical)``, ``("check", id)``, ``("commit", id,
    layers)``, and each proposal read, by check id."""
    log, proposals, pending, placements = [], {}, [], {}
    for step, load in enumerate(counts):
        physical = step % 4 == 3
        if physical:  # per slot: each expert's count split evenly over its slots in service
            placement = balancer.placement
            load = np.asarray(load, np.float64)[np.arange(LAYERS)[:, None], placement.phy2log] \
                / placement.logcnt[np.arange(LAYERS)[:, None], placement.phy2log]
        balancer.record(load, physical=physical)
        log.append(("record", load, physical))
        if step % check_every == 0:
            log.append(("check", balancer.check()))
        if settle and rng.random() < settle:
            assert balancer.wait(60)  # the worker catches up: proposals arrive at other passes
        proposal = balancer.poll()
        if proposal is not None:
            check_id = balancer.last_decision["check"]
            proposals[check_id] = proposal
            placements[id(proposal[0])] = check_id
            pending = [(proposal[0], c.layers) for c in proposal[1].chunks(chunk)]
        if pending:
            placement, layers = pending.pop(0)
            balancer.commit(placement, layers)
            log.append(("commit", placements[id(placement)], layers))
    assert balancer.wait(60)
    return log, proposals


def replay(log, **config) -> tuple[eplb.Balancer, dict, dict]:
    """The same calls on a synchronous Balancer: its proposals and decisions by check id."""
    balancer = eplb.Balancer(LAYERS, **config)
    proposals, decisions = {}, {}
    for entry in log:
        if entry[0] == "record":
            balancer.record(entry[1], physical=entry[2])
        elif entry[0] == "check":
            if balancer.should_rebalance():
                proposals[entry[1]] = balancer.rebalance(commit=False)
            decisions[entry[1]] = balancer.last_decision
        else:
            balancer.commit(proposals[entry[1]][0], entry[2])
    return balancer, proposals, decisions


@pytest.mark.parametrize("settle, staging_rows, extra", [
    (0.05, None, {}),  # the worker lags as it likes, caught up now and then
    (0.3, 2, {}),  # a two-row ring: record waits for room; the worker catches up at random passes
    (0.2, None, {"cost_model": eplb.CostModel.preset("H100", "deepseek-v3"), "deployment": eplb.Deployment.of(
        EXPERTS, **{**LAYOUT, "num_groups": None})}),
])
def test_same_placements_as_the_synchronous_balancer(settle, staging_rows, extra):
    config = {"deployment": DEPLOYMENT, **CONFIG, **extra}
    rng = np.random.default_rng(1)
    with eplb.BackgroundBalancer(LAYERS, staging_rows=staging_rows, **config) as background:
        log, proposals = run_loop(background, passes(120, seed=3), check_every=10, chunk=2, rng=rng, settle=settle)
        while background.pending_checks:  # the decisions still unread, and every proposal not yet polled
            proposal = background.poll()
            if proposal is not None:
                proposals[background.last_decision["check"]] = proposal
        decisions = {decision["check"]: decision for decision in background.decisions}
        state = background.state_dict()
        in_service = background.placement
        steps, rebalances = background.steps, background.rebalances
    synchronous, expected, expected_decisions = replay(log, **config)
    assert any(entry[0] == "commit" for entry in log), "the loop must commit something to test commits"
    assert sorted(decisions) == sorted(expected_decisions)  # every check answered
    assert sorted(c for c, d in decisions.items() if d["rebalance"]) == sorted(expected)  # the same said yes
    # every yes is handed over unless a commit came after its check (then it is stale, and dropped)
    assert sorted(proposals) == sorted(c for c, d in decisions.items() if d["rebalance"] and not d["stale"])
    for check_id, (placement, transfer) in proposals.items():
        assert_same_placement(placement, expected[check_id][0])
        assert_same_transfer(transfer, expected[check_id][1])
    for check_id, decision in decisions.items():
        assert {k: v for k, v in decision.items() if k not in ("check", "stale")} == expected_decisions[check_id]
    assert_same_state(state, synchronous.state_dict())
    np.testing.assert_array_equal(in_service.phy2log, synchronous.placement.phy2log)
    assert (steps, rebalances) == (synchronous.steps, synchronous.rebalances)


def test_a_proposal_planned_before_a_later_commit_is_dropped():
    counts = passes(20, seed=5)
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        for load in counts:
            background.record(load)
        first = background.check()
        assert background.wait(60)
        proposal = background.poll()
        assert proposal is not None and background.last_decision["check"] == first
        second = background.check()  # the same window and placement: the same yes, planned from it
        background.commit(proposal[0])  # ... but the placement in service changes after that check
        assert background.wait(60)
        assert background.poll() is None
        assert background.last_decision["check"] == second and background.last_decision["rebalance"]
        assert background.last_decision["stale"] is True
        assert background.placement is proposal[0] and background.rebalances == 1
        with pytest.raises(ValueError, match="layers must satisfy"):
            background.commit(proposal[0], (3, 3))
        with pytest.raises(ValueError, match="layers must be None or a"):
            background.commit(proposal[0], "all")


def test_bad_input_is_refused_in_the_caller():
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['windw'\\]"):
        eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, windw=3)
    with pytest.raises(ValueError, match="context must be one of"):
        eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, context="fork", **CONFIG)
    with pytest.raises(ValueError, match="staging_rows must be an integer >= 2"):
        eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, staging_rows=1, **CONFIG)
    with pytest.raises(ValueError, match="window must be"):  # the worker's Balancer refuses it, raised here
        eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **{**CONFIG, "window": 0})
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        with pytest.raises(ValueError, match="counts must have shape"):
            background.record(np.ones((LAYERS, EXPERTS + 1)))
        bad = np.ones((LAYERS, EXPERTS))
        bad[2, 5] = -1
        with pytest.raises(ValueError, match="finite and non-negative, found -1.0 at flat index 133"):
            background.record(bad)
        bad[2, 5] = np.nan
        with pytest.raises(ValueError, match="finite and non-negative"):
            background.record(bad)
        foreign = eplb.plan(np.ones((LAYERS, EXPERTS)), num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
        with pytest.raises(ValueError, match="placement must be one that this BackgroundBalancer's poll"):
            background.commit(foreign)
        background.record(np.ones((LAYERS, EXPERTS)))  # refused passes left no trace
        assert background.wait(60) and background.steps == 1 and background.state_dict()["steps"] == 1


def test_every_dtype_and_layout_is_staged_as_the_balancer_records_it():
    """record() copies a pass in its own dtype (the worker widens it) and checks shape and dtype
    once per kind of input: every kind, switching back and forth, gives the Balancer's window,
    leaves the caller's arrays as they were, and bad values of a kind already seen are refused."""
    counts = passes(24, seed=9)
    kinds = [np.uint16, np.uint32, np.int16, np.int32, np.float16, np.dtype(">i4"), np.uint8, np.float64]
    loads = []
    for step, load in enumerate(counts):
        load = np.asarray(load, np.float64).astype(kinds[step % len(kinds)])
        if step % 5 == 4:
            load = np.asfortranarray(load)  # not C-contiguous
        if step % 7 == 6:
            load.setflags(write=False)
        loads.append(load)
    originals = [load.copy() for load in loads]
    synchronous = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        for load in loads + loads[::-1]:
            background.record(load)
            background.record(load)  # the same kind again: the cached check
            synchronous.record(load)
            synchronous.record(load)
        for dtype, value in ((np.int16, -3), (np.int64, -1), (np.float32, np.nan), (np.float64, np.inf)):
            good = np.ones((LAYERS, EXPERTS), dtype)
            background.record(good)
            synchronous.record(good)
            bad = good.copy()
            bad[1, 2] = value
            with pytest.raises(ValueError, match=f"finite and non-negative, found {value}.* at flat index {EXPERTS + 2}"):
                background.record(bad)
            with pytest.raises(ValueError, match="counts must have shape"):
                background.record(good[:, :-1])
        assert_same_state(background.state_dict(), synchronous.state_dict())
    for load, original in zip(loads, originals):
        np.testing.assert_array_equal(load, original)


def test_a_dead_worker_or_a_closed_balancer_raises():
    background = eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG)
    background.record(np.ones((LAYERS, EXPERTS)))
    os.kill(background.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(RuntimeError, match="died"):
        while time.monotonic() < deadline:  # the watchdog notices within moments
            background.record(np.ones((LAYERS, EXPERTS)))
            time.sleep(0.01)
    for call in (background.check, background.poll, background.wait, background.state_dict):
        with pytest.raises(RuntimeError, match="died"):
            call()
    background.close()
    background.close()  # idempotent
    assert background.closed and background.pid is None
    with pytest.raises(RuntimeError, match="closed"):
        background.record(np.ones((LAYERS, EXPERTS)))


def test_state_round_trips_through_a_saved_file(tmp_path):
    counts = passes(30, seed=7)
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        for load in counts[:20]:
            background.record(load)
        np.savez(tmp_path / "state.npz", **background.state_dict())
    with np.load(tmp_path / "state.npz", allow_pickle=False) as saved:
        restored = eplb.BackgroundBalancer.from_state_dict(saved, compile="lazy")
    synchronous = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    with restored:
        assert restored.steps == 20
        for load in counts:
            synchronous.record(load)
        for load in counts[20:]:
            restored.record(load)
        assert_same_state(restored.state_dict(), synchronous.state_dict())


def test_the_pass_is_handed_over_after_a_memory_fence():
    """``stage_pass`` writes the counter that hands a pass to the worker after a fence, so a CPU that
    reorders stores (aarch64) cannot show the worker the counter before the row; and the fence
    Python code calls around the other counters is one too."""
    import numba

    from eplb.kernels.plumbing.load_window import memory_fence, stage_pass

    row, header, limit = np.zeros((2, 3), np.uint16), np.zeros(4, np.int64), 1e300
    assert not stage_pass(np.arange(6, dtype=np.uint16).reshape(2, 3), row, header, 2, 7, limit)
    assert header[2] == 7 and row.ravel().tolist() == list(range(6))
    assert stage_pass(np.array([[1.0, -1.0]]), np.zeros((1, 2)), header, 2, 8, limit) and header[2] == 7  # bad: not handed
    assert stage_pass(np.array([[1.0, 5.0]]), np.zeros((1, 2)), header, 2, 8, 4.0) and header[2] == 7  # above the limit
    fresh = numba.njit(stage_pass.py_func)  # compiled here: a cached kernel cannot show its code
    fresh(row, row.copy(), header, 2, 9, limit)
    fence = numba.njit(memory_fence.py_func)
    fence()
    for kernel in (fresh, fence):
        assert all("fence seq_cst" in ir for ir in kernel.inspect_llvm().values())


def test_a_proposal_polled_after_twenty_checks_can_be_committed():
    """Issue 44 item 8: 20 checks, then poll(), then commit() of the placement it returned (the
    worker kept only its newest 8 proposals: ``KeyError: 0``, then every call failed). Any proposal
    the caller still holds can be committed, those it dropped are released in the worker, and the
    balancer goes on."""
    import gc

    counts = passes(40, seed=5)
    synchronous = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        for load in counts[:20]:
            background.record(load)
            synchronous.record(load)
        checks = [background.check() for _ in range(20)]
        assert background.wait(60)
        proposals = [background.poll() for _ in checks]  # no commit between the checks: none is stale
        assert all(p is not None for p in proposals) and background.poll() is None
        assert [d["check"] for d in background.decisions] == checks
        first, last = proposals[0][0], proposals[-1][0]
        del proposals
        gc.collect()  # the caller keeps two of the twenty: the worker may drop the others
        background.commit(first)  # check 0's, planned 19 checks before the newest
        background.commit(last, (0, 3))  # another one the caller held, in part
        expected, _ = synchronous.rebalance(commit=False)
        synchronous.commit(expected)
        assert_same_placement(first, expected)
        np.testing.assert_array_equal(last.phy2log, expected.phy2log)
        assert background.rebalances == 2 and background.placement.phy2log.tolist() == expected.phy2log.tolist()
        state = background.state_dict()
        assert state["rebalances"] == 2 and state["phy2log"].tolist() == expected.phy2log.tolist()
        for load in counts[20:]:  # and it goes on: record, check, poll, commit
            background.record(load)
            synchronous.record(load)
        background.check()
        assert background.wait(60)
        proposal = background.poll()
        if synchronous.should_rebalance():
            assert_same_placement(proposal[0], synchronous.rebalance(commit=False)[0])
            background.commit(proposal[0])
        else:
            assert proposal is None
        assert background.wait(60) and background.state_dict()["steps"] == 40


def test_record_refuses_counts_whose_window_sums_would_overflow():
    """Issue 44 item 9: a finite count so large that the window's sums overflow (1e308) is refused
    by record() with a ValueError naming the limit, as by a Balancer; the largest count taken keeps
    every check working, and the worker goes on."""
    synchronous = eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG)
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        limit = synchronous.count_limit
        assert 1e290 < limit < 1e308
        for dtype in (np.float64, np.float32, np.float16):  # the compiled and the widened staging
            huge = np.ones((LAYERS, EXPERTS))
            huge[1, 2] = min(1e308, float(np.finfo(dtype).max))
            if huge[1, 2] <= limit:
                continue  # float32, float16: their largest value is far below the limit
            for balancer in (background, synchronous):
                with pytest.raises(ValueError, match=re.escape(f"counts must be at most {limit:.3g} (beyond it the "
                                                               "window's sums overflow float64")
                                   + f".* found 1e\\+308 at flat index {EXPERTS + 2}"):
                    balancer.record(huge.astype(dtype))
        rng = np.random.default_rng(4)
        for _ in range(CONFIG["window"]):  # a window of passes at the limit
            load = rng.pareto(1.0, (LAYERS, EXPERTS))
            load = load / load.max() * limit
            background.record(load)
            synchronous.record(load)
        background.check()
        assert background.wait(60)
        proposal = background.poll()  # no exception: the window's sums stayed finite
        assert (proposal is not None) == synchronous.should_rebalance()
        assert np.isfinite(synchronous.planning_counts()).all()
        assert_same_state(background.state_dict(), synchronous.state_dict())


def test_an_exception_in_a_check_is_raised_by_poll_and_the_worker_goes_on():
    """Issue 44 item 9: an exception in one check (here the planning method refuses an option, which
    it reads only when a check plans) is raised by the poll() that reads that check's outcome, with
    the worker's traceback, and named in last_decision; later passes, checks and state work, as
    they do for a Balancer (every call failed after it)."""
    config = {**CONFIG, "options": {"no_such_option": 1}}
    synchronous = eplb.Balancer(LAYERS, DEPLOYMENT, **config)
    even = 10.0 * eplb.Balancer(LAYERS, DEPLOYMENT, **CONFIG).placement.logcnt  # every slot the same load
    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **config) as background:
        for load in passes(CONFIG["window"], seed=2):  # skewed: the check plans, and the method raises
            background.record(load)
            synchronous.record(load)
        failing = background.check()
        with pytest.raises(ValueError, match="unknown option") as raised:
            synchronous.should_rebalance()
        assert background.wait(60)
        with pytest.raises(ValueError, match="unknown option") as remote:
            background.poll()
        assert str(remote.value) == str(raised.value) and "in the eplb worker process" in str(remote.value.__cause__)
        assert background.last_decision["check"] == failing and not background.last_decision["rebalance"]
        assert "the check raised ValueError" in background.last_decision["reason"]
        assert background.pending_checks == 0 and background.poll() is None
        for _ in range(CONFIG["window"]):  # balanced loads: no plan needed, so no error
            background.record(even)
            synchronous.record(even)
        background.check()
        assert background.wait(60) and background.poll() is None
        assert not synchronous.should_rebalance()
        assert background.last_decision["reason"] == synchronous.last_decision["reason"]
        assert_same_state(background.state_dict(), synchronous.state_dict())


def test_a_background_balancer_cannot_be_copied_and_stays_usable():
    """Issue 44 item 14: copy.copy(balancer) shared the worker, so close() on the copy left the
    original saying closed == False while every call failed. Copying (and deepcopy, pickle) is
    refused with a TypeError that says how to get a second one; the original is untouched."""
    import copy
    import pickle

    with eplb.BackgroundBalancer(LAYERS, DEPLOYMENT, **CONFIG) as background:
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"cannot be copied or pickled.*BackgroundBalancer.from_state_dict"):
                attempt(background)
        background.record(np.ones((LAYERS, EXPERTS)))
        assert not background.closed and background.wait(60) and background.state_dict()["steps"] == 1

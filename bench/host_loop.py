"""eplb's time on the engine's host: the serving loop's caller time per pass, at DeepSeek-V3 size.

The loop an engine runs (58 layers, 256 experts, 288 slots, 32 GPUs, 4 nodes, 8 groups,
``window=1000``): record every pass, ask for a decision every 100 passes, and when a plan comes,
commit it 8 layers per pass (``transfer.chunks(8)``, as if the weights moved meanwhile). Passes are
drawn from drifting DeepSeek-V3-sized traffic (``eplb.simulation.series``: 7 synthetic workloads,
4096 tokens x top-8 a pass, the mix moving through them), one every :data:`STEP_S` seconds (the
engine thread sleeps for the GPU's step, releasing the GIL). Timed per pass: the caller's time in
eplb's calls (the rest of the pass is not eplb's), as mean / p50 / p99 / max, for

- copying the pass's counts into a float64 array with numpy (what an engine does anyway: the reference
  the issue's targets beside a busy thread are stated against),
- ``eplb.Balancer`` (``should_rebalance()`` then ``rebalance(commit=False)`` on the caller's thread),
- ``eplb.BalancerProcess`` (the same calls, answered by a worker process the caller waits for),
- ``eplb.BackgroundBalancer`` (``check()`` posts the decision, ``poll()`` hands a plan over once the
  worker made it: the caller never waits),

each alone and beside a busy Python thread (a pure-Python loop, as an engine's scheduler). The
issue's targets for the loop: alone mean <= 50 us, p99 <= 2 ms, max <= 10 ms; beside the busy thread
p99 and max within 2 ms / 10 ms of copying the pass's counts.

Usage: ``python bench/host_loop.py [--quick]``. Prints Markdown.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from _common import load_note, markdown_table, read_csv, rows_of, run_alone, write_csv
from background_thread import busy_python

import eplb
from eplb.simulation.series import Series, mixture_path, synthetic_workloads

DEPLOYMENT = dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)
LAYERS, EXPERTS = 58, 256
CHECK_EVERY = 100
CHUNK_LAYERS = 8
STEP_S = 0.005
"""Seconds between passes: the engine's GPU step, during which its thread holds no GIL."""

TARGETS = {"mean_us": 50.0, "p99_ms": 2.0, "max_ms": 10.0}
"""The issue's bounds alone; beside the busy thread p99 and max within 2 / 10 ms of copying."""

LOOPS = ("copying the pass's counts", "Balancer", "BalancerProcess", "BackgroundBalancer")


def settings(quick: bool) -> dict:
    return {"passes": 300, "window": 200} if quick else {"passes": 2000, "window": 1000}


def draw_passes(passes: int) -> np.ndarray:
    """``[T, L, E]`` uint16 counts of drifting DeepSeek-V3-sized traffic (fixed seeds)."""
    workloads = synthetic_workloads(7, LAYERS, EXPERTS, num_groups=8)
    return Series(workloads, num_steps=passes, tokens_per_step=4096, top_k=8, mixture=mixture_path(passes, 7)).to_array()


def copy_loop(counts: np.ndarray, window: int) -> tuple[np.ndarray, dict]:
    """The reference: each pass's counts copied into a float64 array by numpy (which lets go of the
    GIL for the copy, so beside a busy thread it can wait a switch interval to get it back)."""
    staged = np.zeros((LAYERS, EXPERTS))
    spent = np.empty(len(counts))
    for step, load in enumerate(counts):
        start = time.perf_counter()
        np.copyto(staged, load)
        spent[step] = time.perf_counter() - start
        time.sleep(STEP_S)
    return spent, {}


def synchronous_loop(balancer, counts: np.ndarray) -> tuple[np.ndarray, dict]:
    """The README's loop on a ``Balancer`` or ``BalancerProcess``: the caller waits for each plan."""
    spent = np.empty(len(counts))
    pending, placement, plans = [], None, 0
    for step, load in enumerate(counts):
        start = time.perf_counter()
        balancer.record(load)
        if step % CHECK_EVERY == 0 and balancer.should_rebalance():
            placement, transfer = balancer.rebalance(commit=False)
            pending, plans = transfer.chunks(CHUNK_LAYERS), plans + 1
        if pending:
            balancer.commit(placement, pending.pop(0).layers)
        spent[step] = time.perf_counter() - start
        time.sleep(STEP_S)
    return spent, {"plans": plans}


def background_loop(balancer: eplb.BackgroundBalancer, counts: np.ndarray) -> tuple[np.ndarray, dict]:
    """The loop on a ``BackgroundBalancer``: decisions posted, plans taken when ready."""
    spent = np.empty(len(counts))
    pending, placement, plans, lags, checked_at = [], None, 0, [], {}
    for step, load in enumerate(counts):
        start = time.perf_counter()
        balancer.record(load)
        if step % CHECK_EVERY == 0:
            checked_at[balancer.check()] = step
        proposal = balancer.poll()
        if proposal is not None:
            placement, transfer = proposal
            pending, plans = transfer.chunks(CHUNK_LAYERS), plans + 1
        if pending:
            balancer.commit(placement, pending.pop(0).layers)
        spent[step] = time.perf_counter() - start
        if proposal is not None:
            lags.append(step - checked_at[balancer.last_decision["check"]])
        time.sleep(STEP_S)
    stale = sum(1 for decision in balancer.decisions if decision["stale"])
    return spent, {"plans": plans, "stale": stale, "lag_passes": f"{min(lags)}-{max(lags)}" if lags else ""}


def run_loop(name: str, counts: np.ndarray, window: int) -> tuple[np.ndarray, dict]:
    """Construct (untimed) and drive one loop."""
    config = dict(window=window, expert_bytes=44 << 20)
    deployment = eplb.Deployment.of(EXPERTS, **DEPLOYMENT)
    if name == LOOPS[0]:
        return copy_loop(counts, window)
    if name == "Balancer":
        return synchronous_loop(eplb.Balancer(LAYERS, deployment, **config), counts)
    if name == "BalancerProcess":
        with eplb.BalancerProcess(LAYERS, deployment, **config) as balancer:
            return synchronous_loop(balancer, counts)
    with eplb.BackgroundBalancer(LAYERS, deployment, **config) as balancer:
        return background_loop(balancer, counts)


def measure(name: str, counts: np.ndarray, window: int, busy: bool) -> dict:
    """One row: the caller's time in eplb per pass, with or without a busy Python thread."""
    stop = threading.Event()
    other = threading.Thread(target=busy_python, args=(stop,), daemon=True) if busy else None
    if other is not None:
        other.start()
    try:
        spent, extra = run_loop(name, counts, window)
    finally:
        stop.set()
        if other is not None:
            other.join()
    return {"loop": name, "busy_thread": busy, "passes": len(spent), "window": window, "mean_us": round(float(spent.mean()) * 1e6, 1),
            "p50_ms": round(float(np.percentile(spent, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(spent, 99)) * 1e3, 3),
            "max_ms": round(float(spent.max()) * 1e3, 2), "plans": extra.get("plans", ""),
            "stale": extra.get("stale", ""), "lag_passes": extra.get("lag_passes", "")}


def verdicts(rows: list[dict]) -> dict[bool, str]:
    """The issue's targets for the BackgroundBalancer's rows, alone and beside the busy thread."""
    found = {(r["loop"], str(r["busy_thread"]) == "True"): r for r in rows}
    out = {}
    for busy in (False, True):
        mine, floor = found.get((LOOPS[3], busy)), found.get((LOOPS[0], busy))
        if mine is None or floor is None:
            continue
        if busy:
            p99_bound = float(floor["p99_ms"]) + TARGETS["p99_ms"]
            max_bound = float(floor["max_ms"]) + TARGETS["max_ms"]
            met = float(mine["p99_ms"]) <= p99_bound and float(mine["max_ms"]) <= max_bound
            out[busy] = (f"p99 {mine['p99_ms']} ms <= {p99_bound:.2f}, max {mine['max_ms']} ms <= {max_bound:.2f}: "
                         f"{'met' if met else 'not met'}")
        else:
            met = all(float(mine[key]) <= bound for key, bound in TARGETS.items())
            out[busy] = (f"mean {mine['mean_us']} us <= 50, p99 {mine['p99_ms']} ms <= 2, max {mine['max_ms']} ms <= 10: "
                         f"{'met' if met else 'not met'}")
    return out


def table(rows: list[dict]) -> str:
    return markdown_table(
        ("caller's time in eplb per pass", "mean us", "p50 ms", "p99 ms", "max ms", "plans taken",
         "stale (dropped)", "passes from check to plan"),
        [(f"{r['loop']}{', beside a busy Python thread' if str(r['busy_thread']) == 'True' else ', alone'}",
          r["mean_us"], r["p50_ms"], r["p99_ms"], r["max_ms"], r["plans"], r["stale"], r["lag_passes"]) for r in rows])


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: the serving loop's caller time per pass."""
    config = settings(quick)
    counts = draw_passes(config["passes"])
    rows = [measure(name, counts, config["window"], busy) for busy in (False, True) for name in LOOPS]
    write_csv(Path(results_dir) / "host_loop.csv", rows)
    found = verdicts(rows)
    return ("## Host loop\n\nThe README's serving loop at DeepSeek-V3 size (58 layers, 256 experts, 288 slots, 32 GPUs, "
            f"4 nodes, 8 groups), `window={config['window']}`, {config['passes']} passes of drifting traffic (4096 "
            f"tokens x top-8), a decision every {CHECK_EVERY} passes, plans committed {CHUNK_LAYERS} layers a pass, "
            f"one pass every {STEP_S * 1e3:g} ms; the caller's time in eplb's calls per pass ({load_note()}). "
            "`BackgroundBalancer` plans in a worker process and hands plans over when ready; the others make the "
            "caller wait for the plan.\n\n" + table(rows) + "\n\n"
            + "".join(f"- Target, {'beside a busy thread' if busy else 'alone'}: {text}\n" for busy, text in found.items()))


def headline(results_dir):
    rows = rows_of(results_dir, "host_loop")
    if not rows:
        return []
    found = verdicts(rows)
    if not found:
        return []
    text = "; ".join(f"{'beside a busy thread' if busy else 'alone'}: {value}" for busy, value in found.items())
    met = len(found) == 2 and all(value.endswith(": met") for value in found.values())
    return [("BackgroundBalancer: caller's time in eplb per pass, README loop (DeepSeek-V3 size)", text,
             "alone mean <= 50 us, p99 <= 2 ms, max <= 10 ms; beside a busy thread p99 / max within 2 / 10 ms of "
             f"copying the pass: {'met' if met else 'not met'}")]


def readme_rows(results_dir) -> list[tuple[str, str, str]]:
    """The README's row: the caller's time in eplb per pass in the README's loop beside a busy
    Python thread, ``BackgroundBalancer`` (the loop the README shows) against ``Balancer``."""
    path = Path(results_dir) / "host_loop.csv"
    if not path.exists():
        return []
    found = {(r["loop"], str(r["busy_thread"]) == "True"): r for r in read_csv(path)}
    mine, synchronous, copying = (found.get((name, True)) for name in ("BackgroundBalancer", "Balancer", LOOPS[0]))
    if mine is None or synchronous is None or copying is None:
        return []

    def spread(row):
        return f"mean {float(row['mean_us']):.0f} us, p99 {float(row['p99_ms']):.2f} ms, max {float(row['max_ms']):.1f} ms"

    return [(f"Caller's time in eplb per pass, the README's loop (DeepSeek-V3 size, `window={mine['window']}`, "
             f"a decision every {CHECK_EVERY} passes) beside a busy Python thread",
             f"`BackgroundBalancer`: {spread(mine)} (for reference, numpy copying the pass's counts: {spread(copying)})",
             f"`Balancer` on the caller's thread: {spread(synchronous)}")]


if __name__ == "__main__":
    run_alone(run, __doc__)

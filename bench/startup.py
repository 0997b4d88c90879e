"""Start-up cost: Numba's cold compile, and a fresh process with a warm on-disk cache.

eplb's kernels are compiled on first use and cached on disk (``cache=True``, in the folder
``$EPLB_CACHE_DIR`` names: :mod:`eplb.kernels.plumbing._cache`). A serving engine pays the compile once per
machine (cold, or at ``eplb.warmup`` time) and, after that, only the cache load in every new
process (warm). Each measurement runs in a fresh Python process on the DeepSeek-V3-sized example
(58 layers x 256 experts, 288 slots, 32 GPUs, 4 nodes, 8 groups), timing ``import eplb`` and the
first call of one entry point:

- ``plan greedy``: ``eplb.plan(..., method="greedy")``;
- ``rebalance_experts greedy``: DeepSeek's entry point, ``method="greedy"``;
- ``rebalance_experts``: DeepSeek's entry point as the README writes it (the default method);
- ``plan default``: ``eplb.plan(...)`` with the default method;
- ``Balancer decision``: a ``Balancer`` of that deployment, one recorded pass, the first
  ``should_rebalance()`` (construction included).

cold: every process gets an empty cache folder (everything it calls compiles); warm: processes on a
folder an untimed process filled; fresh install: the package built into a wheel from this checkout
(the build compiles the kernels it ships, :func:`eplb.precompile.ship`) and installed into a
folder of its own, every process on an empty cache folder (what a user's first call after
``pip install`` meets: the shipped kernels are copied into the cache and loaded, not compiled).

After ``eplb warmup`` (issue 21): a process runs ``eplb.warmup`` for that deployment on an empty
folder, then a fresh process times the first and the second call of each public call a server
makes (:data:`PUBLIC_CALLS`: ``plan`` by default, global, ``previous=``, ``max_off_node=``, of a
series ``[T, L, E]`` (hedged), ``dispatch="optimal"``; the lower bound, ``eplb.dispatch``, engine
shares, ``transfer_plan``, ``rebalance_experts``, ``simulate``, a Balancer's decision and
rebalance) and counts the Numba specializations each first call compiled or loaded. Medians over ``repeats`` processes (3; 1 with ``--quick``, which
measures warm starts only, on one cache folder, ``$XDG_CACHE_HOME/eplb-bench-quick``, kept between
quick runs, so only the first quick run on a machine and code version pays the compile). Run: ``python bench/startup.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, load_note, markdown_table, pyplot, read_csv, write_csv

# The child process: times ``import eplb`` and the first call of the entry point named in argv.
CHILD = r"""
import json, sys, time
start, cpu_start = time.perf_counter(), time.process_time()
import eplb
imported, cpu_imported = time.perf_counter(), time.process_time()
import numpy as np
from eplb.simulation.synthetic import DEEPSEEK_V3 as c, deepseek_v3_counts
counts = deepseek_v3_counts(0)
deploy = dict(num_slots=c["num_slots"], num_gpus=c["num_gpus"], num_nodes=c["num_nodes"], num_groups=c["num_groups"])


def decision():
    balancer = eplb.Balancer(counts.shape[0], eplb.Deployment.of(counts.shape[1], **deploy))
    balancer.record(counts)
    return balancer.should_rebalance()


calls = {
    "plan greedy": lambda: eplb.plan(counts, method="greedy", **deploy),
    "rebalance_experts": lambda: eplb.rebalance_experts(counts, c["num_slots"], c["num_groups"], c["num_nodes"],
                                                        c["num_gpus"]),
    "rebalance_experts greedy": lambda: eplb.rebalance_experts(counts, c["num_slots"], c["num_groups"], c["num_nodes"],
                                                               c["num_gpus"], method="greedy"),
    "plan default": lambda: eplb.plan(counts, **deploy),
    "Balancer decision": decision,
}
entry = sys.argv[1]
t, cpu = time.perf_counter(), time.process_time()
calls[entry]()
out = {"import_s": imported - start, "import_cpu_s": cpu_imported - cpu_start,
       "first_s": time.perf_counter() - t, "first_cpu_s": time.process_time() - cpu}
t = time.perf_counter(); calls[entry](); out["next_call_s"] = time.perf_counter() - t
print(json.dumps(out))
"""

ENTRIES = ("plan greedy", "rebalance_experts greedy", "rebalance_experts", "plan default", "Balancer decision")
TARGETS = {"plan greedy": 5.0, "rebalance_experts greedy": 5.0, "plan default": 5.0, "Balancer decision": 15.0}
"""Cold-start targets (seconds, import + first call, empty cache): issue 15 (greedy) and issue 21
(the default plan, a Balancer built and answering its first decision) on a 2-core machine."""
WARM_TARGET = 2.0
AFTER_WARMUP_TARGET = 0.5
"""Issue 21: after ``eplb warmup``, a fresh process's first call of each public call costs at most
this many seconds more than its second call."""


# After eplb warmup: one fresh process per public call (named by argv[1]) times its first and second call.
# The placement in service comes from a file the warm-up process wrote, so no other call runs before
# the one timed (a user's process that starts and calls one thing).
AFTER_WARMUP_CHILD = r"""
import importlib, json, os, pkgutil, sys, time
import numpy as np
from numba.core.registry import CPUDispatcher
import eplb, eplb.kernels
from eplb.analysis.engine_dispatch import ENGINES, with_engine_shares
from eplb.simulation.synthetic import DEEPSEEK_V3 as c, deepseek_v3_counts
deploy = dict(num_slots=c["num_slots"], num_gpus=c["num_gpus"], num_nodes=c["num_nodes"], num_groups=c["num_groups"])
flat = dict(num_slots=c["num_slots"], num_gpus=c["num_gpus"], num_nodes=c["num_nodes"])
series = np.stack([deepseek_v3_counts(seed) for seed in (1, 2, 3, 4)])
a, b = series[0], series[1]
with open(os.path.join(os.environ["EPLB_CACHE_DIR"], "in_service.json")) as file:
    state = {"p": eplb.Placement.from_dict(json.load(file))}  # the placement in service (a greedy plan)


def compiled():  # (specializations compiled, loaded from the cache) so far by eplb's kernels
    misses = hits = 0
    for info in pkgutil.walk_packages(eplb.kernels.__path__, "eplb.kernels."):
        module = importlib.import_module(info.name)
        for v in vars(module).values():
            if isinstance(v, CPUDispatcher) and v.py_func.__module__ == module.__name__:
                misses += sum(v.stats.cache_misses.values())
                hits += sum(v.stats.cache_hits.values())
    return misses, hits


def decision():
    balancer = eplb.Balancer(a.shape[0], eplb.Deployment.of(a.shape[1], **deploy))
    balancer.record(a)
    balancer.should_rebalance()
    return balancer


PUBLIC_CALLS = {
    "plan (default)": lambda: eplb.plan(a, **deploy),
    "plan global": lambda: eplb.plan(a, **flat),
    "plan previous=": lambda: eplb.plan(b, previous=state["p"], **deploy),
    "plan max_off_node=0.1": lambda: eplb.plan(a, max_off_node=0.1, **deploy),
    "plan series [4, 58, 256] (hedged)": lambda: eplb.plan(series, **deploy),
    "plan series, previous=": lambda: eplb.plan(series, previous=state["p"], **deploy),
    "plan series, dispatch=optimal": lambda: eplb.plan(series, dispatch="optimal", **deploy),
    "lower bound (placement.lower_bound)": lambda: eplb.plan(b, method="greedy", **deploy).lower_bound,
    "eplb.dispatch": lambda: eplb.dispatch(b, state["p"]),
    "engine shares (every engine)": lambda: [with_engine_shares(state["p"], e).balancedness(b, dispatch="shares")
                                             for e in ENGINES],
    "transfer_plan": lambda: eplb.transfer_plan(state["p"], eplb.plan(b, method="greedy", **deploy)).counts(),
    "rebalance_experts (default method)": lambda: eplb.rebalance_experts(
        a, c["num_slots"], c["num_groups"], c["num_nodes"], c["num_gpus"]),
    "simulate [4, 58, 256]": lambda: eplb.simulate(series, eplb.Deployment.of(series.shape[-1], **deploy)),
    "Balancer built + first decision": decision,
    "Balancer.rebalance()": lambda: decision().rebalance(),
}
if sys.argv[1:] == ["--names"]:
    print(json.dumps(list(PUBLIC_CALLS)))
    sys.exit(0)
out = {}
for name in sys.argv[1:]:
    call = PUBLIC_CALLS[name]
    before = compiled()
    t, cpu = time.perf_counter(), time.process_time()
    call()
    first, first_cpu = time.perf_counter() - t, time.process_time() - cpu
    after = compiled()
    t, cpu = time.perf_counter(), time.process_time()
    call()
    out[name] = {"first_s": first, "first_cpu_s": first_cpu, "second_s": time.perf_counter() - t,
                 "second_cpu_s": time.process_time() - cpu, "compiled": after[0] - before[0],
                 "loaded": after[1] - before[1]}
print(json.dumps(out))
"""

WARMUP_CHILD = r"""
import json, time
t, cpu = time.perf_counter(), time.process_time()
import eplb
from eplb.simulation.synthetic import DEEPSEEK_V3 as c
eplb.warmup(eplb.Deployment.of(c["num_experts"], num_slots=c["num_slots"], num_gpus=c["num_gpus"],
                               num_nodes=c["num_nodes"], num_groups=c["num_groups"]))
took = {"warmup_s": time.perf_counter() - t, "warmup_cpu_s": time.process_time() - cpu}
import os
from eplb.simulation.synthetic import deepseek_v3_counts
in_service = eplb.plan(deepseek_v3_counts(0), method="greedy", num_slots=c["num_slots"], num_gpus=c["num_gpus"],
                       num_nodes=c["num_nodes"], num_groups=c["num_groups"])
with open(os.path.join(os.environ["EPLB_CACHE_DIR"], "in_service.json"), "w") as file:
    json.dump(in_service.to_dict(), file)
print(json.dumps(took))
"""


def _child(code: str, args: list[str], cache_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EPLB_CACHE_DIR": cache_dir}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        raise RuntimeError(f"start-up child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def after_warmup(folder: str | None = None) -> tuple[dict, dict]:
    """``eplb.warmup`` for DeepSeek-V3 on an empty folder (its time), then, for each public call, a
    fresh process timing its first and second call: ``(warmup, {call: timings})``. ``folder``: the
    cache folder to fill and keep (default a temporary one)."""
    if folder is not None:
        warm = _child(WARMUP_CHILD, [], folder)
        names = json.loads(subprocess.run([sys.executable, "-c", AFTER_WARMUP_CHILD, "--names"], check=True,
                                          env={**os.environ, "PYTHONPATH": str(ROOT), "EPLB_CACHE_DIR": folder},
                                          cwd=ROOT, capture_output=True, text=True).stdout)
        return warm, {name: _child(AFTER_WARMUP_CHILD, [name], folder)[name] for name in names}
    with tempfile.TemporaryDirectory(prefix="eplb-cache-warmup-") as folder:
        return after_warmup(folder)


def after_warmup_section(results_dir: Path, folder: str | None = None) -> str:
    warm, calls = after_warmup(folder)
    rows = [{"call": name, **{k: round(v, 4) for k, v in r.items()}} for name, r in calls.items()]
    write_csv(results_dir / "startup_after_warmup.csv", rows)
    table = []
    for r in rows:
        extra, extra_cpu = r["first_s"] - r["second_s"], r["first_cpu_s"] - r["second_cpu_s"]
        table.append((r["call"], f"{r['first_s']:.3f}", f"{r['first_cpu_s']:.3f}", f"{r['second_s']:.3f}",
                      f"{extra:.3f}", f"{extra_cpu:.3f}", f"{r['compiled']:g} / {r['loaded']:g}",
                      f"<= {AFTER_WARMUP_TARGET:g} s: " + verdict(extra, extra_cpu, AFTER_WARMUP_TARGET)))
    return "\n".join([
        "### After `eplb warmup`", "",
        f"`eplb.warmup(eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8))` on an empty cache folder took "
        f"{warm['warmup_s']:.1f} s wall, {warm['warmup_cpu_s']:.1f} s CPU (a fresh process, import included). Then "
        "a fresh process per public call, on that folder, makes that call twice and nothing else before it "
        "(DeepSeek-V3-sized loads other than the warm-up's; the placement in service is a greedy plan read "
        "from a file). Seconds; `extra` = first - second call; "
        "`compiled / loaded`: Numba specializations of eplb's kernels the first call compiled (0: the warm-up "
        "left nothing to compile) / loaded from the on-disk cache (a fresh process's first use).", "",
        markdown_table(("public call", "first s", "first CPU s", "second s", "extra s", "extra CPU s",
                        "compiled / loaded", "target"), table), "",
    ])


def fresh_process(entry: str, cache_dir: str, site: Path = ROOT) -> dict:
    """Run the child in a new interpreter with ``EPLB_CACHE_DIR=cache_dir`` on the eplb in ``site``
    (this checkout, or an installed copy); its timings plus the process's wall time (interpreter
    start-up included)."""
    env = {**os.environ, "PYTHONPATH": str(site), "EPLB_CACHE_DIR": cache_dir}
    env.pop("NUMBA_CACHE_DIR", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, entry], env=env, cwd=site, capture_output=True, text=True,
                          timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"start-up child failed for {entry!r}:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_wall_s": wall}


def install_copy(folder: Path) -> dict:
    """Build this checkout into a wheel (the build compiles the kernels it ships) and install it into
    ``folder/site``; the build's wall time and its manifest."""
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "eplb", source / "eplb", ignore=shutil.ignore_patterns("__pycache__", "_precompiled"))
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "EPLB_CACHE_DIR", "EPLB_PRECOMPILE")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w",
                    str(folder / "wheel")], env=env, cwd=source, check=True, capture_output=True, timeout=3600)
    build_s = time.perf_counter() - start
    (wheel,) = (folder / "wheel").glob("eplb-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(folder / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=600)
    (manifest,) = (folder / "site" / "eplb" / "_precompiled").glob("*/manifest.json")
    return {"build_s": build_s, **json.loads(manifest.read_text())}


def _row(entry: str, kind: str, runs: list[dict]) -> dict:
    """One table row: medians over fresh processes."""

    def med(fn):
        return round(statistics.median(fn(r) for r in runs), 4)

    return {"entry": entry, "kind": kind, "import_s": med(lambda r: r["import_s"]),
            "first_call_s": med(lambda r: r["first_s"]),
            "import_plus_first_call_s": med(lambda r: r["import_s"] + r["first_s"]),
            "import_plus_first_call_cpu_s": med(lambda r: r["import_cpu_s"] + r["first_cpu_s"]),
            "process_wall_s": med(lambda r: r["process_wall_s"]), "next_call_s": med(lambda r: r["next_call_s"]),
            "runs": len(runs)}


FRESH_INSTALL = "fresh install, empty cache"
COLD = "cold (empty cache, nothing shipped)"


def measure(entry: str, repeats: int, cold: bool = True, warm_folder: str | None = None,
            site: Path | None = None) -> list[dict]:
    """Start-ups of one entry point: ``repeats`` cold processes (each on its own empty cache
    folder) with ``cold``, on this checkout and, given the ``site`` of an installed copy, on it;
    then ``repeats`` warm ones on a folder filled by an untimed process (a fresh one, or
    ``warm_folder``, kept between runs)."""
    rows = []
    if cold:
        for kind, where in ((COLD, ROOT), (FRESH_INSTALL, site)):
            if where is None:
                continue
            runs = []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory(prefix="eplb-cache-cold-") as folder:
                    runs.append(fresh_process(entry, folder, where))
            rows.append(_row(entry, kind, runs))
    if warm_folder is not None:
        fresh_process(entry, warm_folder)  # fills the cache (loads it when an earlier run did)
        rows.append(_row(entry, "warm cache", [fresh_process(entry, warm_folder) for _ in range(repeats)]))
        return rows
    with tempfile.TemporaryDirectory(prefix="eplb-cache-warm-") as folder:
        fresh_process(entry, folder)  # fills the cache
        rows.append(_row(entry, "warm cache", [fresh_process(entry, folder) for _ in range(repeats)]))
    return rows


def quick_cache_folder() -> str:
    """The cache folder ``--quick`` measures warm starts on: kept between quick runs and shared by
    the entry points, so a quick run compiles at most once per machine and code version (Numba
    recompiles a kernel whose source changed)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")  # the user's own, not a shared /tmp
    folder = base / "eplb-bench-quick"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(folder)


def verdict(wall_s: float, cpu_s: float, target_s: float) -> str:
    if wall_s <= target_s:
        return "met"
    if cpu_s <= target_s:
        return "met on CPU time (wall time inflated by other processes)"
    return "NOT met"


def _target(row: dict) -> float | None:
    return WARM_TARGET if row["kind"] == "warm cache" else TARGETS.get(row["entry"])


def run(quick: bool, results_dir: Path, entries: tuple[str, ...] = ENTRIES, cold: bool | None = None,
        repeats: int | None = None, warm_folder: str | None = None, after: bool | None = None) -> str:
    """Cold (full run, or ``cold=True``) and warm start-ups of each entry point of ``entries``; warm
    ones on ``warm_folder`` when given, else (``quick``) :func:`quick_cache_folder`, else a fresh
    folder per entry point; with ``after`` (default: the full run) the first and second public
    calls after ``eplb warmup``."""
    if after is None:
        after = not quick
    results_dir.mkdir(parents=True, exist_ok=True)
    if cold is None:
        cold = not quick
    if repeats is None:
        repeats = 1 if quick else 3
    note = load_note()
    if warm_folder is None and quick:
        warm_folder = quick_cache_folder()
    with tempfile.TemporaryDirectory(prefix="eplb-install-") as folder:
        built = install_copy(Path(folder)) if cold else None
        site = Path(folder) / "site" if cold else None
        rows = [row for entry in entries
                for row in measure(entry, repeats, cold=cold, warm_folder=warm_folder, site=site)]
    write_csv(results_dir / "startup.csv", rows)
    if built is not None:
        (results_dir / "startup_build.json").write_text(json.dumps(built, indent=1))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(rows)))
    labels = [f"{r['entry']} ({r['kind']})" for r in rows]
    ax.barh(labels, [r["import_s"] for r in rows], label="import eplb")
    ax.barh(labels, [r["first_call_s"] for r in rows], left=[r["import_s"] for r in rows], label="first call")
    for r, y in zip(rows, range(len(rows))):
        target = _target(r)
        if target is not None:
            ax.plot([target, target], [y - 0.4, y + 0.4], color="red", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (fresh process; red: target)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(results_dir / "startup.png", dpi=110)
    plt.close(fig)

    table = []
    for r in rows:
        target = _target(r)
        bar = "" if target is None else f"<= {target:g} s: " + verdict(
            r["import_plus_first_call_s"], r["import_plus_first_call_cpu_s"], target)
        table.append((r["entry"], r["kind"], f"{r['import_s']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{r['import_plus_first_call_s']:.2f}", f"{r['import_plus_first_call_cpu_s']:.2f}",
                      f"{r['process_wall_s']:.2f}", f"{1e3 * r['next_call_s']:.1f}", bar))
    skipped = [] if cold else ["Cold starts are measured by the full run (`python bench/run.py`).", ""]
    return "\n".join([
        "## Start-up", "",
        "Fresh Python processes on the DeepSeek-V3-sized example (58 x 256, 288 slots, 32 GPUs, 4 nodes, 8 "
        "groups). *cold*: each process on an empty `EPLB_CACHE_DIR`, on this checkout, which ships no compiled "
        "kernels (its first call compiles what it uses); *fresh install*: the same on the package built into a wheel "
        "and installed (`pip install .`), whose build compiled the kernels it ships"
        + (f" ({built['build_s']:.0f} s to build the wheel, {built['compile_s']:.0f} s of it compiling; "
           f"{built['files']} cache files shipped)" if built else "") + "; "
        f"*warm cache*: new processes on a filled one. Medians of {repeats} processes. Seconds; `CPU` is the "
        "process's CPU time (less inflated by other processes on a shared machine); `process` includes "
        f"interpreter start-up; `next call` is the second call in that process ({note}).", "",
        markdown_table(("first call of", "kind", "import s", "first call s", "import + first call s", "same, CPU s",
                        "process s", "next call ms", "target"), table), "",
        *skipped, "![start-up](startup.png)", "",
        *([after_warmup_section(results_dir)] if after else []),
    ])


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    path = results_dir / "startup.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        total, cpu = float(r["import_plus_first_call_s"]), float(r["import_plus_first_call_cpu_s"])
        target = _target(r)
        what = {"warm cache": "fresh process, warm cache", FRESH_INSTALL: "fresh install (kernels shipped compiled), "
                "empty cache"}.get(r["kind"], "cold start (empty cache, no shipped kernels)")
        out.append((f"{what}: import + first `{r['entry']}`", f"{total:.2f} s wall, {cpu:.2f} s CPU",
                    "recorded" if target is None else f"<= {target:g} s: {verdict(total, cpu, target)}"))
    after = results_dir / "startup_after_warmup.csv"
    if after.exists():
        rows = read_csv(after)
        worst = max(rows, key=lambda r: float(r["first_s"]) - float(r["second_s"]))
        extra = float(worst["first_s"]) - float(worst["second_s"])
        extra_cpu = float(worst["first_cpu_s"]) - float(worst["second_cpu_s"])
        compiled = sum(int(float(r["compiled"])) for r in rows)
        out.append((f"after `eplb warmup` (DeepSeek-V3), fresh process: first call - second call, worst of "
                    f"{len(rows)} public calls (`{worst['call']}`)",
                    f"{extra:.3f} s wall, {extra_cpu:.3f} s CPU; {compiled} specializations compiled",
                    f"<= {AFTER_WARMUP_TARGET:g} s: {verdict(extra, extra_cpu, AFTER_WARMUP_TARGET)}"))
    return out


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's row: import + first call in a fresh process on an empty cache, installed with
    ``pip install .`` (kernels shipped compiled) against a checkout or editable install (compiles)."""
    path = results_dir / "startup.csv"
    if not path.exists():
        return []
    rows = {(r["entry"], r["kind"]): float(r["import_plus_first_call_s"]) for r in read_csv(path)}
    entries = [e for e in ("plan default", "Balancer decision") if (e, FRESH_INSTALL) in rows]
    if not entries:
        return []
    cold = [(e, k) for e in entries for k in {k for _, k in rows} if k.startswith("cold") and (e, k) in rows]
    names = {"plan default": "`eplb.plan`", "Balancer decision": "a `Balancer`'s first decision"}
    return [("Fresh process, empty cache: import + first call (" + ", ".join(names[e] for e in entries)
             + "), DeepSeek-V3 size, median of fresh processes",
             "after `pip install .`: " + ", ".join(f"{rows[e, FRESH_INSTALL]:.2f} s" for e in entries),
             "a checkout or editable install (compiles on first use): "
             + ", ".join(f"{rows[key]:.1f} s" for key in cold))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="warm starts only, one process per entry point")
    parser.add_argument("--cold", action="store_true", help="with --quick: measure cold starts too")
    parser.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated entry points")
    parser.add_argument("--after-warmup", action="store_true",
                        help="with --quick: measure the public calls after eplb warmup too")
    parser.add_argument("--repeats", type=int, default=None, help="fresh processes per measurement")
    args = parser.parse_args()
    print(run(args.quick, Path(__file__).resolve().parent / "results" / ("quick" if args.quick else ""),
              entries=tuple(e for e in args.entries.split(",") if e), cold=True if args.cold else None,
              repeats=args.repeats, after=True if args.after_warmup else None))

"""Compile, ahead of serving, every kernel a deployment will use: :func:`warmup`.

eplb's kernels are compiled by Numba on their first call and cached on disk (see
:mod:`eplb.kernels.plumbing._cache`). An engine that plans inside its serving loop must not stall on that
compile: run :func:`warmup` (or ``eplb warmup``) once while building the container or starting the
server, for the configuration the engine will serve. Later processes then load the compiled code
from the cache (a fraction of a second) instead of compiling it.

Which kernels a call compiles depends on the configuration (hierarchical or global, slots per GPU,
tiny or not) and on the loads (a layer near its bound skips the searches). So the warm-up plans
the configuration itself, with few layers of synthetic loads that take every path: skewed (Zipf,
hot experts), uniform and all-zero (dense) layers, from scratch and from a placement in service,
and it computes the lower bound, the migration, the other public calls a server makes
(:func:`warm_public_calls`: the global plan, ``max_off_node``, a series planned hedged,
``dispatch="optimal"``, :func:`eplb.dispatch`, every engine's shares, transfer plans,
:func:`eplb.simulate`) and, with ``balancer=True``, a Balancer's whole record / decide / rebalance
cycle (:func:`eplb.serving.balancer.warm_kernels`). ``tests/project/test_warmup.py`` checks that, after it,
a fresh process compiles nothing on any of those calls.

:func:`ship` is the warm-up a wheel's build runs (``eplb/_build.py``): it compiles three
deployments (:data:`SHIPPED_DEPLOYMENTS`) and puts Numba's cache files in the package, so a fresh install's first call loads
compiled code (:mod:`eplb.kernels.plumbing._cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numba
import numpy as np

from .planning.api import plan, rebalance_experts
from .serving.balancer import warm_kernels
from .planning.methods import DEFAULT_METHOD, METHODS
from .model.change import DeploymentChange
from .model.deployment import Deployment, deployment_argument, make_deployment
from .simulation.synthetic import skewed_counts
from .kernels.plumbing._cache import MANIFEST, cache_dir, shipped_tag
from .serving.transfer import transfer_plan
from .analysis.dispatch import dispatch
from .analysis.engine_dispatch import ENGINES, with_engine_shares
from .serving.policy import vllm_like
from .simulation.simulate import simulate

def synthetic_loads(num_experts: int, num_groups: int | None = None, seed: int = 0) -> np.ndarray:
    """``[5, E]`` int64 token counts whose layers take every planning path: Zipf 1.5 (heavy hot
    experts: the aligned replications and retries), hot experts, lognormal, uniform, all zero."""
    rows = [
        skewed_counts(1, num_experts, family="zipf", skew=1.5, num_groups=num_groups, seed=seed),
        skewed_counts(1, num_experts, family="hot", skew=1.0, num_groups=num_groups, seed=seed + 1),
        skewed_counts(1, num_experts, family="lognormal", skew=1.0, num_groups=num_groups, seed=seed + 2),
        skewed_counts(1, num_experts, family="uniform", num_groups=num_groups, seed=seed + 3),
        np.zeros((1, num_experts), np.int64),
    ]
    return np.concatenate(rows)


def warm_public_calls(loads: np.ndarray, later: np.ndarray, hierarchical: bool, config: dict) -> None:
    """Run, with the default method, the public calls a server of this configuration makes beside
    a plan from scratch, on ``loads`` and ``later`` (``[L, E]`` each): the global plan of the same
    slots and GPUs (when the configuration is hierarchical), a capped off-node plan
    (``max_off_node``), a series ``[T, L, E]`` planned hedged (from scratch, near a placement, capped),
    ``dispatch="optimal"``, :func:`eplb.dispatch`, every engine's shares
    (:mod:`eplb.analysis.engine_dispatch`), transfer plans, a re-plan across a lost GPU and
    :func:`eplb.simulate`."""
    series = np.stack([loads, later, loads[::-1].copy()])
    scratch = plan(loads, **config)
    placements = [scratch]
    if hierarchical:
        flat = {key: value for key, value in config.items() if key != "num_groups"}
        flat_plan = plan(loads, **flat)
        flat_plan.lower_bound
        transfer_plan(flat_plan, plan(later, previous=flat_plan, **flat)).counts()
        for cap in (0.1, 1.0):
            capped = plan(loads, max_off_node=cap, **config)
            capped.lower_bound
            capped.balancedness(later, dispatch="shares")
            capped.off_node_fraction(later)
            placements.append(capped)
        plan(series, max_off_node=0.1, **config)
    hedged = plan(series, **config)
    hedged.lower_bound
    near = plan(series, previous=scratch, **config)
    transfer_plan(scratch, near).counts()
    placements.append(plan(series, dispatch="optimal", **config))
    for placement in placements:
        dispatch(later, placement)
        placement.balancedness(later, dispatch="optimal")
    for engine in ENGINES:
        shared = with_engine_shares(scratch, engine)
        shared.balancedness(later, dispatch="shares")
        if hierarchical:
            shared.off_node_fraction(later)
    deployment = make_deployment(loads.shape[1], **config)
    _warm_change(later, deployment, scratch)
    simulate(series, deployment)
    with warnings.catch_warnings():  # a 3-step series is too short for the timer to act: it need not
        warnings.simplefilter("ignore", RuntimeWarning)
        simulate(series, deployment, policy=vllm_like())


def _warm_change(later: np.ndarray, deployment: Deployment, scratch) -> None:
    """A re-plan across a deployment change (the last GPU with slots lost, the survivors given the
    slots that hold every expert) and its transfer plan with loads from host memory."""
    slots = deployment.topology.slots_per_gpu
    active = np.flatnonzero(slots > 0)
    if active.size < 2:
        return
    need = -(-deployment.num_experts // (active.size - 1))
    with warnings.catch_warnings():  # a hierarchical deployment may be relaxed: that is what is warmed
        warnings.simplefilter("ignore", RuntimeWarning)
        change = DeploymentChange.lose(deployment, [int(active[-1])], slots_per_gpu=max(need, int(slots.max())))
        moved = plan(later, change, previous=scratch)
    transfer_plan(scratch, moved, change).counts()


def _timed(steps: dict, name: str, fn) -> None:
    start = time.perf_counter()
    fn()
    steps[name] = time.perf_counter() - start


def warmup(deployment: Deployment | None = None, *, methods=None, balancer=True, **deployment_keywords) -> dict:
    """Compile (or load from Numba's on-disk cache) every kernel this deployment will use.

    Args:
        deployment: the :class:`eplb.Deployment` (``eplb.Deployment.of(E, num_slots=..., ...)``);
            its keywords still work in its place, deprecated.
        methods: planning methods to warm (names from ``eplb.METHODS``); default the default
            method and ``"greedy"`` (``rebalance_experts(method="greedy")``).
        balancer: also warm a :class:`eplb.Balancer` of each method (:func:`eplb.serving.balancer.warm_kernels`:
            record, should_rebalance, rebalance on loads that take every path).
    Returns:
        ``{"steps": {name: seconds}, "time_s": total seconds, "methods": [...], "balancer": bool}``;
        a step that compiled takes seconds, one that loaded from the cache milliseconds.
    Raises:
        ValueError: a bad configuration or an unknown method (as :func:`eplb.plan` would).
    """
    deployment = deployment_argument(deployment, deployment_keywords, "warmup")
    if methods is None:
        methods = list(dict.fromkeys([DEFAULT_METHOD, "greedy"]))
    elif isinstance(methods, str):
        methods = [methods]
    methods = list(methods)
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"methods must be names from {sorted(METHODS)}, got {method!r}")
    if not isinstance(balancer, bool):
        raise ValueError(f"balancer must be True or False, got {balancer!r}")
    num_experts = deployment.num_experts
    config = dict(num_slots=deployment.topology.num_slots, num_gpus=deployment.topology.num_gpus,
                  num_nodes=deployment.topology.num_nodes, num_groups=deployment.num_groups)
    loads = synthetic_loads(num_experts, deployment.num_groups)
    later = synthetic_loads(num_experts, deployment.num_groups, seed=10)  # the loads drift
    steps: dict[str, float] = {}
    start = time.perf_counter()
    for method in methods:
        def from_scratch(method=method):
            placement = plan(loads, method=method, **config)
            placement.lower_bound  # computed on first access: the bound kernels
            placement.gap
            near = plan(later, method=method, previous=placement, **config)  # migration-aware
            transfer_plan(placement, near)

        _timed(steps, f"plan {method}", from_scratch)
        if deployment.topology.is_uniform:
            _timed(steps, f"rebalance_experts {method}",
                   lambda method=method: rebalance_experts(loads, config["num_slots"], config["num_groups"] or 1,
                                                           config["num_nodes"], config["num_gpus"], method=method))
    _timed(steps, "public calls", lambda: warm_public_calls(loads, later, deployment.hierarchical, config))
    if balancer:
        for method in methods:
            _timed(steps, f"Balancer {method}", lambda method=method: warm_kernels(deployment, method=method))
    return {"steps": steps, "time_s": time.perf_counter() - start, "methods": methods, "balancer": balancer}


SHIPPED_DEPLOYMENTS = (
    Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),  # DeepSeek-V3 (and global)
    Deployment.of(32, num_slots=40, num_gpus=8),  # small models (gpt-oss-20b): the searches of few experts
    Deployment.of(8, num_slots=8, num_gpus=8),  # as many slots as experts (Mixtral)
    Deployment.of(256, num_slots=288, num_gpus=144),  # DeepSeek's decode unit: two slots a GPU
    Deployment.of(256, num_slots=288, num_gpus=72),  # a 72-GPU rack: four slots a GPU
)
"""The deployments :func:`ship` warms: between them, the paths of large and small models, of
hierarchical and global deployments, and of the two- and four-slot kernels of wide expert
parallelism (the pairing step and the pair and head bounds; the last two add 6 s and 3 s to the
build after the others)."""


def ship(folder) -> dict:
    """Compile the kernels of :data:`SHIPPED_DEPLOYMENTS` (:func:`warmup`, a Balancer included) in this
    process's cache, then copy Numba's cache files to ``folder/<tag>/<kernel folder>/`` with a
    manifest (``<tag>`` is :func:`eplb.kernels.plumbing._cache.shipped_tag`): what a wheel's build ships as
    ``eplb/_precompiled``. Run it in a fresh process with an empty cache folder (``EPLB_CACHE_DIR``),
    so that only this source's entries are shipped.

    Returns:
        the manifest: ``{"id", "numba", "python", "deployments", "compile_s", "files"}``.
    """
    start = time.perf_counter()
    for deployment in SHIPPED_DEPLOYMENTS:
        warmup(deployment, balancer=True)
    compile_s = time.perf_counter() - start
    kernels_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
    located = cache_dir(os.path.join(kernels_dir, "__init__.py"))
    if located is None:  # a warning said why: the kernels were compiled in memory, nothing to ship
        raise RuntimeError("no private kernel cache folder to ship the compiled kernels from; "
                           "set EPLB_CACHE_DIR to an empty folder only you can write")
    source = Path(located)
    tag_dir = Path(folder) / shipped_tag()
    if tag_dir.exists():
        shutil.rmtree(tag_dir)  # an earlier build's files
    target = tag_dir / os.path.basename(kernels_dir)
    target.mkdir(parents=True)
    digest = hashlib.sha256()
    files = sorted(p for p in source.iterdir() if p.suffix in (".nbi", ".nbc"))
    for path in files:
        data = path.read_bytes()
        (target / path.name).write_bytes(data)
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(data).digest())
    manifest = {"id": digest.hexdigest(), "numba": numba.__version__, "python": sys.implementation.cache_tag,
                "deployments": [d.to_dict() for d in SHIPPED_DEPLOYMENTS], "compile_s": round(compile_s, 1), "files": len(files)}
    (tag_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest

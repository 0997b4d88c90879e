"""What-if sweeps: the same series through many deployments, dispatch modes and policies.

Operators ask "how many redundant slots are worth their memory", "what changes from 4 to 8
nodes", "how often should I rebalance". :func:`sweep` answers on their own traffic: every
combination of the axes is one :func:`eplb.simulate` run on the same series, from the same start
rule (the greedy plan of the first step), run in a pool of processes (every core by default).

A row of the result gives the deployment, the dispatch mode and the policy, the MoE time lost to
imbalance (as a share of the perfectly balanced time, and with the weight copies' stalls), the
copies and bytes moved, and the memory the redundant replicas take on a GPU. Policies are names
of the one registry (:data:`eplb.serving.policy.POLICY_NAMES`: ``"none"``, ``"vllm"``, ``"sglang"``,
``"balancer"``, ...; or ``"every:N/W"``), built by :func:`eplb.serving.policy.policy_by_name` in the
worker, or zero-argument callables that return a fresh :class:`eplb.Policy` (a callable must be
picklable, e.g. a module-level function or ``functools.partial``, to cross to the worker processes).

A warning a run raises (e.g. that the series ends before a policy's first decision, so it never
acts) is caught in the worker and raised once in the calling process, however many runs raised it.
"""

from __future__ import annotations

import itertools
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..model._validation import as_int
from ..model.cost import CostModel
from ..model.deployment import make_deployment
from ..engines import SCORING
from ..serving.policy import policy_by_name
from .simulate import checked_series, simulate


@dataclass(frozen=True)
class Point:
    """One combination of the sweep's axes."""

    extra_slots_per_gpu: int
    num_gpus: int
    num_nodes: int
    dispatch: str
    policy: str | Callable


def slots_for(num_experts: int, num_gpus: int, extra_slots_per_gpu: int) -> int:
    """Slots of a deployment: the fewest whole slots per GPU that hold every expert, plus ``extra``."""
    return num_gpus * (-(-num_experts // num_gpus) + extra_slots_per_gpu)


def _run_point(args) -> tuple[dict, list]:
    """One :func:`eplb.simulate` run: ``(row, warnings)``, the run's warnings as
    ``(category, message)`` pairs (a worker process would print them raw, once per run)."""
    series, point, num_groups, cost_model, check_every = args
    num_layers, num_experts = series.shape[1], series.shape[2]
    num_slots = slots_for(num_experts, point.num_gpus, point.extra_slots_per_gpu)
    policy = (policy_by_name(point.policy, check_every=check_every) if isinstance(point.policy, str)
              else point.policy())
    groups = num_groups if num_groups is not None and num_groups % point.num_nodes == 0 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deployment = make_deployment(num_experts, num_slots, point.num_gpus, point.num_nodes, groups,
                                     dispatch=point.dispatch)
        result = simulate(series, deployment, policy=policy, cost_model=cost_model)
    summary = result.summary()
    replicas_per_gpu = (num_slots - num_experts) / point.num_gpus
    row = {
        "policy": summary["policy"], "num_slots": num_slots, "redundant_slots": num_slots - num_experts,
        "extra_slots_per_gpu": point.extra_slots_per_gpu, "num_gpus": point.num_gpus, "num_nodes": point.num_nodes,
        "hierarchical": groups is not None, "dispatch": point.dispatch,
        "lost_share": summary["lost_share"], "lost_with_stalls_share": summary["lost_with_stalls_share"],
        "rebalances": summary["rebalances"], "copies": summary["copies"],
        "copies_cross_node": summary["copies_cross_node"], "bytes_moved": summary["bytes_moved"],
        "replica_memory_per_gpu_bytes": replicas_per_gpu * num_layers * cost_model.expert_bytes,
        "wall_time_s": summary["wall_time_s"],
        **{key: summary[key] for key in ("host_ms_mean", "host_ms_p99", "host_ms_max")},
    }
    return row, [(w.category, str(w.message)) for w in caught]


def sweep(counts, *, extra_slots_per_gpu=(0, 1, 2), num_gpus=(32,), num_nodes=(1,), num_groups=None,
          dispatch=("uniform",), policies=("balancer",), cost_model: CostModel | None = None,
          workers: int | None = None, check_every: int = 100) -> list[dict]:
    """Simulate every combination of the axes on ``counts``; one row per combination.

    Args:
        counts: ``[T, L, E]`` counts per step (numpy).
        extra_slots_per_gpu: redundant slots per GPU beyond the fewest that hold every expert (the
            memory axis: each is one more expert replica per GPU and layer).
        num_gpus, num_nodes: GPUs and nodes (a pair where the GPUs do not divide by the nodes is skipped).
        num_groups: expert groups, kept on one node each where they divide by the nodes.
        dispatch: ``"uniform"`` and/or ``"optimal"`` (see :func:`eplb.simulate`).
        policies: names from :data:`eplb.serving.policy.POLICY_NAMES` (or ``"every:N/W"``) or
            zero-argument callables returning a fresh :class:`eplb.Policy`.
        cost_model: default ``CostModel.preset()``.
        workers: processes (default: every core; 1 runs in this process).
        check_every: steps between the Balancer's decisions (policy ``"balancer"``; as
            :func:`eplb.serving.policy.policy_by_name` and ``eplb simulate --check-every``).
    Returns:
        Rows (dicts) in the order of the axes' product: deployment, dispatch, policy, ``lost_share``,
        ``lost_with_stalls_share``, ``rebalances``, ``copies``, ``copies_cross_node``,
        ``bytes_moved``, ``replica_memory_per_gpu_bytes``, ``wall_time_s`` and the policy's time on
        the engine's thread per step (``host_ms_mean``, ``host_ms_p99``, ``host_ms_max``).
    """
    series = checked_series(counts, generators=False)
    extras = [as_int(x, "extra_slots_per_gpu entry", minimum=0) for x in extra_slots_per_gpu]
    gpus = [as_int(g, "num_gpus entry", minimum=1) for g in num_gpus]
    nodes = [as_int(n, "num_nodes entry", minimum=1) for n in num_nodes]
    check_every = as_int(check_every, "check_every", minimum=1)
    for mode in dispatch:
        if mode not in SCORING:
            raise ValueError(f"dispatch entries must be one of {SCORING}, got {mode!r}")
    for policy in policies:
        if not callable(policy):
            try:
                policy_by_name(policy)  # fail here, not in a worker process
            except ValueError as exc:
                raise ValueError(f"policies entries must be names or callables returning an eplb.Policy: {exc}") \
                    from None
    if not (extras and gpus and nodes and dispatch and policies):
        raise ValueError("every axis needs at least one value")
    cost_model = CostModel.preset() if cost_model is None else cost_model
    points = [Point(e, g, n, d, p) for e, g, n, d, p in itertools.product(extras, gpus, nodes, dispatch, policies)
              if g % n == 0]
    if not points:
        raise ValueError("no deployment left: the GPUs must divide by the nodes in at least one pair")
    jobs = [(series, point, num_groups, cost_model, check_every) for point in points]
    workers = (os.cpu_count() or 1) if workers is None else as_int(workers, "workers", minimum=1)
    if workers == 1 or len(jobs) == 1:
        done = [_run_point(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            done = list(pool.map(_run_point, jobs))
    for category, message in dict.fromkeys(w for _, caught in done for w in caught):  # each once, in order
        warnings.warn(message, category, stacklevel=2)
    return [row for row, _ in done]


def knee(rows: list[dict], *, threshold: float = 0.01) -> dict[tuple, int | None]:
    """For every (GPUs, nodes, dispatch, policy): the fewest extra slots per GPU after which one more
    extra slot per GPU cuts the time lost (with stalls) by less than ``threshold`` (absolute share
    of the balanced time). The memory beyond it buys little. ``None`` when the values tried show no
    knee (each step still cut at least ``threshold``, or a single value): the last value tried is
    not a knee."""
    out = {}
    key = lambda r: (r["num_gpus"], r["num_nodes"], r["dispatch"], r["policy"])  # noqa: E731
    for group, members in itertools.groupby(sorted(rows, key=lambda r: (key(r), r["extra_slots_per_gpu"])), key=key):
        members = list(members)
        best = None
        for here, after in zip(members, members[1:]):
            if here["lost_with_stalls_share"] - after["lost_with_stalls_share"] < threshold:
                best = here["extra_slots_per_gpu"]
                break
        out[group] = best
    return out

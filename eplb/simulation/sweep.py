"""What-if sweeps: the same series through many deployments (slots, GPUs, nodes, dispatch rule) and policies.

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
from concurrent.futures import ProcessPoolExecutor, as_completed

from ..model._validation import as_int
from ..model.cost import CostModel
from ..model.deployment import Deployment
from ..engines import SCORING
from ..serving.policy import policy_by_name
from .simulate import checked_series, simulate


GRID_KEYWORDS = ("extra_slots_per_gpu", "num_gpus", "num_nodes", "num_groups", "dispatch")
"""The deprecated keywords of :func:`sweep` that spelled its grid (now :meth:`eplb.Deployment.grid`)."""


def _run_point(args) -> tuple[dict, list]:
    """One :func:`eplb.simulate` run: ``(row, warnings)``, the run's warnings as
    ``(category, message)`` pairs (a worker process would print them raw, once per run)."""
    series, deployment, policy, cost_model, check_every = args
    num_layers, num_experts = series.shape[1], series.shape[2]
    policy = policy_by_name(policy, check_every=check_every) if isinstance(policy, str) else policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = simulate(series, deployment, policy=policy, cost_model=cost_model)
    summary = result.summary()
    num_slots, num_gpus = deployment.num_slots, deployment.num_gpus
    replicas_per_gpu = (num_slots - num_experts) / num_gpus
    row = {
        "policy": summary["policy"], "num_slots": num_slots, "redundant_slots": num_slots - num_experts,
        "extra_slots_per_gpu": deployment.extra_slots_per_gpu, "num_gpus": num_gpus,
        "num_nodes": deployment.num_nodes, "hierarchical": deployment.hierarchical, "dispatch": deployment.dispatch,
        "lost_share": summary["lost_share"], "lost_with_stalls_share": summary["lost_with_stalls_share"],
        "rebalances": summary["rebalances"], "copies": summary["copies"],
        "copies_cross_node": summary["copies_cross_node"], "bytes_moved": summary["bytes_moved"],
        "replica_memory_per_gpu_bytes": replicas_per_gpu * num_layers * cost_model.expert_bytes,
        "wall_time_s": summary["wall_time_s"],
        **{key: summary[key] for key in ("host_ms_mean", "host_ms_p99", "host_ms_max")},
    }
    return row, [(w.category, str(w.message)) for w in caught]


def _point_label(row: dict) -> str:
    """What a sweep run was, for progress: ``"policy at S slots on G GPUs / N nodes"``."""
    return (f"{row['policy']} at {row['num_slots']} slots on {row['num_gpus']} GPUs / {row['num_nodes']} nodes, "
            f"{row['dispatch']}")


def _deployments(deployments, grid_keywords: dict, num_experts: int) -> list[Deployment]:
    """The deployments a :func:`sweep` was given: one value, a list of them, or (deprecated) the
    grid's keywords, which build :meth:`Deployment.grid` and warn with the call to write."""
    unknown = sorted(set(grid_keywords) - set(GRID_KEYWORDS))
    if unknown:
        raise TypeError(f"sweep() got unexpected keyword argument(s) {', '.join(unknown)}")
    if grid_keywords:
        if deployments is not None:
            raise ValueError("sweep: give the deployments either as values or as the grid's keywords, not both")
        spelled = ", ".join(f"{name}={value!r}" for name, value in grid_keywords.items())
        warnings.warn(f"sweep: the grid's keywords are deprecated; pass the deployments, "
                      f"eplb.Deployment.grid({num_experts}, {spelled})", DeprecationWarning, stacklevel=3)
        return Deployment.grid(num_experts, **{"num_gpus": (32,), **grid_keywords})  # the old defaults
    if deployments is None:
        raise ValueError("sweep needs the deployments: eplb.Deployment.grid(num_experts, extra_slots_per_gpu=..., "
                         "num_gpus=..., num_nodes=...) or a list of eplb.Deployment")
    listed = [deployments] if isinstance(deployments, Deployment) else list(deployments)
    if not listed:
        raise ValueError("deployments must hold at least one eplb.Deployment")
    for deployment in listed:
        if not isinstance(deployment, Deployment):
            raise ValueError(f"deployments entries must be eplb.Deployment values, got {type(deployment).__name__}")
        if deployment.num_experts != num_experts:
            raise ValueError(f"deployments entries must be for the counts' {num_experts} experts, "
                             f"got one for {deployment.num_experts}")
        if deployment.dispatch not in SCORING:
            raise ValueError(f"deployments entries' dispatch must be one of {SCORING}, got {deployment.dispatch!r}")
    return listed


def sweep(counts, deployments=None, *, policies=("balancer",), cost_model: CostModel | None = None,
          workers: int | None = None, check_every: int = 100, progress=None, **grid_keywords) -> list[dict]:
    """Simulate the same series through every deployment and policy.

    Args:
        counts: ``[T, L, E]`` counts per step (numpy).
        deployments: an :class:`eplb.Deployment` or a list of them, e.g.
            ``eplb.Deployment.grid(E, extra_slots_per_gpu=(0, 1, 2), num_gpus=(32, 64), num_nodes=(4,),
            num_groups=8, dispatch=("uniform", "optimal"))``: slots (the memory axis: each extra slot per
            GPU is one more expert replica per GPU and layer), GPUs, nodes, groups, and the rule that
            prices the steps (``"uniform"`` or ``"optimal"``, see :func:`eplb.simulate`). The grid's
            keywords given here instead still work, deprecated.
        policies: names from :data:`eplb.serving.policy.POLICY_NAMES` (or ``"every:N/W"``) or
            zero-argument callables returning a fresh :class:`eplb.Policy`.
        cost_model: default ``CostModel.preset()``.
        workers: processes (default: every core; 1 runs in this process).
        check_every: steps between the Balancer's decisions (policy ``"balancer"``; as
            :func:`eplb.serving.policy.policy_by_name` and ``eplb simulate --check-every``).
        progress: ``None``, or called as ``progress(runs done, runs in all, what)`` at the start and
            as each run ends (:class:`eplb.io.progress.Progress` shows it).
    Returns:
        Rows (dicts) in the order of the product deployments x policies: the deployment
        (``num_slots``, ``redundant_slots``, ``extra_slots_per_gpu``, ``num_gpus``, ``num_nodes``,
        ``hierarchical``, ``dispatch``), ``policy``, ``lost_share``, ``lost_with_stalls_share``,
        ``rebalances``, ``copies``, ``copies_cross_node``, ``bytes_moved``,
        ``replica_memory_per_gpu_bytes``, ``wall_time_s`` and the policy's time on the engine's
        thread per step (``host_ms_mean``, ``host_ms_p99``, ``host_ms_max``).
    """
    series = checked_series(counts, generators=False)
    listed = _deployments(deployments, grid_keywords, series.shape[2])
    check_every = as_int(check_every, "check_every", minimum=1)
    if isinstance(policies, str) or not len(policies):
        raise ValueError(f"policies must be a non-empty list of names or callables, got {policies!r}")
    for policy in policies:
        if not callable(policy):
            try:
                policy_by_name(policy)  # fail here, not in a worker process
            except ValueError as exc:
                raise ValueError(f"policies entries must be names or callables returning an eplb.Policy: {exc}") \
                    from None
    cost_model = CostModel.preset() if cost_model is None else cost_model
    jobs = [(series, deployment, policy, cost_model, check_every)
            for deployment, policy in itertools.product(listed, policies)]
    workers = (os.cpu_count() or 1) if workers is None else as_int(workers, "workers", minimum=1)
    tell = progress if progress is not None else (lambda done, total, note: None)
    tell(0, len(jobs), "")
    if workers == 1 or len(jobs) == 1:
        done = []
        for job in jobs:
            done.append(_run_point(job))
            tell(len(done), len(jobs), _point_label(done[-1][0]))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            futures = [pool.submit(_run_point, job) for job in jobs]
            for finished, future in enumerate(as_completed(futures), 1):
                tell(finished, len(jobs), _point_label(future.result()[0]))
            done = [future.result() for future in futures]
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

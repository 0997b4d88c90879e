"""A battery of plans on the public API, each output array hashed: the check that a refactor left
every placement and diagnostic byte-identical.

Run it before a change (``--write hashes.json``) and after it (``--check hashes.json``): the check
prints every output whose SHA-256 changed and exits 1 when any did. The cases are small (a minute
or two on a busy machine, most of it Numba compiling) and cover every method (``exact`` on small
cases, with a deterministic time budget), global and hierarchical deployments, ``previous=`` (with
and without ``max_moves``), ``max_off_node=``, series planned with each kind of objective and with
``dispatch="optimal"``, ``rebalance_experts`` (numpy and torch), ``eplb.dispatch``, the engine
dispatch rules, lower bounds, ``pareto``, ``transfer_plan`` and ``simulate`` with each provided
policy. Wall-clock figures (``info`` keys naming a time, ``wall_time_s``) are left out: they differ
between any two runs.

Usage::

    PYTHONPATH=$PWD python bench/battery.py --write /tmp/battery.json
    PYTHONPATH=$PWD python bench/battery.py --check /tmp/battery.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

import eplb


def digest(value) -> str:
    """SHA-256 of an array's dtype, shape and bytes (numbers and strings as 0-d arrays)."""
    array = np.ascontiguousarray(np.asarray(value))
    if array.dtype == object:
        raise TypeError(f"cannot hash an object array: {value!r}")
    h = hashlib.sha256()
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def _is_timing(key: str) -> bool:
    return "time" in key and key not in ("time_limit", "deterministic_time")


def placement_outputs(name: str, placement, counts) -> dict[str, str]:
    """Every array a :class:`eplb.Placement` carries, its diagnostics on ``counts`` and its info."""
    out = {f"{name}.phy2log": digest(placement.phy2log), f"{name}.log2phy": digest(placement.log2phy),
           f"{name}.logcnt": digest(placement.logcnt)}
    for attr in ("shares", "home_node", "max_load", "lower_bound", "gap"):
        value = getattr(placement, attr)
        if value is not None:
            out[f"{name}.{attr}"] = digest(value)
    out[f"{name}.gpu_loads"] = digest(placement.gpu_loads(counts))
    out[f"{name}.balancedness"] = digest(placement.balancedness(counts))
    for key, value in sorted(placement.info.items()):
        if _is_timing(key):
            continue
        try:
            out[f"{name}.info.{key}"] = digest(value)
        except (TypeError, ValueError):
            out[f"{name}.info.{key}"] = hashlib.sha256(repr(value).encode()).hexdigest()
    return out


def counts_2d(seed: int, layers: int, experts: int, dense_layer: bool = True) -> np.ndarray:
    """``[L, E]`` skewed integer counts (lognormal popularity), one all-zero (dense) layer."""
    rng = np.random.default_rng(seed)
    popularity = rng.lognormal(0.0, 1.0, size=(layers, experts))
    counts = rng.poisson(2000 * popularity / popularity.sum(axis=1, keepdims=True) * experts).astype(np.float64)
    if dense_layer:
        counts[-1] = 0
    return counts


def series_3d(seed: int, windows: int, layers: int, experts: int) -> np.ndarray:
    """``[T, L, E]`` counts whose hot experts drift between windows."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 1.0, size=(layers, experts))
    out = np.empty((windows, layers, experts))
    for t in range(windows):
        base = base * rng.lognormal(0.0, 0.3, size=base.shape)
        out[t] = rng.poisson(500 * base / base.sum(axis=1, keepdims=True) * experts)
    return out


def cases() -> dict[str, str]:
    out: dict[str, str] = {}
    counts = counts_2d(0, 4, 64)
    glob = dict(num_slots=80, num_gpus=8, num_nodes=2)
    hier = dict(num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
    small = counts_2d(1, 2, 8, dense_layer=False)
    small_cfg = dict(num_slots=12, num_gpus=4)

    for method in eplb.METHODS:
        if method == "exact":
            for cfg_name, cfg, c in (("small", small_cfg, small),
                                     ("small_hier", dict(num_slots=12, num_gpus=4, num_nodes=2, num_groups=2), small)):
                p = eplb.plan(c, method="exact", deterministic_time=2.0, workers=1, **cfg)
                out.update(placement_outputs(f"plan.exact.{cfg_name}", p, c))
            continue
        for cfg_name, cfg in (("global", glob), ("hier", hier)):
            p = eplb.plan(counts, method=method, **cfg)
            out.update(placement_outputs(f"plan.{method}.{cfg_name}", p, counts))
        p = eplb.plan(small, method=method, **small_cfg)
        out.update(placement_outputs(f"plan.{method}.small", p, small))

    for name, topology in (("uniform", eplb.Topology.uniform(80, 8, 2)),
                           ("masked", eplb.Topology.from_layout(80, 8, 2, masked_gpus=(3,)))):
        p = eplb.plan(counts, topology=topology)
        out.update(placement_outputs(f"plan.topology.{name}", p, counts))

    # near a previous placement
    moved = counts_2d(2, 4, 64)
    old = eplb.plan(counts, method="greedy", **glob)
    for name, kwargs in (("default", {}), ("max_moves", dict(max_moves=6)), ("tolerance_none", dict(tolerance=None, max_moves=10)),
                         ("phy2log", dict(previous=old.phy2log))):
        kwargs = {"previous": old, **kwargs}
        p = eplb.plan(moved, **glob, **kwargs)
        out.update(placement_outputs(f"plan.previous.{name}", p, moved))
    p = eplb.plan(moved, previous=eplb.plan(counts, **hier), **hier)
    out.update(placement_outputs("plan.previous.hier", p, moved))
    p = eplb.plan(small, previous=eplb.plan(counts_2d(3, 2, 8, dense_layer=False), method="greedy", **small_cfg),
                  method="exact", deterministic_time=2.0, workers=1, max_moves=4, **small_cfg)
    out.update(placement_outputs("plan.previous.exact", p, small))

    # capped off-node traffic
    for cap in (0.0, 0.1, 1.0):
        p = eplb.plan(counts, max_off_node=cap, **hier)
        out.update(placement_outputs(f"plan.max_off_node.{cap}", p, counts))
    curve = eplb.pareto(counts, eplb.Deployment.of(counts.shape[-1], **hier), fractions=(0.0, 0.1),
                        held_out=counts_2d(4, 4, 64))
    out.update({f"pareto.{k}": digest(v) for k, v in sorted(curve.items())})

    # series
    series = series_3d(5, 6, 3, 32)
    scfg = dict(num_slots=40, num_gpus=8)
    for objective in ("sum", "quantile", "max_share", "expected_peak", "worst_window", "expected_peak_search"):
        p = eplb.plan(series, objective=objective, **scfg)
        out.update(placement_outputs(f"plan.series.{objective}", p, series.sum(axis=0)))
    p = eplb.plan(series, objective="expected_peak", dispatch="optimal", **scfg)
    out.update(placement_outputs("plan.series.optimal.expected_peak", p, series.sum(axis=0)))
    p = eplb.plan(series, dispatch="optimal", window_weights=np.linspace(0.5, 1.5, 6), **scfg)
    out.update(placement_outputs("plan.series.optimal.default_weighted", p, series.sum(axis=0)))
    p = eplb.plan(series, **scfg)
    out.update(placement_outputs("plan.series.summed", p, series.sum(axis=0)))

    # DeepSeek's entry point
    for method in ("greedy", "balanced", "best"):
        for name, args in (("hier", (80, 8, 2, 8)), ("global", (80, 3, 2, 8))):
            arrays = eplb.rebalance_experts(counts, *args, method=method)
            out.update({f"rebalance.{method}.{name}.{i}": digest(a) for i, a in enumerate(arrays)})
    arrays = eplb.rebalance_experts(counts[0], 80, 8, 2, 8)
    out.update({f"rebalance.one_layer.{i}": digest(a) for i, a in enumerate(arrays)})
    try:
        import torch
    except ImportError:
        pass
    else:
        arrays = eplb.rebalance_experts(torch.from_numpy(counts), 80, 8, 2, 8)
        out.update({f"rebalance.torch.{i}": digest(a.numpy()) for i, a in enumerate(arrays)})

    # dispatch
    placement = eplb.plan(counts, **hier)
    out["dispatch.2d"] = digest(eplb.dispatch(counts, placement))
    placement_s = eplb.plan(series, **scfg)
    out["dispatch.3d"] = digest(eplb.dispatch(series, placement_s))
    out["gpu_loads.optimal"] = digest(placement.gpu_loads(counts, dispatch="optimal"))
    engine_dispatch = _engine_dispatch()
    for engine in engine_dispatch.ENGINES:
        if engine.startswith("sglang"):
            same = eplb.plan(counts, num_slots=96, num_gpus=8, num_nodes=2, num_groups=8)
            shares = engine_dispatch.engine_shares(same, engine)
        else:
            shares = engine_dispatch.engine_shares(placement, engine)
        out[f"engine_shares.{engine}"] = digest(shares)

    # lower bounds
    topo = placement.topology
    flat, hier = (eplb.Deployment.of(counts.shape[-1], topology=topo, num_groups=g) for g in (None, 8))
    out["lower_bound.global"] = digest(eplb.lower_bound(counts, flat))
    out["lower_bound.hier"] = digest(eplb.lower_bound(counts, hier))
    out.update({f"lower_bounds.{k}": digest(v) for k, v in sorted(eplb.lower_bounds(counts, flat).items())})

    # transfer plans
    tp = eplb.transfer_plan(old, eplb.plan(moved, previous=old, **glob))
    for key in ("layer", "expert", "src_slot", "dst_slot", "src_gpu", "dst_gpu", "kind"):
        if hasattr(tp, key):
            out[f"transfer.{key}"] = digest(getattr(tp, key))

    # simulation
    sim_series = series_3d(6, 12, 3, 32)
    policies = {"none": None, "fixed": eplb.FixedInterval(every=4, window=4), "vllm": eplb.vllm_like(),
                "balancer": eplb.BalancerPolicy(check_every=4)}
    sim_layout = dict(num_slots=40, num_gpus=8, num_nodes=2)
    for name, policy in policies.items():
        for dispatch in ("uniform", "optimal"):
            deployment = eplb.Deployment.of(sim_series.shape[-1], **sim_layout, dispatch=dispatch)
            result = eplb.simulate(sim_series, deployment, policy=policy)
            for key in ("layer_time", "balanced_time", "stall_time", "copies", "copy_time", "rebalance_steps"):
                out[f"simulate.{name}.{dispatch}.{key}"] = digest(getattr(result, key))
            out[f"simulate.{name}.{dispatch}.final"] = digest(result.final_placement.phy2log)
    result = eplb.simulate(sim_series, eplb.Deployment.of(sim_series.shape[-1], **sim_layout),
                           policy=eplb.FixedInterval(every=4), layers_per_step=1)
    out["simulate.chunked.layer_time"] = digest(result.layer_time)
    out["simulate.chunked.copies"] = digest(result.copies)
    return out


def _engine_dispatch():
    """The engine dispatch rules' module: ``eplb/analysis/engine_dispatch.py``, or at the package's
    root in the layout before the folders were the layers (so the battery runs on either)."""
    import importlib

    for where in (("eplb", "analysis", "engine_dispatch"), ("eplb", "engine_dispatch")):
        try:
            return importlib.import_module(".".join(where))
        except ImportError:
            continue
    raise ImportError("no engine dispatch module")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="write the hashes to this JSON file")
    group.add_argument("--check", type=Path, help="compare with the hashes in this JSON file")
    args = parser.parse_args(argv)
    hashes = cases()
    if args.write:
        args.write.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        print(f"{len(hashes)} outputs hashed into {args.write}")
        return 0
    expected = json.loads(args.check.read_text())
    changed = sorted(k for k in expected.keys() & hashes.keys() if expected[k] != hashes[k])
    missing = sorted(expected.keys() - hashes.keys())
    new = sorted(hashes.keys() - expected.keys())
    for key in changed:
        print(f"changed: {key}")
    for key in missing:
        print(f"missing: {key}")
    for key in new:
        print(f"new: {key}")
    same = len(expected.keys() & hashes.keys()) - len(changed)
    print(f"{same} of {len(expected)} outputs identical; {len(changed)} changed, {len(missing)} missing, {len(new)} new")
    return 1 if changed or missing or new else 0


if __name__ == "__main__":
    sys.exit(main())

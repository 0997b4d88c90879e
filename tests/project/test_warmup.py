"""eplb.warmup: after it, serving the configuration compiles nothing.

The check counts compiled specializations of every Numba dispatcher in ``eplb.kernels`` (a
specialization loaded from the on-disk cache counts as well: either would be a stall in the serving
loop), in a fresh interpreter with an empty cache folder. No wall-clock assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.precompile import synthetic_loads, warmup

# Marked slow test by test (each compiles every kernel of a deployment in fresh processes); the
# unmarked tests check this module in the fast tier (pytest -m "not slow").

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import importlib, json, pkgutil, sys
import numpy as np
from numba.core.registry import CPUDispatcher
import eplb
import eplb.kernels
from eplb.analysis.engine_dispatch import ENGINES, with_engine_shares
from eplb.simulation.synthetic import skewed_counts


def compiled():
    out = {}
    for info in pkgutil.walk_packages(eplb.kernels.__path__, "eplb.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                out[module.__name__ + "." + name] = len(value.overloads)
    return out


def public_calls(experts, config):
    \"\"\"(name, call) of every public call a server makes, on other loads than the warm-up's (a
    drifting series of 7 layers with a dense one), each call on its own so a compile names its call.\"\"\"
    groups = config.get("num_groups")
    series = np.stack([skewed_counts(7, experts, family=f, skew=s, seed=5 + i, num_groups=groups, dense_layers=(2,))
                       for i, (f, s) in enumerate([("lognormal", 0.9), ("zipf", 1.2), ("hot", 0.8)])])
    a, b = series[0], series[1]
    flat = {k: v for k, v in config.items() if k != "num_groups"}
    hierarchical = groups is not None and groups % config.get("num_nodes", 1) == 0
    state = {}

    def first():
        state["p"] = eplb.plan(a, **config)

    def balancer():
        balancer = eplb.Balancer(7, eplb.Deployment.of(experts, **config), window=3, min_gain=0.0, move_cost=0.0)  # compile="eager"
        for counts in series:
            balancer.record(counts)
            balancer.should_rebalance()
            balancer.rebalance()
        balancer.record(np.ones((7, config["num_slots"])), physical=True)
        balancer.rebalance()

    calls = [
        ("plan", first),
        ("plan global", lambda: eplb.plan(a, **flat).lower_bound),
        ("lower bound", lambda: state["p"].gap),
        ("plan previous=", lambda: eplb.plan(b, previous=state["p"], **config)),
        ("plan series", lambda: eplb.plan(series, **config).lower_bound),
        ("plan series previous=", lambda: eplb.plan(series, previous=state["p"], **config)),
        ("plan dispatch=optimal", lambda: eplb.plan(series, dispatch="optimal", **config)),
        ("eplb.dispatch", lambda: eplb.dispatch(b, state["p"])),
        ("engine shares", lambda: [with_engine_shares(state["p"], e).balancedness(b, dispatch="shares")
                                   for e in ENGINES]),
        ("transfer_plan", lambda: eplb.transfer_plan(state["p"], eplb.plan(b, **config)).counts()),
        ("rebalance_experts", lambda: eplb.rebalance_experts(b, config["num_slots"], groups or 1,
                                                             config.get("num_nodes", 1), config["num_gpus"])),
        ("rebalance_experts greedy", lambda: eplb.rebalance_experts(
            b, config["num_slots"], groups or 1, config.get("num_nodes", 1), config["num_gpus"], method="greedy")),
        ("simulate", lambda: eplb.simulate(series, eplb.Deployment.of(experts, **config))),
        ("Balancer", balancer),
    ]
    if hierarchical:
        calls[4:4] = [("plan max_off_node", lambda: eplb.plan(a, max_off_node=0.1, **config).lower_bound),
                      ("plan max_off_node=1", lambda: eplb.plan(a, max_off_node=1.0, **config).lower_bound)]
    return calls


report = {}
for config in json.loads(sys.argv[1]):
    experts = config.pop("num_experts")
    done = eplb.warmup(eplb.Deployment.of(experts, **config))
    new = {}
    for name, call in public_calls(experts, config):
        before = compiled()
        call()
        after = compiled()
        new[name] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    report[f"{experts} experts, {config['num_slots']} slots, {config['num_gpus']} GPUs"] = {
        "steps": sorted(done["steps"]), "new": new, "hierarchical": "num_groups" in config}
print(json.dumps(report))
"""


@pytest.mark.slow
def test_after_warmup_serving_compiles_nothing(tmp_path):
    configs = [
        dict(num_experts=64, num_slots=80, num_gpus=8, num_nodes=2, num_groups=4),  # hierarchical
        dict(num_experts=32, num_slots=48, num_gpus=8),  # global, small: the replication retries run
        dict(num_experts=32, num_slots=48, num_gpus=24),  # two slots a GPU: the pairing step
    ]
    env = {**os.environ, "EPLB_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), json.dumps(configs)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == len(configs)
    for name, result in report.items():
        assert {"plan balanced", "plan greedy", "public calls", "Balancer balanced"} <= set(result["steps"])
        assert "plan max_off_node" in result["new"] or not result["hierarchical"]  # the capped plan
        compiled = {call: new for call, new in result["new"].items() if new}
        assert compiled == {}, f"{name}: compiled after warmup, by call: {compiled}"


def test_warmup_rejects_bad_arguments():
    deployment = eplb.Deployment.of(16, num_slots=24, num_gpus=4)
    with pytest.raises(ValueError, match="methods"):
        warmup(deployment, methods=["fastest"], balancer=False)
    with pytest.raises(ValueError, match="num_slots"):
        warmup(eplb.Deployment.of(16, num_slots=8, num_gpus=4), balancer=False)
    with pytest.raises(ValueError, match="warmup needs the deployment"):
        warmup(16, balancer=False)
    with pytest.raises(ValueError, match="balancer"):
        warmup(deployment, balancer="yes")
    with pytest.raises(TypeError):  # one deployment value, not its parts by position
        warmup(16, 24, 4, balancer=False)


def test_synthetic_loads_take_every_path():
    """The warm-up loads hold a dense (all-zero) layer, a uniform one and skewed ones, with the
    group structure of the configuration."""
    loads = synthetic_loads(64, num_groups=4)
    assert loads.shape == (5, 64) and loads.dtype == np.int64
    assert (loads[-1] == 0).all() and (loads[:-1].sum(axis=1) > 0).all()
    assert loads[0].max() > 5 * loads[0].mean()  # Zipf 1.5: a heavy hot expert
    assert np.array_equal(loads, synthetic_loads(64, num_groups=4))  # deterministic


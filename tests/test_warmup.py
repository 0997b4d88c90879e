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

from eplb.precompile import synthetic_loads, warmup

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import importlib, json, pkgutil, sys
import numpy as np
from numba.core.registry import CPUDispatcher
import eplb
import eplb.kernels
from eplb.simulation.synthetic import skewed_counts


def compiled():
    out = {}
    for info in pkgutil.iter_modules(eplb.kernels.__path__):
        module = importlib.import_module("eplb.kernels." + info.name)
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                out[module.__name__ + "." + name] = len(value.overloads)
    return out


report = {}
for config in json.loads(sys.argv[1]):
    experts = config.pop("num_experts")
    done = eplb.warmup(experts, **config)
    before = compiled()
    # serving: other loads than the warm-up's (a drifting series), from scratch, near the
    # placement in service, the bound, greedy's entry point and a Balancer fed int64 counts
    series = [skewed_counts(7, experts, family=f, skew=s, seed=5 + i, num_groups=config.get("num_groups"),
                            dense_layers=(2,))
              for i, (f, s) in enumerate([("lognormal", 0.9), ("zipf", 1.2), ("hot", 0.8)])]
    first = eplb.plan(series[0], **config)
    first.gap
    second = eplb.plan(series[1], previous=first, **config)
    eplb.transfer_plan(first, second)
    eplb.rebalance_experts(series[2], config["num_slots"], config.get("num_groups") or 1, config.get("num_nodes", 1),
                           config["num_gpus"], method="greedy")
    balancer = eplb.Balancer(7, experts, window=3, min_gain=0.0, move_cost=0.0, **config)
    for counts in series:
        balancer.record(counts)
        balancer.should_rebalance()
        balancer.rebalance()
    after = compiled()
    report[str(experts)] = {"steps": sorted(done["steps"]),
                            "new": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}
print(json.dumps(report))
"""


def test_after_warmup_serving_compiles_nothing(tmp_path):
    configs = [
        dict(num_experts=64, num_slots=80, num_gpus=8, num_nodes=2, num_groups=4),  # hierarchical
        dict(num_experts=32, num_slots=48, num_gpus=8),  # global, small: the replication retries run
    ]
    env = {**os.environ, "EPLB_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), json.dumps(configs)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for experts, result in report.items():
        assert result["new"] == {}, f"{experts} experts: compiled after warmup: {result['new']}"
        assert {"plan balanced", "plan greedy", "Balancer balanced"} <= set(result["steps"])


def test_warmup_rejects_bad_arguments():
    with pytest.raises(ValueError, match="methods"):
        warmup(16, num_slots=24, num_gpus=4, methods=["fastest"], balancer=False)
    with pytest.raises(ValueError, match="num_slots"):
        warmup(16, num_slots=8, num_gpus=4, balancer=False)
    with pytest.raises(ValueError, match="num_slots and num_gpus are required"):
        warmup(16, balancer=False)
    with pytest.raises(ValueError, match="balancer"):
        warmup(16, num_slots=24, num_gpus=4, balancer="yes")
    with pytest.raises(TypeError):  # the deployment is keyword-only, as for eplb.plan
        warmup(16, 24, 4, balancer=False)


def test_synthetic_loads_take_every_path():
    """The warm-up loads hold a dense (all-zero) layer, a uniform one and skewed ones, with the
    group structure of the configuration."""
    loads = synthetic_loads(64, num_groups=4)
    assert loads.shape == (5, 64) and loads.dtype == np.int64
    assert (loads[-1] == 0).all() and (loads[:-1].sum(axis=1) > 0).all()
    assert loads[0].max() > 5 * loads[0].mean()  # Zipf 1.5: a heavy hot expert
    assert np.array_equal(loads, synthetic_loads(64, num_groups=4))  # deterministic


"""Planning functions with the published ``rebalance_experts`` signature that go wrong in each way
``eplb compare`` must survive (and two valid ones it must flag), for ``tests/simulation/test_compare.py``."""

from __future__ import annotations

import os

import numpy as np


def _round_robin(weight, num_replicas):
    """Slot ``s`` holds expert ``s % E``: every expert placed, groups spread over every node."""
    layers, experts = np.shape(weight)
    return np.tile(np.arange(num_replicas, dtype=np.int64) % experts, (layers, 1))


def round_robin(weight, num_replicas, num_groups, num_nodes, num_gpus):
    return _round_robin(weight, num_replicas)


def doubled(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """Every expert once, then expert 0 in every redundant slot: the last GPU holds it twice or more."""
    layers, experts = np.shape(weight)
    row = np.concatenate([np.arange(experts), np.zeros(num_replicas - experts, np.int64)])
    return np.tile(row, (layers, 1))


def wrong_shape(weight, num_replicas, num_groups, num_nodes, num_gpus):
    return _round_robin(weight, num_replicas)[:, :-1]


def missing_expert(weight, num_replicas, num_groups, num_nodes, num_gpus):
    phy2log = _round_robin(weight, num_replicas)
    phy2log[phy2log == 1] = 0
    return phy2log


def float_ids(weight, num_replicas, num_groups, num_nodes, num_gpus):
    return _round_robin(weight, num_replicas).astype(np.float64)


def bad_logcnt(weight, num_replicas, num_groups, num_nodes, num_gpus):
    phy2log = _round_robin(weight, num_replicas)
    return phy2log, None, np.ones(np.shape(weight), np.int64)


def raises(weight, num_replicas, num_groups, num_nodes, num_gpus):
    raise RuntimeError("this method is broken on purpose")


def returns_none(weight, num_replicas, num_groups, num_nodes, num_gpus):
    return None


def loops(weight, num_replicas, num_groups, num_nodes, num_gpus):
    while True:
        pass


def dies(weight, num_replicas, num_groups, num_nodes, num_gpus):
    os._exit(3)


def _start_lingering_child() -> None:
    """Start a process that inherits this one's stderr and outlives the method by a minute: it
    writes its pid to ``$EPLB_TEST_CHILDREN/<pid>.pid`` at once and ``<pid>.outlived`` if nobody
    killed it in that minute."""
    import subprocess
    import sys
    import time

    folder = os.environ["EPLB_TEST_CHILDREN"]
    code = ("import os, sys, time; folder = sys.argv[1]; pid = os.getpid(); "
            "open(os.path.join(folder, f'{pid}.pid'), 'w').close(); time.sleep(60); "
            "open(os.path.join(folder, f'{pid}.outlived'), 'w').close()")
    child = subprocess.Popen([sys.executable, "-c", code, folder])  # stderr inherited
    while not os.path.exists(os.path.join(folder, f"{child.pid}.pid")):  # started: its pid is on record
        time.sleep(0.01)


def spawns_and_hangs(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """Starts a child that holds stderr open, then never returns."""
    _start_lingering_child()
    while True:
        pass


def spawns_and_returns(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """Starts a child that holds stderr open, then returns a valid plan at once."""
    _start_lingering_child()
    return _round_robin(weight, num_replicas)


def six_values(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """A valid plan followed by three more values: not the published return value."""
    phy2log = _round_robin(weight, num_replicas)
    logcnt = np.stack([np.bincount(row, minlength=np.shape(weight)[1]) for row in phy2log])
    return phy2log, None, logcnt, 0.0, "extra", None

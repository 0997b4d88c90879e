"""What :func:`eplb.serving.balancer.warm_kernels` runs to compile a
:class:`~eplb.serving.balancer.Balancer`'s kernels before the serving loop needs them: the window
kernels with the array types :meth:`~eplb.serving.balancer.Balancer.record` passes
(:func:`warm_window_kernels`), passes that take a balancer through its planning paths
(:func:`warm_loads`), a deployment change (:func:`warm_change`), and the throw-away balancer's
warnings hidden (:func:`throwaway_warnings_hidden`)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import numpy as np

from ..kernels.plumbing.load_window import (store_logical, store_physical, warm_copy_counts, weighted_window,
                                            window_residuals)
from ..model.change import DeploymentChange
from ..model.deployment import make_deployment
from ..model.topology import Topology
from ..planning.migration import SPREAD_WARNING
from ..planning.pipeline import MAX_MOVES_WARNING
from ..planning.replan import RELAXED_WARNING


def warm_window_kernels(num_layers: int, num_experts: int, num_slots: int) -> None:
    """Compile (or load from the cache) the kernels :meth:`Balancer.record` and
    :meth:`Balancer.window_counts` call, with the array types they pass."""
    logical = np.zeros((num_layers, num_experts))
    warm_copy_counts()
    store_logical(logical, np.zeros((num_layers, num_experts)))
    phy2log = np.zeros((num_layers, num_slots), np.int64) % num_experts
    phy2log.setflags(write=False)  # record(physical=True) passes a placement's read-only phy2log
    store_physical(np.zeros((num_layers, num_slots)), phy2log, np.zeros((num_layers, num_experts)))
    weighted_window(np.zeros((1, num_layers, num_experts)), np.ones(1), np.zeros((num_layers, num_experts)))
    level, slope, out = (np.zeros((num_layers, num_experts)) for _ in range(3))
    window_residuals(np.zeros((1, num_layers, num_experts)), np.ones(1), np.zeros(1), level, slope,
                     np.ones((num_layers, num_experts)), out)


def warm_loads(num_layers: int, num_experts: int) -> list[np.ndarray]:
    """Passes ``[L, E]`` that take a balancer through its planning paths: skewed loads, the same
    loads on other experts (the search from the placement in service stalls), a small drift (it
    does not), a dense (all-zero) layer and a one-hot layer. Fixed seed."""
    rng = np.random.default_rng(0)
    skewed = np.floor(rng.pareto(1.0, (num_layers, num_experts)) * 100.0) + 1.0
    moved = skewed[:, rng.permutation(num_experts)]
    drifted = np.floor(moved * rng.uniform(0.8, 1.25, moved.shape))
    extreme = drifted.copy()
    extreme[0] = 0.0
    extreme[-1] = 0.0
    extreme[-1, num_experts // 2] = 1e6
    return [skewed, moved, drifted, extreme]


@contextlib.contextmanager
def throwaway_warnings_hidden():
    """Hide the warning that the throw-away balancer's round-robin start spreads groups over more
    slots than its move budget allows: it is about no placement of the caller's. Warning filters are
    process-wide and not thread-safe, so they change only on the main thread (a background compile
    may show it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SPREAD_WARNING, category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=RELAXED_WARNING, category=RuntimeWarning)  # its change (warm_change)
        warnings.filterwarnings("ignore", message=MAX_MOVES_WARNING, category=RuntimeWarning)  # ditto
        yield


def warm_change(balancer) -> None:
    """Take a throw-away ``balancer`` (a :class:`~eplb.serving.balancer.Balancer`) across a deployment
    change, so the kernels of the re-plan and of its transfer plan are compiled before a GPU is lost
    in service: one more slot on every GPU with slots (the kernels are the same for any change; this
    one keeps a uniform deployment uniform, which every method plans)."""
    deployment = balancer.deployment
    slots = deployment.topology.slots_per_gpu
    grown = Topology(slots + (slots > 0), deployment.topology.num_nodes)
    change = DeploymentChange(deployment, make_deployment(deployment.num_experts, topology=grown,
                                                          num_groups=deployment.num_groups,
                                                          dispatch=deployment.dispatch))
    placement, transfer = balancer.rebalance(deployment=change)
    transfer.counts()

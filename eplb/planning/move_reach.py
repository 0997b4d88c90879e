"""Whether a search near the placement in service can end within a move budget at all: a test
that skips searches whose result could never be kept (:func:`beyond_budget`), used by
:mod:`eplb.planning.migration` for the relabelled fresh plan and the recount restarts."""

from __future__ import annotations

import numpy as np

from ..analysis.loads import gpu_loads, peak_loads


def beyond_budget(weights: np.ndarray, previous: np.ndarray, topology, cap: np.ndarray, budget: int) -> np.ndarray:
    """``[L]`` bool: True where no placement that changes at most ``budget`` slots of ``previous
    [L, S]`` has every GPU load at most ``cap [L]`` under ``weights [L, E]`` (never True where one
    exists; False where the test cannot tell).

    The test: a GPU none of whose slots changed carries at least its previous load unless an
    expert it holds gained a replica, and ``budget`` changed slots give new replicas to at most
    ``budget`` experts, held by at most their previous replica counts of GPUs each. So at most
    ``budget`` plus the sum of the ``budget`` largest previous replica counts of GPUs can get below
    their previous load: if more GPUs than that are above ``cap``, no such placement exists. Where
    the search's result never ends above ``cap`` (the relabelled fresh plan: its peak or the
    target; a restart: its start's peak or the target) and is kept only within the budget, that
    search cannot change the plan and need not run. At few slots per GPU with the Balancer's move
    budget (2 slots of 288 at 144 GPUs) the relabelling (an assignment over GPUs, ``O(G^3)``) and
    the search that follows were most of a decision's time (``bench/rack.py``); they are skipped
    on nearly every layer there, without a budget never."""
    num_layers, num_experts = weights.shape
    hopeless = np.zeros(num_layers, bool)
    if budget >= topology.num_gpus or num_layers == 0:
        return hopeless
    # guards against rounding: loads summed in another order (relative 1e-9) and, with sums near
    # the largest or the smallest floats, no test at all
    sane = weights.sum(axis=1) < 1e300
    cnt = np.zeros((num_layers, num_experts), np.int64)
    np.add.at(cnt, (np.arange(num_layers)[:, None], previous), 1)
    most = min(budget, num_experts)
    top = np.partition(cnt, num_experts - most, axis=1)[:, num_experts - most:].sum(axis=1) if most else 0
    reach = budget + top
    loads = gpu_loads(weights, previous, topology, logcnt=cnt)  # [L, G]
    above = (loads > cap[:, None] * (1.0 + 1e-9) + 1e-250).sum(axis=1)
    return sane & (above > reach)


def within_reach(weights, previous, topology, starts: list, target: np.ndarray, budget: int) -> list:
    """The ``(layer, row)`` starts of a restart whose search may end within ``budget`` changed slots
    of ``previous [L, S]``: its result's peak is at most the start's or the target (steps only
    lower the peak; slots are given back while the peak stays at most the larger of the two), so
    where :func:`beyond_budget` finds that out of reach the search runs for nothing (its result is
    kept only within the budget)."""
    layers = np.array([layer for layer, _ in starts])
    rows = np.stack([row for _, row in starts])
    cap = np.maximum(target[layers], peak_loads(weights[layers], rows, topology))
    hopeless = beyond_budget(weights[layers], previous[layers], topology, cap, budget)
    return [start for start, skip in zip(starts, hopeless) if not skip]

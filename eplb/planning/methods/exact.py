"""``method="exact"``: the CP-SAT model of :mod:`eplb.planning.methods.exact_model`, one layer at a time, warm-started
from the default method, with per-layer optimality certificates and proven bounds.

Needs OR-Tools, an optional extra: ``pip install 'eplb[exact]'``. It is imported only when the
method runs (``import eplb`` never loads it).
"""

from __future__ import annotations

import importlib

import numpy as np

from ...model._validation import MissingExtraError
from . import DEFAULT_METHOD, Option, Deployment, get_method, register

DEFAULT_TIME_LIMIT = 10.0
"""Wall-clock seconds per layer when neither ``time_limit`` nor ``deterministic_time`` is given."""


CP_SAT_INT_MAX = 2**31 - 1
"""The largest ``workers`` CP-SAT's parameters take (an int32 field)."""


def load_solver():
    """The :mod:`eplb.planning.methods.exact_model` module (imports OR-Tools), or :class:`MissingExtraError` naming the
    extra to install."""
    try:
        importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        raise MissingExtraError("ortools", "exact", "method='exact'") from None
    return importlib.import_module("eplb.planning.methods.exact_model")


@register("exact", options={"time_limit": Option("number", above=0, allow_none=True),
                            "deterministic_time": Option("number", above=0, allow_none=True),
                            "workers": Option("int", minimum=1, maximum=CP_SAT_INT_MAX), "progress": Option("bool", allow_none=True)},
          rescale=False)
def exact_method(weights: np.ndarray, deployment: Deployment, *, time_limit: float | None = None,
                 deterministic_time: float | None = None, workers: int = 1, progress: bool | None = None
                 ) -> tuple[np.ndarray, dict]:
    """The lowest max load among the placements that keep the spread rule (no two replicas of an
    expert on one GPU where the replica counts allow otherwise), warm-started from the default
    method's plan, which keeps it too: when the budget ends before a proof, the plan is the best
    found so far (``info["status"]`` FEASIBLE or UNKNOWN, ``info["optimal"]`` False) and still
    keeps the rule. ``info`` also has ``doubled`` ``[L]`` and ``source`` ``[L]``
    (:func:`eplb.planning.methods.exact_model.solve`).

    Options:
        time_limit: per layer, in wall-clock seconds, > 0: every stage of the layer (building the
            model, the search, the spreading search) ends within it (the up-front warm start and
            bound take milliseconds once compiled). Default :data:`DEFAULT_TIME_LIMIT` unless
            ``deterministic_time`` is given. Where the search stops then depends on the machine's
            speed and load.
        deterministic_time: per layer, every stage included, in CP-SAT deterministic time units
            (a count of work, about one second of one core), > 0: the same input then gives the
            same plan on every run and machine. With both options the search stops at whichever
            comes first.
        workers: CP-SAT search workers, >= 1 and <= :data:`CP_SAT_INT_MAX` (several workers run
            interleaved, still deterministic).
        progress: per-layer progress bar on stderr; None (default) shows it when stderr is a terminal.
    """
    exact = load_solver()
    if time_limit is None and deterministic_time is None:
        time_limit = DEFAULT_TIME_LIMIT
    warm_method = DEFAULT_METHOD if DEFAULT_METHOD != "exact" else "greedy"
    try:
        warm, _ = get_method(warm_method)(weights, deployment)
    except ValueError:  # a configuration the default method does not take (e.g. uneven slots)
        warm_method = "largest-first"
        warm = np.stack([exact.largest_first_plan(w, deployment.topology) for w in weights])
    phy2log, info = exact.solve(weights, deployment, np.asarray(warm, dtype=np.int64), time_limit=time_limit,
                                deterministic_time=deterministic_time, workers=workers, progress=progress)
    info.update(warm_start_method=warm_method, time_limit=time_limit, deterministic_time=deterministic_time,
                workers=workers, hierarchical=deployment.hierarchical)
    return phy2log, info

"""``method="exact"``: the CP-SAT model of :mod:`eplb.exact`, one layer at a time, warm-started
from the default method, with per-layer optimality certificates and proven bounds."""

from __future__ import annotations

import math

import numpy as np

from .._validation import as_int
from . import Problem, register


@register("exact")
def exact_method(weights: np.ndarray, problem: Problem, *, time_limit: float = 10.0, workers: int = 1,
                 progress: bool | None = None) -> tuple[np.ndarray, dict]:
    """Options:
        time_limit: per layer, in CP-SAT deterministic seconds (about one second of one core; used
            instead of the wall clock so the same input always gives the same plan), > 0.
        workers: CP-SAT search workers, >= 1 (several workers run interleaved, still deterministic).
        progress: per-layer progress bar on stderr; None (default) shows it when stderr is a terminal.
    """
    from .. import exact  # OR-Tools loads in ~0.2 s: only when the exact method is used
    from . import DEFAULT_METHOD, get_method

    if isinstance(time_limit, (bool, np.bool_)) or not isinstance(time_limit, (int, float, np.integer, np.floating)):
        raise ValueError(f"time_limit must be a number of seconds, got {time_limit!r}")
    if not math.isfinite(time_limit) or time_limit <= 0:
        raise ValueError(f"time_limit must be a finite number of seconds > 0, got {time_limit!r}")
    workers = as_int(workers, "workers", minimum=1)
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise ValueError(f"progress must be True, False or None, got {progress!r}")
    warm_method = DEFAULT_METHOD if DEFAULT_METHOD != "exact" else "greedy"
    try:
        warm, _ = get_method(warm_method)(weights, problem)
    except ValueError:  # a configuration the default method does not take (e.g. uneven slots)
        warm_method = "largest-first"
        warm = np.stack([exact.largest_first_plan(w, problem.topology) for w in weights])
    phy2log, info = exact.solve(weights, problem, np.asarray(warm, dtype=np.int64), time_limit=float(time_limit),
                                workers=workers, progress=progress)
    info.update(warm_start_method=warm_method, time_limit=float(time_limit), workers=workers,
                hierarchical=problem.hierarchical)
    return phy2log, info

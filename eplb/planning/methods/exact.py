"""``method="exact"``: the CP-SAT model of :mod:`eplb.planning.methods.exact_formulation` (searched by
:mod:`eplb.planning.methods.exact_model`), one layer at a time, warm-started from the default method,
with per-layer optimality certificates and proven bounds.

Needs OR-Tools, an optional extra: ``pip install 'eplb[exact]'``. It is imported only when the
method runs (``import eplb`` never loads it).
"""

from __future__ import annotations

import importlib
import time

import numpy as np

from ...analysis.bounds import pair_weights, strongest_bound
from ...analysis.loads import slot_order_peaks
from ...analysis.metrics import replicas_sharing_a_gpu
from ...model._validation import MissingExtraError
from ..spread import avoidable_doubled
from .exact_pairs import keep_lighter, slots_per_gpu
from . import Option, Deployment, get_method, register

DEFAULT_TIME_LIMIT = 10.0
"""Wall-clock seconds per layer when neither ``time_limit`` nor ``deterministic_time`` is given."""


WARM_START_METHOD = "best"
"""The plan CP-SAT starts from and returns at worst: ``best`` (the default plus its searches), so a
layer the budget leaves unproven is never heavier than ``best``'s (288 / 72, lognormal: 0.09% above
the bound instead of the default's 0.20%)."""

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


def solve_unproven(exact, weights: np.ndarray, deployment: Deployment, warm: np.ndarray, **options
                   ) -> tuple[np.ndarray, dict]:
    """:func:`eplb.planning.methods.exact_model.solve` on the layers no closed form proves.

    With one or two slots on every GPU (global placement), the warm start ``warm [L, S]`` already
    holds the one- and two-slot construction where it is lighter
    (:func:`eplb.planning.methods.exact_pairs.keep_lighter`, ``best``'s last step), and every layer
    whose plan meets the package's lower bound
    (:func:`eplb.analysis.bounds.strongest_bound`, with two slots the weighting bound aimed at the
    plan, :func:`eplb.analysis.bounds.pair_weights`; both hold for every placement) is proven
    optimal there: status ``OPTIMAL``, source ``"closed form"``, no CP-SAT. With two slots, the
    other layers first get the search over replica counts
    (:func:`eplb.planning.methods.exact_pair_counts.prove_pairs`, half of each layer's budget):
    source ``"pair counts"`` where it proves or lightens the plan. What is still open goes to
    CP-SAT's placement model with the rest of the budget, warm-started from the lightest plan."""
    if slots_per_gpu(deployment) not in (1, 2):
        return exact.solve(weights, deployment, warm, **options)
    topology = deployment.topology
    warm = warm.copy()
    peaks = slot_order_peaks(weights, warm, topology)
    bound = pair_weights(weights, topology, strongest_bound(weights, deployment), peaks)
    proven = (peaks <= bound * (1.0 + 1e-9)) & (avoidable_doubled(warm, deployment) == 0)
    num_layers = weights.shape[0]
    info = {"optimal": proven.copy(), "proven_bound": np.where(proven, peaks, bound), "solve_time_s": np.zeros(num_layers),
            "status": ["OPTIMAL" if p else "SKIPPED" for p in proven],
            "source": ["closed form" if p else "warm start" for p in proven],
            "doubled": replicas_sharing_a_gpu(warm, topology), "warm_start_rearranged": np.zeros(num_layers, bool),
            "interrupted": False, "exact_arithmetic": np.ones(num_layers, bool), "closed_form": proven}
    if slots_per_gpu(deployment) == 2:
        options = _pair_counts(weights, deployment, warm, proven, info, options)
    open_layers = np.flatnonzero(~info["optimal"])
    phy2log = warm.copy()
    if open_layers.size:
        part, solved = exact.solve(np.ascontiguousarray(weights[open_layers]), deployment, warm[open_layers], **options)
        phy2log[open_layers] = part
        for key in ("optimal", "proven_bound", "doubled", "warm_start_rearranged", "exact_arithmetic"):
            info[key][open_layers] = solved[key]
        info["solve_time_s"][open_layers] += solved["solve_time_s"]
        for key in ("status", "source"):
            for i, layer in enumerate(open_layers):
                if not (key == "source" and solved[key][i] == "warm start"):
                    info[key][layer] = solved[key][i]
        info["interrupted"] = solved["interrupted"]
        info["proven_bound"][open_layers] = np.maximum(solved["proven_bound"], bound[open_layers])
    return phy2log, info


def _pair_counts(weights: np.ndarray, deployment: Deployment, warm: np.ndarray, proven: np.ndarray, info: dict,
                 options: dict) -> dict:
    """Run the replica-count search on the layers of ``warm [L, S]`` not ``proven [L]`` with half of
    each layer's budget, updating ``warm`` and ``info`` in place; the options for what is left."""
    from .exact_pair_counts import PROOF_MARGIN, prove_pairs

    time_limit, deterministic = options.get("time_limit"), options.get("deterministic_time")
    half_wall = None if time_limit is None else 0.5 * time_limit
    half_det = None if deterministic is None else 0.5 * deterministic
    for layer in np.flatnonzero(~proven):
        start = time.perf_counter()
        deadline = None if half_wall is None else start + half_wall
        row, optimal, _ = prove_pairs(weights[layer], deployment, warm[layer], deadline=deadline,
                                      deterministic=half_det, workers=options.get("workers", 1))
        info["solve_time_s"][layer] = time.perf_counter() - start
        if not (row == warm[layer]).all():
            warm[layer] = row
            info["source"][layer] = "pair counts"
        if optimal:
            peak = float(slot_order_peaks(weights[layer][None], row[None], deployment.topology)[0])
            info["optimal"][layer] = True
            info["proven_bound"][layer] = peak * (1.0 - PROOF_MARGIN)
            info["status"][layer] = "OPTIMAL"
            info["source"][layer] = "pair counts"
            info["doubled"][layer] = replicas_sharing_a_gpu(row[None], deployment.topology)[0]
    rest = dict(options)
    rest.update(time_limit=half_wall, deterministic_time=half_det)
    return rest


@register("exact", options={"time_limit": Option("number", above=0, allow_none=True),
                            "deterministic_time": Option("number", above=0, allow_none=True),
                            "workers": Option("int", minimum=1, maximum=CP_SAT_INT_MAX), "progress": Option("bool", allow_none=True)},
          rescale=False)
def exact_method(weights: np.ndarray, deployment: Deployment, *, time_limit: float | None = None,
                 deterministic_time: float | None = None, workers: int = 1, progress: bool | None = None
                 ) -> tuple[np.ndarray, dict]:
    """The lowest max load among the placements that keep the spread rule (no two replicas of an
    expert on one GPU where the replica counts allow otherwise), warm-started from
    :data:`WARM_START_METHOD`'s plan, which keeps it too: when the budget ends before a proof, the plan is the best
    found so far (``info["status"]`` FEASIBLE or UNKNOWN, ``info["optimal"]`` False) and still
    keeps the rule. ``info`` also has ``doubled`` ``[L]`` and ``source`` ``[L]``
    (:func:`eplb.planning.methods.exact_model.solve`).

    Options:
        time_limit: per layer, in wall-clock seconds, > 0: every stage of the layer (building the
            model, the search, the spreading search) ends within it (the up-front warm start and
            bound come before: ``method="best"`` takes 0.1 to 8 s per model at DeepSeek-V3 size,
            the most at two slots a GPU). Default :data:`DEFAULT_TIME_LIMIT` unless
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
    warm_method = WARM_START_METHOD
    try:
        warm, _ = get_method(warm_method)(weights, deployment)
    except ValueError:  # a configuration the default method does not take (e.g. uneven slots)
        warm_method = "largest-first"
        warm = np.stack([exact.largest_first_plan(w, deployment.topology) for w in weights])
        warm, _ = keep_lighter(weights, deployment, warm)  # what ``best`` adds at one or two slots a GPU
    warm = np.asarray(warm, dtype=np.int64)
    phy2log, info = solve_unproven(exact, weights, deployment, warm, time_limit=time_limit,
                                   deterministic_time=deterministic_time, workers=workers, progress=progress)
    info.update(warm_start_method=warm_method, time_limit=time_limit, deterministic_time=deterministic_time,
                workers=workers, hierarchical=deployment.hierarchical)
    return phy2log, info

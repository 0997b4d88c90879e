"""Proofs for GPUs of two slots each: the search over replica counts as a CP-SAT model.

With two slots a GPU a placement is a pairing of the replica loads, and for fixed replica counts
the sorted pairing (heaviest with lightest) is the best one (:mod:`eplb.kernels.bounds.pairs`). So
"some placement has every GPU ``<= T``" asks only for counts ``c [E]`` whose replicas can be paired
under ``T``; by Hall's theorem, exactly when at every level ``x > T / 2`` at least as many replicas
carry ``<= T - x`` as carry ``>= x``. Counts summing to fewer than ``S`` suffice: one more replica
of an expert whose replicas are ``<= T / 2`` keeps the condition. Each expert's count is one
choice among a few: those whose replicas are heavier than ``T / 2`` (each needs a light partner),
the fewest whose replicas are not and some more, and "more than listed", modelled at the load of
the most replicas the expert could get (a relaxation: lighter replicas only help a pairing). Where
a solution takes "more than listed", more counts are listed for that expert and the model is asked
again, so an answer is either a proof or counts that really pair under ``T``. The levels chain
through running totals, so the model stays linear in the options.

:func:`prove_pairs` asks it just below the best plan's max load: infeasible proves the plan optimal
(among every placement, two replicas of an expert on one GPU included); feasible gives counts whose
sorted pairing, laid out by :func:`eplb.planning.methods.exact_pairs.pair_rows`, is a lighter plan,
and the question is asked again below that one.

Needs OR-Tools (the ``exact`` extra); imported only by ``method="exact"``.
"""

from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

from ...analysis.loads import slot_order_peaks
from ...model.deployment import Deployment
from .exact_formulation import Levers
from .exact_model import Budget
from .exact_pairs import pair_rows, spread_cap

PROOF_MARGIN = 1e-10
"""The model is asked for a max load ``<= peak (1 - PROOF_MARGIN)``: infeasible there proves the
plan optimal within the package's ``1e-9`` optimality tolerance."""

_TIE = 1e-12  # relative: loads this close to a threshold count on the side that keeps a relaxation


def _options(w: np.ndarray, num_slots: int, target: float, listed: np.ndarray
             ) -> list[tuple[int, int, float, bool, int]]:
    """``(expert, count, replica load, heavy, replicas counted)`` for every count the model offers
    each expert of ``w [E]`` under ``target`` ``T``: from the fewest that keep a replica ``<= T``
    through the fewest that keep it ``<= T / 2`` and ``listed [E]`` more, and "more than that"
    (count ``-n``: ``n`` the fewest such), modelled as the most replicas the expert could get (the
    slots the others leave it at their fewest), at their load, while it costs only ``n`` slots: a
    relaxation, as more and lighter light replicas only help a pairing."""
    fewest = np.maximum(1, np.ceil(w / target * (1.0 - _TIE))).astype(np.int64)
    most = num_slots - (int(fewest.sum()) - fewest)
    out = []
    for e, load in enumerate(w):
        light = max(int(fewest[e]), int(np.ceil(2.0 * load / target * (1.0 - _TIE))))
        last = light + int(listed[e])
        for c in range(int(fewest[e]), min(last, int(most[e])) + 1):
            out.append((e, c, load / c, c < light, c))
        if last < most[e]:
            out.append((e, -(last + 1), load / most[e], False, int(most[e])))
    return out


def _running(model: cp_model.CpModel, total, added: list, bound: int):
    """``total`` plus the ``added`` terms, as a new variable when there are any."""
    if not added:
        return total
    var = model.new_int_var(0, bound, "")
    model.add(var == total + sum(added))
    return var


def pairing_model(w: np.ndarray, num_slots: int, target: float, listed: np.ndarray):
    """``(model, choices)``: the CP-SAT model of "counts for ``w [E]`` (non-negative), at most
    ``num_slots`` in all, pair with every pair ``<= target``" (see the module docstring), with
    ``listed [E]`` counts above each expert's fewest light ones; ``choices`` is ``[(expert, count,
    var)]``, a negative count ``-n`` for "more than listed" (``n`` replicas at the fewest)."""
    model = cp_model.CpModel()
    choices = []
    by_expert: dict[int, list] = {}
    for e, c, load, heavy, counted in _options(w, num_slots, target, listed):
        var = model.new_bool_var(f"e{e}c{c}")
        by_expert.setdefault(e, []).append(var)
        choices.append((e, abs(c), load, heavy, var, c < 0, counted))
    for e in range(len(w)):
        model.add_exactly_one(by_expert[e])
    model.add(sum(c * var for _, c, _, _, var, _, _ in choices) <= num_slots)
    heavy = sorted(((load, n, var) for _, _, load, h, var, _, n in choices if h), key=lambda t: -t[0])
    light = sorted(((load, n, var) for _, _, load, h, var, _, n in choices if not h), key=lambda t: t[0])
    # Hall at each heavy level x (decreasing): the replicas <= T - x (increasing) cover those >= x;
    # running totals as variables keep the model linear in the options
    demand, supply, i, j = 0, 0, 0, 0
    while i < len(heavy):
        x = heavy[i][0]
        added = []
        while i < len(heavy) and heavy[i][0] >= x:
            added.append(heavy[i][1] * heavy[i][2])
            i += 1
        demand = _running(model, demand, added, num_slots)
        added = []
        while j < len(light) and light[j][0] <= (target - x) * (1.0 + _TIE):
            added.append(light[j][1] * light[j][2])
            j += 1
        supply = _running(model, supply, added, num_slots)
        model.add(supply >= demand)
    return model, [(e, c, var, more) for e, c, _, _, var, more, _ in choices]


def _filled(w: np.ndarray, counts: np.ndarray, num_slots: int, target: float) -> np.ndarray:
    """``counts [E]`` raised to ``num_slots`` in all, one replica at a time to the expert with
    replicas ``<= target / 2`` whose replicas stay lightest (which keeps a pairing under ``target``)."""
    counts = counts.copy()
    for _ in range(num_slots - int(counts.sum())):
        after = np.where(w / counts <= 0.5 * target * (1.0 + _TIE), w / (counts + 1), np.inf)
        counts[int(np.argmin(after))] += 1
    return counts


def counts_under(w: np.ndarray, num_slots: int, target: float, budget: Budget, workers: int
                 ) -> tuple[str, np.ndarray | None]:
    """``(answer, counts [E] or None)``: ``"INFEASIBLE"`` (no counts summing to ``num_slots``
    pair ``w [E]`` under ``target``, proven), ``"FEASIBLE"`` with such counts, or ``"UNKNOWN"``
    (the budget ended; ``budget`` is spent as CP-SAT runs)."""
    if np.maximum(1, np.ceil(w / target * (1.0 - _TIE))).sum() > num_slots:
        return "INFEASIBLE", None  # some replica exceeds the target whatever the counts
    listed = np.full(len(w), 2, np.int64)
    while True:
        if not budget.left():
            return "UNKNOWN", None
        solver = budget.solver(workers, Levers())
        model, choices = pairing_model(w, num_slots, target, listed)
        answer = solver.solve(model)
        budget.spend(solver)
        if answer == cp_model.INFEASIBLE:
            return "INFEASIBLE", None
        if answer not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return "UNKNOWN", None
        more = [e for e, _, var, m in choices if m and solver.value(var)]
        if more:  # the relaxation chose "more than listed": list more counts there and ask again
            listed[more] *= 2
            continue
        counts = np.zeros(len(w), np.int64)
        for e, c, var, _ in choices:
            if solver.value(var):
                counts[e] = c
        return "FEASIBLE", _filled(w, counts, num_slots, target)


def prove_pairs(w: np.ndarray, deployment: Deployment, row: np.ndarray, *, deadline: float | None,
                deterministic: float | None, workers: int) -> tuple[np.ndarray, bool, str]:
    """Ask :func:`counts_under` just below the max load of the plan ``row [S]`` of ``w [E]`` (two
    slots on every GPU, :data:`PROOF_MARGIN`): no counts proves the plan optimal; counts give a
    lighter plan, and the question is asked again below it (asking lower first was slower: a
    target well below the optimum is harder to refute at 512 / 256). Returns ``(row [S], optimal,
    last answer)``: the lightest plan found that keeps the spread rule and whether it is proven
    optimal (its max load shaded by :data:`PROOF_MARGIN` is then a proven bound). ``deadline`` is
    a ``time.perf_counter()`` value."""
    topology = deployment.topology
    num_slots, num_gpus = topology.num_slots, topology.num_gpus
    cap = spread_cap(len(w), num_slots, num_gpus)
    budget = Budget(deadline, deterministic)
    peak = float(slot_order_peaks(w[None], row[None], topology)[0])
    answer = "UNKNOWN"
    while peak > 0.0:
        answer, counts = counts_under(w, num_slots, peak * (1.0 - PROOF_MARGIN), budget, workers)
        if answer == "INFEASIBLE":
            return row, True, answer
        if counts is None or counts.max() > cap:
            break
        lighter = pair_rows(w[None], counts[None], num_gpus)[0]
        if lighter is None:
            break  # the counts pair under the target only with an expert twice on a GPU
        lighter_peak = float(slot_order_peaks(w[None], lighter[None], topology)[0])
        if not lighter_peak < peak:
            break
        row, peak = lighter, lighter_peak
    return row, False, answer

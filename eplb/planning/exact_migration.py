"""The fewest slot changes within a tolerance, proven: a CP-SAT model per layer.

Migration-aware planning (:mod:`eplb.planning.migration`) searches for a placement close to the one in
service; this module finds the closest one, with a certificate. For one layer with loads ``w[E]``,
the previous placement's replica counts ``p[e, g]`` (expert ``e`` on GPU ``g``) and a cap ``C`` on
the max GPU load, the model is the one of :class:`eplb.planning.methods.exact_formulation.LayerModel` (replica counts ``r_e``,
replicas per GPU ``x[e, g]``, loads ``load_g``; no symmetry breaking, since the previous placement
tells GPUs apart) plus::

    kept[e, g] <= x[e, g],  0 <= kept[e, g] <= p[e, g]    replicas of e that stay on g
    changes = S - sum kept                                 slots whose expert changes
    load_g <= C            (tolerance given)               and/or   changes <= max_moves
    minimise changes       (tolerance given)               else     minimise max_g load_g

Slots on one GPU are interchangeable, so a GPU that keeps ``kept[e, g]`` replicas of ``e`` keeps
them in the slots they had: the changed slots of GPU ``g`` are ``k_g - sum_e kept[e, g]`` and
:func:`eplb.kernels.search.relabel.align_slots` puts every kept expert back in its old slot.

Integer loads: the per-replica loads are the model's integer table (exact, or rounded down to a
total of 2**31, see :func:`eplb.planning.methods.exact_formulation.load_table`). Rounded down, the model is a relaxation: the
cap ``floor(C * scale)`` admits every placement whose true max load is at most ``C``, so the
minimum it proves is a valid lower bound on the changes; the plan it returns is then checked with
the true loads and, in the rare case it exceeds ``C`` by the rounding, the cap is lowered by one
unit and the layer solved again (then the minimum is no longer claimed as proven).

Determinism: fixed seed and a *deterministic* time limit (see :func:`eplb.planning.methods.exact_model.solver_parameters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from .methods.exact_formulation import load_table
from .methods.exact_model import solver_parameters
from ..analysis.loads import slot_order_peaks
from ..kernels.search.relabel import align_slots
from .methods import Deployment

@dataclass
class MoveResult:
    """One layer's outcome.

    Attributes:
        slots: ``[S]`` int64 phy2log row; changes: slots differing from the previous row.
        max_load: of ``slots`` (count units); proven: the solver proved ``changes`` minimal (with a
            cap) or ``max_load`` minimal (budget only); lower_bound: proven fewest changes (cap)
            or proven lowest max load in count units (budget only); status: CP-SAT's status name.
    """

    slots: np.ndarray
    changes: int
    max_load: float
    proven: bool
    lower_bound: float
    status: str


def _on_gpu(row: np.ndarray, num_experts: int, topology) -> np.ndarray:
    """``[E, G]`` replicas of each expert on each GPU."""
    out = np.zeros((num_experts, topology.num_gpus), np.int64)
    held = row >= 0  # -1: a hole of a placement carried across a deployment change
    np.add.at(out, (row[held], topology.gpu_of_slot[held]), 1)
    return out


class MoveModel:
    """The CP-SAT model of one layer (see the module docstring), disaggregated by replica count.

    Variables: ``y[e, r]`` (expert ``e`` has ``r`` replicas), ``n[e, g, r]`` (replicas of ``e`` on
    GPU ``g`` when it has ``r``: ``sum_g n[e, g, r] = r * y[e, r]``), ``x[e, g] = sum_r n[e, g, r]``,
    ``load_g = sum_{e, r} P[e, r] * n[e, g, r]`` (linear: no product of variables), ``kept[e, g]``.
    A count whose per-replica load alone exceeds the cap is left out. This formulation's linear
    relaxation is much tighter than one load variable per (expert, GPU) switched by ``y``, which is
    what lets CP-SAT prove the fewest changes in well under a second on real traces.

    Args:
        w: ``[E]`` loads; deployment: topology and groups; previous: ``[S]`` the placement in service.
        cap: max GPU load (count units) or None; max_moves: budget of changed slots or None.
        cap_units: the cap in the model's integer units (default: from ``cap``).
        shared: allow a GPU to hold several replicas of one expert (default: at most as many as
            the previous placement has there, and at least one, as eplb's own search does).
    """

    def __init__(self, w: np.ndarray, deployment: Deployment, previous: np.ndarray, cap: float | None,
                 max_moves: int | None, cap_units: int | None = None, shared: bool = False):
        topology = deployment.topology
        self.w, self.deployment, self.previous = w, deployment, previous
        num_experts, slots = len(w), topology.slots_per_gpu
        num_slots = topology.num_slots
        self.max_count = max_count = num_slots - num_experts + 1
        self.table, self.scale, self.exact = load_table(w, max_count)
        table = self.table
        total = int(table[:, 0].sum())
        if cap is not None and cap_units is None:
            # a relaxation: a plan whose true max load is <= cap has integer loads <= cap * scale
            cap_units = min(total, math.floor(cap * self.scale * (1.0 + 1e-12)))
        self.cap_units = cap_units
        top = total if cap_units is None else cap_units
        self.gpus = gpus = [g for g in range(topology.num_gpus) if slots[g] > 0]
        model = self.model = cp_model.CpModel()
        self.counts = counts = {e: [r for r in range(1, max_count + 1) if table[e, r - 1] <= top]
                                for e in range(num_experts)}
        self.y = y = {(e, r): model.new_bool_var(f"y[{e},{r}]") for e in counts for r in counts[e]}
        for e in range(num_experts):
            model.add_exactly_one(y[e, r] for r in counts[e])  # empty: no plan fits the cap
        model.add(sum(r * var for (e, r), var in y.items()) == num_slots)
        self.n = n = {}
        for (e, r), var in y.items():
            for g in gpus:
                most = min(int(slots[g]), r)
                n[e, g, r] = model.new_int_var(0, most, f"n[{e},{g},{r}]")
                model.add(n[e, g, r] <= most * var)
            model.add(sum(n[e, g, r] for g in gpus) == r * var)
        self.x = x = {(e, g): sum(n[e, g, r] for r in counts[e]) for e in range(num_experts) for g in gpus}
        self.prev_on_gpu = prev_on_gpu = _on_gpu(previous, num_experts, topology)
        self.most_on_gpu = None
        if not shared:  # like eplb's search: no GPU gets a second replica of an expert it holds
            self.most_on_gpu = np.maximum(prev_on_gpu, 1)
            for (e, g), expr in x.items():
                if int(slots[g]) > int(self.most_on_gpu[e, g]):
                    model.add(expr <= int(self.most_on_gpu[e, g]))
        for g in gpus:
            model.add(sum(x[e, g] for e in range(num_experts)) == int(slots[g]))
        self.peak = model.new_int_var(0, top, "T")
        for g in gpus:
            model.add(sum(int(table[e, r - 1]) * n[e, g, r] for e in range(num_experts) for r in counts[e])
                      <= self.peak)
        if deployment.hierarchical:
            self._add_groups_on_nodes()
        self.kept = kept = {}
        for (e, g), expr in x.items():
            if prev_on_gpu[e, g] > 0:
                kept[e, g] = model.new_int_var(0, int(prev_on_gpu[e, g]), f"kept[{e},{g}]")
                model.add(kept[e, g] <= expr)
        self.changes = model.new_int_var(0, num_slots, "changes")
        model.add(self.changes == num_slots - sum(kept.values()))
        if max_moves is not None:
            model.add(self.changes <= int(max_moves))
        if cap_units is not None:
            model.minimize(self.changes)
        else:
            model.minimize(self.peak)

    def _add_groups_on_nodes(self):
        """Each group on exactly one node ``a[q, m]``; its experts' replicas only on that node."""
        model, deployment, topology = self.model, self.deployment, self.deployment.topology
        group_size = len(self.w) // deployment.num_groups
        a = {(q, m): model.new_bool_var(f"a[{q},{m}]") for q in range(deployment.num_groups)
             for m in range(topology.num_nodes)}
        for q in range(deployment.num_groups):
            model.add_exactly_one(a[q, m] for m in range(topology.num_nodes))
            for e in range(q * group_size, (q + 1) * group_size):
                for g in self.gpus:
                    model.add(self.x[e, g] <= int(topology.slots_per_gpu[g]) * a[q, int(topology.node_of_gpu[g])])
        for m in range(topology.num_nodes):
            model.add(sum(group_size * a[q, m] for q in range(deployment.num_groups)) <= int(topology.slots_per_node[m]))

    def add_hint(self, row: np.ndarray) -> None:
        """Warm start from the placement ``row [S]`` (skipped where it uses a count left out)."""
        on_gpu = _on_gpu(row, len(self.w), self.deployment.topology)
        have = on_gpu.sum(axis=1)
        if any(int(have[e]) not in self.counts[e] for e in range(len(self.w))):
            return
        if self.most_on_gpu is not None and (on_gpu > self.most_on_gpu).any():
            return
        model = self.model
        for (e, r), var in self.y.items():
            model.add_hint(var, r == have[e])
        for (e, g, r), var in self.n.items():
            model.add_hint(var, int(on_gpu[e, g]) if r == have[e] else 0)
        for (e, g), var in self.kept.items():
            model.add_hint(var, int(min(on_gpu[e, g], self.prev_on_gpu[e, g])))
        model.add_hint(self.changes, int((row != self.previous).sum()))

    def plan_from(self, value) -> np.ndarray:
        """The solution as a ``phy2log`` row ``[S]``, every kept expert in its previous slot."""
        topology = self.deployment.topology
        row = []
        for g in range(topology.num_gpus):
            if topology.slots_per_gpu[g] == 0:
                continue
            for e in range(len(self.w)):
                row.extend([e] * sum(int(value(self.n[e, g, r])) for r in self.counts[e]))
        row = np.asarray(row, dtype=np.int64)
        out = np.empty_like(row)
        align_slots(row, np.ascontiguousarray(self.previous, dtype=np.int64), topology.slot_offsets, len(self.w), out)
        return out


def fewest_changes_layer(w: np.ndarray, deployment: Deployment, previous: np.ndarray, hint: np.ndarray, *,
                         cap: float | None, max_moves: int | None, time_limit: float = 10.0,
                         workers: int = 1, shared: bool = False) -> MoveResult:
    """Solve one layer.

    Args:
        w: ``[E]`` float64 loads; previous: ``[S]`` the placement in service; hint: ``[S]`` a
            placement to start from (the heuristic's), also returned if the solver finds nothing
            better.
        cap: max GPU load allowed (count units), or None (then ``max_moves`` is required and the
            max load is minimised).
        max_moves: at most this many changed slots, or None.
        time_limit: CP-SAT deterministic seconds; workers: CP-SAT workers.
        shared: allow several replicas of one expert on a GPU (see :class:`MoveModel`).
    """
    topology = deployment.topology
    hint_changes = int((hint != previous).sum())
    hint_peak = float(slot_order_peaks(w[None], hint[None], topology)[0])
    if cap is None and max_moves is None:
        raise ValueError("give a cap on the max load, max_moves or both")
    if not w.any():  # a dense layer: every placement is as good; the previous one changes nothing
        return MoveResult(previous.copy(), 0, 0.0, True, 0.0, "TRIVIAL")
    if cap is not None and max_moves is not None:
        result = fewest_changes_layer(w, deployment, previous, hint, cap=cap, max_moves=None,
                                      time_limit=time_limit, workers=workers, shared=shared)
        if result.changes <= max_moves and result.max_load <= cap:
            return result
        # the cap needs more changes than the budget: the lowest max load within the budget
        return fewest_changes_layer(w, deployment, previous, hint, cap=None, max_moves=max_moves,
                                    time_limit=time_limit, workers=workers, shared=shared)
    hint_ok = (cap is None or hint_peak <= cap) and (max_moves is None or hint_changes <= max_moves)
    relaxation = True  # the model admits every plan within the cap (its bound is a proven bound)
    cap_units = None
    name = "UNKNOWN"
    for _attempt in range(3):
        move_model = MoveModel(w, deployment, previous, cap, max_moves, cap_units, shared)
        if hint_ok:
            move_model.add_hint(hint)
        solver = solver_parameters(time_limit, workers)
        status = solver.solve(move_model.model)
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        row = move_model.plan_from(solver.value)
        peak = float(slot_order_peaks(w[None], row[None], topology)[0])
        count = int((row != previous).sum())
        if cap is not None and peak > cap:  # over the cap by the rounding of the loads: tighten, retry
            cap_units = int(solver.value(move_model.peak)) - 1
            relaxation = False
            continue
        optimal = status == cp_model.OPTIMAL and relaxation
        if cap is not None:
            bound = float(math.ceil(solver.best_objective_bound - 1e-6)) if relaxation else 0.0
            better = not hint_ok or count < hint_changes
        else:
            bound = max(0.0, solver.best_objective_bound / move_model.scale) if relaxation else 0.0
            optimal = optimal and move_model.exact
            better = not hint_ok or peak < hint_peak
        if better:
            return MoveResult(row, count, peak, bool(optimal), bound, name)
        same = count == hint_changes if cap is not None else peak == hint_peak
        return MoveResult(hint.copy(), hint_changes, hint_peak, bool(optimal and same), bound, name)
    # nothing found (out of time, or proven infeasible): keep the hint
    infeasible = name == "INFEASIBLE" and relaxation and cap is not None
    return MoveResult(hint.copy(), hint_changes, hint_peak, False,
                      float(topology.num_slots + 1) if infeasible else 0.0, name)


def fewest_changes(weights: np.ndarray, deployment: Deployment, previous: np.ndarray, hint: np.ndarray, *,
                   cap: np.ndarray | None, max_moves: int | None, time_limit: float = 10.0,
                   workers: int = 1, shared: bool = False) -> tuple[np.ndarray, dict]:
    """Every layer with :func:`fewest_changes_layer`.

    Args:
        weights: ``[L, E]``; previous, hint: ``[L, S]`` int64; cap: ``[L]`` max load per layer or None.
    Returns:
        ``phy2log [L, S]`` and info: ``slots_changed [L]``, ``proven [L]`` bool, ``fewest_changes_bound [L]``
        (proven fewest changes under the cap; 0 when unknown), ``status`` (list of names).
    """
    num_layers = weights.shape[0]
    out = np.empty_like(hint)
    changes = np.zeros(num_layers, np.int64)
    proven = np.zeros(num_layers, bool)
    bound = np.zeros(num_layers)
    status = []
    for layer in range(num_layers):
        result = fewest_changes_layer(weights[layer], deployment, previous[layer], hint[layer],
                                      cap=None if cap is None else float(cap[layer]), max_moves=max_moves,
                                      time_limit=time_limit, workers=workers, shared=shared)
        out[layer], changes[layer], proven[layer], bound[layer] = (result.slots, result.changes, result.proven,
                                                                   result.lower_bound)
        status.append(result.status)
    return out, {"slots_changed": changes, "proven": proven, "fewest_changes_bound": bound, "status": status}

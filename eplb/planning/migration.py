"""Migration-aware planning: a new placement close to the previous one.

Planning from scratch after the loads drift moves almost every expert (greedy changes ~90% of the
slots), and every changed slot is an expert's weights (tens of MiB) copied across GPUs. Here, per
layer:

0. (:func:`plan_near`, the path of :func:`eplb.plan` and :class:`eplb.Balancer`, on layers of at
   least :data:`BOUND_FIRST_SLOTS` slots) first improve the previous placement as in step 2 until
   it is within the tolerance of a cheap lower bound (:func:`reference_bound`); a layer that gets
   there is within the tolerance of any plan from scratch, so none is made for it: most layers of a
   drifting load, and the plan from scratch is most of the time of a rebalance. Only the other
   layers go on to steps 1-6;
1. plan from scratch with the chosen method: the reference max GPU load ``M``;
2. improve the previous placement by local search (swap two slots, give a slot to another expert),
   best balance gain per changed slot first, until its max load is at most ``(1 + tolerance) * M``
   or the budget of changed slots is spent; then give back every changed slot the target does not
   need (:func:`eplb.kernels.search.few_changes.search_near_previous`);
3. where that stalls above the target, search again: by steepest descent, from the previous
   placement with the fresh plan's replica counts, and (hierarchical) with whole groups moved to
   the fresh plan's nodes;
4. where that still misses, relabel the fresh plan's nodes, GPUs and slots (assignment matching) so
   that what stays, stays put, and give back changed slots the target does not need;
5. keep the candidate that reaches the target with the fewest changed slots (if none does, the one
   with the lowest max load). A budget of moves (``max_moves``) is never exceeded;
6. on small layers (at most ``TINY_MIGRATION_SLOTS`` slots, global mode), search every set of fewer changed
   slots exhaustively, within a fixed amount of work.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..model.defaults import COPY_COST, PLAN_TOLERANCE
from ..model._validation import as_int
from ..analysis.bounds import average_bound
from ..kernels.search.few_changes import SearchLayout, search_near_previous
from ..kernels.search.recount import recounted_starts
from ..kernels.search.relabel import min_cost_assignment, relabel_like
from ..kernels.search.tiny_changes import fewest_changes_search
from ..analysis.loads import peak_loads
from .methods import Deployment, get_method
from ..analysis.placement import Placement, check_placement
from ..analysis.searches import group_assignment
from .spread import avoidable_doubled, within_cap
from . import move_reach


def _differs(mine, theirs) -> str:
    """What differs between the topologies ``mine`` (previous's) and ``theirs`` (the deployment's),
    in words (issue 47 item 20: the nodes were never named)."""
    parts = []
    if mine.num_gpus != theirs.num_gpus:
        parts.append(f"{mine.num_gpus} GPUs, the deployment {theirs.num_gpus}")
    elif not np.array_equal(mine.slots_per_gpu, theirs.slots_per_gpu):
        where = np.flatnonzero(mine.slots_per_gpu != theirs.slots_per_gpu)[:8].tolist()
        parts.append(f"slots per GPU {mine.slots_per_gpu[where].tolist()} on GPUs {where}, the deployment "
                     f"{theirs.slots_per_gpu[where].tolist()}")
    if mine.num_nodes != theirs.num_nodes:
        parts.append(f"{mine.num_nodes} node{'s' if mine.num_nodes != 1 else ''}, the deployment {theirs.num_nodes}")
    return "previous has " + "; ".join(parts)


def as_previous(previous, num_experts: int, deployment: Deployment, num_layers: int) -> np.ndarray:
    """The previous placement as ``phy2log [L, S]`` int64, checked against the new deployment."""
    if isinstance(previous, Placement):
        if previous.num_experts != num_experts:
            raise ValueError(f"previous has {previous.num_experts} experts, counts have {num_experts}")
        if previous.topology != deployment.topology:
            raise ValueError("previous must be planned on the deployment it is read on (the old one of a change): "
                             + _differs(previous.topology, deployment.topology))
        phy2log = previous.phy2log
    else:
        if type(previous).__module__.split(".")[0] == "torch":
            previous = previous.detach().cpu().numpy()
        try:
            phy2log, _ = check_placement(np.asarray(previous), num_experts, deployment.topology)
        except ValueError as exc:
            raise ValueError(f"previous: {exc}") from None
    if phy2log.shape[0] != num_layers:
        raise ValueError(f"previous has {phy2log.shape[0]} layers, counts have {num_layers}")
    # writable (a Placement's array is read-only): the kernels then get one compiled specialization
    return np.require(phy2log, dtype=np.int64, requirements="CW")


@dataclass(frozen=True)
class Carried:
    """The placement in service carried across a deployment change
    (:meth:`eplb.model.change.DeploymentChange.carry`), as the search sees it.

    Attributes:
        slots: ``[L, S]`` int64 with ``-1`` holes: what changed slots are counted against.
        recover_to: ``[L]`` the max GPU load the placement in service reached before the change,
            scaled to the GPUs after it (the same balancedness): the search does not spend copies
            to get below it times ``1 + tolerance``, only to get within the tolerance of a plan from
            scratch where that is higher (a relaxed hierarchy can balance far better than the
            deployment in service did). The tolerance applies to both (:meth:`target`): a
            hierarchical deployment that lost a GPU then ends within the tolerance of its balance
            before the loss, at fewer copies (bench/elastic.py, DeepSeek-V3 size, tolerance 0.005:
            3.25x the copy floor instead of 3.94x, balancedness 0.9259 for 0.9262 before).
        groups: the expert groups of a hierarchical deployment whose groups no longer all fit
            (planned without the rule): the search still puts no expert on a node that holds no
            expert of its group. ``None``: the deployment's own rule.
    """

    slots: np.ndarray
    recover_to: np.ndarray
    groups: int | None = None

    def rows(self, rows) -> "Carried":
        return Carried(np.ascontiguousarray(self.slots[rows]), self.recover_to[rows], self.groups)

    def target(self, fresh: np.ndarray, tolerance: float, paying: np.ndarray | None = None) -> np.ndarray:
        """``[L]`` the search's target across the change, from ``fresh [L]`` (a plan from scratch's
        peak, or a bound on it, times ``1 + tolerance``): where the service balanced worse than that
        (``recover_to`` above it), ``recover_to * (1 + tolerance)``, unless ``paying [L]`` (bool,
        :func:`copies_pay`) says the copies to reach ``fresh`` pay; elsewhere ``fresh``. A service
        within the tolerance of a fresh plan thus never lets a change loose another tolerance: a
        sequence of changes keeps the fresh plan's (bench/elastic.py, 2 -> 4 -> 8 -> 4 -> 2 nodes)."""
        worse = self.recover_to > fresh
        if paying is not None:
            worse &= ~paying
        return np.where(worse, self.recover_to * (1.0 + tolerance), fresh)


def copies_pay(weights: np.ndarray, carried: Carried, topology, fresh: np.ndarray) -> np.ndarray:
    """``[L]`` bool: across a change, whether reaching the fresh plan's target ``fresh [L]`` instead
    of the service's own balance (``carried.recover_to``) pays for its copies even if every slot
    changed: the gain ``(recover_to - fresh) / mean`` (in ``peak / mean``) above
    :data:`eplb.model.defaults.COPY_COST` (the price of one copy in ``peak / mean``) times the slots
    beyond the fewest any plan copies (``max(orphans, holes)``, counted against ``carried.slots``).

    A rack of two lost (144 GPUs of 2 slots, the 72 survivors taking 4, DeepSeek-V3 synthetic): the
    service balanced 0.876 (2 slots a GPU), a fresh plan 0.998; the re-plan kept 0.884 at 1.07x the
    copy floor and now reaches 0.986 at 1.09x (``bench/rack_nodes.py``). Never where the change
    relaxed a hierarchy (``carried.groups`` set): there a fresh plan beats the service's balance by
    spreading groups over nodes, whose off-node traffic a copy's price does not count (a
    hierarchical 32-GPU deployment that lost one GPU, 0.926 before, would go from 0.922 at 2.69x
    the floor to 0.942 at 3.19x, past bench/elastic.py's target of 3x)."""
    if carried.groups is not None:
        return np.zeros(weights.shape[0], bool)
    num_layers, num_experts = weights.shape
    slots = carried.slots
    held = slots >= 0
    present = np.array([np.unique(row[keep]).size for row, keep in zip(slots, held)], dtype=np.int64)
    floor = np.maximum((~held).sum(axis=1), num_experts - present)
    mean = weights.sum(axis=1) / max(int((topology.slots_per_gpu > 0).sum()), 1)
    gain = (carried.recover_to - fresh) / np.where(mean > 0, mean, 1.0)
    return (mean > 0) & (gain > COPY_COST * (slots.shape[1] - floor))


RESTARTS = ("steepest", "recount", "regroup", "ungrouped")  # the searches tried where the first one stalls
SPREAD_WARNING = "previous spreads expert groups over nodes"  # opens the warning that max_moves cannot gather them
TINY_MIGRATION_SLOTS = 16  # layers with at most this many slots also get an exhaustive search for fewer changes
BOUND_FIRST_SLOTS = 128
"""Layers with at least this many slots take the bound-first search (:func:`near_bound`). There the
plan from scratch is most of a rebalance's time (DeepSeek-V3 size: 11 -> 6.6 ms hierarchical, 19
-> 10 ms global), and the tighter cap costs few moves (3.8 -> 4.0% of the slots per rebalance
hierarchical, 8.8 -> 9.0% global, bench/serving.py). In smaller layers one slot is a large share
of the layer, every avoided move matters (gpt-oss-20b on 40 slots: 27.4% -> 27.9%), and planning
from scratch takes a few milliseconds anyway. At 2 slots per GPU few layers get within the
tolerance of the cheap bound (DeepSeek-V3 size, decode loads with the prefill plan in service:
0 of 58 at 288/144, 0-1 of 58 at 512/256, where it cost 15 and 200 ms of a 130 and 690 ms plan;
since the search skips what cannot fit the move budget, about a tenth of a 17 ms and a 20th of a
36 ms decision, bench/rack.py), yet it stays: the one layer that got there at 512/256 (the Balancer's window) reached 0.9716
balancedness at 181 copies, where without the stage the Balancer's plan reached 0.9010 at 91 (its
mean over layers 0.002 lower), bench/rack.py's loads."""
TINY_WORK = 1_300_000  # placements that search checks per layer at most (~40 ms if it finds none)


def migrate(weights: np.ndarray, deployment: Deployment, previous: np.ndarray, scratch: np.ndarray, *,
            tolerance: float | None = PLAN_TOLERANCE, max_moves=None, exact: dict | None = None,
            carried: Carried | None = None) -> tuple[np.ndarray, dict]:
    """Choose, per layer, a placement close to ``previous`` and about as balanced as ``scratch``.

    Args:
        weights: ``[L, E]`` float64 loads to plan for.
        deployment: topology and groups (with ``deployment.hierarchical`` no move puts an expert on a
            node holding no expert of its group, and nodes are relabelled as a whole).
        previous: ``[L, S]`` int64, the placement in service.
        scratch: ``[L, S]`` int64, a plan from scratch for ``weights`` (the balance reference).
        tolerance: accept a max GPU load up to ``(1 + tolerance)`` times the one of ``scratch``
            (``None``: as balanced as the budget allows).
        max_moves: at most this many slots change per layer (``None``: no limit).
        exact: ``None``, or the options (``time_limit``, ``workers``) of the CP-SAT model of
            :mod:`eplb.planning.exact_migration`, warm-started from the search's result: the fewest changed
            slots within the tolerance (and the budget), proven per layer where the solver finishes.
        carried: across a deployment change, the placement in service carried (:class:`Carried`; the
            target from its :meth:`Carried.target`): changes are counted against it.
    Returns:
        ``phy2log [L, S]`` and info: ``slots_changed [L]``, ``scratch_max_load [L]``,
        ``from_scratch [L]`` bool (the layer took the relabelled fresh plan: the local search
        missed the target and the fresh plan fits the budget); with ``exact`` also
        ``fewest_changes_proven [L]`` bool and ``fewest_changes_bound [L]`` (proven fewest changes
        within the tolerance; 0 where unknown).
    """
    topology = deployment.topology
    (num_layers, num_experts), num_slots = weights.shape, topology.num_slots
    tolerance, budget = check_trade_off(tolerance, max_moves, num_slots)

    scratch_peak = _peaks(weights, scratch, topology)
    target = np.full(num_layers, -1.0) if tolerance is None else scratch_peak * (1.0 + tolerance)
    if carried is not None and tolerance is not None:  # across a change: recover; improve only where copies pay
        target = carried.target(target, tolerance, copies_pay(weights, carried, topology, target))
    layout = search_layout(deployment, num_experts, None if carried is None else carried.groups)
    budgets = np.full(num_layers, budget, np.int64)
    # a layer whose previous placement spreads a group over nodes takes the relabelled fresh plan (below)
    spread = groups_spread(previous, deployment, num_experts)
    kept, reference = np.flatnonzero(~spread), previous if carried is None else carried.slots
    local, local_changes = previous.copy(), (previous != reference).sum(axis=1)
    local_peak = np.full(num_layers, np.inf)
    if kept.size:
        # per_change given (True, the default) in every call: one compiled specialization
        local[kept], local_changes[kept], _ = search_near_previous(
            np.ascontiguousarray(weights[kept]), np.ascontiguousarray(previous[kept]),
            np.ascontiguousarray(reference[kept]), layout, target[kept], budgets[kept], 2 * num_slots, True)
        local_peak[kept] = _peaks(weights[kept], local[kept], topology)
    _restart_where_missed(weights, deployment, previous, scratch, layout=layout, target=target, budget=budget,
                          budgets=budgets, spread=spread, best=(local, local_changes, local_peak), reference=reference,
                          ungrouped=getattr(carried, "groups", None) is not None)
    # the relabelled fresh plan is only needed where the local search missed the target
    missed = np.flatnonzero(local_peak > target)
    if carried is None and missed.size:  # not where no fresh plan's relabelling can fit the budget (exact)
        hopeless = move_reach.beyond_budget(weights[missed], previous[missed], topology,
                                  np.maximum(target, scratch_peak)[missed], budget)
        missed = missed[~hopeless | spread[missed]]  # (a spread layer takes the fresh plan whatever it costs)
    relabelled, fresh_changes, fresh_peak, matched = _relabelled_fresh(
        weights, deployment, previous, scratch, missed, fallback=local, reference=reference, layout=layout,
        target=target, budgets=budgets)
    use_fresh = spread.copy()
    for layer in kept:
        use_fresh[layer] = fresh_changes[layer] <= budget and _better(
            fresh_peak[layer], fresh_changes[layer], local_peak[layer], local_changes[layer], target[layer])
    over = np.flatnonzero(spread & (fresh_changes > budget))
    if over.size:
        warnings.warn(
            f"{SPREAD_WARNING} in layers {over.tolist()}: keeping every group on one "
            f"node changes {fresh_changes[over].tolist()} slots there, more than max_moves={budget}",
            RuntimeWarning, stacklevel=5)  # the caller of eplb.plan
    phy2log = np.where(use_fresh[:, None], relabelled, local)
    changes = np.where(use_fresh, fresh_changes, local_changes)
    _keep_spread(phy2log, changes, deployment, reference, dict(zip(missed.tolist(), matched)), use_fresh, budget)
    if (topology.num_slots <= TINY_MIGRATION_SLOTS and not deployment.hierarchical and tolerance is not None
            and reference is previous):  # (that search counts changes against a whole placement)
        _fewer_changes_on_small_layers(weights, previous, deployment, target=target, budget=budget, phy2log=phy2log,
                                       changes=changes, chosen_peak=np.where(use_fresh, fresh_peak, local_peak))
    info = {}
    if exact is not None:
        from .exact_migration import fewest_changes

        options = {k: v for k, v in exact.items() if k in ("time_limit", "workers")}
        phy2log, solved = fewest_changes(weights, deployment, reference, np.ascontiguousarray(phy2log),
                                         cap=None if tolerance is None else target,
                                         max_moves=max_moves if max_moves is None else budget, **options)
        changes = solved["slots_changed"]
        info = {"fewest_changes_proven": solved["proven"], "fewest_changes_bound": solved["fewest_changes_bound"]}
    info = {
        **info,
        "slots_changed": changes,
        "scratch_max_load": scratch_peak,
        "from_scratch": use_fresh,
        "regrouped": spread,
        "tolerance": tolerance,
        "max_moves": max_moves,
    }
    return phy2log, info


def _relabelled_fresh(weights, deployment, previous, scratch, missed, *, fallback, reference, layout, target,
                      budgets):
    """The fresh plan ``scratch [L, S]`` of the layers ``missed``, relabelled to keep what stays in
    place (:func:`eplb.kernels.search.relabel.relabel_like`), then with every changed slot the
    target allows given back its previous expert (the search without steps). Returns ``rows [L,
    S]`` (``fallback``'s row elsewhere), ``changes [L]`` against ``reference`` (``S + 1``
    elsewhere), ``peaks [L]`` (inf elsewhere) and the relabelled rows before any slot was given
    back (``[len(missed), S]``)."""
    topology = deployment.topology
    num_layers, num_slots = previous.shape
    rows, changes = fallback.copy(), np.full(num_layers, num_slots + 1, np.int64)
    peaks, matched = np.full(num_layers, np.inf), np.empty((0, num_slots), np.int64)
    if missed.size:
        matched, _ = relabel_like(np.ascontiguousarray(scratch[missed], dtype=np.int64),
                                  np.ascontiguousarray(previous[missed]), topology.slot_offsets,
                                  topology.gpus_per_node, deployment.hierarchical, weights.shape[1])
        rows[missed], changes[missed], _ = search_near_previous(
            weights[missed], matched, np.ascontiguousarray(reference[missed]), layout, target[missed],
            budgets[missed], 0, True)
        peaks[missed] = _peaks(weights[missed], rows[missed], topology)
    return rows, changes, peaks, matched


def _keep_spread(phy2log, changes, deployment, reference, fresh_rows: dict, use_fresh, budget: int) -> None:
    """Where a layer took the relabelled fresh plan (``use_fresh [L]``; ``fresh_rows``: layer ->
    row, before any slot was given back; it keeps the spread rule of :mod:`eplb.planning.spread`)
    and giving slots back broke the rule (rare: the new replica counts no longer force a doubled
    replica the fresh plan's counts forced, on uneven slots or near-zero loads), take that row
    instead when it fits the ``budget`` of changed slots. ``phy2log [L, S]`` and ``changes [L]`` (against ``reference [L,
    S]``) are updated in place. A doubled replica carried from the placement in service is the
    search's to keep (its moves never add one). Costs one sort when nothing is doubled."""
    gpu = deployment.topology.gpu_of_slot
    keys = np.sort(gpu[None, :] * (deployment.num_experts + 1) + phy2log, axis=1)
    for layer in np.flatnonzero((np.diff(keys, axis=1) == 0).any(axis=1)):
        row = fresh_rows.get(int(layer)) if use_fresh[layer] else None
        if row is None or not avoidable_doubled(phy2log[layer:layer + 1], deployment)[0]:
            continue
        changed = int((row != reference[layer]).sum())
        if changed <= budget:
            phy2log[layer], changes[layer] = row, changed


def _restart_where_missed(weights, deployment, previous, scratch, *, layout, target, budget, budgets, spread,
                          best, reference, ungrouped=False) -> None:
    """Where the search from the previous placement stalls above the target, search again: (a) by
    steepest descent, (b) from the previous placement with the fresh plan's replica counts, and in
    hierarchical mode (c) with whole groups moved to the nodes the fresh plan gives them; (d) with
    ``ungrouped`` (a relaxed hierarchy across a change, whose groups only the search keeps on their
    home nodes: ``layout`` has them, ``deployment`` not), from the best so far with experts free to
    leave their group's nodes, before the fresh plan, which keeps no group anywhere, is taken
    (DeepSeek-V3 size, a GPU lost, 4 nodes / 8 groups: one layer took the relabelled fresh plan at
    219 copies where this reaches the target at 41). A restart replaces a layer of ``best = (local [L, S], local_changes [L], local_peak
    [L])`` (updated in place) where it is better and within the layer's budget; changes are counted
    against ``reference [L, S]`` (:func:`migrate`)."""
    local, local_changes, local_peak = best
    topology = deployment.topology
    num_slots = topology.num_slots
    for restart in RESTARTS:
        if restart == "regroup" and not (deployment.hierarchical and topology.num_nodes > 1):
            continue
        if restart == "ungrouped" and not ungrouped:
            continue
        missed = np.flatnonzero((local_peak > target) & ~spread)
        if restart == "steepest":
            starts = [(layer, previous[layer]) for layer in missed]
        elif restart == "ungrouped":
            starts = [(layer, local[layer]) for layer in missed]
        elif restart == "recount":
            starts = _recounted(weights, previous, scratch, missed, layout, deployment.hierarchical)
        else:
            starts = [(layer, _regrouped(weights[layer], previous[layer], scratch[layer], topology,
                                         deployment.num_groups)) for layer in missed]
        starts = [(layer, row) for layer, row in starts if row is not None]
        if restart == "recount" and starts and reference is previous:
            starts = move_reach.within_reach(weights, previous, topology, starts, target, budget)
        if starts:
            rows = np.array([layer for layer, _ in starts])
            tried, tried_changes, _ = search_near_previous(
                weights[rows], np.stack([row for _, row in starts]), np.ascontiguousarray(reference[rows]),
                search_layout(deployment, weights.shape[1]) if restart == "ungrouped" else layout, target[rows],
                budgets[rows], 2 * num_slots, restart != "steepest")
            tried_peak = _peaks(weights[rows], tried, topology)
            for i, layer in enumerate(rows):
                if tried_changes[i] <= budget and _better(tried_peak[i], tried_changes[i], local_peak[layer],
                                                          local_changes[layer], target[layer]):
                    local[layer], local_changes[layer], local_peak[layer] = tried[i], tried_changes[i], tried_peak[i]


def _fewer_changes_on_small_layers(weights, previous, deployment, *, target, budget, phy2log, changes,
                                   chosen_peak) -> None:
    """Small layers: an exhaustive search for fewer changed slots within the target (a fixed amount
    of work per layer); ``phy2log [L, S]`` and ``changes [L]`` are updated in place. The search
    keeps each GPU's doubled replicas to those of ``previous`` but not the spread rule (its new
    replica counts may make a kept doubled replica avoidable, or bring an expert doubled on a GPU
    beyond the cap elsewhere): a row that breaks the rule where the chosen one keeps it is not taken."""
    topology = deployment.topology
    num_layers, num_slots = phy2log.shape
    for layer in range(num_layers):
        met = chosen_peak[layer] <= target[layer]
        most = int(changes[layer]) if met else budget + 1  # missed: any fit within the budget is better
        if most < 2:
            continue
        row, fewer = fewest_changes_search(weights[layer], previous[layer], topology.slot_offsets, target[layer],
                                           min(most, num_slots + 1), TINY_WORK)
        if (fewer > 0 and _peaks(weights[layer:layer + 1], row[None], topology)[0] <= target[layer]
                and avoidable_doubled(row[None], deployment)[0] <= avoidable_doubled(phy2log[layer:layer + 1],
                                                                                     deployment)[0]):
            phy2log[layer], changes[layer] = row, fewer


def plan_near(weights: np.ndarray, deployment: Deployment, previous: np.ndarray | None, *, method: str,
              tolerance: float | None = PLAN_TOLERANCE, max_moves=None, options: dict | None = None,
              threads: int = 1, carried: Carried | None = None) -> tuple[np.ndarray, dict]:
    """``phy2log [L, S]`` and info for ``weights [L, E]``: from scratch with ``method``, then (with
    ``previous [L, S]``) close to ``previous`` via :func:`migrate`. No bounds are computed: this is
    the fast path for serving engines (:class:`eplb.Balancer`, the engine adapters).

    ``threads > 1`` plans contiguous chunks of layers on that many threads (the kernels release
    the GIL). Every layer's row depends on that layer alone, so the result is the same for any
    number of threads (property-tested); only the wall time changes. ``carried``: across a
    deployment change, the placement in service carried (:func:`migrate`), ``previous`` its repair.
    A layer whose ``previous`` keeps the spread rule keeps it (:func:`keep_rule`).
    """
    start = time.perf_counter()
    threads = as_int(threads, "threads", minimum=1)
    chunks = np.array_split(np.arange(weights.shape[0]), min(threads, weights.shape[0]))
    if len(chunks) == 1:
        phy2log, info = _plan_layers(weights, deployment, previous, method, tolerance, max_moves, options, carried)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(chunks)) as pool:
            parts = list(pool.map(lambda rows: _plan_layers(
                weights[rows], deployment, None if previous is None else previous[rows], method, tolerance, max_moves,
                options, None if carried is None else carried.rows(rows)), chunks))
        phy2log = np.concatenate([part for part, _ in parts])
        info = _merge_infos([part_info for _, part_info in parts])
    if previous is not None:
        reference = previous if carried is None else carried.slots
        if keep_rule(weights, deployment, previous, phy2log, reference).size:
            info = {**info, "slots_changed": (phy2log != reference).sum(axis=1)}
    return phy2log, {**info, "time_s": time.perf_counter() - start}


def keep_rule(weights: np.ndarray, deployment: Deployment, start: np.ndarray, phy2log: np.ndarray,
              reference: np.ndarray) -> np.ndarray:
    """Where ``phy2log [L, S]``, searched from ``start [L, S]``, breaks the spread rule
    (:mod:`eplb.planning.spread`) and ``start`` keeps it, the row brought within the cap
    (:func:`eplb.planning.spread.within_cap`, few slots changed against ``reference [L, S]``),
    else ``start``'s row; ``phy2log`` is updated in place. Returns the layers changed.

    The searches give no GPU a second replica of an expert, which keeps the rule on GPUs with at
    most as many slots as their domain has experts; a GPU with more must double one, and a search
    move that then gives that expert a replica on every other GPU too breaks the cap (slots 3, 4, 2
    for 3 experts: replica counts 2, 4, 3). Costs one sort when nothing is doubled."""
    gpu = deployment.topology.gpu_of_slot
    keys = np.sort(gpu[None, :] * (deployment.num_experts + 1) + phy2log, axis=1)
    fixed = []
    for layer in np.flatnonzero((np.diff(keys, axis=1) == 0).any(axis=1)).tolist():
        rows = slice(layer, layer + 1)
        if not avoidable_doubled(phy2log[rows], deployment)[0] or avoidable_doubled(start[rows], deployment)[0]:
            continue
        row = within_cap(phy2log[layer], weights[layer], deployment, reference[layer])
        phy2log[layer] = start[layer] if row is None else row
        fixed.append(layer)
    return np.asarray(fixed, np.int64)


def _plan_layers(weights, deployment, previous, method, tolerance, max_moves, options, carried=None):
    """:func:`plan_near` on one chunk of layers (no timing)."""
    options = options or {}
    if previous is None:
        return get_method(method)(weights, deployment, **options)
    num_layers = weights.shape[0]
    within = np.zeros(num_layers, bool)
    if _bound_first(deployment, tolerance, method):
        tolerance, budget = check_trade_off(tolerance, max_moves, deployment.topology.num_slots)
        near, near_changes, within = near_bound(weights, deployment, previous, tolerance=tolerance, budget=budget,
                                                carried=carried)
    rows = np.flatnonzero(~within)
    # the other layers: plan from scratch (the reference), then migrate towards it
    scratch, info = get_method(method)(np.ascontiguousarray(weights[rows]), deployment, **options)
    phy2log, moved = migrate(np.ascontiguousarray(weights[rows]), deployment, np.ascontiguousarray(previous[rows]),
                             scratch, tolerance=tolerance, max_moves=max_moves,
                             exact=options if method == "exact" else None,
                             carried=None if carried is None else carried.rows(rows))
    if rows.size == num_layers:
        return phy2log, {**info, **moved, "within_bound": within}
    changes, scratch_peak, from_scratch = near_changes.copy(), np.full(num_layers, np.nan), np.zeros(num_layers, bool)
    near[rows], changes[rows] = phy2log, moved["slots_changed"]
    scratch_peak[rows], from_scratch[rows] = moved["scratch_max_load"], moved["from_scratch"]
    return near, {**info, **moved, "slots_changed": changes, "scratch_max_load": scratch_peak,
                  "from_scratch": from_scratch, "within_bound": within}


def _bound_first(deployment: Deployment, tolerance: float | None, method: str) -> bool:
    """Whether :func:`plan_near` tries :func:`near_bound` before planning from scratch: with a
    tolerance, on layers of at least :data:`BOUND_FIRST_SLOTS` slots, except for the exact method
    (its reference is its own plan)."""
    return tolerance is not None and method != "exact" and deployment.topology.num_slots >= BOUND_FIRST_SLOTS


def _merge_infos(infos: list[dict]) -> dict:
    """The info of the whole plan from the infos of its chunks of layers: per-layer arrays and lists
    concatenated, counts of layers summed, flags or-ed, settings (equal in every chunk) kept."""
    merged = {}
    for key, first in infos[0].items():
        values = [info[key] for info in infos]
        if isinstance(first, np.ndarray) and first.ndim >= 1:
            merged[key] = np.concatenate(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        elif isinstance(first, bool):  # flags ("interrupted") or settings equal in every chunk
            merged[key] = any(values)
        elif isinstance(first, (int, np.integer)) and key.startswith("layers_"):
            merged[key] = int(sum(values))
        else:
            merged[key] = first
    return merged


def check_trade_off(tolerance, max_moves, num_slots: int) -> tuple[float | None, int]:
    """``(tolerance, budget of changed slots per layer)`` checked: a clear ``ValueError`` otherwise."""
    if tolerance is not None:
        tolerance = float(tolerance)
        if not np.isfinite(tolerance) or tolerance < 0:
            raise ValueError(f"tolerance must be a non-negative number or None, got {tolerance}")
    if tolerance is None and max_moves is None:
        raise ValueError("give tolerance, max_moves or both (else there is no trade-off to make)")
    return tolerance, num_slots if max_moves is None else as_int(max_moves, "max_moves", minimum=0)


def search_layout(deployment: Deployment, num_experts: int, groups: int | None = None) -> SearchLayout:
    """The deployment as :func:`eplb.kernels.search.few_changes.search_near_previous` takes it; ``groups``:
    keep experts on nodes holding their group, ``groups`` of them, whatever the deployment's rule."""
    topology = deployment.topology
    if deployment.hierarchical or groups is not None:
        num_groups = deployment.num_groups if groups is None else groups
        group_of_expert = np.arange(num_experts, dtype=np.int64) // (num_experts // num_groups)
    else:
        group_of_expert = np.zeros(num_experts, np.int64)
        num_groups = 1
    return SearchLayout(topology.gpu_of_slot, topology.slot_offsets, topology.node_of_gpu, group_of_expert,
                        bool(deployment.hierarchical or groups is not None), int(num_groups))


def reference_bound(weights: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L]`` a lower bound on the max load of any plan from scratch, cheap enough for every
    rebalance: the average bound, and in hierarchical mode the bound that the group -> node search
    proves (about 2 ms at DeepSeek-V3 size; the full :func:`eplb.analysis.bounds.lower_bound` costs ~5 ms)."""
    bound = average_bound(weights, deployment.topology)
    if deployment.hierarchical:

        _, proven = group_assignment(weights, deployment, lower=bound)
        bound = np.maximum(bound, proven)
    return bound


def near_bound(weights: np.ndarray, deployment: Deployment, previous: np.ndarray, *, tolerance: float,
               budget: int, carried: Carried | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first search of :func:`migrate` with a lower bound as the reference: improve ``previous``
    until its max load is within ``(1 + tolerance)`` of :func:`reference_bound`, at most ``budget``
    changed slots per layer (across a deployment change, counted against ``carried``, the target
    from its :meth:`Carried.target`: :func:`migrate`).

    A layer that gets there is within the tolerance of any plan from scratch (none is lighter than
    the bound), so it needs none. Returns ``phy2log [L, S]``, ``slots_changed [L]`` and
    ``within [L]`` bool (the layers that got there).
    """
    num_layers, num_experts = weights.shape
    reference = previous if carried is None else carried.slots
    near, changes, within = previous.copy(), (previous != reference).sum(axis=1), np.zeros(num_layers, bool)
    rows = np.flatnonzero(~groups_spread(previous, deployment, num_experts))  # the others must move groups: see migrate
    if rows.size == 0:
        return near, changes, within
    if rows.size < num_layers:
        weights, previous = np.ascontiguousarray(weights[rows]), np.ascontiguousarray(previous[rows])
        reference = np.ascontiguousarray(reference[rows])
        carried = carried.rows(rows) if carried is not None else None
    # writable, as in migrate's calls (a placement's arrays are read-only): one compiled specialization
    previous = np.require(previous, np.int64, "CW")
    reference = np.require(reference, np.int64, "CW")
    target = reference_bound(weights, deployment) * (1.0 + tolerance)
    if carried is not None:
        target = carried.target(target, tolerance, copies_pay(weights, carried, deployment.topology, target))
    near[rows], changes[rows], _ = search_near_previous(
        weights, previous, reference, search_layout(deployment, num_experts, None if carried is None else carried.groups),
        target,
        np.full(rows.size, budget, np.int64), 2 * deployment.topology.num_slots, True)
    within[rows] = _peaks(weights, near[rows], deployment.topology) <= target
    return near, changes, within


def groups_spread(phy2log: np.ndarray, deployment: Deployment, num_experts: int) -> np.ndarray:
    """``[L]`` bool: the layers of ``phy2log [L, S]`` where some expert group has replicas on more
    than one node (always False unless ``deployment.hierarchical``)."""
    num_layers = phy2log.shape[0]
    if not deployment.hierarchical or deployment.topology.num_nodes == 1:
        return np.zeros(num_layers, bool)
    topology = deployment.topology
    group = phy2log // (num_experts // deployment.num_groups)  # [L, S]
    node = topology.node_of_gpu[topology.gpu_of_slot]  # [S]
    present = np.zeros((num_layers, deployment.num_groups, topology.num_nodes), bool)
    present[np.arange(num_layers)[:, None], group, node[None, :]] = True
    return (present.sum(axis=2) > 1).any(axis=1)


def _better(peak_a, changes_a, peak_b, changes_b, target) -> bool:
    """Whether candidate a beats b: meeting the target first, then fewer changes (both meet it) or
    a lower peak (neither does)."""
    ok_a, ok_b = peak_a <= target, peak_b <= target
    if ok_a != ok_b:
        return bool(ok_a)
    if ok_a:
        return bool(changes_a < changes_b)
    return bool(peak_a < peak_b)


def _recounted(weights, previous, scratch, layers, layout: SearchLayout, hierarchical: bool) -> list:
    """Starts for the local search of ``layers``: the previous placement with the replica counts
    of the fresh plan (:func:`eplb.kernels.search.recount.recounted_starts`: surplus replicas leave
    the most loaded GPUs first, the freed slots go to the experts short of replicas, largest
    per-replica load first, lightest GPU first, on the node of the expert's group in hierarchical
    mode). ``weights [L, E]``, ``previous``, ``scratch [L, S]``; returns ``[(layer, row [S])]``
    for the layers that have one."""
    if layers.size == 0:
        return []
    rows, found = recounted_starts(
        np.ascontiguousarray(weights[layers], dtype=np.float64), np.ascontiguousarray(previous[layers], dtype=np.int64),
        np.ascontiguousarray(scratch[layers], dtype=np.int64), layout.gpu_of_slot, layout.slot_offsets,
        layout.node_of_gpu, layout.group_of_expert, bool(hierarchical))
    return [(layer, rows[i]) for i, layer in enumerate(layers) if found[i]]


def _regrouped(weights: np.ndarray, previous: np.ndarray, scratch: np.ndarray, topology, num_groups: int):
    """A start for the local search of one layer: every group on the node the fresh plan gives it
    (nodes matched to keep the most groups in place), groups that stay keep their slots, arriving
    groups take the slots of leaving ones (one replica per expert, then the largest per-replica
    loads get the spare slots). ``None`` if a placement does not keep its groups on one node.

    Args:
        weights: ``[E]``; previous, scratch: ``[S]`` placements keeping each group on one node.
    Returns:
        ``[S]`` int64 or ``None``.
    """
    num_experts = weights.shape[0]
    size = num_experts // num_groups
    gpu_of_slot, offsets = topology.gpu_of_slot, topology.slot_offsets
    node_of_slot = topology.node_of_gpu[gpu_of_slot]
    group = np.arange(num_experts) // size

    def node_of_group(row):
        present = np.zeros((num_groups, topology.num_nodes), bool)
        present[group[row], node_of_slot] = True
        if (present.sum(axis=1) != 1).any():
            return None
        return np.argmax(present, axis=1)

    old_node, new_node = node_of_group(previous), node_of_group(scratch)
    if old_node is None or new_node is None:
        return None
    num_nodes = topology.num_nodes
    per_node = topology.slots_per_gpu.reshape(num_nodes, -1)
    cost = np.zeros((num_nodes, num_nodes))
    for a in range(num_nodes):
        for b in range(num_nodes):
            if not np.array_equal(per_node[a], per_node[b]):
                cost[a, b] = 1e9
            else:
                cost[a, b] = -np.sum((new_node == a) & (old_node == b))
    new_node = min_cost_assignment(cost)[new_node]  # in the previous placement's node labels
    row = previous.copy()
    for n in range(num_nodes):
        arriving = [e for g in np.flatnonzero((new_node == n) & (old_node != n)) for e in range(g * size, (g + 1) * size)]
        slots = np.flatnonzero(node_of_slot == n)
        free = [s for s in slots if new_node[group[row[s]]] != n]  # leaving groups' slots
        if not arriving and not free:
            continue
        if len(free) < len(arriving):
            # take spare replicas of staying experts, the lightest per replica first
            counts = np.bincount(row[slots], minlength=num_experts)
            spare = [s for s in slots if new_node[group[row[s]]] == n and counts[row[s]] > 1]
            spare.sort(key=lambda s: (weights[row[s]] / counts[row[s]], s))
            for s in spare:
                if len(free) >= len(arriving):
                    break
                if counts[row[s]] > 1:
                    counts[row[s]] -= 1
                    free.append(s)
        if len(free) < len(arriving):
            return None
        free.sort()
        for s, e in zip(free, arriving):
            row[s] = e
        counts = np.bincount(row[slots][[new_node[group[e]] == n for e in row[slots]]], minlength=num_experts)
        members = np.flatnonzero(new_node[group] == n)
        on_gpu = np.zeros(num_experts, bool)
        for s in free[len(arriving):]:
            on_gpu[:] = False
            on_gpu[row[offsets[gpu_of_slot[s]]:offsets[gpu_of_slot[s] + 1]]] = True
            allowed = (counts[members] > 0) & ~on_gpu[members]  # no second replica on one GPU
            if not allowed.any():
                return None
            e = members[np.argmax(np.where(allowed, weights[members] / np.maximum(counts[members], 1), -1.0))]
            row[s] = e
            counts[e] += 1
    return row


def warm_search_kernels(topology) -> None:
    """Compile (or load from the cache) the kernels :func:`migrate` calls only on some loads (the
    relabelled fresh plan, the node matching of the regroup restart, the exhaustive search of small
    layers), with the argument types it passes; the rest is compiled by any migration-aware plan."""
    min_cost_assignment(np.zeros((2, 2)))
    row = np.arange(topology.num_slots, dtype=np.int64)[None, :]
    relabel_like(np.ascontiguousarray(row), np.ascontiguousarray(row), topology.slot_offsets, topology.gpus_per_node,
                 False, topology.num_slots)
    if topology.num_slots <= TINY_MIGRATION_SLOTS:
        weights = np.ones((1, topology.num_slots))
        previous = np.zeros((1, topology.num_slots), np.int64)
        fewest_changes_search(weights[0], previous[0], topology.slot_offsets, np.ones(1)[0], 1, TINY_WORK)


def _peaks(weights: np.ndarray, phy2log: np.ndarray, topology) -> np.ndarray:
    """``[L]`` max GPU load of ``phy2log`` on ``weights``."""
    if phy2log.shape[0] == 0:
        return np.zeros(0)
    return peak_loads(weights, phy2log, topology)

"""Placements for a series of windows under uniform split: lower the expected step time.

An engine that splits each expert's tokens evenly among its replicas (vLLM, TensorRT-LLM) waits,
in every window, for its most loaded GPU. :func:`improve_expected_peak` takes a placement (e.g.
the plan of the summed counts) and searches, per layer, for one whose weighted mean over the
windows of ``peak / mean`` GPU load is lower: first the best swaps between each window's most
loaded GPU and a light one (:func:`eplb.kernels.split.expected_peak.pair_descent`, the bulk of the gain in
milliseconds), then random swaps and redundant replicas moved from one expert to another
(:func:`eplb.kernels.split.expected_peak.improve_expected_peak`).

Held out (leave one workload out, next window), the search serves windows whose hot experts differ
in structure (workloads of real traces, drifting popularity) much better than the plan of the
summed counts. When windows differ only by independent noise around one popularity, no fixed
placement can do much better than the summed counts and the search only fits the noise; ``folds``
checks by cross-validation over the windows which case a series is, per layer (or group of
layers), on equal terms (the start and the search both made without the windows they are judged
on), and keeps the start, or only the first steps of the search, where the search does not pay on
windows it has not seen.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..model._validation import as_counts, validated_counts
from ..kernels.split.expected_peak import improve_expected_peak as _improve
from ..kernels.split.expected_peak import InService, pair_descent
from ..kernels.plumbing.layout import replica_counts
from ..analysis.loads import peak_loads
from ..analysis.placement import uniform_shares
from ..analysis.windows import check_window_weights

DEFAULT_SWAPS = 200  # best-swap iterations per layer (pair descent)
DEFAULT_ITERATIONS = 800  # random moves per layer after it (swaps and replica moves)
DEFAULT_ANCHOR = 0.25
# The anchor (the windows' weighted sum joined as one more window) weighs at least DEFAULT_ANCHOR and
# 1 / sqrt(T) with T windows of positive weight (3 windows: 0.58, 5: 0.45, 16 and more: 0.25): the
# fewer the windows, the less their differences tell of the next one's (a mean's standard error
# goes as 1 / sqrt(T)), so the search is pulled harder towards the average traffic. Held out
# (bench/robust_default.py), against 0.25 for every T: OLMoE's 6 domains 0.723 -> 0.780 (worst
# 0.614 -> 0.696), its 4-domain series from -0.005 below the summed plan (2 of 3 series below
# -0.002) to +0.005 (none); gpt-oss-20b's 11 benchmarks 0.852 -> 0.847, its 4 subject categories
# +0.032 -> +0.017 over the summed plan (worst +0.002 -> +0.008); series of 16 windows unchanged.
DEFAULT_FOLDS = 4
CHECK_LAYERS = 6  # the cross-validation check searches at most this many layers (evenly spread)
# Before any search, a layer whose windows of token counts look like draws from one popularity
# (a chi-square test of homogeneity, standardised, below NOISE_Z: see sampling_noise_layers) keeps
# the start: no placement serves pure sampling noise better than the plan of the sum. Windows of
# real traffic that differ by workload score far above it (3 or 4 workloads of the real traces:
# 515 at the least, 22,000 in the median layer), so a strict level costs them nothing and keeps a
# noise layer from slipping through by chance (bench/robust_default.py, --decision-only).
NOISE_Z = 4.0
# A step of the search is then kept for a layer only when it serves so many of the held-out
# windows of the cross-validation better than the start that a coin would do so with probability
# at most SIGN_TEST (3 windows: all 3; 12 windows: 9), and its mean gain exceeds DECISION_Z
# standard errors. Looser (0.5 and 0), measured with the anchor at 0.25 for every T, served the
# fourth of 3 real workloads 0.01-0.02 better (gpt-oss-20b, OLMoE) and OLMoE's 6 domains 0.745
# instead of 0.723 on the mean, but its worst domain at 0.561 instead of 0.614
# (bench/robust_default.py): not yet a clear win.
SIGN_TEST = 0.2
DECISION_Z = 1.0


def gpu_zones(deployment) -> np.ndarray:
    """``[G]`` int64 zone of each GPU, which moves stay inside: its node when groups stay on their
    node, else 0."""
    topology = deployment.topology
    if deployment.hierarchical:
        return np.ascontiguousarray(topology.node_of_gpu, dtype=np.int64)
    return np.zeros(topology.num_gpus, np.int64)


def slot_zones(deployment) -> np.ndarray:
    """``[S]`` int64 zone of each slot (:func:`gpu_zones` of its GPU)."""
    return np.ascontiguousarray(gpu_zones(deployment)[deployment.topology.gpu_of_slot])


class Hedged(NamedTuple):
    """The result of :func:`hedge`: ``phy2log [L, S]`` int64, ``shares [L, S]`` float64 (the
    fraction of its expert's tokens each slot takes), the objective ``before [L]`` / ``after [L]``
    (with the anchor window), ``searched`` (False: the start unchanged) and ``steps [L]`` int64,
    how many of the search's steps (:func:`search_steps`) each layer kept (0: cross-validation
    kept the start)."""

    phy2log: np.ndarray
    shares: np.ndarray
    before: np.ndarray
    after: np.ndarray
    searched: bool
    steps: np.ndarray


def improve_expected_peak(series, phy2log, deployment, window_weights=None, *, swaps: int = DEFAULT_SWAPS,
                          iterations: int = DEFAULT_ITERATIONS, replica_moves: bool = True, seed: int = 1,
                          anchor: float | None = None, folds: int = DEFAULT_FOLDS):
    """Search from ``phy2log`` for a placement with a lower expected uniform-split peak on ``series``
    (:func:`hedge` with an even split and no placement in service).

    Returns:
        ``phy2log [L, S]`` int64 (a new array) and ``(before [L], after [L])`` float64, the
        objective searched (with the anchor window) before and after.
    """
    result = hedge(as_counts(series, "series", ndims=(2, 3)), phy2log, deployment, window_weights, swaps=swaps, iterations=iterations,
                   replica_moves=replica_moves, seed=seed, anchor=anchor, folds=folds)
    return result.phy2log, (result.before, result.after)


def hedge(series, phy2log, deployment, window_weights=None, *, shares=None, previous=None, copy_cost: float = 0.0,
          swaps: int = DEFAULT_SWAPS, iterations: int = DEFAULT_ITERATIONS, replica_moves: bool = True,
          seed: int = 1, anchor: float | None = None, folds: int = DEFAULT_FOLDS, start_of=None) -> Hedged:
    """Search from ``phy2log`` for a placement with a lower expected peak over the windows of ``series``.

    Per layer, the objective is the weighted mean over windows of ``max GPU load / mean GPU load``,
    each slot taking a fixed fraction of its expert's tokens (``1 / logcnt``, an even split, or the
    given ``shares``); windows are compared at the same total, so a long window does not outweigh a
    short one. Moves: first ``swaps`` best swaps between a window's most loaded GPU and a light GPU
    (:func:`eplb.kernels.split.expected_peak.pair_descent`; a slot's share moves with its expert); then, under
    an even split and with no ``previous``, ``iterations`` random moves: swaps and, with
    ``replica_moves``, a redundant replica given from one expert to another
    (:func:`eplb.kernels.split.expected_peak.improve_expected_peak`). Every expert keeps at least one replica,
    every GPU its slot count, no GPU gets a second replica of an expert it already holds, and with
    a hierarchical ``deployment`` every slot stays on its node (so no token changes node: a capped
    plan keeps its off-node traffic). The result is never worse than ``phy2log`` on the objective
    searched, and the same input always gives the same output (``seed`` fixes the random stream).
    Cost per layer: ``swaps`` times ``k^2`` swaps scored in ``O(T)`` (``k`` slots per GPU) plus
    ``iterations`` moves of ``O(T)``; the cross-validation check adds ``folds`` starts and searches
    of at most ``CHECK_LAYERS`` layers, and only the layers that keep a step are searched.

    ``anchor`` guards against fitting the windows at the expense of the average traffic: the
    weighted sum of the windows joins them as one more window, weighing ``anchor`` times all the
    others together (``0``: the windows alone; ``None``: :func:`default_anchor` of the windows).

    Args:
        series: ``[T, L, E]`` float64 non-negative counts, validated by the caller (``[L, E]`` is one window).
        phy2log: ``[L, S]`` integer starting placement for ``deployment`` (every expert has a slot).
        deployment: an :class:`eplb.model.deployment.Deployment` (its topology and whether groups stay on nodes).
        window_weights: ``[T]`` non-negative weights of the windows (``None``: equal).
        shares: ``[L, S]`` fraction of its expert's tokens each slot takes (``None``: ``1 / logcnt``).
        previous: ``[L, S]`` int64, the placement in service; with ``copy_cost > 0`` a swap must
            lower the objective by more than ``copy_cost`` per slot it makes differ from it.
        copy_cost: ``>= 0``, in units of the objective (mean ``peak / mean``) per changed slot.
        swaps: best-swap iterations per layer (``>= 0``); iterations: random moves after them
            (``>= 0``); replica_moves: also change replica counts there.
        seed: ``>= 1``, the random stream; anchor: ``>= 0``, the weight of the summed window
            (``None``: :func:`default_anchor`, more weight the fewer the windows).
        folds: ``>= 2``: first decide by cross-validation over the windows how many of the
            search's steps (:func:`search_steps`) each layer keeps (:func:`_validated_steps`: the
            start and the search both made without the fold they are judged on, per layer or per
            group of layers around each of up to ``CHECK_LAYERS`` checked layers); a layer where no
            step pays on windows it has not seen keeps its start row (``after == before``). ``0``
            or ``1``: every layer takes every step.
        start_of: ``(summed [C, E], layers [C]) -> phy2log [C, S]`` (or ``(phy2log, shares)``):
            how the start was made, from the weighted sum of the windows outside a fold, for the
            cross-validation's layers ``layers``; ``None``: every fold starts from ``phy2log``
            (which has seen the fold, so the check then leans towards the start).
    """
    windows = validated_counts(series, "series", ndims=(2, 3))
    if windows.ndim == 2:
        windows = windows[None]
    weights = check_window_weights(window_weights, windows.shape[0])
    for name, value in (("swaps", swaps), ("iterations", iterations), ("folds", folds)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 1):
        raise ValueError(f"seed must be a positive integer, got {seed!r}")
    if anchor is None:
        anchor = default_anchor(weights)
    for name, value in (("anchor", anchor), ("copy_cost", copy_cost)):
        if not (isinstance(value, (int, float, np.integer, np.floating)) and np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    num_layers, num_experts = windows.shape[1:]
    placement = _checked_placement(phy2log, "phy2log", num_layers, num_experts, deployment.topology.num_slots)
    if shares is None:
        fractions = uniform_shares(placement, replica_counts(placement, num_experts))
    else:
        fractions = np.ascontiguousarray(shares, dtype=np.float64)
        if fractions.shape != placement.shape or not np.isfinite(fractions).all() or (fractions < 0).any():
            raise ValueError(f"shares must be finite, non-negative, of shape [L, S] = {list(placement.shape)}")
    in_service = placement if previous is None else _checked_placement(previous, "previous", num_layers, num_experts,
                                                                       deployment.topology.num_slots, complete=False)
    random_moves = int(iterations) if shares is None and previous is None else 0
    search = dict(steps=search_steps(int(swaps), random_moves), seed=int(seed), replica_moves=bool(replica_moves),
                  previous=in_service, copy_cost=float(copy_cost) if previous is not None else 0.0)
    upto = np.full(num_layers, len(search["steps"]), np.int64)
    if folds >= 2 and windows.shape[0] >= 2 and search["steps"]:
        noise = sampling_noise_layers(windows, weights)
        if not noise.all():
            upto = _validated_steps(windows, weights, placement, fractions, deployment, int(folds), float(anchor),
                                    search, start_of)
        upto[noise] = 0
    anchored, anchored_weights = _with_anchor(windows, weights, float(anchor))
    out, out_fractions, before, after = _search(anchored, anchored_weights, placement, fractions, deployment, upto=upto,
                                                **search)
    return Hedged(out, out_fractions, before, after, bool((out != placement).any()), upto)


def _checked_placement(phy2log, name: str, num_layers: int, num_experts: int, num_slots: int, *,
                       complete: bool = True) -> np.ndarray:
    """``phy2log [L, S]`` as C-contiguous int64, checked (with ``complete``: every expert has a slot)."""
    placement = np.asarray(phy2log)
    if placement.shape != (num_layers, num_slots):
        raise ValueError(f"{name} must have shape [L, S] = [{num_layers}, {num_slots}], got {placement.shape}")
    if not np.issubdtype(placement.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {placement.dtype}")
    placement = np.ascontiguousarray(placement, dtype=np.int64)
    if placement.size and (placement.min() < 0 or placement.max() >= num_experts):
        raise ValueError(f"{name} must hold expert ids in [0, {num_experts})")
    if complete:
        for layer in range(num_layers):
            if np.bincount(placement[layer], minlength=num_experts).min() < 1:
                raise ValueError(f"{name} must give every expert a slot (layer {layer} misses one)")
    return placement


def default_anchor(window_weights: np.ndarray) -> float:
    """The anchor's weight for windows of weights ``[T]``: ``max(DEFAULT_ANCHOR, 1 / sqrt(T'))`` with
    ``T'`` the windows of positive weight (see the comment at :data:`DEFAULT_ANCHOR`)."""
    return max(DEFAULT_ANCHOR, 1.0 / math.sqrt(max(1, int((np.asarray(window_weights) > 0).sum()))))


def _with_anchor(windows, weights, anchor):
    """``windows [T, L, E]`` and ``weights [T]`` with the anchor window appended (the weighted sum
    of the windows, weighing ``anchor * sum(weights)``), as C-contiguous float64."""
    if anchor > 0:
        windows = np.concatenate([windows, np.tensordot(weights, windows, axes=1)[None]])
        weights = np.append(weights, anchor * weights.sum())
    return np.ascontiguousarray(windows, dtype=np.float64), np.ascontiguousarray(weights, dtype=np.float64)


def search_steps(swaps: int, iterations: int) -> tuple[tuple[str, int], ...]:
    """The steps of the search, smallest first: ``("swaps", n)`` (``n`` best swaps,
    :func:`eplb.kernels.split.expected_peak.pair_descent`) or ``("moves", n)`` (``n`` random moves,
    :func:`eplb.kernels.split.expected_peak.improve_expected_peak`). A quarter of the best swaps first:
    where the evidence is weak the decision can keep only the first, largest-gain swaps."""
    first = (swaps + 3) // 4
    steps = (("swaps", first), ("swaps", swaps - first), ("moves", iterations))
    return tuple(step for step in steps if step[1] > 0)


def _search(windows, weights, placement, fractions, deployment, *, steps, upto, seed, replica_moves, previous,
            copy_cost, on_step=None):
    """The search's ``steps`` on validated arrays (the anchor window already appended), each layer
    ``l`` taken through its first ``upto[l]`` steps (``upto [L]`` int64). ``on_step(k, phy2log,
    fractions)``, if given, sees every layer's placement after step ``k`` (1-based).
    Returns ``(phy2log [L, S], fractions [L, S], before [L], after [L])``."""
    topology = deployment.topology
    gpu_of_slot = np.ascontiguousarray(topology.gpu_of_slot, dtype=np.int64)
    slot_offsets = np.ascontiguousarray(topology.slot_offsets, dtype=np.int64)
    zones = np.require(gpu_zones(deployment), np.int64, "CW")
    previous = np.require(previous, np.int64, "CW")
    windows = np.require(windows, np.float64, "CW")
    # every array writable int64 / float64 and scalars as Python numbers: one compiled specialization
    # (a read-only placement, as a Placement's, is a type of its own)
    out = np.require(placement, np.int64, "CW").copy()
    out_fractions = np.require(fractions, np.float64, "CW").copy()
    num_layers = out.shape[0]
    before, after = np.ones(num_layers), np.ones(num_layers)
    # the objective before the search: from the first step's call where that is a best-swap step (it
    # scores its start the same way), from a call without swaps for the layers no step searches
    unscored = np.flatnonzero(upto < 1) if steps and steps[0][0] == "swaps" else np.arange(num_layers)
    if unscored.size:
        _, _, before[unscored], after[unscored] = pair_descent(
            np.take(windows, unscored, axis=1), weights, out[unscored], out_fractions[unscored], gpu_of_slot,
            slot_offsets, zones, 0, int(seed), InService(previous[unscored], float(copy_cost)))
    for k, (kind, amount) in enumerate(steps, start=1):
        rows = np.flatnonzero(upto >= k)
        if rows.size:
            # [T, R, E]: every layer's windows as they are, else a C-contiguous copy (windows[:, rows] is not)
            part = windows if rows.size == num_layers else np.take(windows, rows, axis=1)
            if kind == "swaps":  # each step its own stream, so a step's start does not depend on the others'
                moved, moved_fractions, scored, after[rows] = pair_descent(
                    part, weights, out[rows], out_fractions[rows], gpu_of_slot, slot_offsets, zones, int(amount),
                    int(seed) + k - 1, InService(previous[rows], float(copy_cost)))
                if k == 1:
                    before[rows] = scored
            else:  # even split only: the random moves recount replicas
                moved, _, after[rows] = _improve(part, weights, out[rows], gpu_of_slot, slot_offsets,
                                                 slot_zones(deployment), int(amount), int(seed), replica_moves)
                moved_fractions = uniform_shares(moved, replica_counts(moved, windows.shape[2]))
            out[rows], out_fractions[rows] = moved, moved_fractions
        if on_step is not None:
            on_step(k, out, out_fractions)
    return out, out_fractions, before, after


def window_share_peaks(windows: np.ndarray, phy2log: np.ndarray, fractions: np.ndarray, topology) -> np.ndarray:
    """``[T, L]`` each window's max GPU load over its mean (1.0 for an all-zero layer), slot ``s``
    taking ``fractions[l, s]`` of its expert's tokens (``windows [T, L, E]``, ``phy2log`` and
    ``fractions`` ``[L, S]``)."""
    peak = peak_loads(windows, phy2log, topology, shares=fractions)
    mean = windows.sum(axis=-1) / topology.num_gpus
    return np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)


def sampling_noise_layers(windows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``[L]`` bool: the layers whose windows look like independent samples of one popularity.

    Per layer, Pearson's chi-square statistic of homogeneity of the windows' token counts
    (``windows [T, L, E]``, windows of weight 0 or no tokens and experts with no tokens left out)
    against its degrees of freedom ``(T' - 1)(E' - 1)``, standardised by its variance under
    Poisson sampling (``2 df + sum of 1 / expected count``, which keeps sparse windows from looking
    like structure): below :data:`NOISE_Z` the windows differ no more than sampling says they
    would, and no placement can serve one better than the plan of their sum. Only integer counts
    (tokens, as engines record them) can be judged this way: with fractional counts (normalised
    or weighted statistics) every layer is ``False`` and cross-validation alone decides.
    """
    noise = np.zeros(windows.shape[1], bool)
    live = weights > 0
    if live.sum() < 2 or not np.array_equal(windows, np.round(windows)):
        return noise
    # every layer at once. A window or expert without tokens in a layer has expected count 0 there
    # and is left out of that layer's table (its cells add nothing, its row or column no freedom).
    # With E = R C / N: sum (O - E)^2 / E = N sum O^2 / (R C) - N and sum 1 / E = N sum 1/R sum 1/C.
    table = windows[live]  # [T', L, E]
    rows, columns = table.sum(axis=2), table.sum(axis=0)  # [T', L], [L, E]
    total = rows.sum(axis=0)  # [L]
    num_rows, num_columns = (rows > 0).sum(axis=0), (columns > 0).sum(axis=1)  # [L]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # counts near the float range: not noise
        inverse_rows = np.where(rows > 0, 1.0 / np.where(rows > 0, rows, 1.0), 0.0)
        inverse_columns = np.where(columns > 0, 1.0 / np.where(columns > 0, columns, 1.0), 0.0)
        statistic = total * np.einsum("tle,tl,le->l", table * table, inverse_rows, inverse_columns) - total
        inverse_expected = total * inverse_rows.sum(axis=0) * inverse_columns.sum(axis=1)
        dof = (num_rows - 1) * (num_columns - 1)
        z = (statistic - dof) / np.sqrt(2.0 * dof + inverse_expected)
    # one window or one expert with tokens: nothing to hedge between; a NaN z is not noise
    return (num_rows < 2) | (num_columns < 2) | (z < NOISE_Z)


def _validated_steps(windows, weights, placement, fractions, deployment, folds, anchor, search, start_of) -> np.ndarray:
    """How many of the search's steps each layer keeps (``[L]`` int64, 0: the start), decided by
    cross-validation over the windows on equal terms.

    Window ``t`` is in fold ``t % folds``. For each fold, the start (``start_of`` of the other
    windows' weighted sum, or the given start without ``start_of``) and the search from it are
    both made without the fold, and both are judged on its windows: ``gain[s, t]`` = the start's
    ``peak / mean`` minus that after step ``s``, less the copies step ``s`` adds (``copy_cost``
    per slot changed from the placement in service). This runs on up to ``CHECK_LAYERS`` evenly
    spread layers; every layer takes the decision of the nearest checked layer (each layer its own
    when there are at most ``CHECK_LAYERS``). A layer keeps the step whose held-out gain is
    largest once ``DECISION_Z`` standard errors (over its held-out windows) are taken off, among
    the steps that win on enough of those windows (:data:`SIGN_TEST`), and the start when no
    step's gain is positive that way: a step must pay on windows it has not seen.
    """
    num_windows, num_layers = windows.shape[:2]
    folds = min(folds, num_windows)
    fold_of = np.arange(num_windows) % folds
    checked = np.unique(np.linspace(0, num_layers - 1, min(CHECK_LAYERS, num_layers)).round().astype(np.int64))
    nearest = np.abs(np.arange(num_layers)[:, None] - checked[None, :]).argmin(axis=1)  # [L] -> index in checked
    steps = search["steps"]
    topology = deployment.topology
    previous = search["previous"][checked]
    options = {**search, "previous": previous}
    gain = np.zeros((len(steps) + 1, num_windows, checked.size))  # [step, window, checked layer]
    counted = np.zeros((num_windows, checked.size), bool)
    full = np.full(checked.size, len(steps), np.int64)
    checked_windows = np.take(windows, checked, axis=1)  # [T, C, E], C-contiguous
    for k in range(folds):
        held, kept = np.flatnonzero(fold_of == k), fold_of != k
        if weights[kept].sum() <= 0 or weights[held].sum() <= 0:
            continue
        kept_windows = checked_windows[kept]
        if start_of is None:
            start, start_fractions = placement[checked], fractions[checked]
        else:
            start, start_fractions = _fold_start(start_of, np.tensordot(weights[kept], kept_windows, axes=1), checked,
                                                 windows.shape[2])
        held_windows = checked_windows[held]
        start_peaks = window_share_peaks(held_windows, start, start_fractions, topology)  # [h, C]
        start_copies = (start != previous).sum(axis=1)

        def judge(step, phy2log, step_fractions):
            copies = (phy2log != previous).sum(axis=1) - start_copies
            gain[step, held] = (start_peaks - window_share_peaks(held_windows, phy2log, step_fractions, topology)
                                - search["copy_cost"] * copies)

        _search(*_with_anchor(kept_windows, weights[kept], anchor), start, start_fractions, deployment, upto=full,
                on_step=judge, **options)
        counted[held] = (held_windows.sum(axis=-1) > 0) & (weights[held] > 0)[:, None]
    chosen = np.zeros(checked.size, np.int64)
    for c in range(checked.size):
        w = weights[counted[:, c]]
        if w.size < 2:  # one held-out window says nothing about chance
            continue
        d = gain[1:, counted[:, c], c]  # [steps, n]
        mean = d @ w / w.sum()
        spread = np.sqrt(((d - mean[:, None]) ** 2) @ w / w.sum())
        effective = w.sum() ** 2 / (w ** 2).sum()  # equal weights: n windows
        lower = mean - DECISION_Z * spread / np.sqrt(effective - 1.0)
        lower[[_sign_test(int(wins), w.size) > SIGN_TEST for wins in (d > 0).sum(axis=1)]] = -np.inf
        best = int(np.argmax(lower))
        if lower[best] > 0.0:
            chosen[c] = best + 1
    return chosen[nearest]


def _sign_test(wins: int, trials: int) -> float:
    """``P(Binomial(trials, 1/2) >= wins)``: how likely a fair coin wins at least as often."""
    return sum(math.comb(trials, k) for k in range(wins, trials + 1)) / 2.0 ** trials


def _fold_start(start_of, summed, layers, num_experts):
    """``start_of(summed [C, E], layers [C])`` as ``(phy2log [C, S] int64, fractions [C, S])``
    (``start_of`` returns a placement, or a placement and its shares; ``None`` shares: an even split)."""
    made = start_of(np.ascontiguousarray(summed), layers)
    phy2log, shares = made if isinstance(made, tuple) else (made, None)
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    if shares is None:
        shares = uniform_shares(phy2log, replica_counts(phy2log, num_experts))
    return phy2log, np.ascontiguousarray(shares, dtype=np.float64)

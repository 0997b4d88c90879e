"""Replica counts for GPUs of two slots each (``k = 2``) from the prices of the weighting bound.

The single replica moves of :func:`eplb.kernels.bounds.pairs.pair_search` stop where no one move
lowers the sorted pairing's peak, and the lighter counts are often several moves away at once (a
hot expert one replica fewer, so its replicas turn heavy, while two others turn light). The
ascent of :mod:`eplb.kernels.bounds.pair_weights` prices replicas by level for a target ``T``, and
the cheapest replication at those prices is the relaxation's answer to "which counts pair under
``T``": nearly a pairing, a few replicas short. :func:`price_search` takes it every few steps of
the ascent at a few targets between a lower bound and the plan's peak, fills the slots left
(D'Hondt over the light experts), runs the single moves from there, and keeps the lightest sorted
pairing.

Measured (`bench/rack_bounds.py`'s families, 58 layers, the two-slot construction of ``best`` with
and without it, targets at 0.5 and 0.85 of the way from the plan-free bound, a start every 40 of
400 steps): mean gap at 288 / 144 0.320 -> 0.231% (lognormal), 1.031 -> 0.695% (Zipf 0.5), 0.114
-> 0.057% (drift), unchanged 0.039% (Zipf 1.0), for 0.1-0.6 s a model; at 512 / 256 1.43 -> 1.32%,
3.81 -> 2.66%, 1.15 -> 1.14%, 1.63 -> 1.52%, for 1.1-3.8 s.
"""

import numpy as np
from numba import njit

from .pair_cover import MAX_DOUBLED, fill_light, pairing_peak
from .pair_weights import ascent_step, candidates, start_weights
from .pairs import descend_counts

@njit(cache=True, nogil=True, error_model="numpy")
def price_search(desc, counts, peaks, lower, num_slots, cap, fractions, ascent, max_moves, removals):
    """Lighter replica counts, per layer, from the weighting bound's prices (module docstring).

    Args:
        desc: ``[L, E]`` float64 non-negative loads, each row decreasing; counts: ``[L, E]`` int64
            replica counts (each ``1 .. cap``, summing to ``num_slots``) and peaks: ``[L]`` float64
            their sorted pairing's max GPU load; lower: ``[L]`` float64 lower bounds on it;
            num_slots: ``S`` (even, ``>= E``); cap: most replicas an expert may get; fractions:
            ``[F]`` float64 targets between ``lower`` (0) and ``peaks`` (1); ascent:
            ``(iterations, step, every)``, the ascent's steps a target, its first step, and the
            steps between two starts; max_moves, removals: of the single moves from each start
            (:func:`eplb.kernels.bounds.pairs.pair_search`).
    Returns:
        ``(counts [L, E] int64, peaks [L] float64)``: a layer's counts change only where their
        sorted pairing is strictly lighter (and holds one expert twice in at most
        :data:`eplb.kernels.bounds.pair_cover.MAX_DOUBLED` pairs).
    """
    num_layers, num_experts = desc.shape
    iterations, step, every = ascent
    out, out_peaks = counts.copy(), peaks.copy()
    num_pairs = num_slots // 2
    levels = np.empty(4 * num_slots)
    trial = np.empty(num_experts, np.int64)
    keys = np.empty(num_experts)
    heap = np.empty(num_experts, np.int64)
    for layer in range(num_layers):
        w = desc[layer]
        n = 0
        while n < num_experts and w[n] > 0.0:
            n += 1
        low, high = lower[layer], peaks[layer]
        if not high > low:
            continue
        idle = num_experts - n
        picks = np.empty(n, np.int64)
        for f in range(fractions.shape[0]):
            target = low + fractions[f] * (high - low)
            num_levels, option_counts, above, below, first = candidates(w[:n], idle, num_slots, target, levels)
            if num_levels <= 0:
                continue
            options = (option_counts, above, below, first)
            weights = start_weights(num_levels)
            work = np.empty((3, num_levels + 1))
            for t in range(iterations):
                value, used = ascent_step(t, weights, options, idle, num_slots, step, picks, work)
                if value > 1e-9 * num_slots:
                    break  # the target is out of reach: no counts to find there
                if t % every != 0 or used > num_slots:
                    continue
                over = False
                for e in range(n):
                    trial[e] = option_counts[picks[e]]
                    over = over or trial[e] > cap
                trial[n:] = 1
                if over or not fill_light(w, trial, num_slots - used, cap, 0.5 * target, keys, heap):
                    continue
                peak = descend_counts(w, trial, cap, max_moves, removals)
                if peak < out_peaks[layer] * (1.0 - 1e-12):
                    peak, doubled = pairing_peak(w, trial, num_pairs)
                    if doubled <= MAX_DOUBLED:
                        out_peaks[layer] = peak
                        out[layer] = trial
    return out, out_peaks

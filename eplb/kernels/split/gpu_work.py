"""Kernel of the simulator: per-GPU tokens and activated slots of many steps under one placement."""

import numpy as np
from numba import njit

RANDOM_SPLIT, FIXED_SPLIT = True, False  # gpu_work's random_split argument, named for callers


@njit(cache=True, nogil=True, error_model="numpy")
def gpu_work(counts, phy2log, shares, gpu_of_slot, num_gpus, random_split):
    """Tokens and activated slots of every GPU, layer and step.

    A slot holding expert ``e`` takes ``shares[l, s]`` of ``e``'s ``c`` tokens. With
    ``random_split`` each token picks a replica at random (uniform dispatch): the slot is activated
    with probability ``1 - (1 - share)^c``, counted as its expectation. Otherwise the split is
    deterministic: the slot is activated when it takes at least half a token.

    Args:
        counts: ``[B, L, E]`` float64 tokens per expert of ``B`` steps.
        phy2log: ``[L, S]`` int64 placement; gpu_of_slot: ``[S]`` int64; num_gpus: ``G``.
        shares: ``[1, L, S]`` (one split for every step) or ``[B, L, S]`` float64.
        random_split: bool, as above.
    Returns:
        ``tokens [B, L, G]`` and ``active [B, L, G]`` float64.
    """
    steps, num_layers, _ = counts.shape
    num_slots = phy2log.shape[1]
    tokens = np.zeros((steps, num_layers, num_gpus))
    active = np.zeros((steps, num_layers, num_gpus))
    per_step = shares.shape[0] > 1
    for b in range(steps):
        sb = b if per_step else 0
        for layer in range(num_layers):
            for s in range(num_slots):
                c = counts[b, layer, phy2log[layer, s]]
                share = shares[sb, layer, s]
                if c <= 0.0 or share <= 0.0:
                    continue
                g = gpu_of_slot[s]
                tokens[b, layer, g] += c * share
                if share >= 1.0:
                    active[b, layer, g] += 1.0
                elif random_split:
                    active[b, layer, g] += 1.0 - (1.0 - share) ** c
                elif c * share >= 0.5:
                    active[b, layer, g] += 1.0
    return tokens, active

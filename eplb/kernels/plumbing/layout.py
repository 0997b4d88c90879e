"""Kernels that turn ``phy2log`` into the other two views of a placement."""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def replica_counts(phy2log, num_experts):
    """``[L, S] -> [L, E]`` int64: how many slots hold each expert."""
    num_layers, num_slots = phy2log.shape
    counts = np.zeros((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        for slot in range(num_slots):
            counts[layer, phy2log[layer, slot]] += 1
    return counts


@njit(cache=True, nogil=True, error_model="numpy")
def slots_of_experts(phy2log, num_experts, width):
    """``[L, S] -> [L, E, width]`` int64: each expert's slots in increasing order, ``-1`` padded."""
    num_layers, num_slots = phy2log.shape
    log2phy = np.empty((num_layers, num_experts, width), np.int64)  # not np.full: shorter to compile
    log2phy[:, :, :] = -1
    filled = np.zeros(num_experts, np.int64)
    for layer in range(num_layers):
        filled[:] = 0
        for slot in range(num_slots):
            e = phy2log[layer, slot]
            log2phy[layer, e, filled[e]] = slot
            filled[e] += 1
    return log2phy

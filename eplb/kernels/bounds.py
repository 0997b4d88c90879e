"""Kernels behind the lower bounds on the maximum GPU load."""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def min_max_replica_load(weights, num_replicas):
    """``min over replica counts r (sum r = R, r >= 1) of max_e w_e / r_e``, for every layer.

    Greedy replication (one replica at a time to the expert with the largest load per replica)
    attains this minimum exactly.

    Args:
        weights: ``[L, E]`` float64; ``num_replicas``: ``R >= E``.
    Returns:
        ``[L]`` float64.
    """
    num_layers, num_experts = weights.shape
    out = np.empty(num_layers)
    counts = np.empty(num_experts, np.int64)
    for layer in range(num_layers):
        w = weights[layer]
        counts[:] = 1
        for _ in range(num_replicas - num_experts):
            best = 0
            best_load = w[0] / counts[0]
            for e in range(1, num_experts):
                load = w[e] / counts[e]
                if load > best_load:
                    best = e
                    best_load = load
            counts[best] += 1
        peak = 0.0
        for e in range(num_experts):
            peak = max(peak, w[e] / counts[e])
        out[layer] = peak
    return out

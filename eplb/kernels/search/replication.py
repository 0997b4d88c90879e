"""Kernels that decide how many replicas each expert gets."""

import numpy as np
from numba import njit

from ..plumbing.common import heap_sift_down, heapify


@njit(cache=True, nogil=True, error_model="numpy")
def replicate_capped(weights, experts, num_replicas, cap, counts):
    """Give one replica at a time to the expert with the largest load per replica, at most ``cap`` each.

    Without the cap this is the D'Hondt rule, which minimises the largest load per replica. The
    cap (the number of GPUs that can hold the experts) keeps every replica of an expert on its own
    GPU: an expert with more replicas than GPUs puts two on one GPU, which carries more than if it
    had one replica per GPU. When ``cap * len(experts) < num_replicas`` the cap grows by whole
    multiples so that every replica finds an expert.

    Args:
        weights: ``[E]`` float64 loads of all experts.
        experts: ``[n]`` int64 ids of the experts to replicate (``n <= num_replicas``).
        num_replicas: replicas in all for these experts.
        cap: ``>= 1``, most replicas of one expert.
        counts: ``[n]`` int64 output, replicas of ``experts[i]`` (``>= 1``, summing to ``num_replicas``).
    """
    n = experts.shape[0]
    if cap < 1:
        cap = 1
    limit = cap
    while limit * n < num_replicas:
        limit += cap
    # the expert with the largest load per replica (the first on ties) is the root of a min-heap
    # keyed by minus that load: O(R log n), not O(R n) (R = 512 replicas of 256 experts: 20x fewer steps)
    minus_load = np.empty(n)
    heap = np.empty(n, np.int64)
    for i in range(n):
        counts[i] = 1
        minus_load[i] = -weights[experts[i]] if limit > 1 else 1.0
        heap[i] = i
    heapify(heap, n, minus_load)
    top = np.int64(0)  # typed, not the literal: one specialization of the sift
    for _ in range(num_replicas - n):
        best = heap[0]
        counts[best] += 1
        minus_load[best] = -(weights[experts[best]] / counts[best]) if counts[best] < limit else 1.0
        heap_sift_down(heap, n, minus_load, top)

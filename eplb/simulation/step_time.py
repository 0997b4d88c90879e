"""The step time of a placement on a pool's windows: sampled passes, each layer's time under the
engines' even split, and the bound no placement can beat (what :mod:`eplb.simulation.pools` prices
its options with).

A pass serves ``batch`` tokens per GPU (decode: one token per sequence, so ``batch`` sequences per
GPU; prefill: ``batch`` prompt tokens per GPU) on ``G`` GPUs, so each MoE layer routes
``n = batch * G * top_k`` tokens. :func:`sample_passes` draws ``passes`` such passes from the
window's per-layer expert distribution (a multinomial per layer, seeded by ``(seed, window)``: the
same passes for every placement judged on that window). :func:`layer_times` sends each token to
one of its expert's replicas at random, as the engines' even split does (drawn, seeded; a slot is
activated when a token picks it), and :class:`eplb.CostModel` prices the GPUs' tokens and activated
slots: a layer waits for its slowest GPU, a step is the sum over the
layers of the counts (pass counts of all the model's MoE layers for the model's full step).

In decode a GPU's time is mostly the weight reads of its activated slots; a replica adds reads
when both copies receive tokens, so at small batches fewer slots can be faster.
"""

from __future__ import annotations

import numpy as np

from ..analysis.placement import Placement
from ..model.cost import CostModel


def sample_passes(window: np.ndarray, routed: int, passes: int, rng: np.random.Generator) -> np.ndarray:
    """``passes`` passes drawn from a window's per-layer expert distribution.

    Args:
        window: ``[L, E]`` non-negative counts; a layer's distribution is its row over its total
            (an all-zero row, a dense layer, routes nothing).
        routed: tokens routed per layer and pass (``batch * G * top_k``).
        passes: ``P``; rng: the generator to draw from.
    Returns:
        ``[P, L, E]`` float64 routed tokens per expert.
    """
    window = np.asarray(window, dtype=np.float64)
    totals = window.sum(axis=1, keepdims=True)
    live = totals[:, 0] > 0
    probs = np.where(live[:, None], window / np.where(totals > 0, totals, 1.0), 1.0 / window.shape[1])
    draws = rng.multinomial(routed, probs, size=(passes, window.shape[0])).astype(np.float64)
    draws[:, ~live] = 0.0
    return draws


class _Sampler:
    """The sampled passes of each window, drawn once (seeded by ``(seed, window)``) and kept."""

    def __init__(self, windows: np.ndarray, routed: int, passes: int, seed: int):
        self.windows, self.routed, self.passes, self.seed = windows, routed, passes, seed
        self._drawn: dict[int, np.ndarray] = {}

    def __call__(self, t: int) -> np.ndarray:
        """``[P, L, E]`` passes of window ``t``."""
        if t not in self._drawn:
            rng = np.random.default_rng([self.seed, t])
            self._drawn[t] = sample_passes(self.windows[t], self.routed, self.passes, rng)
        return self._drawn[t]


def layer_times(passes: np.ndarray, placement: Placement, cost: CostModel, seed: int = 0) -> np.ndarray:
    """Mean over sampled passes of each layer's time (its slowest GPU) under the even split.

    Each token goes to one replica of its expert, picked at random (as the engines' even split
    sends it; drawn per pass and seeded), and a slot's weights are read when at least one token
    picks it. The split is drawn, not taken as its expectation: the slowest GPU of the expected
    activations (a replica of an expert with one token counted as half a read on each of two GPUs)
    underestimates the expected slowest GPU wherever replicas are read by few tokens (1.6% for the
    token plan on 8 H200 at 1 sequence per GPU, 272 slots).

    Args:
        passes: ``[P, L, E]`` routed tokens per expert of ``P`` passes (whole numbers).
        placement: the layout (``phy2log [L, S]``) on its topology.
        cost: prices each GPU's tokens and activated slots.
        seed: the random split's seed (the same arguments give the same times).
    Returns:
        ``[L]`` seconds; their sum is the predicted MoE step time.
    """
    passes = np.asarray(passes, dtype=np.float64)
    if passes.ndim != 3 or not np.array_equal(passes, np.round(passes)) or (passes < 0).any():
        raise ValueError("passes must be a [P, L, E] array of whole, non-negative token counts")
    tokens_of_slot = _split_tokens(passes, placement.phy2log, placement.logcnt, seed)
    offsets = placement.topology.slot_offsets
    tokens = _per_gpu(tokens_of_slot, offsets)  # [P, L, G]
    active = _per_gpu((tokens_of_slot > 0).astype(np.float64), offsets)
    return cost.layer_time(tokens, active).mean(axis=0)


def _per_gpu(per_slot: np.ndarray, slot_offsets: np.ndarray) -> np.ndarray:
    """``[..., S]`` whole numbers per slot -> ``[..., G]`` their sums over each GPU's slots
    ``[slot_offsets[g], slot_offsets[g + 1])`` (a GPU without slots: 0). Differences of running sums,
    exact for whole numbers below 2**53; a matrix product with the ``[S, G]`` slot-to-GPU matrix cost
    0.4 s a call at 432 slots on 144 GPUs, most of :func:`recommend`'s time there."""
    running = np.concatenate([np.zeros(per_slot.shape[:-1] + (1,)), np.cumsum(per_slot, axis=-1)], axis=-1)
    return running[..., slot_offsets[1:]] - running[..., slot_offsets[:-1]]


def _split_tokens(passes: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, seed: int) -> np.ndarray:
    """``[P, L, E]`` whole token counts -> ``[P, L, S]`` the tokens each slot receives when every
    token picks one of its expert's ``logcnt [L, E]`` replicas at random: an expert's ``c`` tokens
    are split by successive binomial draws over its replicas in slot order, replica ``j`` of ``r``
    taking ``Binomial(left, 1 / (r - j))``. Layer ``l`` draws from its own stream ``(seed, l)``, so a
    layer's split does not depend on the other layers (a per-layer mix of placements is priced,
    layer by layer, as the placements it mixes)."""
    tokens = np.take_along_axis(passes, np.broadcast_to(phy2log, (len(passes),) + phy2log.shape), axis=2)  # [P, L, S]
    for layer in np.flatnonzero((logcnt > 1).any(axis=1)):
        rng = np.random.default_rng([seed, layer])
        slots = np.flatnonzero(logcnt[layer, phy2log[layer]] > 1)  # replicated experts' slots, in slot order
        experts = phy2log[layer, slots]
        by_expert = np.argsort(experts, kind="stable")
        first = np.searchsorted(experts[by_expert], experts[by_expert])  # each run's start
        rank = np.empty_like(slots)
        rank[by_expert] = np.arange(len(slots)) - first  # j: earlier slots of the same expert
        left = passes[:, layer].astype(np.int64)  # [P, E] tokens not yet given to a replica
        for j in range(int(rank.max()) + 1):
            at = rank == j  # at most one slot per expert
            taken = rng.binomial(left[:, experts[at]], 1.0 / (logcnt[layer, experts[at]] - j))  # the last takes the rest
            tokens[:, layer, slots[at]] = taken
            left[:, experts[at]] -= taken
    return tokens


def layer_time_bound(passes: np.ndarray, num_gpus: int, cost: CostModel) -> np.ndarray:
    """A lower bound on :func:`layer_times` of *every* placement on ``G = num_gpus`` GPUs, even one
    remade for each pass.

    In a pass a layer routes ``T`` tokens to ``A`` distinct experts; whatever the placement and the
    split, its slowest GPU carries at least ``T / G`` tokens (compute), and its memory time is at
    least the mean over the GPUs of ``active * expert_bytes + tokens * token_bytes``, as every
    activated expert is read at least once (``A / G`` reads: with the even split's expected
    activations a GPU's count is fractional, so not ``ceil(A / G)``). A GPU's time is the larger
    of its compute and memory (under the roofline), so the layer's is at least the larger of the
    two bounds, plus the overhead.

    Args:
        passes: ``[P, L, E]`` routed tokens per expert of ``P`` passes.
        num_gpus: ``G``; cost: prices tokens and weight reads (its ``regime`` respected).
    Returns:
        ``[L]`` seconds: the mean over the passes of each pass's bound. Their sum bounds the MoE
        step time any placement can reach on these passes: how much shorter than a given plan's
        any plan could be.
    """
    passes = np.asarray(passes, dtype=np.float64)
    tokens = passes.sum(axis=-1) / num_gpus  # [P, L]
    experts = (passes > 0).sum(axis=-1)  # [P, L]
    compute = tokens * (cost.flops_per_token / cost.flops)
    memory = (experts * cost.expert_bytes / num_gpus + tokens * cost.token_bytes) / cost.hbm_bandwidth
    bound = {"compute": compute, "memory": memory}.get(cost.regime, np.maximum(compute, memory))
    return (bound + cost.layer_overhead_s).mean(axis=0)

"""``method="best"``: more time for better placements (offline planning).

Starts from the default method's placement (so it is never worse, and never worse than greedy),
then, on every layer and domain (the cluster, or each node in hierarchical mode, with the default
method's group -> node assignment), tries the aligned replications (heavy experts given a multiple
of the domain's GPUs in replicas, ten tiers and multiples around the default's one) and a seeded
series of replications that move a few replicas between experts, packs each one (spread
largest-first + swap descent) and keeps the best; on the domains more than
:data:`MOVE_TOLERANCE` above the proven bound, rounds of single replica moves between the heaviest
experts (from the default's replication and again after the aligned ones: with one expert carrying
~40% of the load, the right replica counts of the next few experts decide whether their replicas
fit beside the hot ones); a pair-swap descent (two replicas for two) finishes the best packing
(:mod:`eplb.kernels.search.multistart`). On small global layers (at most :data:`CAPPED_SLOTS` slots on
identical GPUs) an exact packing search under a load cap then bisects the max load and moves
replicas between experts (:func:`eplb.kernels.search.capped.descend`). Fixed seed and node budgets: the
same input gives the same placement.

Re-solving the heaviest GPU and a few partners exactly (CP-SAT) after this was measured and not
kept: ``bench/research/best_levers.py`` (it gains little at hundreds of milliseconds per layer).
"""

from __future__ import annotations

import numpy as np

from ...analysis.bounds import TINY_SLOTS, strongest_bound
from ...kernels.search.multistart import PAIR_SWAPS, MoveSearch, best_placement
from ...analysis.searches import improve_layer
from ...model._validation import INT64_MAX
from . import Option, Deployment, register
from .balanced import balanced, writable
from .exact_pairs import keep_lighter
from ...analysis.loads import slot_order_peaks


MOVE_TOLERANCE = 2e-3
"""Replica moves (``move_experts``, ``move_passes``) on the domains whose heaviest GPU is more than
this above the proven lower bound of the layer (:func:`eplb.analysis.bounds.lower_bound`)."""


CAPPED_SLOTS = 64
"""Global layers of more than :data:`eplb.analysis.bounds.TINY_SLOTS` (solved exactly by the default) and at
most this many slots, on identical GPUs, finish with the capped search. On gpt-oss-20b (40 slots,
8 GPUs) it takes ``best`` from 0.098% to 0.026% above the bound at ~45 ms per layer
(``bench/research/gpt_oss_certificate.py``; 20,000 nodes per attempt reach 0.008%, so the bound is within
0.008% of the optimum there); with more slots per GPU it found nothing lighter."""

CAPPED_ATTEMPTS = 20
"""Packing attempts of the capped search per unit of ``capped_budget`` (the attempts are counted in int64)."""


def finish_capped(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, bound: np.ndarray,
                  budget: int) -> np.ndarray:
    """On small global layers (see :data:`CAPPED_SLOTS`), the lightest placement the capped search
    (:func:`eplb.analysis.searches.improve_layer`, ``budget`` nodes per packing attempt) finds from
    ``phy2log [L, S]``, never heavier; ``bound [L]`` is where it stops. Other layouts: unchanged."""
    topology = deployment.topology
    if (budget == 0 or deployment.hierarchical or not topology.is_uniform
            or not TINY_SLOTS < topology.num_slots <= CAPPED_SLOTS):
        return phy2log
    num_gpus, slots = topology.num_gpus, int(topology.slots_per_gpu[0])
    phy2log = phy2log.copy()
    for layer in range(weights.shape[0]):
        _, phy2log[layer], _ = improve_layer(weights[layer], phy2log[layer], num_gpus, slots, float(bound[layer]),
                                             budget=int(budget), max_attempts=CAPPED_ATTEMPTS * int(budget))
    return phy2log


@register("best", options={"num_starts": Option("int", minimum=1), "max_steps": Option("int", minimum=0),
                           "seed": Option("int", minimum=0), "move_experts": Option("int", minimum=0),
                           "move_passes": Option("int", minimum=0),
                           "capped_budget": Option("int", minimum=0, maximum=INT64_MAX // CAPPED_ATTEMPTS)})
def best(weights: np.ndarray, deployment: Deployment, num_starts: int = 32, max_steps: int = 4096,
         seed: int = 0, move_experts: int = 8, move_passes: int = 4, capped_budget: int = 1000
         ) -> tuple[np.ndarray, dict]:
    """``num_starts``: replications tried per layer and domain; ``seed``: generator seed;
    ``move_experts`` / ``move_passes``: then every move of one replica between two of the domain's
    ``move_experts`` heaviest experts, up to ``move_passes`` rounds while it helps;
    ``capped_budget``: search nodes per packing attempt of the capped search on small global
    layers (0: off)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    topology = deployment.topology
    start, info = balanced(weights, deployment, max_steps=max_steps)
    if deployment.hierarchical:
        domain = topology.node_of_gpu.astype(np.int64)
    else:
        domain = np.zeros(topology.num_gpus, np.int64)
    # replica moves only where the default is more than MOVE_TOLERANCE above the proven bound
    bound = strongest_bound(weights, deployment)
    phy2log = best_placement(weights, writable(topology.slots_per_gpu), domain, start, int(num_starts),
                             int(max_steps), int(seed), PAIR_SWAPS, np.zeros(weights.shape[0]),
                             MoveSearch(int(move_experts), int(move_passes),
                                        np.ascontiguousarray(bound * (1 + MOVE_TOLERANCE))))
    worse = slot_order_peaks(weights, phy2log, topology) > slot_order_peaks(weights, start, topology)
    phy2log[worse] = start[worse]  # per-domain improvement cannot raise a layer's max; kept as a guarantee
    phy2log = finish_capped(weights, deployment, phy2log, bound, capped_budget)
    # one or two slots a GPU: the pairing construction
    phy2log, _ = keep_lighter(weights, deployment, phy2log, lower=bound)
    return phy2log, {**info, "num_starts": int(num_starts), "seed": int(seed)}

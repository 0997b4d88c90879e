"""SGLang's replica choice written out in plain Python from its source (SGLang 0.5.23's
``expert_location.py``): the test oracle for eplb's Numba kernels (:mod:`eplb.engines.sglang`).

``tests/analysis/test_engine_dispatch.py`` checks this reference against SGLang's own code run from
its files (the per-rank static table, bit for bit) and eplb's shares against this reference; the
rules themselves are described in :mod:`eplb.engines.sglang`.
"""

from __future__ import annotations

import random

import numpy as np

from eplb.analysis.placement import Placement

SGLANG_SEED = 42  # compute_logical_to_rank_dispatch_physical_map's seed (never overridden by SGLang)
SGLANG_RANDINT = 65536  # dynamic dispatch draws randint(0, 65536) % n


def near_replicas(placement: Placement) -> np.ndarray:
    """The slot each rank prefers for each expert under SGLang's rule (``_find_nearest_expert``),
    or ``-1`` where the rank has no near replica (the "fair" / random choice applies).

    Returns:
        ``[L, G, E]`` int64.
    """
    phy2log = placement.phy2log
    num_layers, num_slots = phy2log.shape
    num_gpus, num_nodes, num_experts = placement.num_gpus, placement.num_nodes, placement.num_experts
    per_gpu = num_slots // num_gpus
    per_node = num_slots // num_nodes
    layers = np.arange(num_layers)[:, None]

    def first_slot(block: int, blocks: int) -> np.ndarray:
        """``[L, blocks, E]``: the lowest slot of each expert in each block of ``block`` slots, or -1."""
        first = np.full((num_layers, blocks, num_experts), -1, np.int64)
        owners = np.arange(blocks)[None, :]
        for offset in range(block - 1, -1, -1):  # the lowest slot is written last
            slots = np.arange(blocks) * block + offset
            first[layers, owners, phy2log[:, slots]] = slots[None, :]
        return first

    logcnt = placement.logcnt
    choice = np.where(logcnt == 1, placement.log2phy[:, :, 0], -1)[:, None, :].repeat(num_gpus, axis=1)
    own = first_slot(per_gpu, num_gpus)
    choice = np.where(choice < 0, own, choice)
    node_of_gpu = placement.topology.node_of_gpu
    on_node = np.zeros((num_layers, num_nodes, num_experts), np.int64)
    np.add.at(on_node, (layers, np.arange(num_slots)[None, :] // per_node, phy2log), 1)
    on_node = on_node[:, node_of_gpu, :]
    narrows = (on_node > 0) & (on_node < logcnt[:, None, :])
    node_first = first_slot(per_node, num_nodes)[:, node_of_gpu, :]
    return np.where((choice < 0) & narrows, node_first, choice)


def sglang_static_table(placement: Placement) -> np.ndarray:
    """The slot each rank sends each expert's tokens to under SGLang's ``static`` dispatch.

    Reproduces SGLang 0.5.23 serving ``placement`` from ``--init-expert-location`` with an
    all-to-all backend (the only setting where it allows ``static``): the near replica when the
    rank has one, else the rank's entry of the fair choice drawn from ``random.Random(42)`` with
    the rank's own random stream (see the module notes): ``random.sample`` then ``random.shuffle``
    of Python's ``random`` module, called as SGLang calls them. Deterministic.

    Args:
        placement: an :class:`eplb.Placement` on a topology with the same slots on every GPU.
    Returns:
        ``[G, L, E]`` int64: ``table[r, l, e]`` is a slot holding expert ``e`` in layer ``l``
        (SGLang's ``logical_to_rank_dispatch_physical_map`` of rank ``r``).
    """
    near = near_replicas(placement)  # [L, G, E]
    fair = near < 0
    takers = fair.sum(axis=1)  # [L, E]: ranks sharing the fair choice
    position = np.cumsum(fair, axis=1) - 1  # [L, G, E]: a rank's index among them
    table = near.transpose(1, 0, 2).copy()
    for rank in range(placement.num_gpus):
        stream = random.Random(SGLANG_SEED)
        for layer, expert in np.argwhere(fair[:, rank, :]):  # layer-major, as SGLang walks them
            count = int(placement.logcnt[layer, expert])
            candidates = placement.log2phy[layer, expert, :count].tolist()
            rounds, rest = divmod(int(takers[layer, expert]), count)
            picks = candidates * rounds + stream.sample(candidates, k=rest)
            stream.shuffle(picks)
            table[rank, layer, expert] = picks[position[layer, rank, expert]]
    return table


def fraction_of_ranks(chosen: np.ndarray, num_slots: int) -> np.ndarray:
    """``[L, G, E]`` slot each rank sends each expert's tokens to (``-1``: none) -> ``[L, S]``
    fraction of the ranks choosing each slot."""
    num_layers, num_ranks, _ = chosen.shape
    layer = np.broadcast_to(np.arange(num_layers)[:, None, None], chosen.shape)
    chosen_somewhere = chosen >= 0
    flat = layer[chosen_somewhere] * num_slots + chosen[chosen_somewhere]
    return np.bincount(flat, minlength=num_layers * num_slots).reshape(num_layers, num_slots) / num_ranks


def sglang_dynamic_shares(placement: Placement) -> np.ndarray:
    """``[L, S]``: the near replica when the rank has one, else replica ``randint(0, 65536) % n``
    of the expert's list (replica ``i`` drawn with probability ``(65536 // n + (i < 65536 % n)) / 65536``)."""
    near = near_replicas(placement)
    layers = np.arange(placement.num_layers)[:, None]
    random_fraction = (near < 0).mean(axis=1)  # [L, E]: ranks that draw at random
    count = placement.logcnt[layers, placement.phy2log]  # [L, S]: replicas of the slot's expert
    index = np.zeros_like(placement.phy2log)  # [L, S]: the slot's place in its expert's list
    listed = placement.log2phy >= 0
    index[np.nonzero(listed)[0], placement.log2phy[listed]] = np.nonzero(listed)[2]
    draw = (SGLANG_RANDINT // count + (index < SGLANG_RANDINT % count)) / SGLANG_RANDINT
    return fraction_of_ranks(near, placement.num_slots) + random_fraction[layers, placement.phy2log] * draw




def reference_shares(placement: Placement, engine: str) -> np.ndarray:
    """``[L, S]``: the shares SGLang's ``engine`` rule (``"sglang-static"`` or ``"sglang-dynamic"``)
    gives ``placement``, from this reference."""
    if engine == "sglang-static":
        return fraction_of_ranks(sglang_static_table(placement).transpose(1, 0, 2), placement.num_slots)
    return sglang_dynamic_shares(placement)

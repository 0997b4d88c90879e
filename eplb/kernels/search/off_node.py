"""Which tokens leave their home node: the node-level step of locality-aware placement.

See :mod:`eplb.planning.locality`. Every array is plain: ``weights [L, E]`` float64 counts, ``expert_node
[L, E]`` int64 home node of every expert, ``gpus [N]`` float64 GPUs with slots per node,
``free_slots [L, N]`` int64 slots of a node left after one replica of each of its experts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..plumbing.common import stable_argsort


@njit(cache=True, nogil=True, error_model="numpy")
def node_target(loads, gpus, budget):
    """Smallest per-GPU target ``tau >= sum(loads) / sum(gpus)`` with
    ``sum max(0, loads - tau * gpus) <= budget`` (bisection to float precision)."""
    low = loads.sum() / gpus.sum()
    high = low
    for n in range(loads.size):
        if gpus[n] > 0 and loads[n] / gpus[n] > high:
            high = loads[n] / gpus[n]
    over = 0.0
    for n in range(loads.size):
        over += max(0.0, loads[n] - low * gpus[n])
    if over <= budget:
        return low
    for _ in range(64):
        mid = 0.5 * (low + high)
        over = 0.0
        for n in range(loads.size):
            over += max(0.0, loads[n] - mid * gpus[n])
        if over <= budget:
            high = mid
        else:
            low = mid
    return high


@njit(cache=True, nogil=True, error_model="numpy")
def off_node_pieces(weights, expert_node, gpus, free_slots, budget, max_piece, piece_expert, piece_node,
                    piece_tokens):
    """Tokens handed from overloaded nodes to underloaded ones, per layer.

    Nodes above the target ``tau`` (:func:`node_target` with ``budget [L]`` tokens) give, heaviest
    node first, tokens of their heaviest experts (at most ``max_piece`` of each) to the node with the
    most room below its target that still has a free slot; one piece per (expert, receiving node)
    takes one slot there.

    Writes ``piece_expert``, ``piece_node`` (int64) and ``piece_tokens`` (float64), each ``[L, P]``,
    and returns ``[L]`` int64 the number of pieces of each layer (``P`` must be at least the free
    slots of a layer).
    """
    num_layers, num_experts = weights.shape
    num_nodes = gpus.size
    count = np.zeros(num_layers, np.int64)
    for layer in range(num_layers):
        loads = np.zeros(num_nodes)
        for e in range(num_experts):
            loads[expert_node[layer, e]] += weights[layer, e]
        tau = node_target(loads, gpus, budget[layer])
        excess = np.maximum(loads - tau * gpus, 0.0)
        room = np.maximum(tau * gpus - loads, 0.0)
        slots = free_slots[layer].copy()
        for n in range(num_nodes):
            if gpus[n] == 0:
                room[n] = 0.0
        order = stable_argsort(-weights[layer])
        for _ in range(num_nodes):
            donor = np.argmax(excess)
            if excess[donor] <= 0:
                break
            for i in range(num_experts):
                e = order[i]
                if expert_node[layer, e] != donor or excess[donor] <= 0:
                    continue
                movable = max_piece * weights[layer, e]
                while excess[donor] > 0 and movable > 0:
                    receiver = -1
                    for n in range(num_nodes):
                        if room[n] > 0 and slots[n] > 0 and (receiver < 0 or room[n] > room[receiver]):
                            receiver = n
                    if receiver < 0:
                        break
                    piece = min(excess[donor], movable, room[receiver])
                    # one piece per (expert, node): add to an earlier piece to the same node
                    found = -1
                    for p in range(count[layer]):
                        if piece_expert[layer, p] == e and piece_node[layer, p] == receiver:
                            found = p
                    if found < 0:
                        found = count[layer]
                        piece_expert[layer, found] = e
                        piece_node[layer, found] = receiver
                        piece_tokens[layer, found] = 0.0
                        count[layer] += 1
                        slots[receiver] -= 1
                    piece_tokens[layer, found] += piece
                    excess[donor] -= piece
                    room[receiver] -= piece
                    movable -= piece
                if receiver_none(room, slots):
                    break
            excess[donor] = 0.0  # done with this donor (what is left found no receiver)
    return count


@njit(cache=True, nogil=True)
def receiver_none(room, slots):
    """True when no node has both room below its target and a free slot."""
    for n in range(room.size):
        if room[n] > 0 and slots[n] > 0:
            return False
    return True

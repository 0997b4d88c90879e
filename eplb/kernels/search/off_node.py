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



@njit(cache=True, nogil=True)
def best_swap(weights, replicas, expert_node, spare, donor, receiver, gap, left, receiver_free):
    """The donor's spare replica ``x`` and the receiver's ``y`` (``-1``: none, only when
    ``receiver_free``: the receiver has a free slot) whose exchange moves ``x - y`` tokens closest
    to ``gap / 2`` (strictly between 0 and ``gap``), for at most ``left`` tokens off home; ``(-1,
    -1)`` when none helps. ``weights [E]``, ``replicas [E]``, ``expert_node [E]`` home node,
    ``spare [E]`` replicas of an expert still at home beyond its first."""
    best_x, best_y, best_score = -1, -1, 0.0
    for x in range(weights.size):
        if expert_node[x] != donor or spare[x] <= 0:
            continue
        load_x = weights[x] / replicas[x]
        for y in range(-1 if receiver_free else 0, weights.size):
            load_y = 0.0
            if y >= 0:
                if expert_node[y] != receiver or spare[y] <= 0:
                    continue
                load_y = weights[y] / replicas[y]
            moved = load_x - load_y
            score = min(moved, gap - moved)
            if moved > 0 and load_x + load_y <= left and score > best_score:
                best_x, best_y, best_score = x, y, score
    return best_x, best_y


@njit(cache=True, nogil=True, error_model="numpy")
def replica_nodes(weights, expert_node, replicas, node_slots, node_share, budget, node_count):
    """The node of every replica of a global plan's replica counts, one replica of each expert at home.

    Every expert keeps one replica on its home node; its other ``replicas - 1`` (``replicas [L, E]``
    int64, e.g. a global plan's counts, summing to the slots) start home too, each carrying
    ``w / r`` tokens (an even split). A node with more replicas than ``node_slots [N]`` int64
    hands its lightest spare replicas (the fewest tokens off home) to the node with a free slot and
    the most room below its target ``node_share [N] * total``; then, while it helps, the heaviest
    node exchanges a spare replica with one of the lightest node's (or hands it one into a free
    slot), the pair moving the load closest to half their gap (:func:`best_swap`). At most
    ``budget [L]`` tokens leave home. ``weights [L, E]`` float64, ``expert_node [L, E]`` int64.

    Where the budget cannot move an overflowing node's lightest spare replica, that replica goes to
    the heaviest replica of an expert at home on a node with a free slot instead (``replicas`` is
    updated in place: the counts the placement then has).

    Writes ``node_count [L, N, E]`` int64 (zero on entry): replicas of each expert on each node.
    """
    num_layers, num_experts = weights.shape
    num_nodes = node_slots.size
    for layer in range(num_layers):
        w, r, home, count = weights[layer], replicas[layer], expert_node[layer], node_count[layer]
        loads, used = np.zeros(num_nodes), np.zeros(num_nodes, np.int64)
        spare = r - 1
        for e in range(num_experts):
            loads[home[e]] += w[e]
            used[home[e]] += r[e]
            count[home[e], e] = r[e]
        target = node_share * w.sum()
        left = budget[layer]
        for _ in range(num_experts * num_nodes):
            over = used - node_slots
            donor = np.argmax(over)
            y = -1
            if over[donor] > 0:
                receiver, x = -1, -1
                for n in range(num_nodes):
                    if over[n] < 0 and (receiver < 0 or loads[n] - target[n] < loads[receiver] - target[receiver]):
                        receiver = n
                for e in range(num_experts):  # the lightest spare replica of the donor
                    if home[e] == donor and spare[e] > 0 and (x < 0 or w[e] / r[e] < w[x] / r[x]):
                        x = e
                if receiver < 0 or x < 0:
                    break
                if w[x] / r[x] > left:  # no budget to move it: the receiver's heaviest replica gets the slot
                    y = -1
                    for e in range(num_experts):
                        if home[e] == receiver and (y < 0 or w[e] / r[e] > w[y] / r[y]):
                            y = e
                    if y < 0:  # no expert at home there: the heaviest replica of any (the cap then judges it)
                        y = np.argmax(w / r)
                    r[x] -= 1
                    r[y] += 1
                    spare[x] -= 1
                    count[donor, x] -= 1
                    count[receiver, y] += 1
                    used[donor] -= 1
                    used[receiver] += 1
                    for n in range(num_nodes):
                        loads[n] = (count[n] * w / r).sum()
                    continue
            else:
                donor, receiver = np.argmax(loads - target), np.argmin(loads - target)
                x, y = best_swap(w, r, home, spare, donor, receiver, loads[donor] - loads[receiver], left,
                                 over[receiver] < 0)
                if x < 0:
                    break
            for e, giver, taker in ((x, donor, receiver), (y, receiver, donor)):
                if e < 0:
                    continue
                spare[e] -= 1
                count[giver, e] -= 1
                count[taker, e] += 1
                used[giver] -= 1
                used[taker] += 1
                loads[giver] -= w[e] / r[e]
                loads[taker] += w[e] / r[e]
                left -= w[e] / r[e]


@njit(cache=True, nogil=True, error_model="numpy")
def best_exchange(item_load, item_expert, slot_gpu, gpu_load, holds, away, is_home, at_home, g, left):
    """The best exchange of a slot of GPU ``g`` (the heaviest) with a slot of another GPU: the pair
    ``(a, b)`` whose exchange leaves the two GPUs' larger load lowest (below ``gpu_load[g]``), for
    at most ``left`` more tokens off home (ties: the fewest); ``(-1, -1)`` when none lowers it.
    ``away [S, G]`` float64: the tokens a slot's replica serves off home when it sits on a GPU,
    ``is_home [S, G]`` bool whether a GPU is on the home node of a slot's replica, ``at_home [E]``
    int64 replicas of each expert on its home node (an exchange never takes an expert's last one
    away from there), ``holds [G, E]`` int64 replicas of each expert on each GPU; other arrays ``[S]`` / ``[G]``."""
    peak = gpu_load[g]
    best_a, best_b, best_peak, best_cost = -1, -1, peak * (1.0 - 1e-9), 0.0
    for a in range(item_load.size):
        if slot_gpu[a] != g:
            continue
        for b in range(item_load.size):
            h = slot_gpu[b]
            if h == g or item_expert[a] == item_expert[b] or holds[h, item_expert[a]] > 0 \
                    or holds[g, item_expert[b]] > 0:
                continue
            if (is_home[a, g] and not is_home[a, h] and at_home[item_expert[a]] == 1) or \
                    (is_home[b, h] and not is_home[b, g] and at_home[item_expert[b]] == 1):
                continue
            new_peak = max(peak - item_load[a] + item_load[b], gpu_load[h] - item_load[b] + item_load[a])
            cost = away[a, h] - away[a, g] + away[b, g] - away[b, h]
            if cost > left or new_peak > best_peak or (new_peak == best_peak and cost >= best_cost):
                continue
            best_a, best_b, best_peak, best_cost = a, b, new_peak, cost
    return best_a, best_b


@njit(cache=True, nogil=True, error_model="numpy")
def exchange_descent(weights, phy2log, replicas, slot_gpu, gpu_node, expert_node, budget, max_steps, keep_home):
    """Lower every layer's heaviest GPU by exchanging slots across GPUs and nodes, spending at most
    ``budget [L]`` tokens off home in all (in place on ``phy2log [L, S]`` int64).

    Each slot carries ``w / r`` of its expert's tokens (``replicas [L, E]`` int64 fixed, an even
    split); a replica serves its tokens off home when its GPU's node (``gpu_node [G]``) is not its
    expert's home (``expert_node [L, E]``). A step exchanges one slot of the heaviest GPU with one
    slot elsewhere (:func:`best_exchange`); at most ``max_steps`` steps a layer. With ``keep_home``
    every expert keeps a replica on its home node; without, an expert's last one may leave (all its
    tokens then count off home).
    ``weights [L, E]`` float64, ``slot_gpu [S]`` int64.
    """
    num_layers, num_experts = weights.shape
    num_slots, num_gpus = slot_gpu.size, gpu_node.size
    for layer in range(num_layers):
        row = phy2log[layer]
        item_load = np.empty(num_slots)
        away = np.zeros((num_slots, num_gpus))
        is_home = np.zeros((num_slots, num_gpus), np.bool_)
        at_home = np.zeros(num_experts, np.int64)
        gpu_load = np.zeros(num_gpus)
        holds = np.zeros((num_gpus, num_experts), np.int64)
        spent = 0.0
        for s in range(num_slots):
            e = row[s]
            item_load[s] = weights[layer, e] / replicas[layer, e]
            for h in range(num_gpus):
                is_home[s, h] = gpu_node[h] == expert_node[layer, e]
                if not is_home[s, h]:
                    away[s, h] = item_load[s]
            at_home[e] += is_home[s, slot_gpu[s]] if keep_home else num_slots + 1  # never the last one
            gpu_load[slot_gpu[s]] += item_load[s]
            holds[slot_gpu[s], e] += 1
            spent += away[s, slot_gpu[s]]
        for _ in range(max_steps):
            g = np.argmax(gpu_load)
            a, b = best_exchange(item_load, row, slot_gpu, gpu_load, holds, away, is_home, at_home, g,
                                 budget[layer] - spent)
            if a < 0:
                break
            h = slot_gpu[b]
            at_home[row[a]] += np.int64(is_home[a, h]) - np.int64(is_home[a, g])
            at_home[row[b]] += np.int64(is_home[b, g]) - np.int64(is_home[b, h])
            spent += away[a, h] - away[a, g] + away[b, g] - away[b, h]
            gpu_load[g] += item_load[b] - item_load[a]
            gpu_load[h] += item_load[a] - item_load[b]
            holds[g, row[a]] -= 1
            holds[h, row[a]] += 1
            holds[h, row[b]] -= 1
            holds[g, row[b]] += 1
            row[a], row[b] = row[b], row[a]
            item_load[a], item_load[b] = item_load[b], item_load[a]
            away[a], away[b] = away[b].copy(), away[a].copy()
            is_home[a], is_home[b] = is_home[b].copy(), is_home[a].copy()

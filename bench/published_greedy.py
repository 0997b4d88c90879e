"""A pure-NumPy re-implementation of the published greedy EPLB algorithm (DeepSeek, MIT licence).

Written from the algorithm's description, kept outside the package on purpose: it is the
baseline that eplb's speed and quality are measured against side by side, and the reference its
``method="greedy"`` must agree with (same per-GPU loads on every layer). It follows the published
code's arithmetic (float32 weights) and tie rules (first index wins), in plain Python loops.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int):
    """``weight [n, items]`` -> ``(pack_index, rank_in_pack)``, each ``[n, items]``: items in
    decreasing weight go to the lightest pack that still has room (``items / num_packs`` each)."""
    num_layers, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        index = np.tile(np.arange(num_items, dtype=np.int64), (num_layers, 1))
        return index, np.zeros_like(index)
    pack_index = np.full((num_layers, num_items), -1, np.int64)
    rank_in_pack = np.full((num_layers, num_items), -1, np.int64)
    for i in range(num_layers):
        loads = [np.float32(0.0)] * num_packs
        sizes = [0] * num_packs
        for item in np.argsort(-weight[i], kind="stable"):
            pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=loads.__getitem__)
            pack_index[i, item] = pack
            rank_in_pack[i, item] = sizes[pack]
            loads[pack] = np.float32(loads[pack] + weight[i, item])
            sizes[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int):
    """``weight [n, E]`` -> ``phy2log [n, num_phy]``, ``rank [n, num_phy]``, ``logcnt [n, E]``:
    each extra replica goes to the expert with the largest load per replica."""
    n, num_log = weight.shape
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (n, 1))
    rank = np.zeros((n, num_phy), np.int64)
    logcnt = np.ones((n, num_log), np.int64)
    rows = np.arange(n)
    for i in range(num_log, num_phy):
        best = (weight / logcnt.astype(np.float32)).argmax(axis=-1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(weight, num_phy, num_groups, num_nodes, num_gpus):
    """Groups -> nodes, replication inside each node, replicas -> GPUs. ``weight [L, E]`` float32."""
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus

    group_tokens = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(group_tokens, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
                + np.arange(group_size)).reshape(num_layers, -1)
    mlog2log = _inverse(log2mlog)

    mlog_tokens = np.take_along_axis(weight, mlog2log, -1).reshape(-1, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_tokens, num_phy // num_nodes)

    phy_tokens = np.take_along_axis(mlog_tokens / mlogcnt.astype(np.float32), phy2mlog, -1)
    pack, rank = balanced_packing(phy_tokens, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    offsets = np.arange(0, num_log, num_log // num_nodes)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + offsets).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """The published entry point: ``phy2log [L, S]``, ``log2phy [L, E, R]``, ``logcnt [L, E]``."""
    weight = np.asarray(weight, dtype=np.float32)
    num_layers, num_log = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    width = int(logcnt.max())
    log2phy = np.full((num_layers, num_log * width), -1, np.int64)
    np.put_along_axis(log2phy, phy2log * width + phyrank,
                      np.broadcast_to(np.arange(num_replicas), phy2log.shape), axis=1)
    return phy2log, log2phy.reshape(num_layers, num_log, width), logcnt

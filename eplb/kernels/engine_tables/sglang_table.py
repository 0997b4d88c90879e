"""SGLang's static dispatch table in Numba: CPython's ``random`` stream, per rank, over plain arrays.

SGLang builds ``logical_to_rank_dispatch_physical_map`` with ``random.Random(42)`` (one stream per
rank, see :mod:`eplb.analysis.engine_dispatch`). These kernels reproduce CPython's Mersenne Twister
(``_randommodule.c``: ``init_by_array``, ``genrand_uint32``) and the pure-Python ``getrandbits``
based ``_randbelow``, ``sample`` (pool and set variants) and ``shuffle`` of ``random.py``, draw
for draw, so that a table is computed in milliseconds instead of seconds, and a layer's table
can be computed for several candidate layouts from the same stream state.

A stream state is ``[625]`` int64: the 624 words of the twister (each in ``[0, 2**32)``), then the
index of the next word; a rank's streams are the rows of ``[G, 625]``.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL

_N = 624
_M = 397
_MASK = 0xFFFFFFFF
STATE_WIDTH = _N + 1


@njit(cache=True, nogil=True, error_model="numpy")
def seeded_state(seed):
    """``[625]`` int64: the state of ``random.Random(seed)`` for ``0 <= seed < 2**32``
    (``init_genrand(19650218)`` then ``init_by_array([seed])``)."""
    mt = np.zeros(STATE_WIDTH, np.int64)
    mt[0] = 19650218
    for i in range(1, _N):
        mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & _MASK
    i, j = 1, 0
    for _ in range(_N):  # max(N, key length 1)
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525)) + seed + j) & _MASK
        i += 1
        j = 0  # the key has one word
        if i >= _N:
            mt[0] = mt[_N - 1]
            i = 1
    for _ in range(_N - 1):
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941)) - i) & _MASK
        i += 1
        if i >= _N:
            mt[0] = mt[_N - 1]
            i = 1
    mt[0] = 0x80000000
    mt[_N] = _N  # index: regenerate on the first draw
    return mt


@njit(cache=True, nogil=True, error_model="numpy")
def next_uint32(mt):
    """The next 32-bit word of the stream ``mt [625]`` (advanced in place)."""
    if mt[_N] >= _N:
        for kk in range(_N - 1):
            y = (mt[kk] & 0x80000000) | (mt[kk + 1] & 0x7FFFFFFF)
            source = kk + _M if kk < _N - _M else kk + _M - _N
            mt[kk] = mt[source] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        y = (mt[_N - 1] & 0x80000000) | (mt[0] & 0x7FFFFFFF)
        mt[_N - 1] = mt[_M - 1] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        mt[_N] = 0
    y = mt[mt[_N]]
    mt[_N] += 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return y & _MASK


@njit(cache=True, nogil=True, error_model="numpy")
def rand_below(mt, n):
    """``random.Random._randbelow_with_getrandbits(n)`` for ``1 <= n < 2**32``."""
    bits = 0
    while (n >> bits) > 0:
        bits += 1
    r = next_uint32(mt) >> (32 - bits)
    while r >= n:
        r = next_uint32(mt) >> (32 - bits)
    return r


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _sample_into(mt, population, k, out, start, pool):
    """``random.sample(population, k)`` written to ``out[start:start + k]`` (``pool``: scratch of at
    least ``len(population)``)."""
    n = population.shape[0]
    setsize = 21
    if k > 5:
        power = 1
        while power < k * 3:  # 4 ** ceil(log(3k, 4))
            power *= 4
        setsize += power
    if n <= setsize:
        pool[:n] = population
        for i in range(k):
            j = rand_below(mt, n - i)
            out[start + i] = pool[j]
            pool[j] = pool[n - i - 1]
    else:
        selected = np.zeros(n, np.bool_)
        for i in range(k):
            j = rand_below(mt, n)
            while selected[j]:
                j = rand_below(mt, n)
            selected[j] = True
            out[start + i] = population[j]


@njit(cache=True, nogil=True, error_model="numpy")
def fair_pick(mt, candidates, takers, position, scratch):
    """One rank's entry of SGLang's ``_fair_choices(candidates, takers, r)[position]``: each of the
    ``n`` candidates ``takers // n`` times plus ``random.sample`` of ``takers % n``, shuffled by
    ``random.shuffle``, on the rank's stream ``mt`` (advanced in place). ``scratch``: int64 of at
    least ``takers + n``."""
    n = candidates.shape[0]
    rounds = takers // n
    picks = scratch[:takers]
    for r in range(rounds):
        picks[r * n:(r + 1) * n] = candidates
    _sample_into(mt, candidates, takers - rounds * n, picks, rounds * n, scratch[takers:])
    for i in range(takers - 1, 0, -1):
        j = rand_below(mt, i + 1)
        value = picks[i]
        picks[i] = picks[j]
        picks[j] = value
    return picks[position]


@njit(cache=True, nogil=True, error_model="numpy")
def static_layer_table(near, log2phy, logcnt, streams, table):
    """One layer of SGLang's static table, advancing every rank's stream.

    Args:
        near: ``[G, E]`` int64, the rank's near replica of each expert, ``-1`` where it takes a fair pick.
        log2phy: ``[E, R]`` int64 slots of each expert, increasing, ``-1`` padded; logcnt: ``[E]`` int64.
        streams: ``[G, 625]`` int64, each rank's stream state before this layer (advanced in place).
        table: ``[G, E]`` int64 output: the slot each rank sends each expert's tokens to.
    """
    num_ranks, num_experts = near.shape
    takers = np.zeros(num_experts, np.int64)
    for r in range(num_ranks):
        for e in range(num_experts):
            if near[r, e] < 0:
                takers[e] += 1
    seen = np.zeros(num_experts, np.int64)
    scratch = np.empty(num_ranks + log2phy.shape[1], np.int64)
    for r in range(num_ranks):
        mt = streams[r]
        for e in range(num_experts):  # the experts a rank has no near replica of, in order
            if near[r, e] >= 0:
                table[r, e] = near[r, e]
            else:
                table[r, e] = fair_pick(mt, log2phy[e, :logcnt[e]], takers[e], seen[e], scratch)
                seen[e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def near_replicas(row, log2phy, logcnt, num_gpus, num_nodes):
    """SGLang's near replica of each expert for each rank (``_find_nearest_expert``), one layer.

    Args:
        row: ``[S]`` int64 expert of each slot (``S / num_gpus`` contiguous slots per GPU, GPUs in
            ``num_nodes`` contiguous nodes); log2phy: ``[E, R]`` int64; logcnt: ``[E]`` int64.
    Returns:
        ``[G, E]`` int64: the only replica; else the rank's lowest slot of the expert; else the
        lowest slot on the rank's node when that node holds some but not all of its replicas; else ``-1``.
    """
    num_slots = row.shape[0]
    num_experts = logcnt.shape[0]
    per_gpu = num_slots // num_gpus
    per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    node_first = np.full((num_nodes, num_experts), -1, np.int64)
    on_node = np.zeros((num_nodes, num_experts), np.int64)
    own_first = np.full((num_gpus, num_experts), -1, np.int64)
    for s in range(num_slots - 1, -1, -1):  # the lowest slot is written last
        e = row[s]
        node_first[s // per_node, e] = s
        own_first[s // per_gpu, e] = s
        on_node[s // per_node, e] += 1
    near = np.full((num_gpus, num_experts), -1, np.int64)
    for g in range(num_gpus):
        n = g // gpus_per_node
        for e in range(num_experts):
            if logcnt[e] == 1:
                near[g, e] = log2phy[e, 0]
            elif own_first[g, e] >= 0:
                near[g, e] = own_first[g, e]
            elif 0 < on_node[n, e] < logcnt[e]:
                near[g, e] = node_first[n, e]
    return near


@njit(cache=True, nogil=True, error_model="numpy")
def dynamic_layer_shares(near, row, log2phy, logcnt, shares):
    """One layer's shares under SGLang ``dynamic`` with an all-to-all backend: the near replica,
    else replica ``randint(0, 65536) % n`` of the expert's list (see :mod:`eplb.analysis.engine_dispatch`).

    Args:
        near: ``[G, E]`` from :func:`near_replicas`; row: ``[S]``; log2phy: ``[E, R]``; logcnt: ``[E]``.
        shares: ``[S]`` float64 output.
    """
    num_ranks, num_experts = near.shape
    shares[:] = 0.0
    for r in range(num_ranks):
        for e in range(num_experts):
            if near[r, e] >= 0:
                shares[near[r, e]] += 1.0 / num_ranks
            else:
                n = logcnt[e]
                for i in range(n):
                    draw = (65536 // n + (1 if i < 65536 % n else 0)) / 65536.0
                    shares[log2phy[e, i]] += draw / num_ranks


@njit(cache=True, nogil=True, error_model="numpy")
def table_shares(table, num_slots, shares):
    """``shares [S]`` (output): the fraction of the ranks whose ``table [G, E]`` entry is each slot."""
    num_ranks, num_experts = table.shape
    shares[:num_slots] = 0.0
    for r in range(num_ranks):
        for e in range(num_experts):
            shares[table[r, e]] += 1.0 / num_ranks

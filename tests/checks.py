"""Assertions shared by the tests: what makes a placement valid."""

import numpy as np

import eplb


def assert_valid(placement: eplb.Placement, num_experts: int):
    """Every expert >= 1 replica per layer, exactly k slots per GPU, the three arrays consistent."""
    phy2log, log2phy, logcnt = placement.phy2log, placement.log2phy, placement.logcnt
    assert_valid_arrays(phy2log, log2phy, logcnt, num_experts, placement.topology.num_slots)
    assert placement.topology.slot_offsets[-1] == phy2log.shape[1]


def assert_valid_arrays(phy2log, log2phy, logcnt, num_experts, num_slots):
    num_layers = phy2log.shape[0]
    assert phy2log.shape == (num_layers, num_slots)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape[:2] == (num_layers, num_experts)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    assert (logcnt >= 1).all(), "every expert needs a replica"
    assert (logcnt.sum(axis=1) == num_slots).all()
    for layer in range(num_layers):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        for e in range(num_experts):
            slots = log2phy[layer, e]
            held = slots[slots >= 0]
            assert len(held) == logcnt[layer, e]
            assert (slots[len(held):] == -1).all(), "padding comes after the slots"
            assert (phy2log[layer, held] == e).all()


def _fits_spread(replicas: np.ndarray, slots: np.ndarray) -> bool:
    """Whether experts with ``replicas`` fit on GPUs with ``slots`` (same total), none twice on a GPU:
    the Gale-Ryser condition with the replica counts sorted (the package checks the other side)."""
    r = np.sort(np.asarray(replicas))[::-1]
    k = np.asarray(slots)
    return r.sum() == k.sum() and all(r[:j].sum() <= np.minimum(k, j).sum() for j in range(1, len(r) + 1))


def avoidable_doubled(placement: eplb.Placement, hierarchical: bool) -> np.ndarray:
    """``[L]``: per layer, the domains (all GPUs, or each node when ``hierarchical``) that break the
    spread rule of docs/methods.md, counted by their doubled slots (at least 1): an expert with more
    replicas than the domain's GPUs with slots, unless its slots exceed its experts times those
    GPUs; or an expert twice on a GPU where the domain's replica counts fit with none twice."""
    topology = placement.topology
    gpu = topology.gpu_of_slot
    active = topology.slots_per_gpu > 0
    domains = ([np.flatnonzero(active)] if not hierarchical else
               [np.flatnonzero(active & (topology.node_of_gpu == n)) for n in range(topology.num_nodes)])
    out = np.zeros(placement.num_layers, np.int64)
    for layer, row in enumerate(placement.phy2log):
        for gpus in domains:
            inside = np.isin(gpu, gpus)
            if not inside.any():
                continue
            replicas = np.bincount(row[inside])
            replicas = replicas[replicas > 0]
            doubled = int(inside.sum()) - len(set(zip(gpu[inside].tolist(), row[inside].tolist())))
            slots = topology.slots_per_gpu[gpus]
            over_cap = slots.sum() <= len(replicas) * len(gpus) and replicas.max() > len(gpus)
            if over_cap or (doubled and _fits_spread(replicas, slots)):
                out[layer] += max(doubled, 1)
    return out

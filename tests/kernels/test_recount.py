"""The recounted start of the migration search (:mod:`eplb.kernels.search.recount`): the rule of its
docstring, checked against a plain-Python statement of it (the implementation it replaced, kept
here as the oracle), on random and nasty placements, global and hierarchical."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.kernels.search.recount import recounted_starts


def oracle(weights, previous, scratch, gpu, offsets, node_of_gpu, group_of_expert, hierarchical):
    """One layer, in Python: ``[S]`` or ``None`` (no start)."""
    num_experts = weights.shape[0]
    have = np.bincount(previous, minlength=num_experts)
    want = np.bincount(scratch, minlength=num_experts)
    if np.array_equal(have, want):
        return None
    node_of_slot = node_of_gpu[gpu]
    share = weights / np.maximum(want, 1)
    row = previous.copy()
    loads = np.bincount(gpu, weights=share[row], minlength=len(offsets) - 1)
    free = []
    for e in np.flatnonzero(have > want):
        slots = sorted(np.flatnonzero(row == e).tolist(), key=lambda s: (-loads[gpu[s]], s))[: have[e] - want[e]]
        for s in slots:
            loads[gpu[s]] -= share[e]
        free.extend(slots)
    short = np.flatnonzero(want > have)
    needs = sorted(np.repeat(short, (want - have)[short]).tolist(), key=lambda e: (-share[e], e))
    free = np.array(free, dtype=np.int64)
    taken = np.zeros(free.size, bool)
    group_node = None
    if hierarchical:
        num_groups = int(group_of_expert.max()) + 1
        present = np.zeros((num_groups, len(node_of_gpu)), bool)
        present[group_of_expert[previous], node_of_slot] = True
        if (present.sum(axis=1) != 1).any():
            return None
        group_node = np.argmax(present, axis=1)
    for e in needs:
        best, best_key = -1, None
        for i in np.flatnonzero(~taken):
            s = free[i]
            if hierarchical and node_of_slot[s] != group_node[group_of_expert[e]]:
                continue
            if np.any(row[offsets[gpu[s]]:offsets[gpu[s] + 1]] == e):
                continue
            key = (loads[gpu[s]], s)
            if best < 0 or key < best_key:
                best, best_key = i, key
        if best < 0:
            return None
        taken[best] = True
        row[free[best]] = e
        loads[gpu[free[best]]] += share[e]
    return row


@st.composite
def layers(draw):
    """Placements on up to 6 GPUs of 0-4 slots (2 nodes when the GPUs split evenly), with ties
    (integer and zero loads) and groups that may or may not sit on one node."""
    num_gpus = draw(st.integers(1, 6))
    slots = np.array(draw(st.lists(st.integers(0, 4), min_size=num_gpus, max_size=num_gpus)), np.int64)
    num_slots = int(slots.sum())
    if num_slots == 0:
        slots[0], num_slots = 1, 1
    num_experts = draw(st.integers(1, num_slots))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for _ in range(2):
        row = np.concatenate([np.arange(num_experts), rng.integers(0, num_experts, num_slots - num_experts)])
        rows.append(rng.permutation(row).astype(np.int64))
    weights = draw(st.sampled_from([rng.integers(0, 4, num_experts), rng.random(num_experts) * 100,
                                    np.zeros(num_experts)])).astype(np.float64)
    offsets = np.concatenate([[0], np.cumsum(slots)]).astype(np.int64)
    gpu = np.repeat(np.arange(num_gpus), slots).astype(np.int64)
    nodes = 2 if num_gpus % 2 == 0 and draw(st.booleans()) else 1
    node_of_gpu = (np.arange(num_gpus) // (num_gpus // nodes)).astype(np.int64)
    num_groups = draw(st.sampled_from([g for g in (1, 2, 4) if num_experts % g == 0]))
    group_of_expert = (np.arange(num_experts) // (num_experts // num_groups)).astype(np.int64)
    return weights, rows[0], rows[1], gpu, offsets, node_of_gpu, group_of_expert, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(layers())
def test_the_kernel_follows_the_rule(case):
    weights, previous, scratch, gpu, offsets, node_of_gpu, group_of_expert, hierarchical = case
    expected = oracle(*case)
    rows, found = recounted_starts(weights[None], previous[None], scratch[None], gpu, offsets, node_of_gpu,
                                   group_of_expert, hierarchical)
    assert bool(found[0]) == (expected is not None)
    if expected is not None:
        np.testing.assert_array_equal(rows[0], expected)
        # what a start must be: the fresh plan's replica counts, changes only where a surplus left
        np.testing.assert_array_equal(np.bincount(rows[0], minlength=len(weights)),
                                      np.bincount(scratch, minlength=len(weights)))
        surplus = np.bincount(previous, minlength=len(weights)) > np.bincount(scratch, minlength=len(weights))
        changed = rows[0] != previous
        assert surplus[previous[changed]].all()


def test_many_layers_at_once_are_each_layer_alone():
    rng = np.random.default_rng(3)
    num_gpus, per_gpu, num_experts = 8, 3, 16
    num_slots = num_gpus * per_gpu
    previous = np.array([rng.permutation(np.concatenate([np.arange(num_experts),
                                                         rng.integers(0, num_experts, num_slots - num_experts)]))
                         for _ in range(5)], dtype=np.int64)
    scratch = np.array([rng.permutation(row) for row in previous[::-1]], dtype=np.int64)
    scratch[2] = rng.permutation(previous[2])  # the same counts: no start
    weights = rng.random((5, num_experts)) * 1000
    gpu = np.repeat(np.arange(num_gpus), per_gpu).astype(np.int64)
    offsets = np.arange(0, num_slots + 1, per_gpu, dtype=np.int64)
    args = (gpu, offsets, np.zeros(num_gpus, np.int64), np.zeros(num_experts, np.int64), False)
    rows, found = recounted_starts(weights, previous, scratch, *args)
    assert not found[2]
    for layer in range(5):
        expected = oracle(weights[layer], previous[layer], scratch[layer], *args)
        assert (expected is not None) == bool(found[layer])
        if expected is not None:
            np.testing.assert_array_equal(rows[layer], expected)


def test_hierarchical_starts_keep_every_group_on_its_node():
    rng = np.random.default_rng(5)
    gpu = np.repeat(np.arange(4), 3).astype(np.int64)
    offsets = np.arange(0, 13, 3, dtype=np.int64)
    node_of_gpu = np.array([0, 0, 1, 1], np.int64)
    group_of_expert = np.repeat([0, 1], 4).astype(np.int64)
    found_any = 0
    for _ in range(40):
        # each node holds its group's 4 experts and 2 extra replicas of them
        previous = np.concatenate([rng.permutation(np.concatenate([np.arange(4), rng.integers(0, 4, 2)])),
                                   rng.permutation(np.concatenate([np.arange(4, 8), rng.integers(4, 8, 2)]))])
        scratch = np.concatenate([rng.permutation(np.concatenate([np.arange(4, 8), rng.integers(4, 8, 2)])),
                                  rng.permutation(np.concatenate([np.arange(4), rng.integers(0, 4, 2)]))])
        weights = rng.random(8) * 10
        args = (gpu, offsets, node_of_gpu, group_of_expert, True)
        expected = oracle(weights, previous, scratch, *args)
        rows, found = recounted_starts(weights[None], previous[None].astype(np.int64), scratch[None].astype(np.int64),
                                       *args)
        assert (expected is not None) == bool(found[0])
        if expected is not None:
            found_any += 1
            np.testing.assert_array_equal(rows[0], expected)
            assert (node_of_gpu[gpu][rows[0] < 4] == 0).all() and (node_of_gpu[gpu][rows[0] >= 4] == 1).all()
    assert found_any > 5

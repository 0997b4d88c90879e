"""The spread rule's checks and repair (``eplb.planning.spread``), against the rule's own words:
``brute_force.keeps_spread_rule`` (enumeration, no theorem) and ``checks.avoidable_doubled``
(Gale-Ryser with the replica counts sorted; the package sorts the slot counts)."""

from __future__ import annotations

import numpy as np
from brute_force import _fits_spread
from checks import assert_valid, avoidable_doubled as oracle
from hypothesis import event, given, settings
from hypothesis import strategies as st

import eplb
from eplb.planning.spread import avoidable_doubled, capped, counts_allow_spread, domains, spread_row, within_cap


@settings(max_examples=300)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_counts_fit_spread_exactly_when_an_enumeration_finds_an_arrangement(replicas, slots):
    if sum(replicas) != sum(slots):  # move the difference onto the first GPU, keeping it > 0
        slots[0] += sum(replicas) - sum(slots)
    if slots[0] < 1:
        return
    assert counts_allow_spread(np.array(replicas), np.array(slots)) == _fits_spread(replicas, slots)


@st.composite
def rows(draw):
    """A deployment (global, or hierarchical with one group a node; uneven and masked slots) and a
    valid ``phy2log`` row of it: every expert once, the other slots random experts of the domain,
    all shuffled (so doubled replicas, avoidable or not, are common)."""
    hierarchical = draw(st.booleans())
    if hierarchical:
        size, per_node = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        slots = [draw(st.integers(0, 4)) for _ in range(2 * per_node)]
        for node in range(2):  # every node holds a group: at least its size in slots
            block = slots[node * per_node:(node + 1) * per_node]
            if sum(block) < size:
                slots[node * per_node] += size - sum(block)
        topology = eplb.Topology(np.array(slots, np.int64), 2)
        deployment = eplb.Deployment.of(2 * size, topology=topology, num_groups=2)  # group g on node g
    else:
        slots = [draw(st.integers(0, 5)) for _ in range(draw(st.integers(1, 4)))]
        slots[0] = max(slots[0], 1)
        topology = eplb.Topology(np.array(slots, np.int64))
        deployment = eplb.Deployment.of(draw(st.integers(1, topology.num_slots)), topology=topology)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row = np.empty(topology.num_slots, np.int64)
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    size = deployment.num_experts // (deployment.num_groups or 1)
    for node in range(topology.num_nodes):
        slots_here = np.flatnonzero(node_of_slot == node) if hierarchical else np.arange(topology.num_slots)
        experts = np.arange(node * size, (node + 1) * size) if hierarchical else np.arange(deployment.num_experts)
        picks = np.concatenate([experts, rng.choice(experts, len(slots_here) - len(experts))])
        row[slots_here] = rng.permutation(picks)
        if not hierarchical:
            break
    return deployment, row


@settings(max_examples=300)
@given(rows())
def test_avoidable_doubled_agrees_with_the_rule_in_its_own_words(case):
    deployment, row = case
    placement = eplb.Placement(row[None], deployment.num_experts, deployment.topology, deployment.num_groups)
    assert (avoidable_doubled(row[None], deployment) > 0) == (oracle(placement, deployment.hierarchical) > 0)


@settings(max_examples=300)
@given(rows())
def test_spread_row_keeps_the_rule_each_experts_domain_and_the_rows_that_keep_it(case):
    deployment, row = case
    spread = spread_row(row, deployment)
    placement = eplb.Placement(spread[None], deployment.num_experts, deployment.topology, deployment.num_groups)
    assert_valid(placement, deployment.num_experts)
    assert oracle(placement, deployment.hierarchical)[0] == 0
    node_of_slot = deployment.topology.node_of_gpu[deployment.topology.gpu_of_slot]
    for e in range(deployment.num_experts):  # every expert stays on the nodes it was on
        assert set(node_of_slot[spread == e]) <= set(node_of_slot[row == e]) or not deployment.hierarchical
    if avoidable_doubled(row[None], deployment)[0] == 0:
        np.testing.assert_array_equal(spread, row)


@settings(max_examples=300)
@given(rows(), st.integers(0, 2**32 - 1))
def test_within_cap_changes_one_slot_per_replica_above_the_cap_and_keeps_each_experts_domain(case, seed):
    """``within_cap`` (the guard of a search near the placement in service): the row within the cap,
    one changed slot per replica above it, each to an expert of the slot's domain; ``None`` only
    where a domain would still break the spread part, which a domain with a GPU of more slots than
    experts never does; a row that keeps the rule is returned as it is."""
    deployment, row = case
    topology = deployment.topology
    weights = np.random.default_rng(seed).gamma(0.5, 10.0, deployment.num_experts)
    out = within_cap(row, weights, deployment)
    excess, crowded = 0, True
    for gpus in domains(deployment):
        counts = np.bincount(row[np.isin(topology.gpu_of_slot, gpus)], minlength=deployment.num_experts)
        present, slots = np.flatnonzero(counts), topology.slots_per_gpu[gpus]
        if capped(present.size, slots):
            excess += int(np.maximum(counts - gpus.size, 0).sum())
        crowded &= bool(slots.max() > present.size)  # a GPU must hold an expert twice: no spread part
    event("replicas above the cap" if excess else "within the cap")
    if out is None:
        assert not crowded and avoidable_doubled(row[None], deployment)[0] > 0
        return
    placement = eplb.Placement(out[None], deployment.num_experts, topology, deployment.num_groups)
    assert_valid(placement, deployment.num_experts)
    assert oracle(placement, deployment.hierarchical)[0] == 0
    assert int((out != row).sum()) == excess
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    for e in range(deployment.num_experts):  # every expert stays on the nodes it was on
        assert set(node_of_slot[out == e]) <= set(node_of_slot[row == e]) or not deployment.hierarchical
    if avoidable_doubled(row[None], deployment)[0] == 0:
        np.testing.assert_array_equal(out, row)

"""Exposure to one lost GPU or node (eplb/analysis/exposure.py) against a brute-force count, and
the keys every plan reports."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import eplb
import eplb.simulation.synthetic
from eplb.analysis.exposure import loss_shares, orphaned_tokens, sole_domain, worst_loss
from strategies import configs, counts_for


def brute_force_orphans(weights, phy2log, domain_of_slot, num_domains):
    """``[L, D]``: for every domain, lose it and add up the tokens of the experts left without a replica."""
    out = np.zeros((weights.shape[0], num_domains))
    for layer in range(weights.shape[0]):
        for lost in range(num_domains):
            survivors = {int(e) for s, e in enumerate(phy2log[layer]) if domain_of_slot[s] != lost}
            present = set(int(e) for e in phy2log[layer])
            out[layer, lost] = sum(weights[layer, e] for e in present - survivors)
    return out


@st.composite
def placements(draw):
    """``(topology, phy2log, counts)``: any slot contents (doubled experts, absent experts), any counts."""
    config = draw(configs(max_experts=12, max_gpus=8, max_slots_per_gpu=4))
    topology = eplb.Topology.uniform(config["num_slots"], config["num_gpus"], config["num_nodes"])
    counts = draw(counts_for(config["num_experts"]))
    rows = draw(st.lists(st.lists(st.integers(0, config["num_experts"] - 1), min_size=config["num_slots"],
                                  max_size=config["num_slots"]), min_size=counts.shape[0], max_size=counts.shape[0]))
    return topology, np.array(rows, np.int64), counts


@given(placements())
def test_orphaned_tokens_match_losing_each_domain(case):
    topology, phy2log, counts = case
    for domain_of_slot, num_domains in ((topology.gpu_of_slot, topology.num_gpus),
                                        (topology.node_of_gpu[topology.gpu_of_slot], topology.num_nodes)):
        expected = brute_force_orphans(counts, phy2log, domain_of_slot, num_domains)
        np.testing.assert_allclose(orphaned_tokens(counts, phy2log, domain_of_slot, num_domains), expected,
                                   rtol=1e-12, atol=0)
        total = counts.sum()
        shares = loss_shares(counts, phy2log, domain_of_slot, num_domains)
        assert ((shares >= 0) & (shares <= 1)).all()
        if total > 0 and np.isfinite(total):
            np.testing.assert_allclose(shares, expected.sum(axis=0) / total, rtol=1e-9, atol=1e-15)
        else:
            assert (shares == 0).all()
    worst = worst_loss(counts, phy2log, topology)
    assert set(worst) == {"worst_gpu_loss", "worst_node_loss"}
    for key, domains in (("worst_gpu_loss", topology.gpu_of_slot),
                         ("worst_node_loss", topology.node_of_gpu[topology.gpu_of_slot])):
        assert worst[key] == pytest.approx(loss_shares(counts, phy2log, domains, int(domains.max()) + 1).max(),
                                           rel=1e-9, abs=1e-15)
    assert worst["worst_gpu_loss"] <= worst["worst_node_loss"] + 1e-12  # a node loss loses its GPUs too


def test_a_hand_counted_case():
    topology = eplb.Topology.uniform(8, 4, 2)  # GPUs 0, 1 on node 0; 2, 3 on node 1
    phy2log = np.array([[0, 1, 0, 2, 3, 4, 5, 5]])  # 0 twice on GPU 0; 5 on GPU 3 twice
    counts = np.array([[10.0, 1.0, 2.0, 3.0, 4.0, 5.0]])  # 25 tokens
    # expert 0 on GPUs 0 and 1 survives any one GPU; experts 0-2 all sit on node 0, 3-5 on node 1
    np.testing.assert_array_equal(orphaned_tokens(counts, phy2log, topology.gpu_of_slot, 4), [[1.0, 2.0, 7.0, 5.0]])
    np.testing.assert_array_equal(sole_domain(phy2log, topology.gpu_of_slot, 6), [[-1, 0, 1, 2, 2, 3]])
    worst = worst_loss(counts, phy2log, topology)
    assert worst == {"worst_gpu_loss": pytest.approx(7 / 25), "worst_node_loss": pytest.approx(13 / 25)}


def test_no_tokens_no_exposure_and_huge_counts_stay_finite():
    topology = eplb.Topology.uniform(4, 2, 1)
    phy2log = np.array([[0, 1, 2, 3]])
    assert worst_loss(np.zeros((1, 4)), phy2log, topology) == {"worst_gpu_loss": 0.0, "worst_node_loss": 0.0}
    huge = np.full((1, 4), 1e308)
    result = worst_loss(huge, phy2log, topology)
    assert result == {"worst_gpu_loss": 0.5, "worst_node_loss": 1.0}  # one node holds everything


def test_every_plan_reports_its_exposure_on_the_planning_counts():
    counts = eplb.simulation.synthetic.skewed_counts(4, 16, seed=2).astype(float)
    placement = eplb.plan(counts, num_slots=24, num_gpus=4, num_nodes=2)
    assert isinstance(placement.info["worst_gpu_loss"], float)
    expected = worst_loss(counts, placement.phy2log, placement.topology)
    assert {k: placement.info[k] for k in expected} == expected
    assert 0 < placement.info["worst_gpu_loss"] <= placement.info["worst_node_loss"] <= 1
    series = np.stack([counts, counts[::-1]])
    planned = eplb.plan(series, num_slots=24, num_gpus=4, num_nodes=2)  # a series: its summed windows
    assert planned.info["worst_gpu_loss"] == pytest.approx(
        worst_loss(series.sum(axis=0), planned.phy2log, planned.topology)["worst_gpu_loss"], rel=1e-12)

"""Two slots on every GPU: the weighting bound (one price per level, every level at once) never
exceeds the optimum, whatever plan it aims at, and on DeepSeek's decode unit (288 slots on 144
GPUs) it certifies plans the one-level bound leaves a percent short of."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.analysis.bounds import average_bound, pair_weights, strongest_bound
from eplb.simulation.synthetic import skewed_counts

from analysis.test_pair_bounds import sorted_pairing_optimum, two_slot_layers


@settings(max_examples=150, deadline=None)
@given(two_slot_layers(), st.sampled_from([1.0, 1.01, 1.5, 3.0]))
def test_the_weighting_bound_never_exceeds_the_optimum(instance, aim):
    w, num_gpus = instance
    deployment = eplb.Deployment.of(len(w), num_slots=2 * num_gpus, num_gpus=num_gpus)
    optimum = float(sorted_pairing_optimum(w, num_gpus))
    start = average_bound(w[None, :], deployment.topology)
    bound = pair_weights(w[None, :], deployment.topology, start, np.array([optimum * aim]))
    assert start[0] <= bound[0] <= optimum * (1 + 1e-12)
    # aimed at the optimum itself it proves the optimum, or stays below it; never past it
    assert eplb.plan(w[None, :], deployment).lower_bound[0] <= optimum * (1 + 1e-12)


def test_the_weighting_bound_is_the_start_on_other_topologies_and_empty_layers():
    w = np.array([[5.0, 3.0, 1.0, 0.0]])
    three = eplb.Deployment.of(4, num_slots=6, num_gpus=2)
    assert pair_weights(w, three.topology, np.array([3.0]), np.array([6.0]))[0] == 3.0
    two = eplb.Deployment.of(4, num_slots=4, num_gpus=2)
    assert pair_weights(np.zeros((1, 4)), two.topology, np.zeros(1), np.zeros(1))[0] == 0.0


def test_deepseek_decode_plans_are_certified_where_the_one_level_bound_is_short():
    counts = np.asarray(skewed_counts(8, 256, family="lognormal", skew=0.7, num_groups=8, seed=1), float)
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    placement = eplb.plan(counts, deployment, method="best")
    one_level = strongest_bound(counts, deployment)
    tightened = placement.lower_bound
    assert (tightened >= one_level).all() and (tightened <= placement.max_load).all()
    old_gap = placement.max_load / one_level - 1
    new_gap = placement.max_load / tightened - 1
    assert (old_gap > 1e-3).all()  # the one-level bound proves none of these plans optimal
    assert (new_gap <= 1e-9).sum() >= 2  # the weighting bound proves some exactly
    assert new_gap.mean() < 0.5 * old_gap.mean()

"""Two slots on every GPU: the replica-count model answers exactly (no counts under a target
below the optimum, counts that really pair at the optimum), and ``method="exact"`` proves layers
optimal with it where the closed form could not, on small instances against the sorted-pairing
oracle and at DeepSeek's decode size (288 slots on 144 GPUs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings

pytest.importorskip("ortools")

import eplb  # noqa: E402
from eplb.planning.methods.exact_model import Budget  # noqa: E402
from eplb.planning.methods.exact_pair_counts import counts_under  # noqa: E402
from eplb.simulation.synthetic import skewed_counts  # noqa: E402

from analysis.test_pair_bounds import sorted_pairing_optimum, two_slot_layers  # noqa: E402


def sorted_peak(w: np.ndarray, counts: np.ndarray) -> float:
    items = np.sort(np.repeat(w / counts, counts))
    return float((items + items[::-1]).max())


@settings(max_examples=120, deadline=None)
@given(two_slot_layers())
@example((np.array([1.0, 11.0, 17.0]), 5))  # the optimum gives the light expert 5 replicas, above those listed
def test_the_count_model_is_exact_on_both_sides_of_the_optimum(instance):
    w, num_gpus = instance
    optimum = float(sorted_pairing_optimum(w, num_gpus))
    if optimum == 0.0:
        return
    answer, counts = counts_under(w, 2 * num_gpus, optimum, Budget(None, None), 1)
    assert answer == "FEASIBLE"
    assert counts.sum() == 2 * num_gpus and (counts >= 1).all()
    assert sorted_peak(w, counts) <= optimum * (1 + 1e-9)
    below, none = counts_under(w, 2 * num_gpus, optimum * (1 - 1e-9), Budget(None, None), 1)
    assert below == "INFEASIBLE" and none is None


@settings(max_examples=40, deadline=None)
@given(two_slot_layers())
def test_exact_at_two_slots_never_claims_more_than_the_oracle(instance):
    w, num_gpus = instance
    deployment = eplb.Deployment.of(len(w), num_slots=2 * num_gpus, num_gpus=num_gpus)
    optimum = float(sorted_pairing_optimum(w, num_gpus))
    placement = eplb.plan(w[None, :], deployment, method="exact", time_limit=5)
    assert placement.max_load[0] >= optimum * (1 - 1e-9)
    # the exact method's optimum is among plans that keep the spread rule (the oracle's may hold an
    # expert twice on a GPU); a proof by counts holds among all plans, so it meets the oracle
    assert placement.info["proven_bound"][0] <= placement.max_load[0] * (1 + 1e-9)
    if placement.info["source"][0] == "pair counts" and placement.info["optimal"][0]:
        assert placement.max_load[0] <= optimum * (1 + 1e-9)
        assert placement.info["doubled"][0] == 0


@pytest.mark.slow
def test_exact_proves_deepseek_decode_layers_optimal_by_their_counts():
    """288 slots on 144 GPUs: the weighting bound aimed at ``best``'s plans proves some of these
    layers; the count search proves the others optimal (deterministic time, so the proof does not
    depend on the load)."""
    counts = np.asarray(skewed_counts(4, 256, family="lognormal", skew=0.7, num_groups=8, seed=1), float)
    deployment = eplb.Deployment.of(256, num_slots=288, num_gpus=144)
    best = eplb.plan(counts, deployment, method="best")
    placement = eplb.plan(counts, deployment, method="exact", deterministic_time=60)
    sources = set(placement.info["source"])
    assert all(placement.info["optimal"]) and "pair counts" in sources and sources <= {"closed form", "pair counts"}
    assert (placement.max_load <= best.max_load).all()
    assert (placement.max_load / placement.lower_bound - 1 <= 1e-9).all()
    assert placement.info["doubled"].sum() == 0

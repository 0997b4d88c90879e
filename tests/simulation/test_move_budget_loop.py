"""The Balancer's default move budget in the loop (:func:`eplb.simulate`), on a small drifting
series: at 2 slots a GPU it copies far fewer weights than the settings before and loses no more
time, stalls included; at 9 slots a GPU (where the settings before were tuned) nothing changes."""

import numpy as np
import pytest

import eplb
from eplb import BalancerPolicy, CostModel, simulate
from eplb.simulation.series import Series, mixture_path, synthetic_workloads

pytestmark = pytest.mark.slow  # compiles the planning kernels and replays 1000 steps four times

BEFORE = dict(tolerance=0.03, max_moves=None)  # the Balancer's defaults before they knew the slots per GPU
STEPS = 1000


@pytest.fixture(scope="module")
def series():
    workloads = synthetic_workloads(5, 6, 64, shift=0.5, num_groups=8, seed=5)
    return Series(workloads, num_steps=STEPS, tokens_per_step=2048, top_k=8, mixture=mixture_path(STEPS, 5),
                  seed=6).block(0, STEPS)


def replay(series, deployment, **options):
    policy = BalancerPolicy(check_every=50, compile="lazy", **options)
    cost = CostModel.preset("H100", "deepseek-v3", regime="compute")
    return simulate(series, deployment, policy=policy, cost_model=cost, initial_steps=10)


def test_at_two_slots_a_gpu_the_defaults_copy_less_and_lose_no_more(series):
    deployment = eplb.Deployment.of(64, num_slots=72, num_gpus=36, num_nodes=2)
    now, before = (replay(series, deployment, **options).summary() for options in ({}, BEFORE))
    assert now["rebalances"] > 0
    assert now["copies"] <= 0.5 * before["copies"]
    assert now["lost_with_stalls_share"] <= before["lost_with_stalls_share"]
    assert now["lost_share"] <= before["lost_share"] * 1.05


def test_at_nine_slots_a_gpu_the_defaults_are_the_settings_before(series):
    deployment = eplb.Deployment.of(64, num_slots=72, num_gpus=8, num_nodes=2)
    now, before = (replay(series, deployment, **options) for options in ({}, BEFORE))
    np.testing.assert_array_equal(now.layer_time, before.layer_time)
    assert now.summary()["copies"] == before.summary()["copies"]

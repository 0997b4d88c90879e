"""One deployment value: eplb.Deployment is checked as plan checks its keywords, every public call
takes it, and the keywords it replaces still plan the same while they warn."""

import numpy as np
import pytest

import eplb
from eplb.model.deployment import deployment_argument

LAYOUT = dict(num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)


def _counts(seed=0, layers=3, experts=64):
    return np.random.default_rng(seed).integers(0, 1000, (layers, experts)).astype(float)


def test_of_applies_the_published_group_rule_and_checks_like_plan():
    assert eplb.Deployment.of(64, **LAYOUT).hierarchical
    assert not eplb.Deployment.of(64, num_slots=80, num_gpus=8, num_nodes=2, num_groups=3).hierarchical
    with pytest.raises(ValueError, match="must be >= the number of experts"):
        eplb.Deployment.of(64, num_slots=32, num_gpus=8)
    with pytest.raises(ValueError, match="num_slots and num_gpus are required"):
        eplb.Deployment.of(64)
    with pytest.raises(ValueError, match="dispatch must be one of"):  # the engines' rules: checked where used
        eplb.plan(_counts(), eplb.Deployment.of(64, num_slots=80, num_gpus=8, dispatch="round-robin"))
    assert eplb.Deployment.of(64, **LAYOUT).to_dict()["topology"] == eplb.Topology.uniform(80, 8, 2).to_dict()


@pytest.mark.parametrize("call, spelled", [
    (lambda counts, **d: eplb.lower_bound(counts, **d), {}),
    (lambda counts, **d: eplb.lower_bounds(counts, **d)["cardinality"], {}),
    (lambda counts, **d: eplb.pareto(counts, fractions=(0.0, 0.1), **d)["balancedness"], {}),
    (lambda counts, **d: eplb.Balancer(3, compile="lazy", **d).placement.phy2log, {"num_experts": 64}),
], ids=["lower_bound", "lower_bounds", "pareto", "Balancer"])
def test_the_old_keywords_warn_and_give_what_the_value_gives(call, spelled):
    counts = _counts()
    by_value = call(counts, deployment=eplb.Deployment.of(64, **LAYOUT))
    with pytest.warns(DeprecationWarning, match=r"pass one value, eplb.Deployment.of\(64, num_slots=80"):
        by_keywords = call(counts, **spelled, **LAYOUT)
    np.testing.assert_array_equal(by_value, by_keywords)


def test_a_deployment_and_its_keywords_together_or_neither_are_refused():
    deployment = eplb.Deployment.of(64, **LAYOUT)
    with pytest.raises(ValueError, match="not both: got deployment and num_gpus"):
        eplb.lower_bound(_counts(), deployment, num_gpus=8)
    with pytest.raises(ValueError, match="lower_bound needs the deployment"):
        eplb.lower_bound(_counts())
    with pytest.raises(ValueError, match="deployment is for 64 experts, but counts has 32"):
        eplb.lower_bound(_counts(experts=32), deployment)
    with pytest.raises(TypeError, match="unexpected keyword argument.*num_slot\\b"):
        deployment_argument(None, {"num_slot": 80}, "lower_bound")
    with pytest.raises(ValueError, match="deployment must be an eplb.Deployment"):
        eplb.Balancer(3, "64", compile="lazy")


def test_the_balancer_plans_for_an_even_split_only():
    with pytest.raises(ValueError, match="for an even split; dispatch='sglang-static' plans from scratch"):
        eplb.Balancer(3, eplb.Deployment.of(64, **LAYOUT, dispatch="sglang-static"), compile="lazy")
    balancer = eplb.Balancer(3, eplb.Deployment.of(64, **LAYOUT, dispatch="vllm"), compile="lazy")
    assert balancer.deployment.dispatch == "vllm"

"""The policy seam (eplb/serving/policy.py): the base class, the provided policies, the one registry
of names, and the README's example of writing one."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.serving import policy as policies
from eplb.simulation import simulate as simulate_module
from eplb.simulation import sweep as sweep_module
from eplb.simulation.synthetic import drifting_counts

README = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()  # the policy example
COST = eplb.CostModel.preset("H100", "gpt-oss-20b", regime="compute")


def readme_policy_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    [block] = [b for b in blocks if "(eplb.Policy)" in b]
    return block


def test_the_readme_policy_runs_and_matches_the_fixed_interval_timer():
    block = readme_policy_block()
    definition = block[:block.index("result = ")]  # the class; the README's own series is larger
    namespace = {"np": np, "eplb": eplb}
    exec(definition, namespace)  # noqa: S102  (the README's code, as a reader would run it)
    series = drifting_counts(250, 2, 32, drift=0.1, tokens=512, num_groups=8, seed=4)
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=8)
    own = eplb.simulate(series, deployment, policy=namespace["EveryHundred"](), cost_model=COST)
    timer = eplb.simulate(series, deployment, policy=eplb.FixedInterval(100, method="greedy"), cost_model=COST)
    assert own.policy == "greedy every 100"
    np.testing.assert_array_equal(own.rebalance_steps, [99, 199])
    np.testing.assert_array_equal(own.rebalance_steps, timer.rebalance_steps)
    np.testing.assert_array_equal(own.layer_time, timer.layer_time)


def test_provided_policies_subclass_the_base_and_it_is_abstract():
    for cls in (eplb.NoRebalance, eplb.FixedInterval, eplb.BalancerPolicy):
        assert issubclass(cls, eplb.Policy)
    for name in policies.POLICY_NAMES:
        assert isinstance(policies.policy_by_name(name), eplb.Policy)
    with pytest.raises(TypeError):
        eplb.Policy()  # start and observe are abstract

    class Half(eplb.Policy):
        def start(self, placement, deployment):
            pass

    with pytest.raises(TypeError):
        Half()
    assert "Policy" in eplb.__all__


def test_one_registry_of_names():
    assert simulate_module.POLICY_NAMES is policies.POLICY_NAMES == tuple(policies.POLICIES)
    assert simulate_module.policy_by_name is policies.policy_by_name
    assert not hasattr(sweep_module, "named_policy")
    timer = policies.policy_by_name("every:40/20", "greedy")
    assert isinstance(timer, eplb.FixedInterval) and (timer.every, timer.window) == (40, 20)
    assert policies.policy_by_name("every:40").window == 40
    for bad in ("vllm-hedge", "every:x", "every:4/y"):
        with pytest.raises(ValueError, match="policy must be one of"):
            policies.policy_by_name(bad)
    with pytest.raises(ValueError, match="policy must be a name"):
        policies.policy_by_name(3)


def test_duck_typed_policies_still_work_and_others_are_refused():
    class Still:  # not a subclass: the same two methods
        def start(self, placement, deployment):
            self.seen = 0

        def observe(self, step, counts):
            self.seen += 1

    series = drifting_counts(5, 2, 32, drift=0.1, tokens=512, num_groups=8, seed=4)
    still = Still()
    deployment = eplb.Deployment.of(32, num_slots=40, num_gpus=8)
    result = eplb.simulate(series, deployment, cost_model=COST, policy=still)
    assert still.seen == 5 and result.policy == "Still"
    with pytest.raises(ValueError, match=r"policy must have start\(placement, deployment\) and observe"):
        eplb.simulate(series, deployment, cost_model=COST, policy=object())

"""The vLLM adapter: an EPLB policy with vLLM's ``rebalance_experts`` interface."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the vLLM adapter returns torch tensors; torch is not installed")

import eplb  # noqa: E402
from eplb.serving.adapters.vllm import EplbPolicy  # noqa: E402
from eplb.simulation.synthetic import drifting_counts  # noqa: E402

ARGS = dict(num_replicas=80, num_groups=8, num_nodes=2, num_ranks=8)


def test_signature_matches_vllm_policy_interface():
    names = list(inspect.signature(EplbPolicy.rebalance_experts).parameters)
    assert names == ["weight", "num_replicas", "num_groups", "num_nodes", "num_ranks", "old_global_expert_indices"]


def test_returns_phy2log_as_an_int64_tensor():
    weight = torch.tensor(drifting_counts(1, 4, 64, num_groups=8, seed=0)[0], dtype=torch.float32)
    phy2log = EplbPolicy.rebalance_experts(weight, 80, 8, 2, 8)
    assert isinstance(phy2log, torch.Tensor) and phy2log.dtype == torch.int64 and phy2log.shape == (4, 80)
    assert phy2log.device == weight.device
    expected = eplb.plan(weight.numpy(), num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
    np.testing.assert_array_equal(phy2log.numpy(), expected.phy2log)


def test_old_placement_keeps_most_experts_in_place():
    series = drifting_counts(2, 6, 64, num_groups=8, drift=0.05, tokens=65536, seed=1)
    old = EplbPolicy.rebalance_experts(torch.tensor(series[0]), **ARGS)
    fresh = EplbPolicy.rebalance_experts(torch.tensor(series[1]), **ARGS)
    near = EplbPolicy.rebalance_experts(torch.tensor(series[1]), **ARGS, old_global_expert_indices=old)
    topology = eplb.Topology.uniform(80, 8, 2)
    loads = [eplb.Placement(p.numpy(), 64, topology).gpu_loads(series[1]).max(axis=1) for p in (near, fresh)]
    assert (loads[0] <= loads[1] * 1.005 + 1e-9).all()
    assert (near != old).sum() < (fresh != old).sum() / 2


def test_old_placement_of_another_size_is_ignored():
    weight = torch.tensor(drifting_counts(1, 3, 64, num_groups=8, seed=2)[0])
    old = torch.zeros((3, 64), dtype=torch.int64)  # e.g. before the EP size changed
    assert torch.equal(EplbPolicy.rebalance_experts(weight, **ARGS, old_global_expert_indices=old),
                       EplbPolicy.rebalance_experts(weight, **ARGS))


def test_configured_policy_uses_its_settings():
    series = drifting_counts(2, 4, 64, num_groups=8, drift=0.3, seed=3)
    old = EplbPolicy.rebalance_experts(torch.tensor(series[0]), **ARGS)
    tight = EplbPolicy.configured(max_moves=2, tolerance=None)
    near = tight.rebalance_experts(torch.tensor(series[1]), **ARGS, old_global_expert_indices=old)
    assert ((near != old).sum(dim=1) <= 2).all()
    assert EplbPolicy.max_moves is None  # the base class is untouched
    greedy = EplbPolicy.configured(method="greedy")
    weight = torch.tensor(series[0])
    np.testing.assert_array_equal(greedy.rebalance_experts(weight, **ARGS).numpy(),
                                  eplb.rebalance_experts(series[0], 80, 8, 2, 8, method="greedy")[0])
    with pytest.raises(ValueError, match="method"):
        EplbPolicy.configured(method="nope")


def test_models_without_groups_and_bad_input():
    weight = torch.rand(2, 30) * 100
    for groups in (None, 0, 1):
        phy2log = EplbPolicy.rebalance_experts(weight, 40, groups, 1, 4)
        assert phy2log.shape == (2, 40)
    with pytest.raises(ValueError, match="divisible"):
        EplbPolicy.rebalance_experts(weight, 42, None, 1, 4)
    with pytest.raises(ValueError, match="weight"):
        EplbPolicy.rebalance_experts(-weight, 40, None, 1, 4)

"""The cost model's arithmetic against hand-computed cases, its presets and its input checks."""

import numpy as np
import pytest

import eplb
from eplb.model.cost import HARDWARE, MODELS, CostModel, Hardware, MoEModel

# round numbers: an expert is 100 bytes, a routed token 10 FLOPs and 1 byte of activations
SIMPLE = dict(expert_bytes=100, flops_per_token=10, token_bytes=1, flops=100, hbm_bandwidth=100,
              nvlink_bandwidth=50, network_bandwidth=10)


def test_deepseek_v3_expert_figures():
    model = MODELS["deepseek-v3"]
    assert model.expert_params == 3 * 7168 * 2048
    assert model.expert_bytes == 44_040_192  # FP8: ~44 MB per expert, as the issue states
    assert model.flops_per_token == 2 * 3 * 7168 * 2048
    assert model.token_bytes == (2 * 7168 + 3 * 2048) * 2
    assert (model.num_experts, model.top_k, model.num_moe_layers) == (256, 8, 58)


def test_preset_scales_peaks_by_efficiencies():
    cost = CostModel.preset("H100", "deepseek-v3", compute_efficiency=0.5, memory_efficiency=0.75,
                            link_efficiency=1.0)
    assert cost.flops == pytest.approx(0.5 * 1979e12)  # FP8 model -> FP8 tensor-core rate
    assert cost.hbm_bandwidth == pytest.approx(0.75 * 3.35e12)
    assert cost.nvlink_bandwidth == pytest.approx(450e9)
    assert cost.network_bandwidth == pytest.approx(50e9)
    bf16 = CostModel.preset("H100", "deepseek-v3", precision="bf16", compute_efficiency=0.5)
    assert bf16.flops == pytest.approx(0.5 * 989e12)
    # a BF16 model runs at the BF16 rate; overrides win
    assert CostModel.preset("H20", "mixtral-8x7b", compute_efficiency=1.0).flops == pytest.approx(148e12)
    assert CostModel.preset(layer_overhead_s=1e-5).layer_overhead_s == 1e-5
    # own hardware and model descriptions plug in
    hw = Hardware("toy", 1e12, 1e14, 2e14, 1e11, 1e10)
    mo = MoEModel("toy", 64, 32, 8, 2, 4, 2.0, "bf16")
    toy = CostModel.preset(hw, mo, compute_efficiency=1, memory_efficiency=1, link_efficiency=1)
    assert (toy.flops, toy.expert_bytes) == (1e14, 3 * 64 * 32 * 2.0)


def test_every_preset_builds():
    for hardware in HARDWARE:
        for model in MODELS:
            cost = CostModel.preset(hardware, model)
            assert cost.gpu_time(1000, 4) > 0


def test_gpu_time_roofline_by_hand():
    cost = CostModel(**SIMPLE)
    # 50 tokens on 2 activated slots: compute 50*10/100 = 5 s, memory (2*100 + 50*1)/100 = 2.5 s
    assert cost.gpu_time(50, 2) == pytest.approx(5.0)
    assert cost.with_(regime="memory").gpu_time(50, 2) == pytest.approx(2.5)
    assert cost.with_(regime="compute").gpu_time(50, 2) == pytest.approx(5.0)
    # decode-like: 4 tokens on 3 slots -> memory (300 + 4) / 100 = 3.04 s beats compute 0.4 s
    assert cost.gpu_time(4, 3) == pytest.approx(3.04)
    assert cost.with_(layer_overhead_s=0.5).gpu_time(4, 3) == pytest.approx(3.54)
    np.testing.assert_allclose(cost.gpu_time(np.array([0, 50]), np.array([0, 2])), [0.0, 5.0])


def test_layer_step_and_balanced_times_by_hand():
    cost = CostModel(**SIMPLE, regime="compute")
    tokens = np.array([[30.0, 10.0], [20.0, 20.0]])  # [L=2, G=2]
    active = np.ones((2, 2))
    np.testing.assert_allclose(cost.layer_time(tokens, active), [3.0, 2.0])  # slowest GPU
    np.testing.assert_allclose(cost.balanced_layer_time(tokens, active), [2.0, 2.0])  # mean GPU
    assert cost.step_time(tokens, active) == pytest.approx(5.0)  # sum over layers


def test_copy_time_by_hand():
    cost = CostModel(**SIMPLE)
    # GPU 0: 2 local copies (read + write: 2*2*100/100 = 4 s), 3 over NVLink (300/50 = 6 s),
    # 1 over the network (100/10 = 10 s): engines run side by side -> 10 s; GPU 1 idle
    assert cost.copy_time([2, 0], [3, 0], [1, 0]) == pytest.approx(10.0)
    assert cost.copy_time([0, 0], [3, 4], [0, 0]) == pytest.approx(8.0)
    assert cost.copy_time([], [], []) == 0.0


def test_transfer_time_of_a_plan():
    topology = eplb.Topology.uniform(4, 2, 2)  # 2 GPUs, one per node, 2 slots each
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[0, 2, 1, 3]])  # experts 1 and 2 swap GPUs: one cross-node copy each way
    deployment = eplb.Deployment.of(4, topology=topology)
    plan = eplb.transfer_plan(old, new, deployment)
    cost = CostModel(**SIMPLE)
    assert cost.transfer_time(plan) == pytest.approx(100 / 10)
    # experts 1 and 2 swap slots on GPU 1: two copies within its HBM, 2 * 2 * 100 / 100 = 4 s
    local = eplb.transfer_plan(np.array([[0, 0, 1, 2]]), np.array([[0, 0, 2, 1]]), eplb.Deployment.of(3, topology=topology))
    assert local.counts()["intra_gpu"] == 2
    assert cost.transfer_time(local) == pytest.approx(4.0)


def test_replica_bytes():
    cost = CostModel(**SIMPLE)
    assert cost.replica_bytes(288, 256, 58) == 32 * 58 * 100
    assert cost.replica_bytes(256, 256, 58) == 0


@pytest.mark.parametrize("field, value, match", [
    ("flops", 0, "flops must be a finite number > 0"),
    ("hbm_bandwidth", -1, "hbm_bandwidth"),
    ("expert_bytes", float("nan"), "expert_bytes"),
    ("regime", "fast", "regime must be one of"),
    ("copy_mode", "later", "copy_mode must be one of"),
])
def test_bad_fields_raise(field, value, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**{**SIMPLE, field: value})


def test_bad_preset_arguments_raise():
    with pytest.raises(ValueError, match="hardware must be one of"):
        CostModel.preset("TPU")
    with pytest.raises(ValueError, match="model must be one of"):
        CostModel.preset("H100", "llama")
    with pytest.raises(ValueError, match="precision"):
        CostModel.preset(precision="fp4")
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        CostModel.preset(compute_efficiency=1.5)
    with pytest.raises(ValueError, match="unknown CostModel fields"):
        CostModel.preset(flop=1)


def test_crossing_cost_by_hand():
    """A token served off its rack sends its hidden state and gets the output back over the network."""
    from eplb.model.cost import crossing_cost

    model = MODELS["deepseek-v3"]
    cost = CostModel.preset("H100", model)
    price = crossing_cost(np.array([1000.0, 0.0]), 144, cost, model)
    per_token = 2 * model.hidden_size * model.activation_bytes
    assert price["bytes_per_token"] == per_token
    np.testing.assert_allclose(price["bytes"], [1000 * per_token, 0.0])
    np.testing.assert_allclose(price["network_s"], [1000 * per_token / (144 * cost.network_bandwidth), 0.0])
    assert price["extra_s"][0] > 0 and price["extra_s"][0] < price["network_s"][0]
    for bad in (np.array([-1.0]), np.array([np.nan])):
        with pytest.raises(ValueError, match="off_node_tokens"):
            crossing_cost(bad, 144, cost, model)
    with pytest.raises(ValueError, match="num_gpus"):
        crossing_cost(1.0, 0, cost, model)

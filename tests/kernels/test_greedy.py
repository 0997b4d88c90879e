"""``method="greedy"`` agrees with the published algorithm (per-GPU loads on every layer)."""

import numpy as np
import published_greedy
from hypothesis import given
from strategies import problems

import eplb
from eplb.analysis.loads import gpu_loads


def published_loads(counts, config):
    groups = config["num_groups"] or 1  # the published code has no "no groups": one group is global
    phy2log, _, logcnt = published_greedy.rebalance_experts(
        counts, config["num_slots"], groups, config["num_nodes"], config["num_gpus"])
    topology = eplb.Topology.uniform(config["num_slots"], config["num_gpus"], config["num_nodes"])
    return gpu_loads(counts, phy2log, topology, logcnt=logcnt)


@given(problems())
def test_same_gpu_loads_as_the_published_algorithm(deployment):
    config, counts = deployment
    counts = np.round(counts) % 2**24  # the published code rounds weights to float32
    groups = config["num_groups"] or 1
    placement = eplb.plan(counts, num_slots=config["num_slots"], num_gpus=config["num_gpus"],
                          num_nodes=config["num_nodes"], num_groups=groups, method="greedy")
    np.testing.assert_allclose(placement.gpu_loads(counts), published_loads(counts, config), rtol=1e-6)


def test_same_gpu_loads_on_deepseek_v3_sized_counts():
    from eplb.simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts

    counts = deepseek_v3_counts(seed=3)
    config = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
    placement = eplb.plan(counts, method="greedy", **config)  # hierarchical
    np.testing.assert_allclose(placement.gpu_loads(counts), published_loads(counts, config), rtol=1e-6)
    config["num_groups"] = 1  # 1 % 4 != 0: global
    placement = eplb.plan(counts, method="greedy", **config)
    np.testing.assert_allclose(placement.gpu_loads(counts), published_loads(counts, config), rtol=1e-6)


def test_hierarchical_greedy_keeps_each_group_on_one_node():
    from eplb.simulation.synthetic import skewed_counts

    counts = skewed_counts(4, 64, num_groups=8, seed=1)
    placement = eplb.plan(counts, num_slots=96, num_gpus=16, num_nodes=4, num_groups=8, method="greedy")
    node_of_slot = placement.topology.node_of_gpu[placement.topology.gpu_of_slot]
    group_of_slot = placement.phy2log // 8
    for layer in range(4):
        for group in range(8):
            assert len(set(node_of_slot[group_of_slot[layer] == group])) == 1

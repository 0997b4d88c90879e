"""``method="greedy"``: the published DeepSeek EPLB algorithm.

Replicate by largest load per replica, then pack replicas largest-first into the lightest GPU
with a free slot; hierarchical (groups -> nodes -> GPUs) when the number of groups is a multiple
of the number of nodes, else global.
"""

from __future__ import annotations

import numpy as np

from ...kernels.engine_tables.deepseek_greedy import greedy_placement
from . import Deployment, register


@register("greedy", options={})
def greedy(weights: np.ndarray, deployment: Deployment) -> tuple[np.ndarray, dict]:
    topology = deployment.topology
    if not topology.is_uniform:
        raise ValueError("method 'greedy' needs the same number of slots on every GPU; use the default method")
    if deployment.hierarchical:
        groups, nodes = deployment.num_groups, topology.num_nodes
    else:
        groups, nodes = 1, 1
    phy2log, _ = greedy_placement(
        np.ascontiguousarray(weights, dtype=np.float32), topology.num_slots, groups, nodes, topology.num_gpus
    )
    return phy2log, {"hierarchical": deployment.hierarchical}

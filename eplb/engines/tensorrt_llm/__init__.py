"""TensorRT-LLM: its dispatch rule and its files.

**Dispatch** (``cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceKernels.cu``,
``moeComputeRouteKernel``): round robin over an expert's replicas, numbering its tokens within each
thread block from the block index (plus the EP rank): an even split (rule ``tensorrt-llm``, kind
``"uniform"``).

**Files** (:mod:`eplb.io.formats.trtllm`): counts from its expert-statistics folder
(``EXPERT_STATISTIC_PATH`` with ``EXPERT_STATISTIC_ITER_RANGE=start-stop``: ``rank{r}.safetensors``
per rank and ``meta_info.json``; ``trtllm-stats``); the placement is the MoE load balancer's YAML
(``num_slots``, ``initial_global_assignments``, ``layer_updates_per_iter``; ``trtllm``), which the
engine loads with ``moe_config: {backend: WideEP, load_balancer: <file>}`` in the extra LLM API
options. Its config model refuses unknown keys, so eplb records GPUs, nodes and groups in a
``# eplb:`` comment.

**Checked against** TensorRT-LLM's sources (``tensorrt_llm/_torch/expert_statistic.py``,
``examples/wide_ep/ep_load_balancer/``, ``tensorrt_llm/llmapi/llm_args.py``); no engine run is part
of the tests. Recipe: ``docs/engines/tensorrt-llm.md``.
"""

from __future__ import annotations

from ..contract import DispatchRule, Engine

ENGINE = Engine(
    name="tensorrt-llm",
    title="TensorRT-LLM",
    rules={"tensorrt-llm": DispatchRule("uniform", "TensorRT-LLM dispatch (an even split)",
                                        "even split (round robin over replicas)")},
    options=("tensorrt-llm",),
    layer_shares=None,
    formats=("trtllm-stats", "trtllm"),
    loads="trtllm",
    adapter=None,
    notes=__doc__,
    # MoeLoadBalancerConfig.get_layer_initial_global_assignments(layer_idx) is called by MoE layers only
    dense_layers="TensorRT-LLM looks up initial_global_assignments only for its MoE layers, so their entries are "
                 "ignored",
)

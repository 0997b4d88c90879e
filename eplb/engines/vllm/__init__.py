"""vLLM: its dispatch rule and its adapter.

**Dispatch** (``vllm/model_executor/layers/fused_moe/router/base_router.py``,
``eplb_map_to_physical_and_record`` / ``eplb_map_to_physical`` from ``BaseRouter._apply_eplb_mapping``;
earlier in ``FusedMoE.select_experts`` of ``fused_moe/layer.py``): replica
``position % logical_replica_count[e]`` of ``logical_to_physical_map[e]``, the position being the
token's flattened index in ``topk_ids`` (earlier releases: ``torch.rand_like`` times the count). No
locality rule: an even split (rule ``vllm``, kind ``"uniform"``).

**Adapter** (:mod:`eplb.serving.adapters.vllm`): vLLM takes no placement file; it asks its EPLB
policy for a placement. ``from eplb.serving.adapters.vllm import install; install()`` before the
engine starts (then serve with ``--enable-eplb``) registers eplb as that policy, for each policy
interface vLLM has shipped, detected at run time from the installed vLLM (not its version string).

**Checked against** the policy files of vLLM 0.11.0 to 0.33.0 (the releases listed in
``tests/engine_interfaces/vllm.json``; ``EPLB_VLLM_SOURCES=<folder of wheels>`` runs the adapter
against them) and one development-branch file. Recipe: ``docs/engines/vllm.md``.
"""

from __future__ import annotations

from ..contract import DispatchRule, Engine

ENGINE = Engine(
    name="vllm",
    title="vLLM",
    rules={"vllm": DispatchRule("uniform", "vLLM dispatch (an even split)",
                                "even split (replica = token position % replica count)")},
    options=("vllm",),
    layer_shares=None,
    formats=(),
    loads=None,
    adapter="eplb.serving.adapters.vllm",
    notes=__doc__,
)

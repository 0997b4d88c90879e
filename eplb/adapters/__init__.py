"""Adapters that plug eplb into serving engines. Engine libraries (torch, vLLM) are imported lazily,
only when an adapter is used, so ``import eplb`` never needs them.

- :mod:`eplb.adapters.vllm`: :class:`~eplb.adapters.vllm.EplbPolicy`, an EPLB policy with vLLM's
  ``rebalance_experts`` interface (migration-aware when vLLM passes the current placement).

SGLang and TensorRT-LLM exchange files rather than calls: see :mod:`eplb.formats`.
"""

"""Adapters that plug eplb into serving engines. Engine libraries (torch, vLLM) are imported lazily,
only when an adapter is used, so ``import eplb`` never needs them.

- :mod:`eplb.adapters.vllm`: eplb as vLLM's EPLB policy for each interface vLLM has shipped
  (:func:`~eplb.adapters.vllm.detect_interface`, :func:`~eplb.adapters.vllm.policy_for`,
  :func:`~eplb.adapters.vllm.install`); migration-aware when vLLM passes the current placement.

SGLang and TensorRT-LLM exchange files rather than calls: see :mod:`eplb.formats`.
"""

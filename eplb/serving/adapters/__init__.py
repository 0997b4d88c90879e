"""Adapters that plug eplb into serving engines. Engine libraries (torch, vLLM) are imported lazily,
only when an adapter is used, so ``import eplb`` never needs them.

- :mod:`eplb.serving.adapters.vllm`: eplb as vLLM's EPLB policy for each interface vLLM has shipped
  (:func:`~eplb.serving.adapters.vllm.detect_interface`, :func:`~eplb.serving.adapters.vllm.policy_for`,
  :func:`~eplb.serving.adapters.vllm.install`); migration-aware when vLLM passes the current placement.

SGLang and TensorRT-LLM exchange files rather than calls: see :mod:`eplb.io.formats`. Each engine's
entry in :data:`eplb.engines.ENGINES` names its adapter (``adapter``) or its files (``formats``).
"""

"""How serving engines really split an expert's tokens among its replicas, as shares.

eplb judges a placement with *shares* ``[L, S]`` (the fraction of its expert's tokens each slot
takes, :mod:`eplb.analysis.dispatch`). The engines choose replicas by their own rules; this module gives
the shares each rule realises, so that ``placement.balancedness(counts, dispatch="shares")`` on
:func:`with_engine_shares` is what the engine serving that placement gets.

What the engines do (read from their sources):

- **SGLang 0.5.23**, ``--ep-dispatch-algorithm`` (``sglang/srt/eplb/expert_location.py`` and
  ``expert_location_dispatch.py``). Each source rank (GPU) ``r`` looks for a *near* replica of
  expert ``e`` (``_find_nearest_expert``): the only replica when there is one; else the first
  (lowest slot) replica on GPU ``r``; else the first replica on ``r``'s node, but only when that
  node holds some and not all of the replicas (the node step is skipped when elastic EP scales
  the world, ``ep_join_mode="scale"``: not modelled here). With an all-to-all backend (DeepEP and the
  others, ``--moe-a2a-backend`` not ``none``) each rank keeps just that near replica as the
  expert's candidate list when it has one (``_compute_logical_to_all_physical_map``).

  * ``static`` (the default with an all-to-all backend once a placement is given): a table
    ``logical_to_rank_dispatch_physical_map`` sends all of rank ``r``'s tokens of ``e`` to one
    slot (``compute_logical_to_rank_dispatch_physical_map``). Ranks without a near replica get a
    "fair" choice (``_fair_choices``): the ``k`` such ranks take each of the ``n`` replicas
    ``k // n`` times plus a random sample of ``k % n``, shuffled, from ``random.Random(42)``.
    Every rank builds the table from its own candidate lists (collapsed to the near replica where
    it has one), so the random stream advances differently on each rank and the fair choices of
    different ranks are *not* coordinated: a replica can get well more or fewer than ``k / n`` of
    them. The choice is deterministic, and reproduced exactly (the kernels of
    :mod:`eplb.kernels.sglang_table`, checked against a plain-Python reference in
    ``tests/sglang_reference.py`` that is checked against SGLang's own code).
  * ``dynamic`` with an all-to-all backend: a token goes to the near replica when its rank has
    one, else to replica ``randint(0, 65536) % n`` of the expert's list (uniform up to a bias
    below ``1 / 65536`` per replica, modelled exactly). This is the expectation of ``static``
    over its random choice (up to that bias).
  * ``dynamic`` without an all-to-all backend (the default then; ``static`` is refused): replica
    ``row % n`` of the full list, i.e. an even split.
  * ``fake`` replaces the router's choice by random logits (benchmarking), then picks like
    ``dynamic``; ``lp`` solves a min-max LP on every batch's all-reduced counts, which is
    eplb's optimal dispatch (``dispatch="optimal"``), not a fixed split.

- **vLLM** (``vllm/model_executor/layers/fused_moe/router/base_router.py``,
  ``eplb_map_to_physical_and_record`` / ``eplb_map_to_physical`` from
  ``BaseRouter._apply_eplb_mapping``; earlier in ``FusedMoE.select_experts`` of
  ``fused_moe/layer.py``): replica ``position % logical_replica_count[e]`` of
  ``logical_to_physical_map[e]``, the position being the token's flattened index in ``topk_ids``
  (earlier releases: ``torch.rand_like`` times the count). No locality rule: an even split.
- **TensorRT-LLM** (``cpp/tensorrt_llm/kernels/moeLoadBalance/moeLoadBalanceKernels.cu``,
  ``moeComputeRouteKernel``): round robin over an expert's replicas, numbering its tokens within
  each thread block from the block index (plus the EP rank): an even split.

The shares assume that every source rank sends the same number of tokens of each expert (the
usual assumption: with data-parallel attention each rank serves its own share of the requests).
Then a slot's share is the fraction of the ranks that send the expert's tokens to it (in
expectation where the choice is random). SGLang's replica lists are in increasing slot order (it
builds them from ``phy2log``, as eplb's ``log2phy``), which fixes what "first" means above.
"""

from __future__ import annotations

import numpy as np

from ..model.dispatch_rules import DISPATCH_RULES, SHARE_RULES
from .placement import Placement, uniform_shares
from .rule_shares import rule_shares

ENGINES = {name: DISPATCH_RULES[name].description for name in SHARE_RULES}
"""Engine names accepted by :func:`engine_shares`, with what each models (the fixed-split rules of
:data:`eplb.model.dispatch_rules.DISPATCH_RULES`)."""

_EVEN = tuple(name for name in SHARE_RULES if DISPATCH_RULES[name].kind == "uniform")


def _check(placement, engine) -> Placement:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be an eplb.Placement, got {type(placement).__name__}")
    if isinstance(engine, str) and engine == "sglang-lp":
        raise ValueError("engine 'sglang-lp' splits each batch by a min-max LP on its counts, not by fixed shares: "
                         "use placement.balancedness(counts, dispatch='optimal') for it")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {engine!r}")
    return placement


def engine_shares(placement: Placement, engine: str) -> np.ndarray:
    """The shares ``engine`` realises when it serves ``placement``.

    Assumes every source rank sends the same number of tokens of each expert (see the module
    notes for each engine's rule and where it lives in the engine's code).

    Args:
        placement: an :class:`eplb.Placement` (SGLang engines: the same slots on every GPU).
        engine: one of :data:`ENGINES`: ``"uniform"``, ``"vllm"``, ``"tensorrt-llm"``,
            ``"sglang-dynamic-no-a2a"`` (even split); ``"sglang-static"`` (SGLang's per-rank table,
            exactly); ``"sglang-dynamic"`` (near replica, else uniform random; the expectation).
    Returns:
        ``[L, S]`` float64, non-negative, summing to 1 over each expert's replicas.
    """
    placement = _check(placement, engine)
    if engine in _EVEN:
        return uniform_shares(placement.phy2log, placement.logcnt)
    return rule_shares(placement.phy2log, placement.num_experts, placement.topology, engine)


def with_engine_shares(placement: Placement, engine: str) -> Placement:
    """``placement`` with :attr:`~eplb.Placement.shares` set to :func:`engine_shares`, so that
    ``dispatch="shares"`` (``gpu_loads``, ``balancedness``, ``off_node_fraction``) measures what
    ``engine`` serves. The planning diagnostics (``lower_bound``, ``max_load``) are not carried
    over: the max load changes with the split.

    Args:
        placement: an :class:`eplb.Placement`; engine: one of :data:`ENGINES`.
    Returns:
        A new :class:`eplb.Placement` with the same ``phy2log [L, S]`` and ``shares [L, S]``.
    """
    shares = engine_shares(placement, engine)
    info = dict(placement.info, engine_dispatch=engine)
    return Placement(placement.phy2log, placement.num_experts, placement.topology, placement.num_groups,
                     method=placement.method, info=info, shares=shares, home_node=placement.home_node)

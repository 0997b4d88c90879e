"""How serving engines really split an expert's tokens among its replicas, as shares.

eplb judges a placement with *shares* ``[L, S]`` (the fraction of its expert's tokens each slot
takes, :mod:`eplb.analysis.dispatch`). The engines choose replicas by their own rules; this module gives
the shares each rule realises, so that ``placement.balancedness(counts, dispatch="shares")`` on
:func:`with_engine_shares` is what the engine serving that placement gets.

What each engine does, where in its code and which versions were checked is in its package's
notes (:data:`eplb.engines.ENGINES`: :mod:`eplb.engines.sglang`, :mod:`eplb.engines.vllm`,
:mod:`eplb.engines.tensorrt_llm`): vLLM and TensorRT-LLM split evenly; SGLang ``static`` sends each
rank's tokens of an expert to one replica by its per-rank table, ``dynamic`` to the rank's near
replica, else a random one (an even split without an all-to-all backend); SGLang ``lp`` is optimal
dispatch, not a fixed split.

The shares assume that every source rank sends the same number of tokens of each expert (the
usual assumption: with data-parallel attention each rank serves its own share of the requests).
Then a slot's share is the fraction of the ranks that send the expert's tokens to it (in
expectation where the choice is random).
"""

from __future__ import annotations

import numpy as np

from ..engines import DISPATCH_RULES, SHARE_RULES, rule_shares
from .placement import Placement, uniform_shares

ENGINES = {name: DISPATCH_RULES[name].description for name in SHARE_RULES}
"""Engine rules accepted by :func:`engine_shares`, with what each models (the fixed-split rules,
:data:`eplb.engines.SHARE_RULES`; the engines themselves are :data:`eplb.engines.ENGINES`)."""


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
    if DISPATCH_RULES[engine].kind == "uniform":
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

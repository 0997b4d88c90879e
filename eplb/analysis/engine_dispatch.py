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
    them. The choice is deterministic, and reproduced here exactly (:func:`sglang_static_table`).
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

import random

import numpy as np

from ..model.dispatch_rules import DISPATCH_RULES, SHARE_RULES
from .placement import Placement, uniform_shares

ENGINES = {name: DISPATCH_RULES[name].description for name in SHARE_RULES}
"""Engine names accepted by :func:`engine_shares`, with what each models (the fixed-split rules of
:data:`eplb.model.dispatch_rules.DISPATCH_RULES`)."""

_EVEN = tuple(name for name in SHARE_RULES if DISPATCH_RULES[name].kind == "uniform")
_SGLANG_SEED = 42  # compute_logical_to_rank_dispatch_physical_map's seed (never overridden by SGLang)
_SGLANG_RANDINT = 65536  # dynamic dispatch draws randint(0, 65536) % n


def _check(placement, engine) -> Placement:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be an eplb.Placement, got {type(placement).__name__}")
    if isinstance(engine, str) and engine == "sglang-lp":
        raise ValueError("engine 'sglang-lp' splits each batch by a min-max LP on its counts, not by fixed shares: "
                         "use placement.balancedness(counts, dispatch='optimal') for it")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {engine!r}")
    if engine.startswith("sglang") and engine not in _EVEN and not placement.topology.is_uniform:
        raise ValueError("SGLang needs the same number of slots on every GPU (num_slots divisible by num_gpus): "
                         f"placement.topology has slots_per_gpu {placement.topology.slots_per_gpu.tolist()}")
    return placement


def _near_replicas(placement: Placement) -> np.ndarray:
    """The slot each rank prefers for each expert under SGLang's rule (``_find_nearest_expert``),
    or ``-1`` where the rank has no near replica (the "fair" / random choice applies).

    Returns:
        ``[L, G, E]`` int64.
    """
    phy2log = placement.phy2log
    num_layers, num_slots = phy2log.shape
    num_gpus, num_nodes, num_experts = placement.num_gpus, placement.num_nodes, placement.num_experts
    per_gpu = num_slots // num_gpus
    per_node = num_slots // num_nodes
    layers = np.arange(num_layers)[:, None]

    def first_slot(block: int, blocks: int) -> np.ndarray:
        """``[L, blocks, E]``: the lowest slot of each expert in each block of ``block`` slots, or -1."""
        first = np.full((num_layers, blocks, num_experts), -1, np.int64)
        owners = np.arange(blocks)[None, :]
        for offset in range(block - 1, -1, -1):  # the lowest slot is written last
            slots = np.arange(blocks) * block + offset
            first[layers, owners, phy2log[:, slots]] = slots[None, :]
        return first

    logcnt = placement.logcnt
    choice = np.where(logcnt == 1, placement.log2phy[:, :, 0], -1)[:, None, :].repeat(num_gpus, axis=1)
    own = first_slot(per_gpu, num_gpus)
    choice = np.where(choice < 0, own, choice)
    node_of_gpu = placement.topology.node_of_gpu
    on_node = np.zeros((num_layers, num_nodes, num_experts), np.int64)
    np.add.at(on_node, (layers, np.arange(num_slots)[None, :] // per_node, phy2log), 1)
    on_node = on_node[:, node_of_gpu, :]
    narrows = (on_node > 0) & (on_node < logcnt[:, None, :])
    node_first = first_slot(per_node, num_nodes)[:, node_of_gpu, :]
    return np.where((choice < 0) & narrows, node_first, choice)


def sglang_static_table(placement: Placement) -> np.ndarray:
    """The slot each rank sends each expert's tokens to under SGLang's ``static`` dispatch.

    Reproduces SGLang 0.5.23 serving ``placement`` from ``--init-expert-location`` with an
    all-to-all backend (the only setting where it allows ``static``): the near replica when the
    rank has one, else the rank's entry of the fair choice drawn from ``random.Random(42)`` with
    the rank's own random stream (see the module notes): ``random.sample`` then ``random.shuffle``
    of Python's ``random`` module, called as SGLang calls them. Deterministic.

    Args:
        placement: an :class:`eplb.Placement` on a topology with the same slots on every GPU.
    Returns:
        ``[G, L, E]`` int64: ``table[r, l, e]`` is a slot holding expert ``e`` in layer ``l``
        (SGLang's ``logical_to_rank_dispatch_physical_map`` of rank ``r``).
    """
    placement = _check(placement, "sglang-static")
    near = _near_replicas(placement)  # [L, G, E]
    fair = near < 0
    takers = fair.sum(axis=1)  # [L, E]: ranks sharing the fair choice
    position = np.cumsum(fair, axis=1) - 1  # [L, G, E]: a rank's index among them
    table = near.transpose(1, 0, 2).copy()
    for rank in range(placement.num_gpus):
        stream = random.Random(_SGLANG_SEED)
        for layer, expert in np.argwhere(fair[:, rank, :]):  # layer-major, as SGLang walks them
            count = int(placement.logcnt[layer, expert])
            candidates = placement.log2phy[layer, expert, :count].tolist()
            rounds, rest = divmod(int(takers[layer, expert]), count)
            picks = candidates * rounds + stream.sample(candidates, k=rest)
            stream.shuffle(picks)
            table[rank, layer, expert] = picks[position[layer, rank, expert]]
    return table


def _fraction_of_ranks(chosen: np.ndarray, num_slots: int) -> np.ndarray:
    """``[L, G, E]`` slot each rank sends each expert's tokens to (``-1``: none) -> ``[L, S]``
    fraction of the ranks choosing each slot."""
    num_layers, num_ranks, _ = chosen.shape
    layer = np.broadcast_to(np.arange(num_layers)[:, None, None], chosen.shape)
    chosen_somewhere = chosen >= 0
    flat = layer[chosen_somewhere] * num_slots + chosen[chosen_somewhere]
    return np.bincount(flat, minlength=num_layers * num_slots).reshape(num_layers, num_slots) / num_ranks


def _sglang_dynamic_shares(placement: Placement) -> np.ndarray:
    """``[L, S]``: the near replica when the rank has one, else replica ``randint(0, 65536) % n``
    of the expert's list (replica ``i`` drawn with probability ``(65536 // n + (i < 65536 % n)) / 65536``)."""
    near = _near_replicas(placement)
    layers = np.arange(placement.num_layers)[:, None]
    random_fraction = (near < 0).mean(axis=1)  # [L, E]: ranks that draw at random
    count = placement.logcnt[layers, placement.phy2log]  # [L, S]: replicas of the slot's expert
    index = np.zeros_like(placement.phy2log)  # [L, S]: the slot's place in its expert's list
    listed = placement.log2phy >= 0
    index[np.nonzero(listed)[0], placement.log2phy[listed]] = np.nonzero(listed)[2]
    draw = (_SGLANG_RANDINT // count + (index < _SGLANG_RANDINT % count)) / _SGLANG_RANDINT
    return _fraction_of_ranks(near, placement.num_slots) + random_fraction[layers, placement.phy2log] * draw


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
    if engine == "sglang-static":
        return _fraction_of_ranks(sglang_static_table(placement).transpose(1, 0, 2), placement.num_slots)
    return _sglang_dynamic_shares(placement)


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

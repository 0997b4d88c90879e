"""SGLang: its dispatch rules, the shares they give a placement, its files.

**Checked against** SGLang 0.5.23 (``sglang/srt/eplb/expert_location.py``,
``expert_location_dispatch.py``, ``expert_distribution.py``); ``tests/sglang_reference.py`` is a
plain-Python copy of its replica choice, checked against SGLang's own code run from its wheel
(``EPLB_SGLANG_SOURCES=<wheel>``), and the shares below are checked against it to 1e-15.

**Dispatch** (``--ep-dispatch-algorithm``). Each source rank (GPU) ``r`` looks for a *near* replica of
expert ``e`` (``_find_nearest_expert``): the only replica when there is one; else the first
(lowest slot) replica on GPU ``r``; else the first replica on ``r``'s node, but only when that
node holds some and not all of the replicas (the node step is skipped when elastic EP scales
the world, ``ep_join_mode="scale"``: not modelled here). With an all-to-all backend (DeepEP and the
others, ``--moe-a2a-backend`` not ``none``) each rank keeps just that near replica as the
expert's candidate list when it has one (``_compute_logical_to_all_physical_map``).

* ``static`` (the default with an all-to-all backend once a placement is given; ``sglang-static``):
  a table ``logical_to_rank_dispatch_physical_map`` sends all of rank ``r``'s tokens of ``e`` to one
  slot (``compute_logical_to_rank_dispatch_physical_map``). Ranks without a near replica get a
  "fair" choice (``_fair_choices``): the ``k`` such ranks take each of the ``n`` replicas
  ``k // n`` times plus a random sample of ``k % n``, shuffled, from ``random.Random(42)``.
  Every rank builds the table from its own candidate lists (collapsed to the near replica where
  it has one), so the random stream advances differently on each rank and the fair choices of
  different ranks are *not* coordinated: a replica can get well more or fewer than ``k / n`` of
  them. The choice is deterministic, and reproduced exactly (the kernels of
  :mod:`eplb.kernels.engine_tables.sglang_table`). The streams run on from one layer to the next, so a layer's
  shares depend on the layers before it: :class:`RuleShares` keeps them between layers.
* ``dynamic`` with an all-to-all backend (``sglang-dynamic``): a token goes to the near replica
  when its rank has one, else to replica ``randint(0, 65536) % n`` of the expert's list (uniform
  up to a bias below ``1 / 65536`` per replica, modelled exactly). This is the expectation of
  ``static`` over its random choice (up to that bias).
* ``dynamic`` without an all-to-all backend (the default then; ``static`` is refused;
  ``sglang-dynamic-no-a2a``): replica ``row % n`` of the full list, i.e. an even split.
* ``fake`` replaces the router's choice by random logits (benchmarking), then picks like
  ``dynamic``; ``lp`` solves a min-max LP on every batch's all-reduced counts, which is
  eplb's optimal dispatch (``dispatch="optimal"``), not a fixed split.

SGLang's replica lists are in increasing slot order (it builds them from ``phy2log``, as eplb's
``log2phy``), which fixes what "first" means above. A plan is made for these rules by
:mod:`eplb.planning.engine_planning`.

**Files** (:mod:`eplb.io.formats.sglang`): counts from its expert-distribution dumps
(``--expert-distribution-recorder-mode stat``: ``sglang-dump``; ``per_pass`` / ``per_token``:
``sglang-detail``; ``{"logical_count": ...}`` JSON: ``logical-count-json``); the placement is
``{"physical_to_logical_map": [[...]]}`` (``sglang``), a row per model layer, which the server loads
with ``--init-expert-location init_expert_location.json``; eplb writes ``<name>.eplb.json`` beside
it (GPUs, nodes, groups) so ``eplb validate`` can read it back. Recipe: ``docs/engines/sglang.md``.
"""

from __future__ import annotations

import numpy as np

from ...kernels.engine_tables.sglang_table import (dynamic_layer_shares, near_replicas, seeded_state, static_layer_table,
                                     table_shares)
from ..contract import DispatchRule, Engine

SGLANG_SEED = 42  # compute_logical_to_rank_dispatch_physical_map's seed


def check_topology(topology, rule: str) -> None:
    """A ``ValueError`` unless every GPU of ``topology`` has the same slots (SGLang's layout)."""
    if not topology.is_uniform:
        raise ValueError(f"dispatch={rule!r} needs the same number of slots on every GPU (num_slots divisible by "
                         f"num_gpus): the topology has slots_per_gpu {topology.slots_per_gpu.tolist()}")


def layer_layout(row: np.ndarray, num_experts: int):
    """``row [S]`` -> ``log2phy [E, R]`` (slots increasing, ``-1`` padded) and ``logcnt [E]``."""
    logcnt = np.bincount(row, minlength=num_experts).astype(np.int64)
    order = np.argsort(row, kind="stable")
    width = int(logcnt.max())
    log2phy = np.full((num_experts, width), -1, np.int64)
    starts = np.concatenate([[0], np.cumsum(logcnt)[:-1]])
    rank = np.arange(row.size) - starts[row[order]]
    log2phy[row[order], rank] = order
    return log2phy, logcnt


class RuleShares:
    """The shares ``[S]`` of one layer under ``sglang-static`` or ``sglang-dynamic``, layer after
    layer (the static table's per-rank streams ``[G, 625]`` advance with every layer whose table is
    kept): SGLang's ``layer_shares`` (:class:`eplb.engines.contract.Engine`)."""

    def __init__(self, rule: str, topology):
        check_topology(topology, rule)
        self.rule = rule
        self.num_gpus = topology.num_gpus
        self.num_nodes = topology.num_nodes
        self.streams = np.tile(seeded_state(SGLANG_SEED), (self.num_gpus, 1)) if rule == "sglang-static" else None

    def layer(self, row: np.ndarray, num_experts: int):
        """``(shares [S] float64, streams after the layer or None, logcnt [E])``; the streams held
        are not advanced (call :meth:`keep`)."""
        log2phy, logcnt = layer_layout(row, num_experts)
        near = near_replicas(row, log2phy, logcnt, self.num_gpus, self.num_nodes)
        shares = np.zeros(row.size)
        if self.streams is None:
            dynamic_layer_shares(near, row, log2phy, logcnt, shares)
            return shares, None, logcnt
        streams = self.streams.copy()
        table = np.empty(near.shape, np.int64)
        static_layer_table(near, log2phy, logcnt, streams, table)
        table_shares(table, row.size, shares)
        return shares, streams, logcnt

    def keep(self, streams) -> None:
        """Advance to the next layer with the streams :meth:`layer` returned for the layout kept."""
        if streams is not None:
            self.streams = streams


ENGINE = Engine(
    name="sglang",
    title="SGLang",
    rules={
        "sglang-static": DispatchRule("engine", "SGLang static dispatch",
                                      "SGLang --ep-dispatch-algorithm static: the per-rank table, reproduced exactly"),
        "sglang-dynamic": DispatchRule("engine", "SGLang dynamic dispatch",
                                       "SGLang dynamic with an all-to-all backend: the rank's near replica, "
                                       "else a uniform random one"),
        "sglang-dynamic-no-a2a": DispatchRule("uniform", "SGLang dynamic dispatch without all-to-all (an even split)",
                                              "SGLang dynamic with --moe-a2a-backend none: even split"),
    },
    options=("sglang-static", "sglang-dynamic"),
    layer_shares=RuleShares,
    formats=("logical-count-json", "sglang-dump", "sglang-detail", "sglang"),
    loads="sglang",
    adapter=None,
    notes=__doc__,
    # ExpertLocationMetadata takes [num_hidden_layers, S] and is indexed by layer id
    dense_layers="SGLang indexes the map by layer id over all of the model's layers, so their rows are kept for the "
                 "shape; its dense layers never read them",
)

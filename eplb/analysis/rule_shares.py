"""The shares an engine's dispatch rule gives a placement, computed fast (Numba kernels of
:mod:`eplb.kernels.sglang_table`), layer by layer: what :class:`eplb.Placement` metrics use for
``dispatch="sglang-static"`` / ``"sglang-dynamic"`` and what :mod:`eplb.planning.engine_planning` plans with.

Equal (to 1e-15: the same choices, summed in another order) to the plain-Python reference the tests keep (``tests/sglang_reference.py``,
checked against SGLang's own code): SGLang ``static`` draws its per-rank "fair" picks from ``random.Random(42)``
streams that run on from one layer to the next, so a layer's shares depend on the layers before it;
:class:`RuleShares` keeps the streams between layers.
"""

from __future__ import annotations

import numpy as np

from ..model.dispatch_rules import DISPATCH_RULES, dispatch_rule
from ..kernels.sglang_table import (dynamic_layer_shares, near_replicas, seeded_state, static_layer_table,
                                   table_shares)

ENGINE_KIND_RULES = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind == "engine")
"""The rules whose shares depend on the placement: ``("sglang-static", "sglang-dynamic")``."""

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
    """The shares ``[S]`` of one layer under a rule, layer after layer (the static table's per-rank
    streams ``[G, 625]`` advance with every layer whose table is kept)."""

    def __init__(self, rule: str, topology):
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


def rule_shares(phy2log, num_experts: int, topology, rule: str) -> np.ndarray:
    """``[L, S]`` float64: the shares ``rule`` gives ``phy2log [L, S]`` of ``num_experts`` experts
    (what :func:`eplb.analysis.engine_dispatch.engine_shares` returns; Numba kernels, milliseconds)."""
    dispatch_rule(rule, "rule", ENGINE_KIND_RULES)
    check_topology(topology, rule)
    phy2log = np.require(phy2log, dtype=np.int64, requirements="C")
    shares = RuleShares(rule, topology)
    out = np.empty(phy2log.shape)
    for layer, row in enumerate(phy2log):
        out[layer], streams, _ = shares.layer(row, num_experts)
        shares.keep(streams)
    return out

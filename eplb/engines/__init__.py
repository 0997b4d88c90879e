"""The serving engines eplb plans for, one package each, and the dispatch rules: one registry.

Every engine is one package of this folder (``vllm/``, ``tensorrt_llm/``, ``sglang/``) whose module
declares ``ENGINE``, an :class:`~eplb.engines.contract.Engine`, and whose docstring is the engine's
notes. :data:`ENGINES` lists them, one line each. The rest of eplb asks this registry, never a
hand-written list: the dispatch rules ``dispatch=`` takes (:data:`DISPATCH_RULES`, the two general
rules and every engine's), their subsets (:data:`SCORING`, :data:`ENGINE_RULES`,
:data:`SHARE_RULES`, :data:`PLACEMENT_RULES`), the shares of a rule that depends on the placement
(:func:`rule_shares`), the formats an engine loads and what it does with dense layers' rows (the CLI).

**The contract**: what an engine entry must provide.

- ``name`` (the registry key) and ``title``; ``notes``: the module's docstring, saying what the
  engine does with a placement (how it picks a replica, where in its code), which versions were
  checked, and how it loads eplb's plan.
- ``rules``: its dispatch rules, :class:`~eplb.engines.contract.DispatchRule` by name, each named
  ``name`` or ``name-...``; a rule's ``kind`` is ``"uniform"`` (an even split), ``"optimal"``
  (a min-max split of each batch) or ``"engine"`` (shares set by the engine's replica choice).
  ``options``: the ones ``--engine`` offers.
- ``layer_shares``: for rules of kind ``"engine"`` only, the class computing a layer's shares
  (:class:`~eplb.engines.contract.Engine` gives its interface); the metrics, ``engine_shares`` and
  the planner for the rule use it, layer by layer. The planner's moves
  (:mod:`eplb.planning.engine_planning`) are those that keep every slot's share under a
  near-replica choice like SGLang's: an engine whose shares move otherwise needs its moves there.
- ``formats`` / ``loads``: its files, by their names in :data:`eplb.io.formats.FORMATS` (the format
  modules live in ``eplb/io/formats/`` with the registry of formats); with ``loads``,
  ``dense_layers``: what it does with the rows of dense layers in that file.
- ``adapter``: the module of its adapter, if it takes calls rather than files (vLLM's policy).

:func:`~eplb.engines.contract.check_engine` checks each entry when this module loads;
``tests/engines/test_engine_registry.py`` checks what needs the layers above (the formats exist in the
format registry, the adapter module imports and provides ``install``, the notes name versions).
Adding an engine is its package and one line in :data:`ENGINES`; adding a rule to an engine is an
entry in its ``rules``.

**Why this layer** (``eplb/layers.py``: above ``kernels``, below ``analysis``): the rules are
read by every layer from ``analysis`` up (the metrics judge a placement under a rule, ``plan``
takes one, the CLI offers them), and SGLang's shares run on Numba kernels, so an engine's dispatch
knowledge sits just above the kernels and below everything that reads it. An engine's files and
adapter need the layers above (``Placement``, ``plan``, the format registry), so they stay in their
layer's registry (``eplb/io/formats/``, ``eplb/serving/adapters/``) and the entry names them; the
engine's package holds the rest, so no lower layer needs a registration done by a higher one.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from . import sglang, tensorrt_llm, vllm
from .contract import KINDS, DispatchRule, Engine, check_engine

__all__ = ["DISPATCH_RULES", "ENGINES", "ENGINE_RULES", "GENERAL_RULES", "KINDS", "PLACEMENT_RULES", "SCORING",
           "SHARE_RULES", "DispatchRule", "Engine", "dispatch_rule", "engine", "engine_of", "rule_shares"]

#: every engine, by name, in a fixed order (the order rules are listed in); one line an engine
ENGINES: dict[str, Engine] = {entry.name: check_engine(entry) for entry in (
    vllm.ENGINE,
    tensorrt_llm.ENGINE,
    sglang.ENGINE,
)}

GENERAL_RULES = {
    "uniform": DispatchRule("uniform", "an even split", "even split 1 / logcnt"),
    "optimal": DispatchRule("optimal", "optimal dispatch", "per batch, the split minimising the max GPU load"),
}
"""The rules of no one engine: the even split and optimal dispatch."""

DISPATCH_RULES: dict[str, DispatchRule] = {**GENERAL_RULES,
                                           **dict(chain.from_iterable(e.rules.items() for e in ENGINES.values()))}
"""Every dispatch rule by name: the general ones, then each engine's in registry order. Read by
:func:`eplb.plan` (``dispatch=``), :class:`eplb.Placement` metrics (``dispatch=``), the series
objectives and the command line (``--dispatch``, ``--engine``)."""

_OWNER = {rule: entry for entry in ENGINES.values() for rule in entry.rules}
if len(_OWNER) != sum(len(entry.rules) for entry in ENGINES.values()) or set(_OWNER) & set(GENERAL_RULES):
    raise ValueError("two engines (or an engine and a general rule) share a dispatch rule's name")

SCORING = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind == name)
"""The rules windows are scored by directly: ``("uniform", "optimal")``; the others map to one of
them (even splits) or to their engine's shares."""

ENGINE_RULES = tuple(chain.from_iterable(entry.options for entry in ENGINES.values()))
"""The engines' rules a user names with ``--engine``: every engine's ``options``."""

SHARE_RULES = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind != "optimal")
"""The rules that are a fixed split of each expert's tokens (:func:`eplb.analysis.engine_dispatch.engine_shares`)."""

PLACEMENT_RULES = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind == "engine")
"""The rules whose shares depend on the placement (kind ``"engine"``): ``("sglang-static", "sglang-dynamic")``."""


def dispatch_rule(name, argument: str = "dispatch", accepted=tuple(DISPATCH_RULES)) -> DispatchRule:
    """The rule called ``name``; a ``ValueError`` naming ``argument`` and the ``accepted`` names otherwise."""
    if not isinstance(name, str) or name not in accepted:
        raise ValueError(f"{argument} must be one of {tuple(accepted)}, got {name!r}")
    return DISPATCH_RULES[name]


def engine(name) -> Engine:
    """The engine called ``name`` (a key of :data:`ENGINES`); a ``ValueError`` naming the accepted
    engines otherwise."""
    if not isinstance(name, str) or name not in ENGINES:
        raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {name!r}")
    return ENGINES[name]


def engine_of(rule: str) -> Engine | None:
    """The engine whose rule ``rule`` is (``None`` for a general rule); a ``ValueError`` for an unknown rule."""
    dispatch_rule(rule, "rule")
    return _OWNER.get(rule)


def rule_shares(phy2log, num_experts: int, topology, rule: str) -> np.ndarray:
    """``[L, S]`` float64: the shares ``rule`` (one of :data:`PLACEMENT_RULES`) gives ``phy2log [L,
    S]`` of ``num_experts`` experts, layer after layer with its engine's ``layer_shares`` (what
    :func:`eplb.analysis.engine_dispatch.engine_shares` returns; SGLang's: Numba kernels, milliseconds)."""
    dispatch_rule(rule, "rule", PLACEMENT_RULES)
    shares = _OWNER[rule].layer_shares(rule, topology)
    phy2log = np.require(phy2log, dtype=np.int64, requirements="C")
    out = np.empty(phy2log.shape)
    for layer, row in enumerate(phy2log):
        out[layer], state, _ = shares.layer(row, num_experts)
        shares.keep(state)
    return out

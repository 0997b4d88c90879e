"""What an engine entry is: :class:`DispatchRule` (how an engine splits an expert's tokens among its
replicas), :class:`Engine` (everything eplb knows about one serving engine) and :func:`check_engine`,
which the registry (:mod:`eplb.engines`) runs on every entry it lists, so a wrong entry fails at
import with a message naming the engine and the field.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

KINDS = ("uniform", "optimal", "engine")
"""The kinds of dispatch rule: ``"uniform"``, an even split, ``1 / logcnt`` per replica;
``"optimal"``, the min-max split of each batch (:func:`eplb.dispatch`); ``"engine"``, fixed shares set
by the engine's replica choice, which depend on where the replicas sit."""


class DispatchRule(NamedTuple):
    """A dispatch rule: its ``kind`` (one of :data:`KINDS`), the words a summary uses for it
    (``label``) and what it models (``description``)."""

    kind: str
    label: str
    description: str


class Engine(NamedTuple):
    """One serving engine, as its module declares it (``ENGINE``) and the registry lists it.

    Attributes:
        name: the registry's key, lower case (``"sglang"``).
        title: the engine's name as its project writes it (``"SGLang"``).
        rules: the engine's dispatch rules, by the name ``dispatch=`` (``eplb.plan``, the metrics)
            takes, each prefixed by ``name`` or equal to it; unique over all engines.
        options: the rules ``--engine`` offers, a subset of ``rules`` (the engine's configurations a
            user serves with; a rule that is the same split as another may be left out).
        layer_shares: for rules of kind ``"engine"`` (and only then): a class built as
            ``layer_shares(rule, topology)`` (a ``ValueError`` for a topology the engine cannot
            serve) whose ``layer(row [S], num_experts)`` returns ``(shares [S] float64, state,
            logcnt [E])`` for one layer's ``phy2log`` row, and whose ``keep(state)`` moves on to the
            next layer with the layer kept (a rule whose choice of one layer depends on the layers
            before it carries that in ``state``; ``None`` when it does not). ``None`` for an engine
            whose rules are even splits.
        formats: the names of its files in the format registry (:data:`eplb.io.formats.FORMATS`):
            the counts it records and the placement it loads.
        loads: the one of ``formats`` it loads a placement from, or ``None`` (it takes calls).
        adapter: the module of its adapter (imported only when used: engine libraries are optional),
            or ``None`` (it exchanges files).
        notes: what the engine does with a placement, which versions were checked and how it loads
            eplb's plan: the engine module's docstring.
        dense_layers: for an engine that loads a file: what it does with the rows of dense layers
            (all-zero counts) in it, as ``eplb plan`` says it; else ``None``.
    """

    name: str
    title: str
    rules: dict[str, DispatchRule]
    options: tuple[str, ...]
    layer_shares: Callable | None
    formats: tuple[str, ...]
    loads: str | None
    adapter: str | None
    notes: str
    dense_layers: str | None = None


def check_engine(entry: Engine) -> Engine:
    """``entry`` if it keeps the contract of :class:`Engine`; a ``ValueError`` naming the engine and
    what is wrong otherwise (the format and adapter names are checked by the tests, which may import
    the layers above)."""
    def fail(what):
        raise ValueError(f"engine {getattr(entry, 'name', entry)!r}: {what}")

    if not isinstance(entry, Engine):
        fail(f"must be an eplb.engines.contract.Engine, got {type(entry).__name__}")
    if not entry.name or entry.name != entry.name.lower() or not entry.title or not entry.notes:
        fail("needs a lower-case name, a title and notes")
    if not entry.rules:
        fail("needs at least one dispatch rule")
    for rule_name, rule in entry.rules.items():
        if not (rule_name == entry.name or rule_name.startswith(entry.name + "-")):
            fail(f"rule {rule_name!r} must be named {entry.name!r} or start with {entry.name + '-'!r}")
        if not isinstance(rule, DispatchRule) or rule.kind not in KINDS:
            fail(f"rule {rule_name!r} must be a DispatchRule of a kind in {KINDS}")
    if not set(entry.options) <= set(entry.rules):
        fail(f"options {entry.options} must be among its rules {tuple(entry.rules)}")
    own_shares = any(rule.kind == "engine" for rule in entry.rules.values())
    if own_shares != (entry.layer_shares is not None):
        fail("layer_shares is given exactly when a rule is of kind 'engine'")
    if entry.loads is not None and entry.loads not in entry.formats:
        fail(f"loads {entry.loads!r} must be one of its formats {entry.formats}")
    if (entry.dense_layers is not None) != (entry.loads is not None):
        fail("dense_layers is given exactly when it loads a file")
    return entry

"""The dispatch rules: how an engine splits an expert's tokens among its replicas. One registry,
read by :func:`eplb.plan` (``dispatch=``), :class:`eplb.Placement` metrics (``dispatch=``), the
series objectives and the command line (``--dispatch``, ``--engine``).

Each rule has a *kind*:

- ``"uniform"``: an even split, ``1 / logcnt`` per replica (vLLM, TensorRT-LLM, SGLang ``dynamic``
  without an all-to-all backend);
- ``"optimal"``: the min-max split of each batch (:func:`eplb.dispatch`; SGLang ``lp``);
- ``"engine"``: fixed shares set by the engine's replica choice, which depend on where the replicas
  sit (SGLang ``static`` and ``dynamic`` with an all-to-all backend, :mod:`eplb.analysis.engine_dispatch`);
  a plan is made for them by :mod:`eplb.planning.engine_planning`.
"""

from __future__ import annotations

from typing import NamedTuple


class DispatchRule(NamedTuple):
    """A dispatch rule: its ``kind`` (``"uniform"``, ``"optimal"`` or ``"engine"``), the words a
    summary uses for it (``label``) and what it models (``description``)."""

    kind: str
    label: str
    description: str


DISPATCH_RULES = {
    "uniform": DispatchRule("uniform", "an even split", "even split 1 / logcnt"),
    "optimal": DispatchRule("optimal", "optimal dispatch", "per batch, the split minimising the max GPU load"),
    "vllm": DispatchRule("uniform", "vLLM dispatch (an even split)",
                         "even split (replica = token position % replica count)"),
    "tensorrt-llm": DispatchRule("uniform", "TensorRT-LLM dispatch (an even split)",
                                 "even split (round robin over replicas)"),
    "sglang-static": DispatchRule("engine", "SGLang static dispatch",
                                  "SGLang --ep-dispatch-algorithm static: the per-rank table, reproduced exactly"),
    "sglang-dynamic": DispatchRule("engine", "SGLang dynamic dispatch",
                                   "SGLang dynamic with an all-to-all backend: the rank's near replica, "
                                   "else a uniform random one"),
    "sglang-dynamic-no-a2a": DispatchRule("uniform", "SGLang dynamic dispatch without all-to-all (an even split)",
                                          "SGLang dynamic with --moe-a2a-backend none: even split"),
}
"""Every dispatch rule by name."""

SCORING = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind == name)
"""The rules windows are scored by directly: ``("uniform", "optimal")``; the others map to one of
them (even splits) or to their engine's shares."""

ENGINE_RULES = ("vllm", "tensorrt-llm", "sglang-static", "sglang-dynamic")
"""The engines' rules a user names with ``--engine``."""

SHARE_RULES = tuple(name for name, rule in DISPATCH_RULES.items() if rule.kind != "optimal")
"""The rules that are a fixed split of each expert's tokens (:func:`eplb.analysis.engine_dispatch.engine_shares`)."""


def dispatch_rule(name, argument: str = "dispatch", accepted=tuple(DISPATCH_RULES)) -> DispatchRule:
    """The rule called ``name``; a ``ValueError`` naming ``argument`` and the ``accepted`` names otherwise."""
    if not isinstance(name, str) or name not in accepted:
        raise ValueError(f"{argument} must be one of {tuple(accepted)}, got {name!r}")
    return DISPATCH_RULES[name]

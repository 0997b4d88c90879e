"""What a :class:`~eplb.serving.balancer.Balancer` saves and reads back: the format version, the keys
of a saved state and of its configuration (:data:`STATE_KEYS`, :data:`CONFIG_KEYS`), and
:func:`read_state`, which checks a saved state's keys and types (a dict, an ``np.load`` result or
JSON lists) into a :class:`SavedState` or raises ``ValueError`` naming the key and the rule. The
balancer's :meth:`~eplb.serving.balancer.Balancer.state_dict` and
:meth:`~eplb.serving.balancer.Balancer.load_state_dict` check shapes and values against its own
configuration."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..model._validation import as_int


STATE_VERSION = 1


CONFIG_KEYS = ("num_layers", "num_experts", "topology", "num_groups", "window", "decay", "forecast", "method",
               "tolerance", "max_moves", "min_gain", "move_cost", "expert_bytes", "options", "threads",
               "subwindows", "copy_cost")
"""The keys of a saved configuration (``state_dict()["config"]``)."""


STATE_KEYS = ("format_version", "config", "window_buffer", "position", "filled", "steps", "rebalances", "phy2log")
"""The keys of :meth:`Balancer.state_dict`."""


@dataclass(frozen=True)
class SavedState:
    """A :meth:`Balancer.state_dict` read back and checked for types (:func:`read_state`).

    Attributes:
        config: the saved configuration (a dict of :data:`CONFIG_KEYS`, ``topology`` a dict).
        window_buffer: ``[window, L, E]`` float64; phy2log: ``[L, S]`` integer array.
        position, filled, steps, rebalances: non-negative ints.
    """

    config: dict
    window_buffer: np.ndarray
    phy2log: np.ndarray
    position: int
    filled: int
    steps: int
    rebalances: int


def read_state(state) -> SavedState:
    """Read a saved state (a dict, an ``np.load`` result or JSON lists) or raise ``ValueError``
    naming the key and the rule it breaks: every key of :data:`STATE_KEYS` present, a supported
    ``format_version``, ``config`` a JSON object with ``num_layers``, ``num_experts`` and
    ``topology``, ``window_buffer`` a numeric array, ``phy2log`` an integer array, the counters
    non-negative integers. Shapes and values against a configuration are the caller's to check."""
    if not isinstance(state, Mapping):  # a dict, or what np.load returns for an .npz
        raise ValueError(f"state must be a mapping of {list(STATE_KEYS)} (Balancer.state_dict()), "
                         f"got {type(state).__name__}")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state is missing the keys {missing}")
    version = _state_int(state, "format_version")
    if version != STATE_VERSION:
        raise ValueError(f"unsupported balancer state format_version {version} (this eplb reads {STATE_VERSION})")
    text = np.asarray(state["config"])
    if text.ndim != 0 or text.dtype.kind not in "US":
        raise ValueError(f"state config must be a JSON string (an object of {list(CONFIG_KEYS)}), got {text!r}")
    try:
        config = json.loads(str(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"state config must be a JSON object, could not parse it: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"state config must be a JSON object of {list(CONFIG_KEYS)}, got {type(config).__name__} "
                         f"{config!r}"[:300])
    needed = sorted({"num_layers", "num_experts", "topology"} - set(config))
    if needed:
        raise ValueError(f"state config is missing the keys {needed}")
    for key in ("num_layers", "num_experts", "window"):
        if key in config:
            as_int(config[key], f"state config {key}", minimum=1)
    buffer = _state_array(state, "window_buffer", np.float64, "a numeric array [window, num_layers, num_experts]")
    phy2log = _state_array(state, "phy2log", None, "an integer array [num_layers, num_slots] of expert ids")
    if phy2log.dtype.kind not in "iu":
        raise ValueError(f"state phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
    position, filled, steps, rebalances = (_state_int(state, key) for key in ("position", "filled", "steps",
                                                                              "rebalances"))
    return SavedState(config, buffer, phy2log, position, filled, steps, rebalances)


def _state_array(state, key: str, dtype, rule: str) -> np.ndarray:
    """``state[key]`` as a numpy array (of ``dtype`` when given), else ``ValueError`` saying ``rule``."""
    try:
        array = np.asarray(state[key], dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state {key} must be {rule}: {exc}") from None
    if array.dtype == object:
        raise ValueError(f"state {key} must be {rule}, got objects")
    return array


def _state_int(state, key: str) -> int:
    """``state[key]`` as a non-negative int (a 0-d array, a number): floats and bools are refused."""
    try:
        value = np.asarray(state[key])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state {key} must be one integer: {exc}") from None
    if value.ndim != 0:
        raise ValueError(f"state {key} must be one integer, got shape {value.shape}")
    return as_int(value.item(), f"state {key}", minimum=0)


class SavedConfig:
    """The configuration half of :meth:`Balancer.state_dict <eplb.serving.balancer.Balancer.state_dict>`:
    methods of the :class:`~eplb.serving.balancer.Balancer` that write its settings as saved
    (:data:`CONFIG_KEYS`)."""

    def _config(self) -> dict:
        return {
            "num_layers": self.num_layers, "num_experts": self.num_experts, "topology": self.topology.to_dict(),
            "num_groups": self.num_groups, "window": self.window, "decay": self.decay, "forecast": self.forecast,
            "method": self.method,
            # as given: "auto" stays "auto" (its value follows the deployment, which may change)
            "tolerance": self._saved_move_argument(0), "max_moves": self._saved_move_argument(1),
            "min_gain": self.min_gain,
            "move_cost": self.move_cost, "expert_bytes": self.expert_bytes, "options": self.options,
            "threads": self.threads, "subwindows": self.subwindows, "copy_cost": self.copy_cost,
        }

    def _saved_move_argument(self, index: int):
        """``tolerance`` (0) or ``max_moves`` (1) as saved: ``"auto"`` when left to the slots per GPU,
        else the value in use."""
        given = self._move_arguments[index]
        if isinstance(given, str):
            return given
        return self.tolerance if index == 0 else self.max_moves

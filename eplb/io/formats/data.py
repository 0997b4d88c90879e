"""What the readers return, and the checks every array read from a file goes through.

Files from outside are untrusted: every array is checked for its shape, its type and its values
here before anything is planned on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...analysis.placement import Placement
from ...engines import DISPATCH_RULES
from .errors import FormatError
from .limits import MAX_ID, check_counts_shape, check_size, limit

#: the phases windows can be selected by (``CountsFile.select_phase``, ``eplb plan --phase``)
PHASES = ("prefill", "decode")
#: the phase of a window that belongs to neither (a pass without tokens, or an engine mode that
#: serves both phases without saying which): no phase selects it
OTHER_PHASE = "other"


@dataclass(frozen=True)
class CountsFile:
    """Expert counts read from a file.

    Attributes:
        counts: ``[T, L, E]`` float64, tokens routed to each logical expert in each recording
            window (``T = 1`` for a file holding ``[L, E]``). Finite and non-negative.
        layer_ids: ``[L]`` int64, the model's index of each MoE layer (``0 .. L-1`` unless the file
            says otherwise; TensorRT-LLM skips dense layers, so its ids may start at 3).
        format: the format name (see :data:`eplb.io.formats.COUNTS_FORMATS`).
        path: the file or folder it was read from.
        metadata: anything else the file said (top-k, ranks, ...).
        phases: ``[T]`` str, the phase of each window's forward pass: ``"prefill"``, ``"decode"``
            or :data:`OTHER_PHASE`; ``None`` when the file does not record one.
        layer_ids_recorded: whether the file says which model layer each row is (a layer column,
            an ``.npz``'s ``layer_ids``, TensorRT-LLM's keys, SGLang's dumps, which have a row per
            model layer); ``False`` when ``layer_ids`` are only the rows' order (a plain ``.npy``
            or matrix): MoE-only rows of a model with dense layers are then not its layers 0 .. L-1.
    """

    counts: np.ndarray
    layer_ids: np.ndarray
    format: str
    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    phases: np.ndarray | None = None
    layer_ids_recorded: bool = True

    def __post_init__(self):
        if self.phases is None:
            return
        phases = np.asarray(self.phases, dtype=str)
        if phases.shape != (self.counts.shape[0],):
            raise ValueError(f"phases must have shape [T] = [{self.counts.shape[0]}] (one per window), "
                             f"got shape {list(phases.shape)}")
        unknown = sorted(set(phases.tolist()) - {*PHASES, OTHER_PHASE})
        if unknown:
            raise ValueError(f"phases must hold {', '.join(map(repr, (*PHASES, OTHER_PHASE)))}, found {unknown}")
        object.__setattr__(self, "phases", phases)

    def select_phase(self, phase: str) -> CountsFile:
        """The windows whose pass was of ``phase`` (one of :data:`PHASES`), in file order.

        Returns:
            a :class:`CountsFile` with ``counts [T', L, E]`` and ``phases [T']`` of those windows
            (``T' <= T``) and ``metadata`` plus ``phase``, ``windows_selected`` (``T'``) and
            ``windows_total`` (``T``).
        Raises:
            ValueError: ``phase`` is not one of :data:`PHASES`.
            FormatError: the file records no phase, or no window of ``phase``.
        """
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        if self.phases is None:
            raise FormatError(self.path, f"records no phase per window ({self.format} files do not), so windows "
                                         f"cannot be selected by phase {phase!r}")
        keep = self.phases == phase
        if not keep.any():
            found = ", ".join(f"{n} {p}" for p, n in zip(*np.unique(self.phases, return_counts=True)))
            raise FormatError(self.path, f"holds no {phase} pass to select (its {self.num_windows} passes: {found})")
        metadata = {**self.metadata, "phase": phase, "windows_selected": int(keep.sum()),
                    "windows_total": self.num_windows}
        return CountsFile(np.ascontiguousarray(self.counts[keep]), self.layer_ids, self.format, self.path, metadata,
                          self.phases[keep], self.layer_ids_recorded)

    def in_windows(self, passes: int) -> CountsFile:
        """The recording cut into windows of ``passes`` consecutive windows (passes or iterations)
        each, summed; the last window holds what is left.

        Returns:
            a :class:`CountsFile` with ``counts [ceil(T / passes), L, E]`` (phases dropped: a window
            may mix them) and ``metadata`` plus ``passes_per_window``.
        Raises:
            ValueError: ``passes`` is not a positive whole number.
        """
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"passes must be a positive whole number, got {passes!r}")
        starts = np.arange(0, self.num_windows, int(passes))
        counts = np.add.reduceat(self.counts, starts, axis=0)
        return CountsFile(counts, self.layer_ids, self.format, self.path,
                          {**self.metadata, "passes_per_window": int(passes)}, layer_ids_recorded=self.layer_ids_recorded)

    @property
    def weights(self) -> np.ndarray:
        """``[L, E]``: the counts summed over windows (what a placement is planned on)."""
        return self.counts.sum(axis=0)

    @property
    def num_windows(self) -> int:
        return self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[2]


@dataclass(frozen=True)
class PlacementFile:
    """A placement read from a file.

    Attributes:
        placement: the :class:`eplb.Placement` (validated: every expert has a replica in every layer).
        layer_ids: ``[L]`` int64, the model's index of each layer.
        format: the format name (see :data:`eplb.io.formats.PLACEMENT_FORMATS`).
        path: the file it was read from.
        metadata: configuration and diagnostics stored with it (eplb's own JSON), else ``{}``.
    """

    placement: Placement
    layer_ids: np.ndarray
    format: str
    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)


def check_counts(array, path, what: str = "counts") -> np.ndarray:
    """Validate counts read from ``path``: ``[E]`` (one layer), ``[L, E]`` or ``[T, L, E]``,
    numeric, finite, >= 0, within the size limits of :mod:`eplb.io.formats.limits`.

    Returns:
        ``[T, L, E]`` float64 (leading axes of 1 are added to ``[E]`` and ``[L, E]``).
    Raises:
        FormatError: naming the file and the rule broken (wrong shape, NaN, negative, ...).
    """
    try:
        array = np.asarray(array)
    except (ValueError, TypeError, OverflowError):
        raise FormatError(path, f"{what} must be a rectangular array of numbers") from None
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise FormatError(path, f"{what} must be numbers (a rectangular array below 1.8e308), "
                                f"got an array of dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.complexfloating):
        raise FormatError(path, f"{what} must be real numbers, got dtype {array.dtype}")
    if array.ndim not in (1, 2, 3):
        raise FormatError(path, f"{what} must have shape [E], [L, E] or [T, L, E], got shape {list(array.shape)}")
    if 0 in array.shape:
        raise FormatError(path, f"{what} must not be empty, got shape {list(array.shape)}")
    check_counts_shape(array.shape, path)
    array = array.astype(np.float64)
    if np.isnan(array).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(array))[0])
        raise FormatError(path, f"{what} contain NaN (first at index {list(where)})")
    if np.isinf(array).any():
        raise FormatError(path, f"{what} contain an infinite value (or a number beyond float64's 1.8e308)")
    if (array < 0).any():
        where = tuple(int(i) for i in np.argwhere(array < 0)[0])
        raise FormatError(path, f"{what} must be non-negative, found {array[where]:g} at index {list(where)}")
    while array.ndim < 3:
        array = array[None]
    return np.ascontiguousarray(array)


def check_layer_ids(layer_ids, num_layers: int, path) -> np.ndarray:
    """``[L]`` distinct non-negative integer layer ids (``0 .. L-1`` when ``None``)."""
    if layer_ids is None:
        return np.arange(num_layers, dtype=np.int64)
    ids = np.asarray(layer_ids)
    if ids.ndim != 1 or ids.size != num_layers:
        raise FormatError(path, f"layer_ids must list {num_layers} layers, got shape {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise FormatError(path, f"layer_ids must be integers, got dtype {ids.dtype}")
    if (ids < 0).any() or np.unique(ids).size != ids.size:
        raise FormatError(path, "layer_ids must be distinct non-negative integers")
    return ids.astype(np.int64)


def recorded_or_given(recorded, given, path, what: str, flag: str, source: str):
    """The value a file records for a setting of its deployment (``num_gpus``...), else the one the
    caller gives; a given value that disagrees with the record is refused (the file describes the
    deployment it was written for: a flag cannot change it).

    Args:
        recorded: what the file records (``None`` when it records nothing).
        given: what the caller passed (``None`` when nothing).
        what, flag, source: the setting (``"GPUs"``), its command-line flag (``"--gpus"``) and
            where the file records it (``"its '# eplb:' comment"``), for the message.
    Raises:
        FormatError: ``"records 4 GPUs (its '# eplb:' comment), not --gpus 8"``.
    """
    if recorded is not None and given is not None and recorded != given:
        raise FormatError(path, f"records {recorded} {what} ({source}), not {flag} {given}: the file describes the "
                                "deployment it was planned for, which a flag cannot change")
    return recorded if recorded is not None else given


def recorded_dispatch(value, path, source: str) -> str:
    """The dispatch rule a file records its plan was made for (a name of
    :data:`eplb.engines.DISPATCH_RULES`): what :attr:`eplb.Placement.dispatch` becomes, so the file is
    judged under that rule. ``None`` (a file written before eplb recorded it) is ``"uniform"``.

    Raises:
        FormatError: naming ``source`` (``"its side file x.eplb.json"``) and the rules accepted.
    """
    if value is None:
        return "uniform"
    if not isinstance(value, str) or value not in DISPATCH_RULES:
        raise FormatError(path, f"{source} records the dispatch rule {value!r:.40}, not one of "
                                f"{', '.join(DISPATCH_RULES)}")
    return value


def layer_ranges(layer_ids) -> str:
    """Layer ids as compact ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0..2,5,7..8"``."""
    ids = [int(i) for i in layer_ids]
    parts, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            parts.append(str(ids[start]) if k - 1 == start else f"{ids[start]}..{ids[k - 1]}")
            start = k
    return ",".join(parts)


def parse_layer_ranges(text: str, path, what: str) -> np.ndarray:
    """The layer ids written by :func:`layer_ranges` (``"0..2,5"`` -> ``[0, 1, 2, 5]``)."""
    ids = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("..")
            first, last = int(first), int(last or first)
            if not 0 <= first <= last <= MAX_ID:
                raise ValueError(part)
            check_size(len(ids) + last - first + 1, "layers", what, path)
            ids.extend(range(first, last + 1))
    except ValueError as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(path, f"{what} must be layer ids as ranges like 0..2,5 (0 .. {MAX_ID}), got {text!r:.60}") \
            from None
    return check_layer_ids(ids, len(ids), path)


def check_phy2log(array, path, what: str = "physical_to_logical_map") -> np.ndarray:
    """A ``[L, S]`` table of integer expert ids read from ``path``, within the size limits
    (values are checked against the expert count by Placement)."""
    try:
        array = np.asarray(array)
    except (ValueError, TypeError, OverflowError):
        raise FormatError(path, f"{what} must be a rectangular table of integers") from None
    if array.dtype == object and array.ndim == 2 and all(isinstance(v, int) for v in array.flat):
        raise FormatError(path, f"{what} holds an expert id beyond int64 (at most {limit('experts') - 1:,} accepted)")
    if array.dtype == object or array.ndim != 2:
        raise FormatError(path, f"{what} must be a rectangular [L, S] table of expert ids, got shape {list(array.shape)}")
    if 0 in array.shape:
        raise FormatError(path, f"{what} must not be empty")
    check_size(array.shape[0], "layers", f"the number of layers in {what}", path)
    check_size(array.shape[1], "slots", f"the number of slots in {what}", path)
    if not np.issubdtype(array.dtype, np.integer):
        if np.issubdtype(array.dtype, np.floating) and np.isfinite(array).all() and (array == np.round(array)).all():
            if np.abs(array).max() >= 2.0 ** 62:
                raise FormatError(path, f"{what} holds an expert id of {np.abs(array).max():g}, above the limit of "
                                        f"{limit('experts'):,} experts (set EPLB_MAX_EXPERTS to allow more)")
            array = array.astype(np.int64)
        else:
            raise FormatError(path, f"{what} must hold integer expert ids, got dtype {array.dtype}")
    if array.min() < 0:
        raise FormatError(path, f"{what} must hold expert ids >= 0, found {int(array.min())}")
    check_size(int(array.max()) + 1, "experts", f"the largest expert id + 1 in {what}", path)
    return array.astype(np.int64)


def config_int(value, path, what: str, *, minimum: int = 1, limit_name: str | None = None,
               allow_none: bool = False):
    """An integer setting read from a file (``num_nodes``, ``num_groups``, ``num_slots``...):
    a Python/numpy integer (or a 0-d / one-element integer array), ``>= minimum`` and within the
    limit ``limit_name``; ``None`` passes when ``allow_none``.

    Raises:
        FormatError: naming the file, the setting and the rule (never ``TypeError``/``OverflowError``).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise FormatError(path, f"{what} must be one integer, got an array of shape {list(value.shape)}")
        value = value.reshape(()).item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) < 2.0 ** 62:
            value = int(value)
        else:
            raise FormatError(path, f"{what} must be an integer, got {value!r:.40}")
    if value < minimum:
        raise FormatError(path, f"{what} must be >= {minimum}, got {value}")
    if limit_name is not None:
        check_size(value, limit_name, what, path)
    return value

"""Plain array files: counts in ``.npy`` / ``.npz`` / ``.csv``, placements in ``.npz``.

NumPy files are loaded with ``allow_pickle=False``: an object array in a file is refused, never
unpickled.
"""

from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import numpy as np

from ..placement import Placement
from ..topology import Topology
from .data import CountsFile, PlacementFile, check_counts, check_layer_ids, check_phy2log
from .errors import FormatError

#: keys of an ``.npz`` that may hold the counts, in the order they are looked for
NPZ_COUNTS_KEYS = ("counts", "logical_count", "weights")


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise FormatError(path, f"not a readable .npy array without pickles ({exc})") from None
    except (OSError, EOFError) as exc:
        raise FormatError(path, f"not a readable .npy file ({exc})") from None


def _open_npz(path: Path):
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise FormatError(path, f"not a readable .npz archive ({exc})") from None


def _npz_array(archive, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as exc:  # an object array: it would need unpickling
        raise FormatError(path, f"array '{key}' cannot be read without unpickling ({exc})") from None
    except Exception as exc:  # zip/CRC/format errors of a damaged archive
        raise FormatError(path, f"array '{key}' is damaged ({exc})") from None


def read_npy_counts(path: Path) -> CountsFile:
    """``.npy`` holding ``[L, E]`` or ``[T, L, E]`` counts."""
    counts = check_counts(_load_npy(path), path)
    return CountsFile(counts, check_layer_ids(None, counts.shape[1], path), "npy", path)


def read_npz_counts(path: Path) -> CountsFile:
    """``.npz`` with counts under ``counts`` (or ``logical_count`` / ``weights`` / its only array),
    and optionally ``layer_ids [L]``."""
    with _open_npz(path) as archive:
        keys = list(archive.files)
        key = next((k for k in NPZ_COUNTS_KEYS if k in keys), keys[0] if len(keys) == 1 else None)
        if key is None:
            raise FormatError(path, f"no counts array: expected one of {list(NPZ_COUNTS_KEYS)}, found {keys}")
        counts = check_counts(_npz_array(archive, key, path), path, f"'{key}'")
        layer_ids = _npz_array(archive, "layer_ids", path) if "layer_ids" in keys else None
    return CountsFile(counts, check_layer_ids(layer_ids, counts.shape[1], path), "npz", path, {"key": key})


def read_csv_counts(path: Path) -> CountsFile:
    """CSV counts, in one of two layouts (an optional header row is recognised):

    - a matrix: one row per layer, one column per expert (``[L, E]``);
    - a long table with a header naming the columns ``layer``, ``expert``, ``count`` and optionally
      ``window``: one row per (window, layer, expert), missing rows count 0.
    """
    try:
        with open(path, newline="") as handle:
            rows = [row for row in csv.reader(handle) if row and any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise FormatError(path, f"not a readable CSV file ({exc})") from None
    if not rows:
        raise FormatError(path, "the CSV file is empty")
    header = [cell.strip().lower() for cell in rows[0]]
    if not all(_is_number(cell) for cell in header):
        rows = rows[1:]
        if {"layer", "expert", "count"} <= set(header):
            return _read_long_csv(path, header, rows)
    if not rows:
        raise FormatError(path, "the CSV file has a header but no rows")
    widths = {len(row) for row in rows}
    if len(widths) != 1:
        raise FormatError(path, f"every row must have the same number of experts, found rows of {sorted(widths)} columns")
    matrix = _parse_numbers(path, rows)
    counts = check_counts(matrix, path)
    return CountsFile(counts, check_layer_ids(None, counts.shape[1], path), "csv", path, {"layout": "matrix"})


def _read_long_csv(path: Path, header: list[str], rows: list[list[str]]) -> CountsFile:
    if not rows:
        raise FormatError(path, "the CSV file has a header but no rows")
    columns = ["window", "layer", "expert", "count"] if "window" in header else ["layer", "expert", "count"]
    index = [header.index(c) for c in columns]
    if any(len(row) != len(header) for row in rows):
        raise FormatError(path, f"every row must have {len(header)} columns like the header")
    table = _parse_numbers(path, [[row[i] for i in index] for row in rows])
    keys = table[:, :-1]
    if (keys != np.round(keys)).any() or (keys < 0).any():
        raise FormatError(path, "window, layer and expert must be non-negative integers")
    keys = keys.astype(np.int64)
    if len(columns) == 3:
        keys = np.concatenate([np.zeros((len(keys), 1), np.int64), keys], axis=1)
    if len({tuple(k) for k in keys.tolist()}) != len(keys):
        raise FormatError(path, "a (window, layer, expert) appears twice")
    windows, layer_ids = np.unique(keys[:, 0]), np.unique(keys[:, 1])
    num_experts = int(keys[:, 2].max()) + 1
    counts = np.zeros((windows.size, layer_ids.size, num_experts))
    counts[np.searchsorted(windows, keys[:, 0]), np.searchsorted(layer_ids, keys[:, 1]), keys[:, 2]] = table[:, -1]
    counts = check_counts(counts, path)
    return CountsFile(counts, layer_ids, "csv", path, {"layout": "long"})


def _is_number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def _parse_numbers(path: Path, rows: list[list[str]]) -> np.ndarray:
    try:
        return np.array([[float(cell) for cell in row] for row in rows], dtype=np.float64)
    except ValueError as exc:
        raise FormatError(path, f"every cell must be a number ({exc})") from None


# -- placements ----------------------------------------------------------------------------------


def write_npz_placement(placement: Placement, path: Path, layer_ids=None) -> None:
    """Write a placement as ``.npz``: ``phy2log [L, S]``, ``log2phy [L, E, R]``, ``logcnt [L, E]``,
    ``slots_per_gpu [G]``, ``num_nodes``, ``num_groups`` (-1 for none), ``num_experts``,
    ``layer_ids [L]``, ``method`` and, when known, ``lower_bound [L]`` / ``max_load [L]``.
    No object arrays: it reads back with ``allow_pickle=False``."""
    arrays = {
        "phy2log": placement.phy2log,
        "log2phy": placement.log2phy,
        "logcnt": placement.logcnt,
        "slots_per_gpu": placement.topology.slots_per_gpu,
        "num_nodes": np.int64(placement.num_nodes),
        "num_groups": np.int64(-1 if placement.num_groups is None else placement.num_groups),
        "num_experts": np.int64(placement.num_experts),
        "layer_ids": check_layer_ids(layer_ids, placement.num_layers, path),
        "method": np.str_(placement.method),
    }
    if placement.lower_bound is not None:
        arrays["lower_bound"] = placement.lower_bound
    if placement.max_load is not None:
        arrays["max_load"] = placement.max_load
    with open(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def read_npz_placement(path: Path) -> PlacementFile:
    """Read a placement written by :func:`write_npz_placement` (``phy2log`` and ``slots_per_gpu``
    are required; the rest has defaults)."""
    with _open_npz(path) as archive:
        keys = set(archive.files)
        for key in ("phy2log", "slots_per_gpu"):
            if key not in keys:
                raise FormatError(path, f"not an eplb placement archive: no '{key}' array (found {sorted(keys)})")
        phy2log = check_phy2log(_npz_array(archive, "phy2log", path), path, "phy2log")
        get = lambda key, default: _npz_array(archive, key, path) if key in keys else default  # noqa: E731
        slots = np.asarray(get("slots_per_gpu", None))
        num_nodes = int(get("num_nodes", 1))
        num_groups = int(get("num_groups", -1))
        num_experts = int(get("num_experts", phy2log.max() + 1))
        layer_ids = get("layer_ids", None)
        method = str(get("method", "unknown"))
        bounds = get("lower_bound", None), get("max_load", None)
    try:
        topology = Topology(slots, num_nodes)
        placement = Placement(phy2log, num_experts, topology, None if num_groups < 0 else num_groups, method,
                              *(b if b is None or np.shape(b) == (phy2log.shape[0],) else None for b in bounds))
    except ValueError as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    return PlacementFile(placement, check_layer_ids(layer_ids, phy2log.shape[0], path), "npz", path)

"""Plain array files: counts in ``.npy`` / ``.npz`` / ``.csv``, placements in ``.npz``.

NumPy files are loaded with ``allow_pickle=False``: an object array in a file is refused, never
unpickled.
"""

from __future__ import annotations

import csv
import tokenize
import zipfile
from pathlib import Path

import numpy as np

from ...analysis.placement import Placement
from ...model.topology import Topology
from .data import CountsFile, PlacementFile, check_counts, check_layer_ids, check_phy2log, config_int, recorded_dispatch
from .errors import FormatError
from .limits import MAX_ID, check_counts_shape, check_size
from .spec import Format

#: keys of an ``.npz`` that may hold the counts, in the order they are looked for
NPZ_COUNTS_KEYS = ("counts", "logical_count", "weights")


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise FormatError(path, f"not a readable .npy array without pickles ({exc})") from None
    # a damaged header: NumPy parses it as a Python literal (tokenize, ast)
    except (OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:
        raise FormatError(path, f"not a readable .npy file ({type(exc).__name__}: {exc})") from None


def _open_npz(path: Path):
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, SyntaxError, tokenize.TokenError) as exc:
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
    return CountsFile(counts, check_layer_ids(None, counts.shape[1], path), "npy", path, layer_ids_recorded=False)


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
    return CountsFile(counts, check_layer_ids(layer_ids, counts.shape[1], path), "npz", path, {"key": key},
                      layer_ids_recorded=layer_ids is not None)


#: header spellings recognised in a CSV (compared lower-case, stripped)
LAYER_COLUMNS = ("layer", "layer_id", "layer_idx", "layer_index", "layer_no", "moe_layer")
EXPERT_COLUMNS = ("expert", "expert_id", "expert_idx", "expert_index", "expert_no")
COUNT_COLUMNS = ("count", "counts", "tokens", "num_tokens", "token_count", "tokens_count", "load", "value")
WINDOW_COLUMNS = ("window", "window_id", "window_idx", "iteration", "iter", "step", "batch")
#: names of an index column written by pandas and friends (``DataFrame.to_csv`` writes an empty one)
INDEX_COLUMNS = ("", "index", "unnamed: 0", "idx", "row", "#")


def read_csv_counts(path: Path) -> CountsFile:
    """CSV counts, in one of two layouts (an optional header row is recognised):

    - a matrix: one row per layer, one column per expert (``[L, E]``); a first column named like an
      index (empty, ``index``, ``Unnamed: 0``: it must hold ``0 .. L-1``) or a layer
      (``layer``/``layer_id``/``layer_idx``: the model's layer ids) is not an expert;
    - a long table with a header naming a layer column (``layer``, ``layer_id``, ``layer_idx``), an
      expert column (``expert``, ``expert_id``, ``expert_idx``), a count column (``count``, ``counts``,
      ``tokens``, ``num_tokens``, ``load``) and optionally a window column (``window``,
      ``iteration``, ``step``): one row per (window, layer, expert), missing rows count 0.

    Sizes implied by ids are checked against :mod:`eplb.io.formats.limits` before allocating.
    """
    try:
        with open(path, newline="") as handle:
            rows = [row for row in csv.reader(handle) if row and any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise FormatError(path, f"not a readable CSV file ({exc})") from None
    if not rows:
        raise FormatError(path, "the CSV file is empty")
    header = [cell.strip().lower() for cell in rows[0]]
    has_header = not all(_is_number(cell) for cell in header)
    if has_header:
        rows = rows[1:]
        columns = _long_columns(header)
        if columns is not None:
            return _read_long_csv(path, header, rows, columns)
        named = [name for name in header if name in LAYER_COLUMNS + EXPERT_COLUMNS]
        if len(named) >= 2:
            raise FormatError(path, f"a long CSV needs a count column named one of {', '.join(COUNT_COLUMNS)} "
                                    f"(header: {','.join(header)})")
    if not rows:
        raise FormatError(path, "the CSV file has a header but no rows")
    widths = {len(row) for row in rows}
    if len(widths) != 1:
        raise FormatError(path, f"every row must have the same number of experts, found rows of {sorted(widths)} columns")
    check_counts_shape((len(rows), widths.pop()), path)
    matrix = _parse_numbers(path, rows)
    layer_ids, layout = None, "matrix"
    if has_header and header[0] in INDEX_COLUMNS + LAYER_COLUMNS and matrix.shape[1] > 1:
        first = matrix[:, 0]
        ids = _integer_ids(path, first, f"the first column {header[0]!r}" if header[0] else "the unnamed first column")
        if header[0] in INDEX_COLUMNS:
            if not np.array_equal(ids, np.arange(len(ids))):
                raise FormatError(path, f"the first column {header[0]!r} looks like an index but does not hold "
                                        f"0 .. {len(ids) - 1}: remove it or name it 'layer'")
        else:
            layer_ids = ids
        matrix, layout = matrix[:, 1:], "matrix with " + ("index" if layer_ids is None else "layer") + " column"
    counts = check_counts(matrix, path)
    return CountsFile(counts, check_layer_ids(layer_ids, counts.shape[1], path), "csv", path, {"layout": layout},
                      layer_ids_recorded=layer_ids is not None)


def _long_columns(header: list[str]) -> list[int] | None:
    """Column indices ``[window or -1, layer, expert, count]`` of a long CSV header, else ``None``."""
    found = []
    for names in (WINDOW_COLUMNS, LAYER_COLUMNS, EXPERT_COLUMNS, COUNT_COLUMNS):
        found.append(next((i for i, cell in enumerate(header) if cell in names), -1))
    if min(found[1:]) < 0:
        return None
    return found


def _integer_ids(path: Path, values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as int64 ids in ``0 .. MAX_ID``, or a :class:`FormatError` naming ``what``."""
    if not np.isfinite(values).all() or (values != np.round(values)).any() or (values < 0).any():
        raise FormatError(path, f"{what} must hold non-negative integers")
    if values.size and values.max() > MAX_ID:
        raise FormatError(path, f"{what} holds {values.max():g}, above the largest id accepted ({MAX_ID:,})")
    return values.astype(np.int64)


def _read_long_csv(path: Path, header: list[str], rows: list[list[str]], columns: list[int]) -> CountsFile:
    if not rows:
        raise FormatError(path, "the CSV file has a header but no rows")
    if any(len(row) != len(header) for row in rows):
        raise FormatError(path, f"every row must have {len(header)} columns like the header")
    index = [i for i in columns if i >= 0]
    table = _parse_numbers(path, [[row[i] for i in index] for row in rows])
    names = ["window", "layer", "expert"][3 - (table.shape[1] - 1):]
    keys = np.stack([_integer_ids(path, table[:, j], f"the {name} column") for j, name in enumerate(names)], axis=1)
    if columns[0] < 0:
        keys = np.concatenate([np.zeros((len(keys), 1), np.int64), keys], axis=1)
    windows, window_index = np.unique(keys[:, 0], return_inverse=True)
    layer_ids, layer_index = np.unique(keys[:, 1], return_inverse=True)
    num_experts = int(keys[:, 2].max()) + 1
    check_size(num_experts, "experts", f"the largest expert id + 1 ({header[columns[2]]!r} column)", path)
    check_counts_shape((windows.size, layer_ids.size, num_experts), path)
    flat = (window_index * layer_ids.size + layer_index) * num_experts + keys[:, 2]
    if np.unique(flat).size != flat.size:
        raise FormatError(path, "a (window, layer, expert) appears twice")
    counts = np.zeros((windows.size, layer_ids.size, num_experts))
    counts.reshape(-1)[flat] = table[:, -1]
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
    ``layer_ids [L]``, ``method``, ``dispatch`` (the rule it was planned for) and, when known,
    ``lower_bound [L]`` / ``max_load [L]``.
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
        "dispatch": np.str_(placement.dispatch),
    }
    if placement.lower_bound is not None:
        arrays["lower_bound"] = placement.lower_bound
    if placement.max_load is not None:
        arrays["max_load"] = placement.max_load
    with open(path, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def read_npz_placement(path: Path) -> PlacementFile:
    """Read a placement written by :func:`write_npz_placement` (``phy2log`` and ``slots_per_gpu``
    are required; the rest has defaults: ``dispatch``, the rule its metrics judge under, an even split)."""
    with _open_npz(path) as archive:
        keys = set(archive.files)
        for key in ("phy2log", "slots_per_gpu"):
            if key not in keys:
                raise FormatError(path, f"not an eplb placement archive: no '{key}' array (found {sorted(keys)})")
        phy2log = check_phy2log(_npz_array(archive, "phy2log", path), path, "phy2log")
        get = lambda key, default: _npz_array(archive, key, path) if key in keys else default  # noqa: E731
        slots = _slots_per_gpu(get("slots_per_gpu", None), path)
        num_nodes = config_int(get("num_nodes", 1), path, "num_nodes", limit_name="slots")
        num_groups = get("num_groups", None)
        if num_groups is not None and np.ndim(num_groups) == 0 and np.issubdtype(np.asarray(num_groups).dtype,
                                                                                   np.integer) and num_groups == -1:
            num_groups = None
        num_groups = config_int(num_groups, path, "num_groups", limit_name="experts", allow_none=True)
        num_experts = config_int(get("num_experts", phy2log.max() + 1), path, "num_experts", limit_name="experts")
        layer_ids = get("layer_ids", None)
        method = str(get("method", "unknown"))
        dispatch = get("dispatch", None)
        dispatch = recorded_dispatch(str(dispatch) if dispatch is not None and np.ndim(dispatch) == 0 else dispatch,
                                     path, "its array 'dispatch'")
        bounds = get("lower_bound", None), get("max_load", None)
    try:
        topology = Topology(slots, num_nodes)
        placement = Placement(phy2log, num_experts, topology, num_groups, method,
                              *(b if b is None or np.shape(b) == (phy2log.shape[0],) else None for b in bounds),
                              dispatch=dispatch)
    except ValueError as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    return PlacementFile(placement, check_layer_ids(layer_ids, phy2log.shape[0], path), "npz", path)


def _slots_per_gpu(array, path: Path) -> np.ndarray:
    """``slots_per_gpu [G]``: non-negative integers, within the slot limit."""
    array = np.asarray(array)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise FormatError(path, f"slots_per_gpu must be a non-empty list of integers, got dtype {array.dtype} "
                                f"shape {list(array.shape)}")
    check_size(array.size, "slots", "the number of GPUs (slots_per_gpu)", path)
    if (array < 0).any():
        raise FormatError(path, "slots_per_gpu must be non-negative")
    check_size(int(array.max()), "slots", "slots on one GPU", path)
    check_size(int(array.astype(object).sum()), "slots", "the number of slots", path)
    return array.astype(np.int64)


#: the formats of this module (collected by :data:`eplb.io.formats.FORMATS`)
FORMATS = (
    Format("npy", "NumPy array", suffixes=(".npy",), read_counts=read_npy_counts),
    Format("npz", "NumPy archive", suffixes=(".npz",), read_counts=read_npz_counts,
           read_placement=read_npz_placement, write_placement=write_npz_placement, keywords=("layer_ids",)),
    Format("csv", "CSV table", suffixes=(".csv",), read_counts=read_csv_counts),
)

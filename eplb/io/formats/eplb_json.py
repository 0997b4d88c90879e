"""eplb's own JSON placement file: the placement, the configuration it was planned under, its
diagnostics and the version of eplb that wrote it.

Layout::

    {"format": "eplb-placement", "eplb_version": "0.1.0",
     "layer_ids": [...],                      # model index of each layer
     "configuration": {...},                  # slots, GPUs, nodes, groups, method, input file...
     "diagnostics": {...},                    # balancedness before/after, gap, moves, time...
     "placement": Placement.to_dict()}        # phy2log, topology, bounds (see eplb.Placement)

Non-finite numbers (an infinite gap) are written as ``null`` so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ...analysis.placement import Placement
from .data import PlacementFile, check_layer_ids, check_phy2log, config_int
from .errors import FormatError
from .limits import MAX_ID
from .spec import Format

FORMAT_NAME = "eplb-placement"


def jsonable(value):
    """Plain JSON values: numpy arrays/scalars to lists/numbers, non-finite floats to ``None``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def write_eplb_json(placement: Placement, path: Path, *, layer_ids=None, configuration=None,
                    diagnostics=None) -> None:
    from ..._version import __version__

    document = {
        "format": FORMAT_NAME,
        "eplb_version": __version__,
        "layer_ids": check_layer_ids(layer_ids, placement.num_layers, path),
        "configuration": configuration or {},
        "diagnostics": diagnostics or {},
        "placement": placement.to_dict(),
    }
    text = json.dumps(jsonable(document), allow_nan=False)
    Path(path).write_text(text + "\n")


def load_json(path: Path):
    """Parse a JSON file; any malformed content (bad syntax, nesting too deep for the parser, a
    number too long to convert) is a :class:`FormatError` naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except UnicodeDecodeError:
        raise FormatError(path, "not a JSON file (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise FormatError(path, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise FormatError(path, "JSON nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        raise FormatError(path, f"not readable JSON ({exc})") from None


def read_eplb_json(path: Path, document=None) -> PlacementFile:
    """Read eplb's JSON (or a bare ``Placement.to_dict()``). Every field is checked (types, sizes
    within :mod:`eplb.io.formats.limits`) before the placement is built."""
    document = load_json(path) if document is None else document
    if not isinstance(document, dict):
        raise FormatError(path, "an eplb placement file must hold a JSON object")
    data = document.get("placement", document)
    if not isinstance(data, dict) or "phy2log" not in data:
        raise FormatError(path, "not an eplb placement: no 'placement' with 'phy2log'")
    phy2log = check_phy2log(data["phy2log"], path, "phy2log")
    topology = data.get("topology")
    if not isinstance(topology, dict) or "slots_per_gpu" not in topology:
        raise FormatError(path, "the placement needs a 'topology' with 'slots_per_gpu'")
    slots = topology["slots_per_gpu"]
    if not isinstance(slots, list) or not slots:
        raise FormatError(path, "topology.slots_per_gpu must be a non-empty list of integers")
    slots = [config_int(v, path, "topology.slots_per_gpu[...]", minimum=0, limit_name="slots") for v in slots]
    checked = dict(data)
    checked["phy2log"] = phy2log
    checked["topology"] = {"slots_per_gpu": slots,
                           "num_nodes": config_int(topology.get("num_nodes", 1), path, "topology.num_nodes",
                                                   limit_name="slots")}
    checked["num_experts"] = config_int(data.get("num_experts"), path, "num_experts", limit_name="experts")
    checked["num_groups"] = config_int(data.get("num_groups"), path, "num_groups", limit_name="experts",
                                       allow_none=True)
    for name in ("lower_bound", "max_load"):
        value = data.get(name)
        try:
            ok = value is None or np.asarray(value, dtype=np.float64).shape == (phy2log.shape[0],)
        except (ValueError, TypeError, OverflowError):
            ok = False
        if not ok:
            raise FormatError(path, f"{name} must be null or a list of {phy2log.shape[0]} numbers")
    if not isinstance(data.get("method", "unknown"), str):
        raise FormatError(path, "method must be a string")
    if not isinstance(data.get("info") or {}, dict):
        raise FormatError(path, "info must be an object")
    try:
        placement = Placement.from_dict(checked)
    except (ValueError, TypeError) as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    layer_ids = document.get("layer_ids")
    if layer_ids is not None and not (isinstance(layer_ids, list)
                                      and all(isinstance(i, int) and 0 <= i <= MAX_ID for i in layer_ids)):
        raise FormatError(path, f"layer_ids must be a list of integers in 0 .. {MAX_ID}")
    layer_ids = check_layer_ids(layer_ids, placement.num_layers, path)
    metadata = {k: document[k] for k in ("eplb_version", "configuration", "diagnostics") if k in document}
    return PlacementFile(placement, layer_ids, "eplb", path, metadata)


def is_eplb_document(document) -> bool:
    """Whether a parsed JSON document is eplb's placement (or a bare ``Placement.to_dict()``)."""
    return isinstance(document, dict) and ("placement" in document or "phy2log" in document)


#: the formats of this module (collected by :data:`eplb.io.formats.FORMATS`)
FORMATS = (
    Format("eplb", "eplb's JSON", suffixes=(".json",), read_placement=read_eplb_json, write_placement=write_eplb_json,
           keywords=("layer_ids", "configuration", "diagnostics"), parse=load_json, recognise=is_eplb_document,
           recognised_by="an eplb 'placement'"),
)

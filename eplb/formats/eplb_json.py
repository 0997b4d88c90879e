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

from ..placement import Placement
from .data import PlacementFile, check_layer_ids
from .errors import FormatError

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
    from .. import __version__

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
    try:
        return json.loads(Path(path).read_text())
    except UnicodeDecodeError:
        raise FormatError(path, "not a JSON file (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise FormatError(path, f"not valid JSON ({exc})") from None


def read_eplb_json(path: Path, document=None) -> PlacementFile:
    """Read eplb's JSON (or a bare ``Placement.to_dict()``)."""
    document = load_json(path) if document is None else document
    if not isinstance(document, dict):
        raise FormatError(path, "an eplb placement file must hold a JSON object")
    data = document.get("placement", document)
    if not isinstance(data, dict) or "phy2log" not in data:
        raise FormatError(path, "not an eplb placement: no 'placement' with 'phy2log'")
    try:
        placement = Placement.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    layer_ids = check_layer_ids(document.get("layer_ids"), placement.num_layers, path)
    metadata = {k: document[k] for k in ("eplb_version", "configuration", "diagnostics") if k in document}
    return PlacementFile(placement, layer_ids, "eplb", path, metadata)

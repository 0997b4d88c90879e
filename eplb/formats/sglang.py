"""SGLang's files: expert-distribution dumps (counts in) and ``--init-expert-location`` (placement out).

What SGLang writes and reads (sgl-project/sglang, ``python/sglang/srt/eplb/``):

- ``expert_distribution.py``, ``_StatAccumulator.dump``: with
  ``--expert-distribution-recorder-mode stat``, ``/dump_expert_distribution_record`` saves
  ``torch.save(dict(rank=..., logical_count=<int tensor [T, L, E]>,
  average_utilization_rate_over_window=<float or None>))`` to
  ``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt``; ``T`` is
  the recorder's buffered forward passes, ``L`` every layer of the model (dense layers stay 0),
  ``E`` the logical experts.
- ``expert_location.py``, ``compute_initial_expert_location_metadata``: ``--init-expert-location``
  takes a ``.pt`` (``torch.load(weights_only=True)``), a ``.json`` file or a JSON string holding
  either ``{"physical_to_logical_map": [[...]]}`` (``[L, S]``, used as the placement) or
  ``{"logical_count": ...}`` (``[L, E]`` or ``[T, L, E]``, SGLang plans itself). The dict is
  passed as keyword arguments (``init_by_mapping(..., **data_dict)``), so the placement file must
  hold that one key and nothing else. Slot ``s`` lives on GPU ``s // (S / ep_size)`` and ``S``
  must divide by ``ep_size``.

Dumps are untrusted: ``.pt`` files are loaded with ``torch.load(..., weights_only=True)`` only
(tensors and plain containers; never arbitrary pickled objects).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..placement import Placement
from ..topology import Topology
from .data import CountsFile, PlacementFile, check_counts, check_layer_ids, check_phy2log, config_int
from .eplb_json import load_json
from .errors import FormatError, require

PLACEMENT_KEY = "physical_to_logical_map"
COUNTS_KEY = "logical_count"
#: the side file eplb writes next to a SGLang placement: <stem>.eplb.json
SIDECAR_SUFFIX = ".eplb.json"
SIDECAR_FORMAT = "eplb-sglang-configuration"


def read_sglang_dump(path: Path, as_json: bool | None = None) -> CountsFile:
    """Counts from a SGLang expert-distribution dump (``.pt`` saved with torch, or JSON when
    ``as_json`` or, by default, when the name ends in ``.json``)."""
    if as_json is None:
        as_json = path.suffix.lower() == ".json"
    if as_json:
        document = load_json(path)
        fmt = "logical-count-json"
    else:
        torch = require("torch", "torch", f"reading the SGLang dump {path}")
        try:
            document = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle / zip errors, or an object weights_only refuses
            raise FormatError(path, f"not a SGLang dump readable with torch.load(weights_only=True): {exc}") from None
        fmt = "sglang-dump"
    if not isinstance(document, dict) or COUNTS_KEY not in document:
        keys = sorted(map(str, document)) if isinstance(document, dict) else type(document).__name__
        raise FormatError(path, f"expected a dict with '{COUNTS_KEY}' ([T, L, E], [L, E] or [E]), found {keys}")
    counts = document[COUNTS_KEY]
    if type(counts).__module__.split(".")[0] == "torch":
        if counts.is_complex():
            raise FormatError(path, f"'{COUNTS_KEY}' must be real numbers, got {counts.dtype}")
        counts = counts.detach().cpu().double().numpy()
    else:
        try:
            counts = np.array(counts, dtype=np.float64)
        except OverflowError:
            raise FormatError(path, f"'{COUNTS_KEY}' holds an integer beyond float64's range (1.8e308)") from None
        except (ValueError, TypeError):
            raise FormatError(path, f"'{COUNTS_KEY}' must be a rectangular array of numbers") from None
    counts = check_counts(counts, path, f"'{COUNTS_KEY}'")
    metadata = {k: document[k] for k in ("rank", "average_utilization_rate_over_window")
                if k in document and isinstance(document[k], (int, float, type(None)))}
    return CountsFile(counts, check_layer_ids(None, counts.shape[1], path), fmt, path, metadata)


def sidecar_path(path: Path) -> Path:
    """Where eplb records what a SGLang placement file cannot hold: ``<name>.eplb.json`` beside it
    (``init_expert_location.json`` -> ``init_expert_location.eplb.json``)."""
    path = Path(path)
    return path.with_name(path.stem + SIDECAR_SUFFIX)


def write_sglang_placement(placement: Placement, path: Path) -> None:
    """Write ``{"physical_to_logical_map": [[...]]}`` for ``--init-expert-location`` (the file must
    hold that key alone), and the configuration (GPUs, nodes, groups, experts, method) into the side
    file :func:`sidecar_path`, which :func:`read_sglang_placement` reads back."""
    if not placement.topology.is_uniform:
        raise FormatError(path, "SGLang needs the same number of slots on every GPU "
                                f"(this placement has {placement.topology.slots_per_gpu.tolist()})")
    Path(path).write_text(json.dumps({PLACEMENT_KEY: placement.phy2log.tolist()}) + "\n")
    sidecar = {"format": SIDECAR_FORMAT, "placement_file": Path(path).name, "num_gpus": placement.num_gpus,
               "num_nodes": placement.num_nodes, "num_groups": placement.num_groups,
               "num_experts": placement.num_experts, "method": placement.method}
    sidecar_path(path).write_text(json.dumps(sidecar) + "\n")


def read_sidecar(path: Path) -> dict:
    """The configuration recorded beside a SGLang placement (``{}`` when there is no side file)."""
    side = sidecar_path(path)
    if not side.is_file():
        return {}
    document = load_json(side)
    if not isinstance(document, dict) or document.get("format") != SIDECAR_FORMAT:
        raise FormatError(side, f"not an eplb side file (expected \"format\": \"{SIDECAR_FORMAT}\")")
    return {
        "num_gpus": config_int(document.get("num_gpus"), side, "num_gpus", limit_name="slots", allow_none=True),
        "num_nodes": config_int(document.get("num_nodes"), side, "num_nodes", limit_name="slots", allow_none=True),
        "num_groups": config_int(document.get("num_groups"), side, "num_groups", limit_name="experts",
                                 allow_none=True),
        "num_experts": config_int(document.get("num_experts"), side, "num_experts", limit_name="experts",
                                  allow_none=True),
        "method": str(document.get("method", "sglang file")),
        "path": side,
    }


def read_sglang_placement(path: Path, *, num_gpus=None, num_nodes=None, num_experts=None, num_groups=None,
                          document=None) -> PlacementFile:
    """Read a ``--init-expert-location`` file holding ``physical_to_logical_map [L, S]``.

    The file does not say how many GPUs there are: ``num_gpus`` comes from the argument, else from
    the side file eplb wrote beside it (:func:`sidecar_path`); ``num_nodes``/``num_groups`` likewise
    (else 1 node, no groups). ``num_experts`` defaults to the side file's, else the largest expert
    id + 1.
    """
    if document is None:
        if path.suffix == ".pt":
            torch = require("torch", "torch", f"reading {path}")
            try:
                document = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise FormatError(path, f"not readable with torch.load(weights_only=True): {exc}") from None
        else:
            document = load_json(path)
    if not isinstance(document, dict) or PLACEMENT_KEY not in document:
        raise FormatError(path, f"not a SGLang placement: expected a JSON object with '{PLACEMENT_KEY}'")
    table = document[PLACEMENT_KEY]
    if type(table).__module__.split(".")[0] == "torch":
        table = table.cpu().numpy()
    phy2log = check_phy2log(table, path)
    side = read_sidecar(path)
    num_gpus = side.get("num_gpus") if num_gpus is None else num_gpus
    num_nodes = (side.get("num_nodes") or 1) if num_nodes is None else num_nodes
    num_groups = side.get("num_groups") if num_groups is None else num_groups
    num_experts = side.get("num_experts") if num_experts is None else num_experts
    if num_gpus is None:
        raise FormatError(path, "a SGLang placement does not record the number of GPUs and there is no side file "
                                f"{sidecar_path(path).name}: pass --gpus")
    num_experts = int(phy2log.max()) + 1 if num_experts is None else num_experts
    try:
        topology = Topology.uniform(phy2log.shape[1], num_gpus, num_nodes)
        placement = Placement(phy2log, num_experts, topology, num_groups=num_groups,
                              method=side.get("method", "sglang file"))
    except ValueError as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    metadata = {"sidecar": str(side["path"])} if side else {}
    return PlacementFile(placement, check_layer_ids(None, phy2log.shape[0], path), "sglang", path, metadata)

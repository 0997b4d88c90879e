"""Reading expert counts and reading/writing placements in every engine's file formats.

Counts in (``read_counts``), detected from the path unless a format is given:

=====================  =====================================================================
``npy``                ``.npy``: ``[L, E]`` or ``[T, L, E]``
``npz``                ``.npz``: ``counts`` (or ``logical_count``/``weights``/its only array), optional ``layer_ids``
``csv``                ``.csv``: a matrix (rows = layers) or a long table ``[window,]layer,expert,count``
``logical-count-json`` ``.json``: ``{"logical_count": [[...]]}`` (SGLang's JSON form)
``sglang-dump``        ``.pt``: SGLang's expert-distribution dump (``torch.load(weights_only=True)``)
``trtllm-stats``       a folder with ``meta_info.json`` + ``rank{r}.safetensors`` (TensorRT-LLM)
=====================  =====================================================================

Placements out (``write_placement``) and back in (``read_placement``):

==========  =========================================================================
``eplb``    eplb's JSON: placement, configuration, diagnostics, version (``.json``)
``npz``     arrays ``phy2log``, ``log2phy``, ``logcnt``, topology... (``.npz``)
``sglang``  ``{"physical_to_logical_map": [[...]]}`` for ``--init-expert-location`` (``.json``)
``trtllm``  TensorRT-LLM's load-balancer YAML (``.yaml`` / ``.yml``)
==========  =========================================================================

Every reader checks shapes and values and raises :class:`FormatError` naming the file; a
missing optional dependency raises :class:`MissingExtraError` naming the extra to install.
"""

from __future__ import annotations

from pathlib import Path

from ..placement import Placement
from .arrays import read_csv_counts, read_npy_counts, read_npz_counts, read_npz_placement, write_npz_placement
from .data import CountsFile, PlacementFile, check_counts
from .eplb_json import jsonable, load_json, read_eplb_json, write_eplb_json
from .errors import FormatError, MissingExtraError
from .sglang import read_sglang_dump, read_sglang_placement, write_sglang_placement
from .trtllm import read_trtllm_statistics, read_trtllm_yaml, write_trtllm_yaml

COUNTS_FORMATS = ("npy", "npz", "csv", "logical-count-json", "sglang-dump", "trtllm-stats")
PLACEMENT_FORMATS = ("eplb", "npz", "sglang", "trtllm")

__all__ = [
    "COUNTS_FORMATS", "PLACEMENT_FORMATS", "CountsFile", "FormatError", "MissingExtraError", "PlacementFile",
    "check_counts", "detect_counts_format", "detect_placement_format", "jsonable", "read_counts",
    "read_placement", "write_placement", "placement_format_for_output",
]


def _existing(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FormatError(path, "no such file or folder")
    return path


def detect_counts_format(path) -> str:
    """The counts format of ``path`` from its suffix (or, for ``.json``/folders, its content)."""
    path = _existing(path)
    if path.is_dir():
        if (path / "meta_info.json").is_file():
            return "trtllm-stats"
        raise FormatError(path, "a folder of counts must be a TensorRT-LLM expert-statistics folder (meta_info.json)")
    suffix = path.suffix.lower()
    by_suffix = {".npy": "npy", ".npz": "npz", ".csv": "csv", ".pt": "sglang-dump", ".pth": "sglang-dump",
                 ".json": "logical-count-json"}
    if suffix in by_suffix:
        return by_suffix[suffix]
    raise FormatError(path, f"cannot tell the counts format from the suffix {suffix!r}: "
                            f"pass --input-format (one of {', '.join(COUNTS_FORMATS)})")


def read_counts(path, format: str | None = None) -> CountsFile:
    """Read expert counts (see the table above); ``format=None`` detects it."""
    path = _existing(path)
    format = format or detect_counts_format(path)
    if format != "trtllm-stats" and path.is_dir():
        raise FormatError(path, f"is a folder, not a {format} file")
    readers = {"npy": read_npy_counts, "npz": read_npz_counts, "csv": read_csv_counts,
               "logical-count-json": lambda p: read_sglang_dump(p, as_json=True), "sglang-dump": read_sglang_dump,
               "trtllm-stats": read_trtllm_statistics}
    if format not in readers:
        raise FormatError(path, f"unknown counts format {format!r}; one of {', '.join(COUNTS_FORMATS)}")
    return readers[format](path)


def placement_format_for_output(path) -> str:
    """The placement format implied by an output file name (``.json`` -> eplb, ``.npz``, ``.yaml``)."""
    suffix = Path(path).suffix.lower()
    by_suffix = {".json": "eplb", ".npz": "npz", ".yaml": "trtllm", ".yml": "trtllm"}
    if suffix not in by_suffix:
        raise FormatError(path, f"cannot tell the output format from the suffix {suffix!r}: "
                                f"pass --format (one of {', '.join(PLACEMENT_FORMATS)})")
    return by_suffix[suffix]


def detect_placement_format(path) -> str:
    """The placement format of an existing file (JSON files are told apart by their keys)."""
    path = _existing(path)
    if path.is_dir():
        raise FormatError(path, "is a folder, not a placement file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        document = load_json(path)
        if isinstance(document, dict) and "physical_to_logical_map" in document:
            return "sglang"
        if isinstance(document, dict) and ("placement" in document or "phy2log" in document):
            return "eplb"
        raise FormatError(path, "a JSON placement must hold 'physical_to_logical_map' (SGLang) or an eplb 'placement'")
    if suffix == ".pt":
        return "sglang"
    return placement_format_for_output(path)


def read_placement(path, format: str | None = None, *, num_gpus=None, num_nodes=None,
                   num_experts=None) -> PlacementFile:
    """Read a placement in any supported format (``format=None`` detects it).

    SGLang and TensorRT-LLM files do not record the GPU count: give ``num_gpus`` (and
    ``num_nodes``) for them; eplb writes a comment into its YAML from which it is recovered.
    """
    path = _existing(path)
    format = format or detect_placement_format(path)
    if format == "eplb":
        return read_eplb_json(path)
    if format == "npz":
        return read_npz_placement(path)
    if format == "sglang":
        return read_sglang_placement(path, num_gpus=num_gpus, num_nodes=num_nodes or 1, num_experts=num_experts)
    if format == "trtllm":
        return read_trtllm_yaml(path, num_gpus=num_gpus, num_nodes=num_nodes, num_experts=num_experts)
    raise FormatError(path, f"unknown placement format {format!r}; one of {', '.join(PLACEMENT_FORMATS)}")


def write_placement(placement: Placement, path, format: str | None = None, *, layer_ids=None,
                    configuration=None, diagnostics=None, layer_updates_per_iter: int = 0) -> str:
    """Write ``placement`` to ``path`` in ``format`` (from the suffix when ``None``); returns the format.

    ``layer_ids`` (``[L]``) are the model's layer indices (TensorRT-LLM keys its YAML by them);
    ``configuration``/``diagnostics`` go into eplb's JSON only.
    """
    path = Path(path)
    format = format or placement_format_for_output(path)
    if path.parent and not path.parent.exists():
        raise FormatError(path, f"the folder {path.parent} does not exist")
    try:
        if format == "eplb":
            write_eplb_json(placement, path, layer_ids=layer_ids, configuration=configuration, diagnostics=diagnostics)
        elif format == "npz":
            write_npz_placement(placement, path, layer_ids=layer_ids)
        elif format == "sglang":
            write_sglang_placement(placement, path)
        elif format == "trtllm":
            write_trtllm_yaml(placement, path, layer_ids=layer_ids, layer_updates_per_iter=layer_updates_per_iter)
        else:
            raise FormatError(path, f"unknown placement format {format!r}; one of {', '.join(PLACEMENT_FORMATS)}")
    except OSError as exc:
        raise FormatError(path, f"cannot write: {exc.strerror or exc}") from None
    return format

"""Reading expert counts and reading/writing placements in every engine's file formats.

Counts in (``read_counts``), detected from the path unless a format is given:

=====================  =====================================================================
``npy``                ``.npy``: ``[E]`` (one layer), ``[L, E]`` or ``[T, L, E]``
``npz``                ``.npz``: ``counts`` (or ``logical_count``/``weights``/its only array), optional ``layer_ids``
``csv``                ``.csv``: a matrix (rows = layers; an index or layer first column is recognised) or a
                       long table ``[window,]layer,expert,count`` (also ``layer_id``/``expert_id``/``tokens``...)
``logical-count-json`` ``.json``: ``{"logical_count": [[...]]}`` (SGLang's JSON form)
``sglang-dump``        ``.pt``: SGLang's expert-distribution dump (``torch.load(weights_only=True)``): a stat
                       dump (``logical_count``), or a detail dump (``records``), read as ``sglang-detail``
``sglang-detail``      ``.pt``: SGLang's ``per_pass`` / ``per_token`` dump, ``records`` (one per forward pass)
                       and ``last_physical_to_logical_map``: ``[T, L, E]``, and with ``per_token`` the phase of
                       each pass (``CountsFile.phases``)
``trtllm-stats``       a folder with ``meta_info.json`` + ``rank{r}.safetensors`` (TensorRT-LLM)
=====================  =====================================================================

Placements out (``write_placement``) and back in (``read_placement``):

==========  =========================================================================
``eplb``    eplb's JSON: placement, configuration, diagnostics, version (``.json``)
``npz``     arrays ``phy2log``, ``log2phy``, ``logcnt``, topology... (``.npz``)
``sglang``  ``{"physical_to_logical_map": [[...]]}`` for ``--init-expert-location`` (``.json``),
            plus ``<name>.eplb.json`` beside it with GPUs, nodes, groups and experts
``trtllm``  TensorRT-LLM's load-balancer YAML (``.yaml`` / ``.yml``), with a ``# eplb:`` comment
            recording GPUs, nodes, groups and experts
==========  =========================================================================

Both SGLang dumps end in ``.pt``: the reader tells them apart by their keys (``records`` is a
detail dump, ``logical_count`` a stat dump).

Counts that look transposed (over 128 layers and more than twice as many layers as experts) are
refused unless ``allow_shape``; ``transpose`` reads ``[E, L]`` files. Sizes a file implies are
checked against :mod:`eplb.io.formats.limits` (overridable with ``EPLB_MAX_*``) before allocating.

Every reader checks shapes and values and raises :class:`FormatError` naming the file; a
missing optional dependency raises :class:`MissingExtraError` naming the extra to install.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...analysis.placement import Placement
from .arrays import read_csv_counts, read_npy_counts, read_npz_counts, read_npz_placement, write_npz_placement
from .data import OTHER_PHASE, PHASES, CountsFile, PlacementFile, check_counts
from .eplb_json import jsonable, load_json, read_eplb_json, write_eplb_json
from .errors import FormatError, MissingExtraError
from .sglang import read_sglang_detail_dump, read_sglang_dump, read_sglang_placement, write_sglang_placement
from .trtllm import read_trtllm_statistics, read_trtllm_yaml, write_trtllm_yaml

COUNTS_FORMATS = ("npy", "npz", "csv", "logical-count-json", "sglang-dump", "sglang-detail", "trtllm-stats")
PLACEMENT_FORMATS = ("eplb", "npz", "sglang", "trtllm")

__all__ = [
    "COUNTS_FORMATS", "OTHER_PHASE", "PHASES", "PLACEMENT_FORMATS", "CountsFile", "FormatError",
    "MissingExtraError", "PlacementFile",
    "check_counts", "detect_counts_format", "detect_placement_format", "jsonable", "read_counts",
    "read_placement", "write_placement", "placement_format_for_output",
]


def _existing(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FormatError(path, "no such file or folder")
    return path


def detect_counts_format(path) -> str:
    """The counts format of ``path`` from its suffix (or, for ``.json``/folders, its content).

    ``.pt`` is ``sglang-dump`` without opening it: reading tells a detail dump (``records``) from a
    stat dump (``logical_count``) by its keys.
    """
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


def read_counts(path, format: str | None = None, *, transpose: bool = False, allow_shape: bool = False) -> CountsFile:
    """Read expert counts (see the table above); ``format=None`` detects it.

    ``transpose`` swaps the last two axes (a file holding ``[E, L]``). A shape that looks
    transposed (more than :data:`MAX_LAYERS_PLAUSIBLE` layers and over twice as many layers as
    experts) is refused unless ``allow_shape``.
    """
    path = _existing(path)
    format = format or detect_counts_format(path)
    if format != "trtllm-stats" and path.is_dir():
        raise FormatError(path, f"is a folder, not a {format} file")
    readers = {"npy": read_npy_counts, "npz": read_npz_counts, "csv": read_csv_counts,
               "logical-count-json": lambda p: read_sglang_dump(p, as_json=True), "sglang-dump": read_sglang_dump,
               "sglang-detail": read_sglang_detail_dump, "trtllm-stats": read_trtllm_statistics}
    if format not in readers:
        raise FormatError(path, f"unknown counts format {format!r}; one of {', '.join(COUNTS_FORMATS)}")
    data = readers[format](path)
    if transpose:
        counts = np.ascontiguousarray(np.swapaxes(data.counts, 1, 2))
        data = CountsFile(counts, np.arange(counts.shape[1], dtype=np.int64), data.format, data.path,
                          {**data.metadata, "transposed": True}, data.phases)
    if not allow_shape:
        check_plausible_shape(data)
    return data


#: more MoE layers than any released model has; with over twice as many layers as experts the
#: array is probably ``[E, L]``
MAX_LAYERS_PLAUSIBLE = 128


def check_plausible_shape(data: CountsFile) -> None:
    """Refuse counts whose shape looks like a misread (``[E, L]``, or a long table read as a matrix).

    Raises:
        FormatError: suggesting ``--transpose`` or ``--allow-shape``.
    """
    layers, experts = data.num_layers, data.num_experts
    if layers > MAX_LAYERS_PLAUSIBLE and layers > 2 * experts:
        raise FormatError(data.path, f"read as {layers} layers x {experts} experts, which looks transposed or "
                                     f"misread (over {MAX_LAYERS_PLAUSIBLE} layers, more than twice the experts): "
                                     "pass --transpose if the file holds [experts, layers], or --allow-shape to "
                                     "accept it as it is")


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
                   num_experts=None, num_groups=None) -> PlacementFile:
    """Read a placement in any supported format (``format=None`` detects it).

    SGLang and TensorRT-LLM files do not record the GPU count, the nodes or the groups: give
    ``num_gpus`` (``num_nodes``, ``num_groups``) for them; eplb records them in a ``# eplb:``
    comment of its YAML and in a side file ``<name>.eplb.json`` beside its SGLang JSON, from which
    they are recovered. eplb's JSON and ``.npz`` record them: ``num_groups`` given for those must
    agree with the file (or the file records none).
    """
    path = _existing(path)
    format = format or detect_placement_format(path)
    if format == "eplb":
        loaded = read_eplb_json(path)
    elif format == "npz":
        loaded = read_npz_placement(path)
    elif format == "sglang":
        return read_sglang_placement(path, num_gpus=num_gpus, num_nodes=num_nodes, num_experts=num_experts,
                                     num_groups=num_groups)
    elif format == "trtllm":
        return read_trtllm_yaml(path, num_gpus=num_gpus, num_nodes=num_nodes, num_experts=num_experts,
                                num_groups=num_groups)
    else:
        raise FormatError(path, f"unknown placement format {format!r}; one of {', '.join(PLACEMENT_FORMATS)}")
    recorded = loaded.placement.num_groups
    if num_groups is not None and recorded != num_groups:
        if recorded is not None:
            raise FormatError(path, f"the file records {recorded} expert groups, not --groups {num_groups}")
        p = loaded.placement
        placement = Placement(p.phy2log, p.num_experts, p.topology, num_groups, p.method, p.lower_bound,
                              p.max_load, p.info)
        loaded = PlacementFile(placement, loaded.layer_ids, loaded.format, loaded.path, loaded.metadata)
    return loaded


def write_placement(placement: Placement, path, format: str | None = None, *, layer_ids=None,
                    configuration=None, diagnostics=None, layer_updates_per_iter: int = 0) -> str:
    """Write ``placement`` to ``path`` in ``format`` (from the suffix when ``None``); returns the format.

    ``layer_ids`` (``[L]``) are the model's layer indices (TensorRT-LLM keys its YAML by them);
    ``configuration``/``diagnostics`` go into eplb's JSON only.
    """
    path = Path(path)
    format = format or placement_format_for_output(path)
    if format != "trtllm" and layer_updates_per_iter:
        raise FormatError(path, f"layer_updates_per_iter applies to TensorRT-LLM YAML only, not to {format} output")
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

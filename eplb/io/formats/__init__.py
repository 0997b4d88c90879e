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

Placements out (``write_placement``) and back in (``read_placement``); every one records the
dispatch rule its plan was made for (:attr:`eplb.Placement.dispatch`), which it is judged under once
read back:

==========  =========================================================================
``eplb``    eplb's JSON: placement, configuration, diagnostics, version (``.json``)
``npz``     arrays ``phy2log``, ``log2phy``, ``logcnt``, topology... (``.npz``)
``sglang``  ``{"physical_to_logical_map": [[...]]}`` for ``--init-expert-location`` (``.json``; a row
            per model layer, by layer id), plus ``<name>.eplb.json`` beside it with GPUs, nodes,
            groups, experts, the planned layers and the dispatch rule
``trtllm``  TensorRT-LLM's load-balancer YAML (``.yaml`` / ``.yml``), with a ``# eplb:`` comment
            recording GPUs, nodes, groups, experts and the dispatch rule
==========  =========================================================================

Both SGLang dumps end in ``.pt``: the reader tells them apart by their keys (``records`` is a
detail dump, ``logical_count`` a stat dump).

The formats are registered once, in :data:`FORMATS`: each format module declares its own
(:class:`~eplb.io.formats.spec.Format`: name, suffixes, the functions it provides, how its content
is recognised), and the registry lists the modules in a fixed order: eplb's JSON, the array files,
SGLang's, TensorRT-LLM's. Everything else comes from it: :data:`COUNTS_FORMATS` and
:data:`PLACEMENT_FORMATS` (its names, in its order), detection, the readers and writers, the names
error messages list and the CLI's choices. Adding a format is one module declaring ``FORMATS`` and
one line in :data:`FORMATS`. Detection:

- counts: a folder is the first counts format whose ``recognise`` accepts it; a file is the first
  counts format (in registry order) claiming its suffix, without opening it (the ``sglang-dump``
  reader reads a detail dump too);
- a placement to write: the format whose files engines name so (``init_expert_location.json``,
  ``decode-init-expert-location.json``: SGLang's, :attr:`Format.output_names`), else the first
  placement format whose output suffixes hold the suffix (``.json`` is eplb's);
- a placement to read: the format claiming its suffix; when several claim it (``.json``: eplb and
  SGLang), the first whose ``recognise`` accepts the content, asking the format that suffix is
  written in (eplb) last: the file is SGLang's if it holds SGLang's key.

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
from . import arrays, eplb_json, sglang, trtllm
from .data import OTHER_PHASE, PHASES, CountsFile, PlacementFile, check_counts
from .eplb_json import jsonable
from .errors import FormatError, MissingExtraError
from .spec import Format

#: every format, in a fixed order: the order names are listed in (:data:`COUNTS_FORMATS`,
#: :data:`PLACEMENT_FORMATS`, error messages, the CLI's choices) and suffixes are claimed in (the
#: first format claiming a suffix is its default). One line a format module.
FORMATS: tuple[Format, ...] = (
    *eplb_json.FORMATS,  # eplb
    *arrays.FORMATS,     # npy, npz, csv
    *sglang.FORMATS,     # logical-count-json, sglang-dump, sglang-detail, sglang
    *trtllm.FORMATS,     # trtllm-stats, trtllm
)

#: the formats that read counts, by name, in registry order
_COUNTS_BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS if f.read_counts is not None}
#: the formats that read or write placements, by name, in registry order
_PLACEMENTS_BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS
                                          if f.read_placement is not None or f.write_placement is not None}
#: the names ``read_counts`` (and ``--input-format``) accept, in registry order
COUNTS_FORMATS = tuple(_COUNTS_BY_NAME)
#: the names ``read_placement`` / ``write_placement`` (and ``--format``) accept, in registry order
PLACEMENT_FORMATS = tuple(_PLACEMENTS_BY_NAME)

__all__ = [
    "COUNTS_FORMATS", "FORMATS", "OTHER_PHASE", "PHASES", "PLACEMENT_FORMATS", "CountsFile", "Format", "FormatError",
    "MissingExtraError", "PlacementFile",
    "check_counts", "detect_counts_format", "detect_placement_format", "jsonable", "read_counts", "read_counts_many",
    "read_placement", "write_placement", "placement_format_for_output", "named_output_format",
]


def _existing(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FormatError(path, "no such file or folder")
    return path


def detect_counts_format(path) -> str:
    """The counts format of ``path`` from its suffix (a folder: from what it holds).

    ``.pt`` is ``sglang-dump`` without opening it: reading tells a detail dump (``records``) from a
    stat dump (``logical_count``) by its keys.
    """
    path = _existing(path)
    if path.is_dir():
        folders = [f for f in _COUNTS_BY_NAME.values() if f.folder]
        found = _recognised(path, folders)
        if found is None:
            raise FormatError(path, f"a folder of counts must be {' or '.join(f.recognised_by for f in folders)}")
        return found.name
    suffix = path.suffix.lower()
    found = next((f for f in _COUNTS_BY_NAME.values() if suffix in f.suffixes), None)
    if found is None:
        raise FormatError(path, f"cannot tell the counts format from the suffix {suffix!r}: "
                                f"pass --input-format (one of {', '.join(COUNTS_FORMATS)})")
    return found.name


def _recognised(path: Path, candidates) -> Format | None:
    """The first of ``candidates`` whose ``recognise`` accepts ``path``'s content (each parser runs once)."""
    parsed = {}
    for fmt in candidates:
        if fmt.recognise is None:
            return fmt
        if fmt.parse not in parsed:
            parsed[fmt.parse] = path if fmt.parse is None else fmt.parse(path)
        if fmt.recognise(parsed[fmt.parse]):
            return fmt
    return None


def read_counts(path, format: str | None = None, *, transpose: bool = False, allow_shape: bool = False) -> CountsFile:
    """Read expert counts (see the table above); ``format=None`` detects it.

    ``transpose`` swaps the last two axes (a file holding ``[E, L]``). A shape that looks
    transposed (more than :data:`MAX_LAYERS_PLAUSIBLE` layers and over twice as many layers as
    experts) is refused unless ``allow_shape``.
    """
    path = _existing(path)
    format = format or detect_counts_format(path)
    fmt = _COUNTS_BY_NAME.get(format)
    if path.is_dir() and not (fmt is not None and fmt.folder):
        raise FormatError(path, f"is a folder, not a {format} file")
    if fmt is None:
        raise FormatError(path, f"unknown counts format {format!r}; one of {', '.join(COUNTS_FORMATS)}")
    data = fmt.read_counts(path)
    if transpose:
        counts = np.ascontiguousarray(np.swapaxes(data.counts, 1, 2))
        data = CountsFile(counts, np.arange(counts.shape[1], dtype=np.int64), data.format, data.path,
                          {**data.metadata, "transposed": True}, data.phases, layer_ids_recorded=False)
    if not allow_shape:
        check_plausible_shape(data)
    return data


def read_counts_many(paths, format: str | None = None, *, transpose: bool = False,
                     allow_shape: bool = False) -> CountsFile:
    """Counts from one or several paths (:mod:`eplb.io.formats.several`): one file or a counts
    folder (a TensorRT-LLM statistics folder) as :func:`read_counts` reads it; several files, or a
    folder of count files (sorted by name), as one series whose windows are the files' windows in
    that order. ``format`` applies to every file (``None``: each detected)."""
    from .several import counts_files, join_counts

    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not paths:
        raise ValueError("counts: give at least one file or folder")
    folders = [f for f in _COUNTS_BY_NAME.values() if f.folder]
    if len(paths) == 1 and (not paths[0].is_dir() or format in {f.name for f in folders}
                            or _recognised(paths[0], folders) is not None):
        return read_counts(paths[0], format, transpose=transpose, allow_shape=allow_shape)
    suffixes = {suffix for f in _COUNTS_BY_NAME.values() if not f.folder for suffix in f.suffixes}
    files = counts_files(paths, suffixes)
    parts = [read_counts(path, format, transpose=transpose, allow_shape=allow_shape) for path in files]
    if len(parts) == 1:
        return parts[0]
    name = paths[0] if len(paths) == 1 else Path(f"{files[0]} and {len(files) - 1} more")
    return join_counts(parts, name)


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


def named_output_format(path) -> str | None:
    """The engine format whose files are named like ``path`` (``init_expert_location.json`` is
    SGLang's ``--init-expert-location``: :attr:`Format.output_names`), else ``None``."""
    found = next((f for f in _PLACEMENTS_BY_NAME.values() if f.named_by(path)), None)
    return None if found is None else found.name


def placement_format_for_output(path) -> str:
    """The placement format implied by an output file name: an engine's file name picks that
    engine's format (:func:`named_output_format`), else the suffix does (``.json`` -> eplb,
    ``.npz``, ``.yaml``)."""
    named = named_output_format(path)
    if named is not None:
        return named
    suffix = Path(path).suffix.lower()
    found = next((f for f in _PLACEMENTS_BY_NAME.values() if suffix in f.writes_to), None)
    if found is None:
        raise FormatError(path, f"cannot tell the output format from the suffix {suffix!r}: "
                                f"pass --format (one of {', '.join(PLACEMENT_FORMATS)})")
    return found.name


def detect_placement_format(path) -> str:
    """The placement format of an existing file: the format claiming its suffix; JSON files, which
    eplb and SGLang both claim, are told apart by their keys."""
    path = _existing(path)
    if path.is_dir():
        raise FormatError(path, "is a folder, not a placement file")
    suffix = path.suffix.lower()
    claiming = [f for f in _PLACEMENTS_BY_NAME.values() if f.read_placement is not None and suffix in f.suffixes]
    if not claiming:
        named = named_output_format(path)
        if named is not None:
            return named
        readable = dict.fromkeys(s for f in _PLACEMENTS_BY_NAME.values() if f.read_placement is not None
                                 for s in f.suffixes)
        counts = next((f.title for f in _COUNTS_BY_NAME.values() if suffix in f.suffixes), None)
        raise FormatError(path, f"cannot tell a placement format from the suffix {suffix!r} (placement files end in "
                                f"{', '.join(readable)})"
                                + (f"; {suffix} is a counts file ({counts}), not a placement" if counts else
                                   f": pass its format (one of {', '.join(PLACEMENT_FORMATS)})"))
    if len(claiming) == 1:
        return claiming[0].name
    default = next((f for f in _PLACEMENTS_BY_NAME.values() if suffix in f.writes_to), None)
    claiming.sort(key=lambda f: f is default)  # the format the suffix is written in is the fallback: asked last
    found = _recognised(path, claiming)
    if found is None:
        raise FormatError(path, f"a {suffix[1:].upper()} placement must hold "
                                f"{' or '.join(f.recognised_by for f in claiming)}")
    return found.name


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
    fmt = _PLACEMENTS_BY_NAME.get(format)
    if fmt is None or fmt.read_placement is None:
        raise FormatError(path, f"unknown placement format {format!r}; one of {', '.join(PLACEMENT_FORMATS)}")
    hints = {"num_gpus": num_gpus, "num_nodes": num_nodes, "num_experts": num_experts, "num_groups": num_groups}
    loaded = fmt.read_placement(path, **fmt.taken(hints))
    if "num_groups" in fmt.keywords:
        return loaded
    recorded = loaded.placement.num_groups  # the file records the groups: a given count must agree
    if num_groups is not None and recorded != num_groups:
        if recorded is not None:
            raise FormatError(path, f"the file records {recorded} expert groups, not --groups {num_groups}")
        p = loaded.placement
        placement = Placement(p.phy2log, p.num_experts, p.topology, num_groups, p.method, p.lower_bound,
                              p.max_load, p.info)
        loaded = PlacementFile(placement, loaded.layer_ids, loaded.format, loaded.path, loaded.metadata)
    return loaded


def write_placement(placement: Placement, path, format: str | None = None, *, layer_ids=None,
                    configuration=None, diagnostics=None, layer_updates_per_iter: int = 0,
                    num_layers: int | None = None) -> str:
    """Write ``placement`` to ``path`` in ``format`` (from the suffix when ``None``); returns the format.

    ``layer_ids`` (``[L]``) are the model's layer indices: TensorRT-LLM keys its YAML by them and
    SGLang's map puts row ``l`` at model layer ``l``, over ``num_layers`` rows (the model's
    ``num_hidden_layers``; default the largest layer id + 1), the layers left out holding SGLang's
    trivial placement. ``configuration``/``diagnostics`` go into eplb's JSON only.
    """
    path = Path(path)
    format = format or placement_format_for_output(path)
    fmt = _PLACEMENTS_BY_NAME.get(format)
    if fmt is not None and fmt.write_placement is None:
        fmt = None
    if layer_updates_per_iter and (fmt is None or "layer_updates_per_iter" not in fmt.keywords):
        takers = " or ".join(f.title for f in _PLACEMENTS_BY_NAME.values() if "layer_updates_per_iter" in f.keywords)
        raise FormatError(path, f"layer_updates_per_iter applies to {takers} only, not to {format} output")
    if num_layers is not None and (fmt is None or "num_layers" not in fmt.keywords):
        takers = " or ".join(f.title for f in _PLACEMENTS_BY_NAME.values() if "num_layers" in f.keywords)
        raise FormatError(path, f"num_layers (the model's layer count) applies to {takers} only, not to "
                                f"{format} output")
    if path.parent and not path.parent.exists():
        raise FormatError(path, f"the folder {path.parent} does not exist")
    if fmt is None:
        raise FormatError(path, f"unknown placement format {format!r}; one of {', '.join(PLACEMENT_FORMATS)}")
    options = {"layer_ids": layer_ids, "configuration": configuration, "diagnostics": diagnostics,
               "layer_updates_per_iter": layer_updates_per_iter, "num_layers": num_layers}
    try:
        fmt.write_placement(placement, path, **fmt.taken(options))
    except OSError as exc:
        raise FormatError(path, f"cannot write: {exc.strerror or exc}") from None
    return format

"""SGLang's files: expert-distribution dumps (counts in) and ``--init-expert-location`` (placement out).

What SGLang writes and reads (sgl-project/sglang, ``python/sglang/srt/eplb/``):

- ``expert_distribution.py``, ``_StatAccumulator.dump``: with
  ``--expert-distribution-recorder-mode stat``, ``/dump_expert_distribution_record`` saves
  ``torch.save(dict(rank=..., logical_count=<int tensor [T, L, E]>,
  average_utilization_rate_over_window=<float or None>))`` to
  ``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR/expert_distribution_recorder_<time>.pt``; ``T`` is
  the recorder's buffered forward passes, ``L`` every layer of the model (dense layers stay 0),
  ``E`` the logical experts.
- ``expert_distribution.py``, ``_DetailAccumulator.dump``: with ``per_pass`` or ``per_token``, every
  rank saves ``torch.save(dict(records=[...], last_physical_to_logical_map=<int tensor [L, S]>))``
  to ``expert_distribution_recorder_<time>_<rank>.pt`` in the same folder: one record (a dict) per
  recorded forward pass with ``forward_pass_id``, ``rank``, ``gatherer_key`` and what the pass's
  gatherer collected. ``per_pass`` (``_SelectExpertsSinglePassGatherer``, or a DeepEP gatherer)
  gives ``global_physical_count`` (``[L, S]`` int32, tokens per physical slot; a DeepEP
  low-latency gatherer fills only this rank's slots). ``per_token`` (``_DetailSinglePassGatherer``)
  gives ``input_ids`` and ``positions`` (lists, one per token), ``extend_seq_lens``,
  ``forward_mode`` (``ForwardMode.value``, an int), ``topk_ids_of_layer`` (``[L, N, 8]`` int32:
  the physical slot each of the pass's ``N`` tokens went to, ``-1`` where unused),
  ``misc_objects`` and ``global_physical_count`` (``topk_ids_of_layer`` counted per slot). Only
  ``per_token`` records the forward mode. The map is the placement at dump time ("last": a
  rebalance during the recording makes earlier passes' slots map to the wrong experts).
- ``model_executor/forward_batch_info.py``, ``ForwardMode``: an ``IntEnum`` numbered from 1 (see
  :data:`FORWARD_MODES` for the phase eplb gives each).
- ``expert_location.py``, ``compute_initial_expert_location_metadata``: ``--init-expert-location``
  takes a ``.pt`` (``torch.load(weights_only=True)``), a ``.json`` file or a JSON string holding
  either ``{"physical_to_logical_map": [[...]]}`` (``[L, S]``, used as the placement) or
  ``{"logical_count": ...}`` (``[L, E]`` or ``[T, L, E]``, SGLang plans itself). The dict is
  passed as keyword arguments (``init_by_mapping(..., **data_dict)``), so the placement file must
  hold that one key and nothing else. Slot ``s`` lives on GPU ``s // (S / ep_size)`` and ``S``
  must divide by ``ep_size``. ``init_by_mapping`` takes the map's rows as they are and the model
  indexes them by layer id (``ExpertLocationMetadata.num_layers`` is the map's row count; the
  recorder asserts every MoE layer id is below it), over every layer of the model:
  ``ModelConfigForExpertLocation.num_layers`` is ``num_hidden_layers`` (61 for DeepSeek-V3, whose
  first 3 layers are dense). Dense layers never read their rows; ``init_trivial`` fills every row
  with slot ``s`` holding expert ``s % E``.

The engine itself (its dispatch rules, the versions checked) is :mod:`eplb.engines.sglang`.

Dumps are untrusted: ``.pt`` files are loaded with ``torch.load(..., weights_only=True)`` only
(tensors and plain containers; never arbitrary pickled objects).
"""

from __future__ import annotations

import json
import warnings
from functools import partial
from pathlib import Path

import numpy as np

from ...analysis.placement import Placement
from ...model.topology import Topology
from .data import (OTHER_PHASE, CountsFile, PlacementFile, check_counts, check_layer_ids, check_phy2log, config_int,
                   recorded_dispatch, recorded_or_given)
from .eplb_json import load_json
from .errors import FormatError, require
from .limits import MAX_ID, check_counts_shape, check_size
from .spec import READ_KEYWORDS, Format

PLACEMENT_KEY = "physical_to_logical_map"
COUNTS_KEY = "logical_count"
#: the keys of a detail dump (``per_pass`` / ``per_token``): the per-pass records and the map
#: from physical slots to logical experts
RECORDS_KEY = "records"
MAP_KEY = "last_physical_to_logical_map"
#: the keys of one detail record that carry counts
PHYSICAL_COUNT_KEY = "global_physical_count"
TOPK_IDS_KEY = "topk_ids_of_layer"
FORWARD_MODE_KEY = "forward_mode"

#: SGLang's ``ForwardMode`` values (``IntEnum`` with ``auto()``, from 1) -> (name, phase of the pass).
#: EXTEND and SPLIT_PREFILL (PD multiplexing) run prompts: prefill. MIXED is a chunked-prefill
#: chunk with the running decode requests appended as one token each (``mix_with_running``): its
#: tokens are mostly the prompt chunk's, SGLang counts it as an extend (``is_prefill``), it only
#: occurs where one server runs both phases, and the record does not say which tokens are which,
#: so the whole pass is prefill. DECODE, TARGET_VERIFY (speculative decoding's check of the draft
#: tokens in the target model) and DRAFT_EXTEND_V2 (the draft model's extend after a decode step)
#: run in decode: decode. IDLE (a data-parallel worker with no sequence) and PREBUILT (a
#: disaggregated decode worker's batch, which never runs the model) carry no token, and
#: DLLM_EXTEND serves both phases of a diffusion model without saying which: neither phase.
FORWARD_MODES = {
    1: ("EXTEND", "prefill"),
    2: ("DECODE", "decode"),
    3: ("MIXED", "prefill"),
    4: ("IDLE", OTHER_PHASE),
    5: ("TARGET_VERIFY", "decode"),
    6: ("DRAFT_EXTEND_V2", "decode"),
    7: ("PREBUILT", OTHER_PHASE),
    8: ("SPLIT_PREFILL", "prefill"),
    9: ("DLLM_EXTEND", OTHER_PHASE),
}
#: forward modes whose passes route no token
TOKENLESS_MODES = (4, 7)
#: the name SGLang's placement files go by (its flag ``--init-expert-location``, the attribute
#: ``init_expert_location``): an output named so (``init_expert_location.json``,
#: ``decode-init-expert-location.json``) is written in SGLang's format
OUTPUT_NAME = "init_expert_location"
#: the side file eplb writes next to a SGLang placement: <stem>.eplb.json
SIDECAR_SUFFIX = ".eplb.json"
SIDECAR_FORMAT = "eplb-sglang-configuration"


def _load_torch(path: Path, what: str = "a SGLang dump"):
    """The object saved in ``path`` by ``torch.save``, loaded with ``weights_only=True`` (tensors and
    plain containers only) onto the CPU. Sparse tensors are checked as they load (indices within
    their shape: a crafted one would make densifying write out of bounds)."""
    torch = require("torch", "torch", f"reading {what} {path}")
    try:
        with torch.sparse.check_sparse_tensor_invariants(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that sparse CSR support is in beta
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors, an object weights_only refuses, an invalid sparse tensor
        raise FormatError(path, f"not {what} readable with torch.load(weights_only=True): {exc}") from None


def _is_tensor(value) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "layout")


def tensor_array(value, path: Path, what: str) -> np.ndarray:
    """A tensor read from a ``.pt`` file as a numpy array of real numbers (float64, or the tensor's
    integer type): a sparse tensor (COO, CSR, ...) is densified, after its dense size is checked
    against :mod:`eplb.io.formats.limits`; a tensor numpy cannot hold (complex, quantized, on the
    meta device) is a :class:`FormatError` naming ``what``."""
    if value.is_complex():
        raise FormatError(path, f"{what} must be real numbers, got {value.dtype}")
    value = value.detach()
    try:
        if str(value.layout) != "torch.strided":  # sparse: tokens of the experts it lists, 0 elsewhere
            cells = 1
            for n in value.shape:
                cells *= int(n)
            check_size(cells, "cells", f"{what} densified ({' x '.join(str(int(n)) for n in value.shape)} numbers)",
                       path)
            value = value.to_dense()
        value = value.cpu()
        return value.numpy() if not value.is_floating_point() else value.double().numpy()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise FormatError(path, f"{what} cannot be read as an array of numbers ({value.layout}, {value.dtype}: "
                                f"{' '.join(str(exc).split())[:120]})") from None


def _keys(document) -> str:
    return str(sorted(map(str, document))) if isinstance(document, dict) else f"a {type(document).__name__}"


def read_sglang_dump(path: Path, as_json: bool | None = None) -> CountsFile:
    """Counts from a SGLang expert-distribution dump (``.pt`` saved with torch, or JSON when
    ``as_json`` or, by default, when the name ends in ``.json``).

    A ``.pt`` holding ``records`` is a detail dump (``per_pass`` / ``per_token``) and is read by
    :func:`detail_counts` (format ``sglang-detail``); one holding ``logical_count`` is a stat dump.
    """
    if as_json is None:
        as_json = path.suffix.lower() == ".json"
    if as_json:
        document = load_json(path)
        fmt = "logical-count-json"
    else:
        document = _load_torch(path)
        fmt = "sglang-dump"
        if isinstance(document, dict) and RECORDS_KEY in document and COUNTS_KEY not in document:
            return detail_counts(document, path)
    if not isinstance(document, dict) or COUNTS_KEY not in document:
        detail = "" if as_json else f" or '{RECORDS_KEY}' (a per_pass / per_token detail dump)"
        raise FormatError(path, f"expected a dict with '{COUNTS_KEY}' ([T, L, E], [L, E] or [E]){detail}, "
                                f"found {_keys(document)}")
    counts = document[COUNTS_KEY]
    if _is_tensor(counts):
        counts = tensor_array(counts, path, f"'{COUNTS_KEY}'")
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


def read_sglang_detail_dump(path: Path) -> CountsFile:
    """Per-pass counts and phases from a SGLang detail dump (see :func:`detail_counts`)."""
    document = _load_torch(path)
    if not isinstance(document, dict) or RECORDS_KEY not in document:
        stat = " (a stat dump: read it as sglang-dump)" if isinstance(document, dict) and COUNTS_KEY in document else ""
        raise FormatError(path, f"not a SGLang detail dump: expected a dict with '{RECORDS_KEY}' and '{MAP_KEY}', "
                                f"found {_keys(document)}{stat}")
    return detail_counts(document, path)


def detail_counts(document: dict, path: Path) -> CountsFile:
    """Per-pass logical counts from a detail dump ``{"records": [...], "last_physical_to_logical_map": [L, S]}``.

    Each record gives its pass's tokens per physical slot: counted from ``topk_ids_of_layer``
    (``[L, N, K]`` slot ids, ``-1`` unused; ``per_token``), which must then agree with its
    ``global_physical_count``, else taken from ``global_physical_count`` (``[L, S]``; ``per_pass``).
    Slot ``s`` of layer ``l`` counts for logical expert ``map[l, s]``; ``E`` is the largest expert
    id in the map + 1 (SGLang places every expert). The file is one rank's view: the tokens that
    rank routed (with a DeepEP low-latency gatherer, the tokens its own slots received).

    Returns:
        a :class:`CountsFile` with ``counts [T, L, E]`` (``T`` records, in file order) and, when
        the records carry ``forward_mode`` (``per_token``), ``phases [T]`` (:data:`FORWARD_MODES`);
        metadata: ``recorder_mode``, ``rank`` (or ``ranks``), ``forward_modes`` (passes per mode name).
    Raises:
        FormatError: naming the record and key at fault (not a list of dicts, a key missing, a
            wrong shape or type, a slot id outside ``-1 .. S-1``, an unknown forward mode, tokens
            in an IDLE pass, counts that disagree, sizes beyond :mod:`eplb.io.formats.limits`).
    """
    records = document[RECORDS_KEY]
    if not isinstance(records, (list, tuple)):
        raise FormatError(path, f"'{RECORDS_KEY}' must be a list of per-pass records (dicts), "
                                f"got a {type(records).__name__}")
    if not records:
        raise FormatError(path, f"'{RECORDS_KEY}' is empty: no forward pass was recorded (start the recorder "
                                "before the traffic, dump before stopping the server)")
    check_size(len(records), "windows", f"the number of '{RECORDS_KEY}' (forward passes)", path)
    if MAP_KEY not in document:
        raise FormatError(path, f"a detail dump needs '{MAP_KEY}' [L, S] to map physical slots to logical experts; "
                                f"found {_keys(document)}")
    phy2log = check_phy2log(_numbers(document[MAP_KEY], path, f"'{MAP_KEY}'"), path, f"'{MAP_KEY}'")
    num_layers, num_slots = phy2log.shape
    num_experts = int(phy2log.max()) + 1
    check_counts_shape((len(records), num_layers, num_experts), path)
    # index of (layer, logical expert) for each (layer, slot): [L, S]
    logical = (np.arange(num_layers)[:, None] * num_experts + phy2log).ravel()
    counts = np.zeros((len(records), num_layers, num_experts))
    modes, kinds, ranks = [], set(), set()
    for t, record in enumerate(records):
        what = f"record {t}"
        if not isinstance(record, dict):
            raise FormatError(path, f"{what} of '{RECORDS_KEY}' must be a dict, got a {type(record).__name__}")
        physical = _record_physical_count(record, path, what, num_layers, num_slots)
        counts[t] = np.bincount(logical, weights=physical.ravel(), minlength=num_layers * num_experts).reshape(
            num_layers, num_experts)
        kinds.add("per_token" if TOPK_IDS_KEY in record else "per_pass")
        rank = record.get("rank")
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise FormatError(path, f"{what}: 'rank' must be an integer, got {rank!r:.40}")
            ranks.add(rank)
        modes.append(_record_mode(record, path, what, physical))
    if len(kinds) > 1:
        raise FormatError(path, f"'{RECORDS_KEY}' mix per_token records (with '{TOPK_IDS_KEY}') and per_pass "
                                "records (without): one dump comes from one recorder mode")
    recorded = [m is not None for m in modes]
    if any(recorded) and not all(recorded):
        first = recorded.index(not recorded[0])
        raise FormatError(path, f"record {first} {'has' if recorded[first] else 'lacks'} '{FORWARD_MODE_KEY}' "
                                f"and record 0 {'has' if recorded[0] else 'lacks'} it: every record or none must "
                                "carry one")
    metadata = {"recorder_mode": kinds.pop()}
    if len(ranks) == 1:
        metadata["rank"] = ranks.pop()
    elif ranks:
        metadata["ranks"] = sorted(ranks)
    phases = None
    if all(recorded):
        names, phases = zip(*(FORWARD_MODES[m] for m in modes))
        metadata["forward_modes"] = {name: names.count(name) for name, _ in FORWARD_MODES.values() if name in names}
        phases = np.array(phases)
    return CountsFile(counts, check_layer_ids(None, num_layers, path), "sglang-detail", path, metadata, phases)


def _numbers(value, path: Path, what: str) -> np.ndarray:
    """A tensor (or nested list) read from a dump as a numpy array of real numbers."""
    if _is_tensor(value):
        return tensor_array(value, path, what)
    if not isinstance(value, (list, tuple)):
        raise FormatError(path, f"{what} must be a tensor, got a {type(value).__name__}")
    try:
        array = np.array(value)
    except (ValueError, TypeError, OverflowError):
        raise FormatError(path, f"{what} must be a rectangular array of numbers") from None
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise FormatError(path, f"{what} must be a rectangular array of numbers")
    return array


def _record_physical_count(record: dict, path: Path, what: str, num_layers: int, num_slots: int) -> np.ndarray:
    """``[L, S]`` float64: tokens the record's pass sent to each physical slot."""
    if TOPK_IDS_KEY not in record and PHYSICAL_COUNT_KEY not in record:
        raise FormatError(path, f"{what} has neither '{TOPK_IDS_KEY}' [L, N, K] (per_token) nor "
                                f"'{PHYSICAL_COUNT_KEY}' [L, S] (per_pass); its keys: {_keys(record)}")
    given = None
    if PHYSICAL_COUNT_KEY in record:
        key = f"{what}: '{PHYSICAL_COUNT_KEY}'"
        given = _numbers(record[PHYSICAL_COUNT_KEY], path, key)
        if given.shape != (num_layers, num_slots):
            raise FormatError(path, f"{key} must have shape [L, S] = [{num_layers}, {num_slots}] like '{MAP_KEY}', "
                                    f"got {list(given.shape)}")
        given = given.astype(np.float64)
        if not np.isfinite(given).all() or (given < 0).any():
            raise FormatError(path, f"{key} must hold finite non-negative token counts")
    if TOPK_IDS_KEY not in record:
        return given
    key = f"{what}: '{TOPK_IDS_KEY}'"
    ids = _numbers(record[TOPK_IDS_KEY], path, key)
    if ids.ndim != 3 or ids.shape[0] != num_layers:
        raise FormatError(path, f"{key} must have shape [L, N, K] with L = {num_layers} layers like '{MAP_KEY}', "
                                f"got {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise FormatError(path, f"{key} must hold integer slot ids, got dtype {ids.dtype}")
    if ids.size and (ids.min() < -1 or ids.max() >= num_slots):
        bad = int(ids.min()) if ids.min() < -1 else int(ids.max())
        raise FormatError(path, f"{key} holds slot id {bad}: ids must be -1 (unused) or 0 .. {num_slots - 1} "
                                f"(the {num_slots} slots of '{MAP_KEY}')")
    tokens = record.get("input_ids")
    if isinstance(tokens, (list, tuple)) and len(tokens) != ids.shape[1]:
        raise FormatError(path, f"{key} covers {ids.shape[1]} tokens but 'input_ids' lists {len(tokens)}")
    layer, _, _ = np.nonzero(ids >= 0)
    counted = np.bincount(layer * num_slots + ids[ids >= 0].astype(np.int64),
                          minlength=num_layers * num_slots).reshape(num_layers, num_slots).astype(np.float64)
    if given is not None and not np.array_equal(counted, given):
        l, s = (int(i) for i in np.argwhere(counted != given)[0])
        raise FormatError(path, f"{what}: '{PHYSICAL_COUNT_KEY}' disagrees with the tokens of '{TOPK_IDS_KEY}' "
                                f"(layer {l}, slot {s}: {given[l, s]:g} vs {counted[l, s]:g})")
    return counted


def _record_mode(record: dict, path: Path, what: str, physical: np.ndarray) -> int | None:
    """The record's ``forward_mode`` (a key of :data:`FORWARD_MODES`), ``None`` when it has none."""
    if FORWARD_MODE_KEY not in record:
        return None
    mode = record[FORWARD_MODE_KEY]
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in FORWARD_MODES:
        known = ", ".join(f"{value} ({name})" for value, (name, _) in FORWARD_MODES.items())
        raise FormatError(path, f"{what}: '{FORWARD_MODE_KEY}' is {mode!r:.40}, not one of SGLang's ForwardMode "
                                f"values {known}")
    if mode in TOKENLESS_MODES and physical.any():
        raise FormatError(path, f"{what}: '{FORWARD_MODE_KEY}' {mode} ({FORWARD_MODES[mode][0]}) is a pass without "
                                f"tokens, but it routes {physical.sum():g}")
    return mode


def sidecar_path(path: Path) -> Path:
    """Where eplb records what a SGLang placement file cannot hold: ``<name>.eplb.json`` beside it
    (``init_expert_location.json`` -> ``init_expert_location.eplb.json``)."""
    path = Path(path)
    return path.with_name(path.stem + SIDECAR_SUFFIX)


def model_layer_map(placement: Placement, path: Path, layer_ids=None, num_layers: int | None = None) -> np.ndarray:
    """The ``physical_to_logical_map`` SGLang reads: one row per layer of the model, ``[N, S]``.

    Row ``layer_ids[i]`` is the placement's layer ``i`` (``layer_ids [L]``, the model's index of
    each planned layer, ``0 .. L-1`` when ``None``); the other rows (dense layers the counts left
    out) hold SGLang's own trivial placement, slot ``s`` -> expert ``s % E``, as ``init_trivial``
    builds them. ``N`` is ``num_layers`` (the model's ``num_hidden_layers``), by default the largest
    layer id + 1 (a model's last layer is a MoE layer: DeepSeek-V3's 3..60 give 61 rows).

    Raises:
        FormatError: a layer id at or beyond ``num_layers``.
    """
    layer_ids = check_layer_ids(layer_ids, placement.num_layers, path)
    last = int(layer_ids.max())
    if num_layers is None:
        num_layers = last + 1
    elif num_layers <= last:
        raise FormatError(path, f"the plan covers model layer {last} but num_layers (--num-layers) is {num_layers}: "
                                "SGLang's map has one row per layer of the model, so num_layers must exceed every "
                                "layer id")
    check_size(num_layers, "layers", "num_layers (--num-layers)", path)
    table = np.broadcast_to(np.arange(placement.num_slots) % placement.num_experts,
                            (num_layers, placement.num_slots)).copy()
    table[layer_ids] = placement.phy2log
    return table


def write_sglang_placement(placement: Placement, path: Path, *, layer_ids=None, num_layers: int | None = None) -> None:
    """Write ``{"physical_to_logical_map": [[...]]}`` for ``--init-expert-location`` (the file must
    hold that key alone), one row per layer of the model (:func:`model_layer_map`: row ``l`` is
    model layer ``l``), and the configuration (GPUs, nodes, groups, experts, method, the planned
    layers, the dispatch rule it was planned for) into the side file :func:`sidecar_path`, which
    :func:`read_sglang_placement` reads back."""
    if not placement.topology.is_uniform:
        raise FormatError(path, "SGLang needs the same number of slots on every GPU "
                                f"(this placement has {placement.topology.slots_per_gpu.tolist()})")
    layer_ids = check_layer_ids(layer_ids, placement.num_layers, path)
    table = model_layer_map(placement, path, layer_ids, num_layers)
    Path(path).write_text(json.dumps({PLACEMENT_KEY: table.tolist()}) + "\n")
    sidecar = {"format": SIDECAR_FORMAT, "placement_file": Path(path).name, "num_gpus": placement.num_gpus,
               "num_nodes": placement.num_nodes, "num_groups": placement.num_groups,
               "num_experts": placement.num_experts, "method": placement.method,
               "num_layers": int(table.shape[0]), "layer_ids": layer_ids.tolist(), "dispatch": placement.dispatch}
    sidecar_path(path).write_text(json.dumps(sidecar) + "\n")


def read_sidecar(path: Path) -> dict:
    """The configuration recorded beside a SGLang placement (``{}`` when there is no side file)."""
    side = sidecar_path(path)
    if not side.is_file():
        return {}
    document = load_json(side)
    if not isinstance(document, dict) or document.get("format") != SIDECAR_FORMAT:
        raise FormatError(side, f"not an eplb side file (expected \"format\": \"{SIDECAR_FORMAT}\")")
    named = document.get("placement_file")
    if named is not None and named != Path(path).name:
        raise FormatError(side, f"records the configuration of {named!r}, not of {Path(path).name!r}: it belongs to "
                                "another placement file (fix its \"placement_file\" if the file was renamed, or "
                                "remove it and pass --gpus/--nodes/--groups)")
    return {
        "num_gpus": config_int(document.get("num_gpus"), side, "num_gpus", limit_name="slots", allow_none=True),
        "num_nodes": config_int(document.get("num_nodes"), side, "num_nodes", limit_name="slots", allow_none=True),
        "num_groups": config_int(document.get("num_groups"), side, "num_groups", limit_name="experts",
                                 allow_none=True),
        "num_experts": config_int(document.get("num_experts"), side, "num_experts", limit_name="experts",
                                  allow_none=True),
        "method": str(document.get("method", "sglang file")),
        "num_layers": config_int(document.get("num_layers"), side, "num_layers", limit_name="layers",
                                 allow_none=True),
        "layer_ids": _sidecar_layer_ids(document.get("layer_ids"), side),
        "dispatch": recorded_dispatch(document.get("dispatch"), side, "it"),
        "masked_ranks": document.get("masked_ranks"),  # SGLang's elastic EP masks these ranks (checked by the reader)
        "path": side,
    }


def _sidecar_layer_ids(value, side: Path) -> np.ndarray | None:
    """The planned layers a side file records (``None`` when it records none)."""
    if value is None:
        return None
    if not (isinstance(value, list) and value
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID for i in value)):
        raise FormatError(side, f"layer_ids must be a non-empty list of layer ids (integers 0 .. {MAX_ID})")
    check_size(len(value), "layers", "the number of layer_ids", side)
    return check_layer_ids(value, len(value), side)


def read_sglang_placement(path: Path, *, num_gpus=None, num_nodes=None, num_experts=None, num_groups=None,
                          document=None) -> PlacementFile:
    """Read a ``--init-expert-location`` file holding ``physical_to_logical_map [L, S]``.

    The file does not say how many GPUs there are: the side file eplb wrote beside it
    (:func:`sidecar_path`) does, else ``num_gpus`` must be given; ``num_nodes``/``num_groups``
    likewise (else 1 node, no groups). ``num_experts`` is the side file's, else the argument, else
    the largest expert id + 1. What the side file records is the deployment the file was planned
    for: a given value that disagrees with it is refused (:func:`~eplb.io.formats.data.recorded_or_given`).

    The map has a row per model layer; with a side file that records the planned layers
    (``layer_ids``) the placement is those rows (the others are SGLang's trivial rows of dense
    layers), with those layer ids; without one, every row, layers ``0 .. N-1``. The side file's
    ``dispatch`` (the rule the plan was made for, e.g. SGLang's static table) becomes the placement's
    :attr:`~eplb.Placement.dispatch`, so its metrics judge under that rule (no side file, or one
    written before eplb recorded the rule: an even split).
    """
    if document is None:
        if path.suffix == ".pt":
            document = _load_torch(path, "a SGLang placement")
        else:
            document = load_json(path)
    if not isinstance(document, dict) or PLACEMENT_KEY not in document:
        raise FormatError(path, f"not a SGLang placement: expected a JSON object with '{PLACEMENT_KEY}'")
    table = document[PLACEMENT_KEY]
    if _is_tensor(table):
        table = tensor_array(table, path, f"'{PLACEMENT_KEY}'")
    phy2log = check_phy2log(table, path)
    side = read_sidecar(path)
    source = f"its side file {sidecar_path(path).name}"
    num_gpus = recorded_or_given(side.get("num_gpus"), num_gpus, path, "GPUs", "--gpus", source)
    num_nodes = recorded_or_given(side.get("num_nodes"), num_nodes, path, "nodes", "--nodes", source) or 1
    num_groups = recorded_or_given(side.get("num_groups"), num_groups, path, "expert groups", "--groups", source)
    num_experts = recorded_or_given(side.get("num_experts"), num_experts, path, "experts", "the counts' experts",
                                    source)
    if num_gpus is None:
        raise FormatError(path, "a SGLang placement does not record the number of GPUs and there is no side file "
                                f"{sidecar_path(path).name}: pass --gpus")
    num_experts = int(phy2log.max()) + 1 if num_experts is None else num_experts
    layer_ids = side.get("layer_ids")
    if side.get("num_layers") is not None and side["num_layers"] != phy2log.shape[0]:
        raise FormatError(path, f"holds {phy2log.shape[0]} layers but {source} records {side['num_layers']}")
    if layer_ids is not None:
        if layer_ids.max() >= phy2log.shape[0]:
            raise FormatError(path, f"{source} records model layer {int(layer_ids.max())}, beyond the map's "
                                    f"{phy2log.shape[0]} rows")
        phy2log = phy2log[layer_ids]
    try:
        topology = Topology.uniform(phy2log.shape[1], num_gpus, num_nodes)
        phy2log, topology = _without_masked_ranks(phy2log, topology, side.get("masked_ranks"), path, source)
        placement = Placement(phy2log, num_experts, topology, num_groups=num_groups,
                              method=side.get("method", "sglang file"), dispatch=side.get("dispatch", "uniform"))
    except ValueError as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    metadata = {"sidecar": str(side["path"])} if side else {}
    if side.get("masked_ranks"):
        metadata["masked_ranks"] = list(side["masked_ranks"])
    return PlacementFile(placement, check_layer_ids(layer_ids, phy2log.shape[0], path), "sglang", path, metadata)


def _without_masked_ranks(phy2log: np.ndarray, topology: Topology, masked, path: Path, source: str):
    """``(phy2log, topology)`` of the ranks that serve: SGLang's elastic EP keeps a lost rank's slots in
    its map and masks the rank (the side file's ``masked_ranks``), so those slots serve nothing and
    the placement is the others' (``phy2log [L, S]`` -> ``[L, S - k * masked]``, the masked GPUs
    holding no slots); unchanged without masked ranks."""
    if not masked:
        return phy2log, topology
    if not isinstance(masked, list) or not all(isinstance(r, int) and 0 <= r < topology.num_gpus for r in masked):
        raise FormatError(path, f"{source} records masked_ranks {masked!r}: expected GPU indices below "
                                f"{topology.num_gpus}")
    slots = topology.slots_per_gpu.copy()
    keep = np.ones(phy2log.shape[1], bool)
    for rank in set(masked):
        keep[topology.slot_offsets[rank]:topology.slot_offsets[rank] + slots[rank]] = False
        slots[rank] = 0
    return np.ascontiguousarray(phy2log[:, keep]), Topology(slots, topology.num_nodes)


def is_sglang_placement(document) -> bool:
    """Whether a parsed JSON document is a SGLang placement (it holds ``physical_to_logical_map``)."""
    return isinstance(document, dict) and PLACEMENT_KEY in document


#: the formats of this module (collected by :data:`eplb.io.formats.FORMATS`). Both dumps end in
#: ``.pt``: detection names the first, whose reader tells a detail dump by its keys.
FORMATS = (
    Format("logical-count-json", "SGLang's logical_count JSON", suffixes=(".json",),
           read_counts=partial(read_sglang_dump, as_json=True)),
    Format("sglang-dump", "SGLang expert-distribution dump", suffixes=(".pt", ".pth"), read_counts=read_sglang_dump),
    Format("sglang-detail", "SGLang per_pass / per_token dump", suffixes=(".pt", ".pth"),
           read_counts=read_sglang_detail_dump),
    Format("sglang", "SGLang --init-expert-location", suffixes=(".json", ".pt"), output_suffixes=(".json",),
           output_names=(OUTPUT_NAME,),
           read_placement=read_sglang_placement, write_placement=write_sglang_placement,
           keywords=(*READ_KEYWORDS, "layer_ids", "num_layers"),
           parse=load_json, recognise=is_sglang_placement, recognised_by=f"'{PLACEMENT_KEY}' (SGLang)"),
)

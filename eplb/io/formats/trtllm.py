"""TensorRT-LLM's files: expert-statistics folders (counts in) and the MoE load-balancer YAML
(placement out).

What TensorRT-LLM writes and reads (NVIDIA/TensorRT-LLM):

- ``tensorrt_llm/_torch/expert_statistic.py``: with ``EXPERT_STATISTIC_ITER_RANGE=start-stop``,
  every rank saves ``safetensors.torch.save_file(records, f"{EXPERT_STATISTIC_PATH}/rank{r}.safetensors")``
  where ``records["{iteration}_{layer}"]`` is ``torch.bincount(token_selected_experts,
  minlength=num_experts)`` (int64 ``[E]``, the tokens *that rank* routed), and rank 0 writes
  ``meta_info.json`` = ``{"num_experts": E, "num_experts_per_token": k}``.
- ``examples/wide_ep/ep_load_balancer/utils.py`` (``load_expert_statistic``) sums the same key
  over all ranks; iterations are consecutive and every (iteration, layer) pair is present. Layer
  indices are the model's (DeepSeek's MoE layers are 3..60).
- ``examples/wide_ep/ep_load_balancer/generate_eplb_config.py`` and its README: the load-balancer
  YAML is ``{"num_slots": S, "initial_global_assignments": {layer: [S expert ids]},
  "layer_updates_per_iter": 0}``; slots ``r*S/ep_size ...`` belong to rank ``r``. It is given to
  the engine as ``moe_config: {load_balancer: <file>}`` and parsed into ``MoeLoadBalancerConfig``
  (``tensorrt_llm/llmapi/llm_args.py``), a strict pydantic model: no other keys are allowed, so
  eplb's own notes go into YAML comments.

The engine itself (its dispatch rule, its notes) is :mod:`eplb.engines.tensorrt_llm`.

Files are untrusted: safetensors holds raw tensors only (read with ``safetensors.numpy``, no
torch needed) and YAML is read with ``yaml.safe_load``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ...analysis.placement import Placement
from ...model.topology import Topology
from .data import (CountsFile, PlacementFile, check_counts, check_layer_ids, check_phy2log, config_int, layer_ranges,
                   parse_layer_ranges, recorded_dispatch, recorded_or_given)
from .errors import FormatError, require
from .limits import MAX_ID, check_size, limit
from .spec import READ_KEYWORDS, Format

META_INFO = "meta_info.json"
RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")
KEY = re.compile(r"^(\d+)_(\d+)$")
#: a comment line eplb writes into its YAML so it can read the GPU count back
HINT = re.compile(r"^#\s*eplb:\s*(.*)$", re.MULTILINE)


def read_trtllm_statistics(folder: Path) -> CountsFile:
    """Counts ``[T, L, E]`` from a TensorRT-LLM expert-statistics folder, summed over ranks."""
    safetensors_numpy = require("safetensors.numpy", "trtllm", f"reading the TensorRT-LLM statistics in {folder}")
    meta_path = folder / META_INFO
    if not meta_path.is_file():
        raise FormatError(folder, f"not a TensorRT-LLM expert-statistics folder: no {META_INFO}")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(meta_path, f"not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("num_experts"), int) or meta["num_experts"] < 1:
        raise FormatError(meta_path, "must hold {\"num_experts\": <positive int>, ...}")
    num_experts = meta["num_experts"]
    check_size(num_experts, "experts", f"num_experts in {META_INFO}", meta_path)
    rank_files = sorted((p for p in folder.iterdir() if RANK_FILE.match(p.name)),
                        key=lambda p: int(RANK_FILE.match(p.name).group(1)))
    if not rank_files:
        raise FormatError(folder, "no rank<r>.safetensors files")
    totals: dict[tuple[int, int], np.ndarray] = {}
    for rank_file in rank_files:
        try:
            records = safetensors_numpy.load_file(str(rank_file))
        except Exception as exc:  # header / dtype errors of a damaged or foreign file
            raise FormatError(rank_file, f"not a readable safetensors file ({exc})") from None
        for key, counts in records.items():
            match = KEY.match(key)
            if match is None:
                raise FormatError(rank_file, f"unexpected tensor name {key!r}: expected '<iteration>_<layer>'")
            if counts.shape != (num_experts,):
                raise FormatError(rank_file, f"tensor {key!r} has shape {list(counts.shape)}, "
                                             f"expected [{num_experts}] (num_experts in {META_INFO})")
            counts = check_counts(counts[None], rank_file, f"tensor {key!r}")[0, 0]
            pair = (int(match.group(1)), int(match.group(2)))
            if max(pair) > MAX_ID:
                raise FormatError(rank_file, f"tensor {key!r}: iteration and layer must be at most {MAX_ID}")
            totals[pair] = totals[pair] + counts if pair in totals else counts
    iterations = sorted({i for i, _ in totals})
    layers = sorted({layer for _, layer in totals})
    missing = [(i, layer) for i in iterations for layer in layers if (i, layer) not in totals]
    if missing:
        raise FormatError(folder, f"incomplete statistics: no counts for iteration {missing[0][0]}, "
                                  f"layer {missing[0][1]} in any rank ({len(missing)} pairs missing)")
    counts = np.stack([np.stack([totals[i, layer] for layer in layers]) for i in iterations])
    metadata = {"num_experts_per_token": meta.get("num_experts_per_token"), "num_ranks": len(rank_files),
                "iterations": [iterations[0], iterations[-1] + 1]}
    return CountsFile(check_counts(counts, folder), np.asarray(layers, np.int64), "trtllm-stats", folder, metadata)


def write_trtllm_yaml(placement: Placement, path: Path, *, layer_ids=None, layer_updates_per_iter: int = 0,
                      num_layers: int | None = None) -> None:
    """Write the load-balancer YAML (``num_slots``, ``initial_global_assignments`` keyed by the
    model's layer index ``layer_ids [L]``, ``layer_updates_per_iter``), expert lists inline as
    TensorRT-LLM's own script does. Each MoE layer looks its row up by its layer index (a missing
    one is a ``KeyError`` in the engine), so the keys are the model's, whatever layers the counts
    held; ``num_layers`` (the model's layer count), when given, must exceed every layer id. The
    ``# eplb:`` comment records the deployment, the layers written (``layers=3..60``) and the dispatch
    rule the plan was made for (``dispatch=uniform``)."""
    yaml = require("yaml", "trtllm", "writing TensorRT-LLM's load-balancer YAML")
    if not placement.topology.is_uniform:
        raise FormatError(path, "TensorRT-LLM needs the same number of slots on every rank "
                                f"(this placement has {placement.topology.slots_per_gpu.tolist()})")
    layer_ids = check_layer_ids(layer_ids, placement.num_layers, path)
    if num_layers is not None and num_layers <= layer_ids.max():
        raise FormatError(path, f"the plan covers model layer {int(layer_ids.max())} but num_layers (--num-layers) "
                                f"is {num_layers}: every layer id must be below the model's layer count")
    config = {
        "num_slots": placement.num_slots,
        "initial_global_assignments": {int(layer): row.tolist() for layer, row in zip(layer_ids, placement.phy2log)},
        "layer_updates_per_iter": int(layer_updates_per_iter),
    }

    class InlineLists(yaml.SafeDumper):
        pass

    InlineLists.add_representer(
        list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))
    body = yaml.dump(config, Dumper=InlineLists, sort_keys=False, width=float("inf"))
    hint = (f"# eplb: num_gpus={placement.num_gpus} num_nodes={placement.num_nodes} "
            f"num_experts={placement.num_experts} num_groups={placement.num_groups or 'none'} "
            f"method={placement.method} layers={layer_ranges(layer_ids)} dispatch={placement.dispatch}\n")
    Path(path).write_text("# TensorRT-LLM MoE load balancer config (moe_config.load_balancer), written by eplb\n"
                          + hint + body)


def _budget_loader(yaml, path: Path):
    """A ``yaml.SafeLoader`` subclass (the same tags and values as ``yaml.safe_load``) that refuses
    a document whose aliases expand it beyond :func:`eplb.io.formats.limits.limit` ``("yaml_nodes")``
    nodes more than are written out ("billion laughs"), or that refers to itself, before any Python
    object is built."""

    class BudgetLoader(yaml.SafeLoader):
        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _check_expansion(node, path)
            return node

        def construct_mapping(self, node, deep=False):
            _refuse_duplicate_keys(self, node, path)
            return super().construct_mapping(node, deep=deep)

    return BudgetLoader


def _refuse_duplicate_keys(loader, node, path: Path) -> None:
    """Refuse a mapping that writes one key twice (``yaml.safe_load`` keeps the last and silently
    loses the other: two ``0:`` layers read as one). Merged keys (``<<``) may be overridden."""
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # the constructor itself refuses an unhashable key
        line = key_node.start_mark.line + 1
        if key in seen:
            raise FormatError(path, f"the key {key!r:.40} appears twice in one mapping (lines {seen[key]} and {line}): "
                                    "each layer (and setting) must be written once")
        seen[key] = line


def _check_expansion(root, path: Path) -> None:
    """Count the nodes of the composed graph and of its expansion (each alias copied out), without
    recursion; raise :class:`FormatError` past the budget or on a cycle."""
    budget = limit("yaml_nodes")
    size: dict[int, int] = {}
    distinct = 0
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > distinct + budget:
                raise FormatError(path, f"YAML aliases expand it to over {distinct + budget:,} nodes (a "
                                        "\"billion laughs\" document?); refused (set EPLB_MAX_YAML_NODES to allow more)")
            continue
        if key in size:
            continue
        if key in on_path:
            raise FormatError(path, "YAML with an alias to itself (a recursive structure) is refused")
        distinct += 1
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


def _children(node) -> list:
    value = node.value
    if isinstance(value, list):
        if value and isinstance(value[0], tuple):
            return [item for pair in value for item in pair]
        return value
    return []


def read_trtllm_yaml(path: Path, *, num_gpus=None, num_nodes=None, num_experts=None, num_groups=None) -> PlacementFile:
    """Read a load-balancer YAML back. The GPU count (and nodes, groups, experts) come from the
    ``# eplb:`` comment of a file eplb wrote, which records the deployment it was planned for (a
    given value that disagrees is refused), else from the arguments. Read with ``yaml.safe_load``
    semantics under a budget on alias expansion; a key written twice is refused, and so are layers
    other than those the comment records (``layers=``). The comment's ``dispatch=`` (the rule the plan
    was made for) becomes the placement's :attr:`~eplb.Placement.dispatch` (none: an even split)."""
    yaml = require("yaml", "trtllm", f"reading the YAML file {path}")
    try:
        text = Path(path).read_text()
        config = yaml.load(text, Loader=_budget_loader(yaml, path))  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise FormatError(path, "not a YAML file (not UTF-8 text)") from None
    except yaml.YAMLError as exc:
        raise FormatError(path, f"not valid YAML ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise FormatError(path, "YAML nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        if isinstance(exc, FormatError):
            raise
        raise FormatError(path, f"not readable YAML ({exc})") from None
    if not isinstance(config, dict) or "initial_global_assignments" not in config:
        raise FormatError(path, "not a TensorRT-LLM load-balancer config with 'initial_global_assignments'")
    assignments = config["initial_global_assignments"]
    if not isinstance(assignments, dict) or not assignments:
        raise FormatError(path, "'initial_global_assignments' must map layer indices to expert lists")
    if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_ID for k in assignments):
        raise FormatError(path, f"'initial_global_assignments' keys must be layer indices (integers 0 .. {MAX_ID})")
    layer_ids = sorted(assignments)
    rows = [assignments[k] for k in layer_ids]
    if not all(isinstance(r, list) for r in rows) or len({len(r) for r in rows}) != 1:
        raise FormatError(path, "every layer of 'initial_global_assignments' must list the same number of slots")
    phy2log = check_phy2log(rows, path, "initial_global_assignments")
    num_slots = config_int(config.get("num_slots", phy2log.shape[1]), path, "num_slots", limit_name="slots")
    if num_slots != phy2log.shape[1]:
        raise FormatError(path, f"num_slots is {num_slots} but each layer of initial_global_assignments lists "
                                f"{phy2log.shape[1]} slots")
    updates = config_int(config.get("layer_updates_per_iter", 0), path, "layer_updates_per_iter", minimum=0)
    hint = dict(item.split("=", 1) for m in HINT.findall(text) for item in m.split() if "=" in item)
    recorded = {}
    try:
        for key, limit_name in (("num_gpus", "slots"), ("num_nodes", "slots"), ("num_experts", "experts"),
                                ("num_groups", "experts")):
            if hint.get(key, "none") != "none":
                recorded[key] = config_int(int(hint[key]), path, f"{key} in the '# eplb:' comment",
                                           limit_name=limit_name)
    except ValueError as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(path, "its '# eplb:' comment is malformed; pass --gpus/--nodes/--groups") from None
    source = "its '# eplb:' comment"
    num_gpus = recorded_or_given(recorded.get("num_gpus"), num_gpus, path, "GPUs", "--gpus", source)
    num_nodes = recorded_or_given(recorded.get("num_nodes"), num_nodes, path, "nodes", "--nodes", source) or 1
    num_experts = recorded_or_given(recorded.get("num_experts"), num_experts, path, "experts", "the counts' experts",
                                    source)
    num_groups = recorded_or_given(recorded.get("num_groups"), num_groups, path, "expert groups", "--groups", source)
    if "layers" in hint:
        written = parse_layer_ranges(hint["layers"], path, "layers in the '# eplb:' comment")
        missing = sorted(set(written.tolist()) - set(layer_ids))
        extra = sorted(set(layer_ids) - set(written.tolist()))
        if missing or extra:
            what = [f"layer{'s' if len(ids) > 1 else ''} {layer_ranges(ids)} {verb}"
                    for ids, verb in ((missing, "missing"), (extra, "not written by eplb")) if ids]
            raise FormatError(path, f"'initial_global_assignments' does not list the layers its '# eplb:' comment "
                                    f"records ({hint['layers']}): {', '.join(what)}")
    if num_gpus is None:
        raise FormatError(path, "this YAML does not record the number of GPUs (ranks): pass --gpus")
    num_experts = int(phy2log.max()) + 1 if num_experts is None else num_experts
    dispatch = recorded_dispatch(hint.get("dispatch"), path, source)
    try:
        topology = Topology.uniform(phy2log.shape[1], num_gpus, num_nodes)
        placement = Placement(phy2log, num_experts, topology, num_groups=num_groups,
                              method=hint.get("method", "trtllm file"), dispatch=dispatch)
    except ValueError as exc:
        raise FormatError(path, f"invalid placement: {exc}") from None
    metadata = {"layer_updates_per_iter": updates}
    if hint:
        metadata["eplb_comment"] = True  # GPUs, nodes and groups recorded by eplb
    return PlacementFile(placement, np.asarray(layer_ids, np.int64), "trtllm", path, metadata)


def is_statistics_folder(path: Path) -> bool:
    """Whether ``path`` is a TensorRT-LLM expert-statistics folder (it holds ``meta_info.json``)."""
    return (Path(path) / META_INFO).is_file()


#: the formats of this module (collected by :data:`eplb.io.formats.FORMATS`)
FORMATS = (
    Format("trtllm-stats", "TensorRT-LLM expert statistics", folder=True, read_counts=read_trtllm_statistics,
           recognise=is_statistics_folder,
           recognised_by=f"a TensorRT-LLM expert-statistics folder ({META_INFO})"),
    Format("trtllm", "TensorRT-LLM YAML", suffixes=(".yaml", ".yml"), read_placement=read_trtllm_yaml,
           write_placement=write_trtllm_yaml,
           keywords=(*READ_KEYWORDS, "layer_ids", "layer_updates_per_iter", "num_layers")),
)

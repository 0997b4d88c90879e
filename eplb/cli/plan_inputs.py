"""What ``eplb plan`` reads from its flags and counts: the counts (a phase, windows), the model's
layers, the output format and the flags as :func:`eplb.plan`'s keywords, each checked against the
others it needs or excludes.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from ..model.cost import MODELS as COST_MODELS
from ..planning.methods import METHODS
from ..engines import DISPATCH_RULES
from ..planning.pipeline import combination_error
from .shared import _accepts, _output_format, _read_counts, _refuse_input_as_output
from .wording import ENGINE_ROWS


def _read_plan_counts(counts, input_format, transpose, allow_shape, phase, passes_per_window):
    """The counts ``eplb plan`` plans from: read, then the passes of ``phase`` only, then cut into
    windows of ``passes_per_window`` passes (each when given)."""
    data = _read_counts(counts, input_format, transpose, allow_shape)
    if phase is not None:
        if data.phases is None:
            raise click.BadParameter(f"{data.path} records no phase per pass (only SGLang's per_token detail dump "
                                     "records one): plan it without --phase", param_hint="--phase")
        data = data.select_phase(phase)
    if passes_per_window is not None:
        data = data.in_windows(passes_per_window)
    return data


def _plan_options(method, previous, tolerance, max_moves, time_limit, deterministic_time, *, engine, dispatch,
                  objective, max_off_node, expert_bytes, model_preset, groups, nodes) -> tuple[dict, dict]:
    """``eplb plan``'s flags as ``(migration, options)`` keywords of :func:`eplb.plan`, each flag
    checked against the others it needs or excludes (a usage error naming them)."""
    if previous is None and (tolerance is not None or max_moves is not None):
        raise click.UsageError("--tolerance and --max-moves apply only with --previous")
    if previous is None and expert_bytes is not None:
        raise click.UsageError("--expert-bytes prices the moves: flags that price them apply only with --previous")
    migration = {k: v for k, v in (("tolerance", tolerance), ("max_moves", max_moves)) if v is not None}
    options = {}
    if time_limit is not None:
        if not _accepts(METHODS[method], "time_limit"):
            takers = [m for m, fn in sorted(METHODS.items()) if _accepts(fn, "time_limit")]
            raise click.BadParameter(f"method {method!r} takes no time limit (methods that do: {', '.join(takers) or 'none'})",
                                     param_hint="--time-limit")
        options["time_limit"] = time_limit
    if deterministic_time is not None:
        if method != "exact":
            raise click.BadParameter(f"applies to method 'exact' only, not {method!r}", param_hint="--deterministic-time")
        options["deterministic_time"] = deterministic_time
    if engine is not None and dispatch != "uniform":
        raise click.UsageError("--engine sets the dispatch rule: not with --dispatch optimal")
    rule = _planning_rule(engine or dispatch, previous=previous is not None)
    refusal = combination_error(rule, objective=objective, previous=previous is not None,
                                max_off_node=max_off_node is not None, is_series=None,
                                hierarchical=groups is not None and groups % nodes == 0, names=_PLAN_FLAGS)
    if refusal:  # the rest (e.g. --objective with --previous on a series) once the counts are read
        raise click.UsageError(refusal)
    options.update({k: v for k, v in (("dispatch", None if rule == "uniform" else rule), ("objective", objective),
                                      ("max_off_node", max_off_node)) if v is not None})
    return migration, options


def _check_outputs(outputs: list, output_format: str, layer_updates_per_iter: int, inputs: list) -> None:
    """What ``eplb plan`` will write, checked before anything is read: ``--layer-updates-per-iter``
    only for TensorRT-LLM's YAML, and no output (``outputs``: ``-o`` first, the SGLang side file of
    ``-o`` after them) naming an input."""
    if layer_updates_per_iter and output_format != "trtllm":
        raise click.BadParameter(f"applies to TensorRT-LLM YAML output only, not to {output_format} output",
                                 param_hint="--layer-updates-per-iter")
    for path in outputs:
        _refuse_input_as_output(path, inputs)
    if output_format == "sglang":
        from ..io.formats.sglang import sidecar_path

        _refuse_input_as_output(sidecar_path(outputs[0]), inputs, what="the SGLang side file of -o")


def _planning_rule(rule: str, *, previous: bool) -> str:
    """The rule a plan is made for: ``rule`` (``--engine`` or ``--dispatch``), except near the
    placement in service (``previous``) for an engine's rule that :func:`eplb.plan` makes from
    scratch only (SGLang's): then an even split, the closest rule the re-plan is made for, and the
    plan is judged and written under ``rule`` (the rule the engine serves it by)."""
    if not previous or DISPATCH_RULES[rule].kind != "engine":
        return rule
    refused = combination_error(rule, objective=None, previous=True, max_off_node=False, hierarchical=False,
                                is_series=None)
    return "uniform" if refused else rule


def _planned_for_line(rule: str, planned: str) -> list[str]:
    """The summary line saying a plan served by ``rule`` was made near the placement in service for
    ``planned`` (:func:`_planning_rule`), or nothing when they are the same rule."""
    if planned == rule:
        return []
    return [f"rule     planned near the placement in service for {DISPATCH_RULES[planned].label} (eplb.plan makes a "
            f"plan for {DISPATCH_RULES[rule].label} from scratch only), then judged and written under "
            f"{DISPATCH_RULES[rule].label}, the rule the engine serves it by"]


_PLAN_FLAGS = {"previous": "--previous", "max_off_node": "--max-off-node", "dispatch": "--engine",
               "objective": "--objective", "num_groups": "--groups", "num_nodes": "--nodes"}
"""How ``eplb plan`` names :func:`eplb.planning.pipeline.combination_error`'s options."""


def _plan_output_format(output, output_format, num_layers, quiet: bool) -> str:
    """The format ``eplb plan`` writes: ``--format``, else from the name of ``-o`` (an engine's file
    name picks its format, with a note on stderr); ``--num-layers`` only with an engine's format."""
    from ..io.formats import placement_format_for_output

    if output_format is None:
        output_format = _output_format(output, placement_format_for_output)
        _note_engine_file_name(output, output_format, quiet)
    if num_layers is not None and output_format not in ENGINE_ROWS:
        raise click.BadParameter(f"applies to engine output ({', '.join(ENGINE_ROWS)}) only, not to {output_format} "
                                 "output (which keeps the counts' layer ids)", param_hint="--num-layers")
    return output_format


def _model_layers(data, layer_ids, model_preset, num_layers, output_format):
    """``(data, model_layers)``: the counts with the model layer of each row, and the model's layer
    count for an engine's file (``--num-layers``, else ``--model``'s; ``None``: the largest id + 1).

    A file that records its layers (a layer column, an ``.npz``'s ``layer_ids``, SGLang's and
    TensorRT-LLM's files) says which they are; ``--layer-ids`` says it for one that does not (and
    must agree with one that does); else ``--model`` does, when the rows are its MoE layers
    (DeepSeek-V3: 58 rows are layers 3..60) or all its layers. Rows no one names are layers
    ``0 .. L-1``, which an engine's file of more layers (``--num-layers``) would put on the wrong
    rows: refused, asking which model layers they are."""
    from dataclasses import replace

    from ..io.formats import FormatError
    from ..io.formats.data import layer_ranges, parse_layer_ranges

    if layer_ids is not None:
        try:
            ids = parse_layer_ranges(layer_ids, None, "--layer-ids")
        except FormatError as exc:
            raise click.BadParameter(exc.problem, param_hint="--layer-ids") from None
        if ids.size != data.num_layers:
            raise click.BadParameter(f"{layer_ranges(ids)} names {ids.size} layers, but {data.path} holds "
                                     f"{data.num_layers} rows of counts", param_hint="--layer-ids")
        if data.layer_ids_recorded and not np.array_equal(ids, data.layer_ids):
            raise click.BadParameter(f"{data.path} records its rows as model layers {layer_ranges(data.layer_ids)}, "
                                     f"not {layer_ranges(ids)}", param_hint="--layer-ids")
        data = replace(data, layer_ids=ids, layer_ids_recorded=True)
    model = None if model_preset is None else COST_MODELS[model_preset]
    fits = model is not None and data.num_experts == model.num_experts and \
        data.num_layers in (model.num_moe_layers, model.num_layers)
    if fits and not data.layer_ids_recorded:
        ids = model.moe_layer_ids if data.num_layers == model.num_moe_layers else np.arange(model.num_layers)
        data = replace(data, layer_ids=ids, layer_ids_recorded=True)
    if output_format not in ENGINE_ROWS:
        return data, num_layers
    if model is not None and not fits:
        raise click.BadParameter(
            f"{model.name} has {model.num_layers} layers ({model.num_moe_layers} MoE layers "
            f"{layer_ranges(model.moe_layer_ids)}) of {model.num_experts} experts, but {data.path} holds "
            f"{data.num_layers} layers x {data.num_experts} experts: for another model pass --num-layers and "
            "--layer-ids", param_hint="--model")
    if model is not None and num_layers is not None and num_layers != model.num_layers:
        raise click.BadParameter(f"{num_layers}, but {model.name} has {model.num_layers} layers",
                                 param_hint="--num-layers")
    num_layers = model.num_layers if model is not None else num_layers
    if num_layers is not None and data.layer_ids.max() >= num_layers:
        raise click.BadParameter(f"{num_layers} layers, but {data.path} holds counts of model layer "
                                 f"{int(data.layer_ids.max())}: the model's layer count must exceed every layer id",
                                 param_hint="--num-layers")
    if num_layers is not None and num_layers > data.num_layers and not data.layer_ids_recorded:
        dense = num_layers - data.num_layers
        raise click.BadParameter(
            f"{num_layers} layers, but {data.path} holds {data.num_layers} rows of counts and does not record which "
            f"model layers they are: pass --layer-ids (--layer-ids {dense}..{num_layers - 1} if the first {dense} "
            "layers are dense) or --model NAME", param_hint="--num-layers")
    return data, num_layers


def _note_engine_file_name(output, output_format: str, quiet: bool) -> None:
    """Say on stderr when the name of ``-o`` chose an engine's format that its suffix alone would not."""
    from ..io.formats import named_output_format

    if named_output_format(output) == output_format and not quiet:
        click.echo(f"note: {Path(output).name} is the name of a {output_format} file: writing {output_format}'s format "
                   "(pass --format eplb for eplb's JSON)", err=True)

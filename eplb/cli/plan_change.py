"""``eplb plan --previous FILE`` across a deployment change: the re-plan, its transfer plan priced,
written and summarised.
"""

from __future__ import annotations

import functools
import shlex
import sys
import time
import warnings

import click
import numpy as np

import eplb

from ..planning.methods import METHODS
from ..engines import DISPATCH_RULES
from ..analysis.metrics import moe_layers, moe_mean
from ..io.report import moe_note
from .change_flags import CHANGE_FLAGS, _check_engine_layout, _deployment_change
from .plan_inputs import _model_layers, _plan_options, _plan_output_format, _read_plan_counts
from .plan_summary import _plan_bound
from .shared import (
    ChangeRefused, _accepts, _check_flag_sizes, _check_previous, _check_previous_layers, _note_global_groups,
    _note_overwrite, _note_plan_warnings, _read_previous, _refuse_input_as_output, _with_timer, show_progress
)
from .wording import _dense_layers_note, _engine_rows_line, _groups_text, _seconds_text, _shape_text


def _plan_across_change(params: dict, command_start: float) -> None:
    """``eplb plan --previous FILE`` across a deployment change: the placement in service re-planned
    for the deployment the flags describe (:func:`_deployment_change`), its transfer plan priced,
    written and summarised."""
    from ..analysis import metrics
    from ..io.formats import FormatError, write_placement
    from ..model.cost import CostModel
    from ..serving.transfer import transfer_plan

    p, quiet = params, params["quiet"]
    migration, options = _plan_options(p["method"], p["previous"], p["tolerance"], p["max_moves"], p["time_limit"],
                                       p["deterministic_time"], engine=p["engine"], dispatch=p["dispatch"],
                                       objective=p["objective"], max_off_node=p["max_off_node"],
                                       expert_bytes=p["expert_bytes"], model_preset=p["model_preset"], groups=p["groups"],
                                       nodes=p["nodes"])
    output_format = _plan_output_format(p["output"], p["output_format"], p["num_layers"], quiet)
    if p["layer_updates_per_iter"] and output_format != "trtllm":
        raise click.BadParameter(f"applies to TensorRT-LLM YAML output only, not to {output_format} output",
                                 param_hint="--layer-updates-per-iter")
    _check_flag_sizes(slots=p["slots"], gpus=p["gpus"], nodes=p["nodes"], groups=p["groups"],
                      **{"num-layers": p["num_layers"]})
    _refuse_input_as_output(p["output"], [p["counts"], p["previous"]])
    if output_format == "sglang":
        from ..io.formats.sglang import sidecar_path

        _refuse_input_as_output(sidecar_path(p["output"]), [p["counts"], p["previous"]], what="the SGLang side file of -o")
    start = time.perf_counter()
    data = _read_plan_counts(p["counts"], p["input_format"], p["transpose"], p["allow_shape"], p["phase"],
                             p["passes_per_window"])
    weights = data.weights
    data, model_layers = _model_layers(data, p["layer_ids"], p["model_preset"], p["num_layers"], output_format)
    prev = _read_previous(p["previous"], p["previous_format"], None, None, None, data)
    old = prev.placement
    if all(p[name] is None for name in CHANGE_FLAGS) and (old.num_layers, old.num_experts) != weights.shape:
        # flags that differ from a placement of other experts or layers: not a change, a mismatch (exit 1)
        _check_previous(prev, dict(layers=weights.shape[0], experts=weights.shape[1], slots=p["slots"] or old.num_slots,
                                   gpus=p["gpus"] or old.num_gpus, nodes=p["nodes"]), p["previous"])
    if prev.placement.num_experts != weights.shape[1]:
        raise ChangeRefused(f"--previous {p['previous']} places {prev.placement.num_experts} experts and the counts have "
                            f"{weights.shape[1]}: a deployment change keeps the experts")
    if prev.placement.num_layers != weights.shape[0]:
        raise FormatError(p["previous"], f"incompatible configuration: the previous placement has "
                                         f"{prev.placement.num_layers} layers, the counts {weights.shape[0]}")
    _check_previous_layers(prev, data.layer_ids, p["previous"])
    change = _deployment_change(prev.placement.deployment, p)
    _check_engine_layout(change, output_format)
    _note_global_groups(p["groups"] or change.old.num_groups, change.new.num_nodes, quiet)
    if _accepts(METHODS[p["method"]], "progress"):
        options["progress"] = show_progress(quiet)
    with warnings.catch_warnings(record=True) as caught:  # said in one line each below, not raw
        warnings.simplefilter("always", RuntimeWarning)
        work = functools.partial(eplb.plan, data.counts, change, previous=prev.placement, method=p["method"],
                                 **migration, **options)
        timed = show_progress(quiet) and p["method"] != "greedy" and "progress" not in options
        placement = _with_timer(work, f"re-planning {weights.shape[0]} layers across the change") if timed else work()
    options.pop("progress", None)
    elapsed = time.perf_counter() - start
    _note_plan_warnings(caught, quiet)
    overrides = {} if p["expert_bytes"] is None else {"expert_bytes": p["expert_bytes"]}
    cost = CostModel.preset(p["hardware"], p["model_preset"] or "deepseek-v3", **overrides)
    # (an identity change as its deployment: transfer_plan refuses a DeploymentChange that changes nothing)
    transfer = transfer_plan(prev.placement, placement, change.new if change.is_identity else change,
                             expert_bytes=int(cost.expert_bytes))
    judge = p["engine"] or "shares"
    figures = {"before": prev.placement.balancedness(weights, judge), "after": placement.balancedness(weights, judge),
               "bound": _plan_bound(placement, weights, p["engine"], p["max_off_node"]), "transfer": transfer,
               "recovery_s": cost.transfer_time(transfer), "cost": cost, "elapsed": elapsed, "judge": judge}
    figures["gap"] = metrics.gap(placement.gpu_loads(weights, judge).max(axis=-1), figures["bound"].values)
    configuration, diagnostics = _change_records(p, data, change, placement, options, migration, figures)
    _note_overwrite(p["output"], quiet)
    write_placement(placement, p["output"], output_format, layer_ids=data.layer_ids, configuration=configuration,
                    diagnostics=diagnostics, layer_updates_per_iter=p["layer_updates_per_iter"], num_layers=model_layers)
    if not quiet:
        lines = _change_summary(p, data, change, placement, figures)
        lines.append(f"time     {elapsed:.2f} s reading and planning; {time.perf_counter() - command_start:.2f} s for "
                     "the whole command")
        lines.append(f"wrote    {p['output']} ({output_format})")
        lines += [line for line in (_engine_rows_line(data.layer_ids, output_format, model_layers),
                                    _dense_layers_note(weights, data.layer_ids, output_format)) if line]
        click.echo("\n".join(lines))


def _change_records(p: dict, data, change, placement, options: dict, migration: dict, figures: dict) -> tuple[dict, dict]:
    """The ``configuration`` and ``diagnostics`` ``eplb plan`` writes beside a plan across a change."""
    new, old, info = change.new, change.old, placement.info
    configuration = {
        "num_slots": new.num_slots, "num_gpus": new.num_gpus, "num_nodes": new.num_nodes, "num_groups": new.num_groups,
        "slots_per_gpu": new.topology.slots_per_gpu.tolist(), "method": p["method"], "options": options,
        "counts_file": str(p["counts"]), "counts_format": data.format, "counts_shape": list(data.counts.shape),
        "phase": p["phase"], "previous": str(p["previous"]), "migration_aware": True, "migration": migration,
        "command": "eplb " + shlex.join(sys.argv[1:]),
        "change": {"description": change.describe(), "gpu_map": change.gpu_map.tolist(),
                   "lost_gpus": change.lost_gpus.tolist(), "added_gpus": change.added_gpus.tolist(),
                   "previous_slots_per_gpu": old.topology.slots_per_gpu.tolist(),
                   "previous_num_nodes": old.num_nodes},
    }
    transfer = figures["transfer"]
    diagnostics = {
        "balancedness_previous": figures["before"], "balancedness": figures["after"], "gap": figures["gap"],
        "lower_bound": figures["bound"].values, "bound": figures["bound"].description,
        "max_load": placement.max_load, "moe_layers": moe_layers(data.weights), "orphans": info.get("orphans"),
        "copy_floor": info.get("copy_floor"), "copies": info.get("copies"), "relaxed": info.get("relaxed"),
        "transfer": transfer.summary(), "recovery_s": figures["recovery_s"], "hardware": figures["cost"].name,
        "expert_bytes": int(figures["cost"].expert_bytes), "time_s": figures["elapsed"],
        "judged_under": figures["judge"],
    }
    return configuration, diagnostics


def _change_summary(p: dict, data, change, placement, figures: dict) -> list[str]:
    """The lines ``eplb plan`` prints for a plan across a deployment change (the time and what was
    written follow)."""
    weights, new, info = data.weights, change.new, placement.info
    moe = moe_layers(weights)
    before, after = figures["before"], figures["after"]
    serving = int((new.topology.slots_per_gpu > 0).sum())
    orphans = int(np.sum(info.get("orphans", 0)))
    floor = int(np.sum(info.get("copy_floor", 0)))
    copies, moved = figures["transfer"].counts(), figures["transfer"].bytes()
    cost = figures["cost"]
    over_floor = f", {copies['total'] / floor:.2f}x the floor of {floor:,}" if floor else ", the floor is 0"
    size = (f"{int(cost.expert_bytes):,} bytes per expert"
            + (f", {p['model_preset'] or 'deepseek-v3'}'s: --model or --expert-bytes for yours"
               if p["expert_bytes"] is None else ""))
    gib = {kind: value / 2**30 for kind, value in moved.items()}
    lines = [
        f"counts   {data.path} ({data.format}): {_shape_text(data)}",
        f"change   {change.describe()}",
        f"plan     {p['method']}: {weights.shape[0]} layers x {weights.shape[1]} experts -> {new.num_slots} slots on "
        f"{serving} GPUs in {new.num_nodes} node{'s' if new.num_nodes > 1 else ''}"
        + _groups_text(new.num_groups, new.num_nodes)
        + f", re-planned from the placement in service ({p['previous']})",
        f"balance  {moe_mean(before, weights):.4f} in service before the change -> {moe_mean(after, weights):.4f} with "
        f"the plan (mean over {moe_note(weights)}; worst layer {after[moe].min() if moe.any() else after.min():.4f})"
        + ("" if p["engine"] is None else f"; under {DISPATCH_RULES[p['engine']].label}"),
        f"orphans  {orphans:,} experts lost every replica ({orphans / weights.shape[0]:.1f} a layer): each loaded from "
        "host memory once",
        f"copies   {copies['total']:,} weight copies{over_floor} (the fewest any re-plan makes): {copies['from_host']:,} "
        f"from host memory, {copies['intra_node']:,} over NVLink, {copies['cross_node']:,} across nodes, "
        f"{copies['intra_gpu']:,} within GPUs",
        f"bytes    {gib['total']:.3g} GiB: {gib['from_host']:.3g} from host, {gib['intra_node']:.3g} over NVLink, "
        f"{gib['cross_node']:.3g} across nodes, {gib['intra_gpu']:.3g} within GPUs ({size})",
        f"recovery {_seconds_text(figures['recovery_s'])} estimated on {p['hardware']}: the host loads first (PCIe, "
        f"{cost.host_bandwidth / 1e9:.0f} GB/s per GPU), then the copies between GPUs (the busiest GPU's slowest link)",
    ]
    if info.get("relaxed"):
        lines.append(f"relaxed  {info['relaxed']}")
    gap = figures["gap"]
    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    lines += [f"bound    {figures['bound'].description}",
              f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
              f" ({figures['bound'].kind})" if finite.size else "gap      n/a"]
    return lines

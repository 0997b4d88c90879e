"""``eplb plan --previous FILE`` across a deployment change: the re-plan, its transfer plan priced,
written and summarised.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
import time
import warnings
from pathlib import Path

import click
import numpy as np

import eplb

from ..engines import DISPATCH_RULES
from ..planning.methods import METHODS
from ..analysis.metrics import moe_layers, moe_mean
from ..model.defaults import RECOVERY_TOLERANCE
from ..io.report import moe_note
from .change_flags import CHANGE_FLAGS, _check_engine_layout, _deployment_change, _with_masked_ranks
from .plan_inputs import (
    _check_outputs, _model_layers, _plan_options, _plan_output_format, _planned_for_line, _planning_rule,
    _read_plan_counts,
)
from .plan_summary import _plan_bound
from .shared import (
    ChangeRefused, _accepts, _check_flag_sizes, _check_previous, _check_previous_layers, _counts_paths,
    _counts_text, _note_global_groups, _note_overwrite, _note_plan_warnings, _read_previous, _recorded_engine,
    show_progress, _with_timer,
)
from .wording import _dense_layers_note, _engine_rows_line, _groups_text, _rule_name, _seconds_text, _shape_text


def _plan_across_change(params: dict, command_start: float) -> None:
    """``eplb plan --previous FILE`` across a deployment change: the placement in service re-planned
    for the deployment the flags describe (:func:`_deployment_change`) under the rule it is served
    by (``--engine``, else the rule ``FILE`` records), its transfer plan priced, written and
    summarised. From a series, the recovery (the re-plan on the summed windows, as
    :func:`eplb.plan` on summed counts) unless ``--rebalance`` asks for the plan hedged over the
    windows; the summary shows the other point beside it."""
    from ..io.formats import write_placement

    p, quiet = params, params["quiet"]
    migration, options = _plan_options(p["method"], p["previous"], p["tolerance"], p["max_moves"], p["time_limit"],
                                       p["deterministic_time"], engine=p["engine"], dispatch=p["dispatch"],
                                       objective=p["objective"], max_off_node=p["max_off_node"],
                                       expert_bytes=p["expert_bytes"], model_preset=p["model_preset"], groups=p["groups"],
                                       nodes=p["nodes"])
    output_format = _plan_output_format(p["output"], p["output_format"], p["num_layers"], quiet)
    _check_flag_sizes(slots=p["slots"], gpus=p["gpus"], nodes=p["nodes"], groups=p["groups"],
                      **{"num-layers": p["num_layers"]})
    outputs = [p["output"]] + ([p["transfer"]] if p.get("transfer") is not None else [])
    _check_outputs(outputs, output_format, p["layer_updates_per_iter"], [*_counts_paths(p["counts"]), p["previous"]])
    start = time.perf_counter()
    data, model_layers, prev = _change_inputs(p, output_format)
    rule, rule_lines = _recorded_engine(p["engine"] or (p["dispatch"] if p["dispatch"] != "uniform" else None),
                                        prev.placement, p["previous"],
                                        also="; the re-plan is planned, judged and written under it too")
    rule = rule or "uniform"
    migration.setdefault("tolerance", RECOVERY_TOLERANCE)
    planned = _planning_rule(rule, previous=True)
    options.pop("dispatch", None)  # the rule is the new deployment's (one value: item 14 of issue 47)
    change = _deployment_change(prev.placement.deployment, p, dispatch=planned)
    rule, rule_lines = _rule_on(change, rule, rule_lines)
    planned = planned if rule != "uniform" else "uniform"
    _check_engine_layout(change, output_format)
    _note_global_groups(p["groups"], change.new.num_nodes, quiet)
    points = _recovery_and_rebalance(data, change, prev.placement, p, options, migration, quiet)
    placement = points["chosen"]
    made_for_rule = rule != planned and change.new.topology.is_uniform
    if made_for_rule:  # the re-plan for an even split, then made for the engine's rule
        placement = _made_for_rule(placement, data, change.new, rule)
    elif placement.dispatch != rule:  # written recording the rule it is served by
        placement = dataclasses.replace(placement, dispatch=rule)
    elapsed = time.perf_counter() - start
    judge = rule if rule != "uniform" else "shares"
    figures = _change_figures(data, change, prev.placement, placement, points, p, judge)
    figures["elapsed"] = elapsed
    configuration, diagnostics = _change_records(p, data, change, placement, options, migration, figures)
    _note_overwrite(p["output"], quiet)
    written = placement
    if output_format == "sglang" and not change.new.topology.is_uniform:  # lost ranks kept in the map, masked
        written = _with_masked_ranks(placement, change)
        configuration["masked_ranks"] = change.lost_gpus.tolist()
    write_placement(written, p["output"], output_format, layer_ids=data.layer_ids, configuration=configuration,
                    diagnostics=diagnostics, layer_updates_per_iter=p["layer_updates_per_iter"], num_layers=model_layers)
    if written is not placement:
        _record_masked_ranks(p["output"], change.lost_gpus.tolist())
    if p.get("transfer") is not None:
        _write_transfer(p["transfer"], figures["transfer"], change, data)
    if not quiet:
        lines = _change_summary(p, data, change, placement, figures)
        lines[2:2] = rule_lines + (_planned_for_line(rule, planned) if not made_for_rule else [
            f"rule     re-planned near the placement in service for {_rule_name(planned)}, then made for "
            f"{_rule_name(rule)}'s shares (eplb.planning.engine_planning: slots swapped between GPUs where the rule "
            "serves the windows better, never worse than the even-split re-plan under it)"])
        lines.append(f"time     {elapsed:.2f} s reading and planning; {time.perf_counter() - command_start:.2f} s for "
                     "the whole command")
        lines.append(f"wrote    {p['output']} ({output_format})"
                     + (f"; the transfer plan {p['transfer']}" if p.get("transfer") is not None else ""))
        if written is not placement:
            lost = ", ".join(map(str, change.lost_gpus.tolist()))
            lines.append(f"masked   rank {lost}: SGLang's elastic EP keeps a lost rank in its map and masks it; its "
                         "slots hold expert 0, as SGLang fills an inactive rank (no token reaches them), the "
                         "survivors' slots hold the re-plan (the side file records masked_ranks)")
        lines += [line for line in (_engine_rows_line(data.layer_ids, output_format, model_layers),
                                    _dense_layers_note(data.weights, data.layer_ids, output_format)) if line]
        click.echo("\n".join(lines))



def _rule_on(change, rule: str, rule_lines: list[str]) -> tuple[str, list[str]]:
    """The rule the re-plan is judged and written under: ``rule``, unless it is an engine's rule
    defined on the same slots on every GPU and the new deployment masks a GPU (eplb models SGLang's
    static table on even ranks only): then an even split, with the line that says so."""
    topology = change.new.topology
    if DISPATCH_RULES[rule].kind != "engine" or topology.is_uniform:
        return rule, rule_lines
    return "uniform", [
        f"rule     {DISPATCH_RULES[rule].label} is modelled on the same slots on every GPU; the new deployment holds "
        f"{topology.slots_per_gpu.tolist()} slots per GPU, so the re-plan is planned, judged and written for "
        f"{DISPATCH_RULES['uniform'].label}"]


def _made_for_rule(placement, data, deployment, rule: str):
    """``placement`` (planned for an even split on ``deployment``, the same slots on every GPU) made
    for ``rule``'s shares from the windows of ``data`` (:func:`eplb.planning.engine_planning.plan_for_rule`),
    recording ``rule``."""
    from ..planning.engine_planning import plan_for_rule

    phy2log, info = plan_for_rule(data.counts, placement.phy2log, deployment, rule)
    return eplb.Placement(phy2log, placement.num_experts, placement.topology, placement.num_groups, placement.method,
                          info={**placement.info, "made_for_rule": info}, dispatch=rule)


def _change_inputs(p: dict, output_format: str):
    """``(data, model_layers, prev)``: the counts (on the model's layers) and the placement in
    service on their layers, checked to be the same experts and layers."""
    from ..io.formats import FormatError

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
    if old.num_experts != weights.shape[1]:
        raise ChangeRefused(f"--previous {p['previous']} places {old.num_experts} experts and the counts have "
                            f"{weights.shape[1]}: a deployment change keeps the experts")
    if old.num_layers != weights.shape[0]:
        raise FormatError(p["previous"], f"incompatible configuration: the previous placement has "
                                         f"{old.num_layers} layers, the counts {weights.shape[0]}")
    _check_previous_layers(prev, data.layer_ids, p["previous"])
    return data, model_layers, prev


def _recovery_and_rebalance(data, change, previous, p: dict, options: dict, migration: dict, quiet: bool) -> dict:
    """The re-plans across ``change``: ``{"recovery", "rebalance", "chosen"}``. The recovery is the
    re-plan on the summed windows near the placement in service (what :func:`eplb.plan` does with
    summed counts); the rebalance the re-plan hedged over the windows of a series (``None`` for
    ``[L, E]`` counts or with ``--objective``, which names the one plan). ``--rebalance`` chooses
    the rebalance, else the recovery is written."""
    series = data.num_windows > 1 and options.get("objective") is None
    if p.get("rebalance") and not series:
        raise click.UsageError("--rebalance re-plans hedged over the windows of a series: the counts hold one window"
                               if data.num_windows == 1 else "--rebalance and --objective: give one")
    plans = {}
    for name in ("recovery", "rebalance") if series else ("recovery",):
        keywords = dict(options, objective="sum") if series and name == "recovery" else dict(options)
        if _accepts(METHODS[p["method"]], "progress"):
            keywords["progress"] = show_progress(quiet)
        with warnings.catch_warnings(record=True) as caught:  # said in one line each below, not raw
            warnings.simplefilter("always", RuntimeWarning)
            work = functools.partial(eplb.plan, data.counts, change, previous=previous, method=p["method"],
                                     **migration, **keywords)
            timed = show_progress(quiet) and p["method"] != "greedy" and "progress" not in keywords
            plans[name] = (_with_timer(work, f"re-planning {data.weights.shape[0]} layers across the change ({name})")
                           if timed else work())
        relaxed = plans[name].info.get("relaxed")  # the summary's "relaxed" line says it: not twice
        _note_plan_warnings([w for w in caught if str(w.message) != relaxed], quiet or name != "recovery")
    plans.setdefault("rebalance", None)
    plans["chosen"] = plans["rebalance"] if p.get("rebalance") else plans["recovery"]
    return plans


def _moe_copies(transfer, moe: np.ndarray):
    """``transfer`` without the copies of dense layers (``moe [L]`` False: no tokens, no expert
    weights to move); every field of one entry per copy is kept in the plan's own order."""
    keep = moe[np.asarray(transfer.layer, np.int64)]
    if keep.all():
        return transfer
    size = len(transfer)
    fields = {f.name: np.asarray(getattr(transfer, f.name))[keep] for f in dataclasses.fields(transfer)
              if isinstance(getattr(transfer, f.name), np.ndarray) and getattr(transfer, f.name).shape[:1] == (size,)}
    return dataclasses.replace(transfer, **fields)


def _change_figures(data, change, previous, placement, points: dict, p: dict, judge: str) -> dict:
    """What the summary and the records say about a re-plan across ``change``: balancedness before
    and after under ``judge``, the bound and gap, the transfer plan (MoE layers only) and its time,
    and the same for the point not written (the recovery or the rebalance)."""
    from ..analysis import metrics
    from ..model.cost import CostModel
    from ..serving.transfer import transfer_plan

    weights = data.weights
    moe = moe_layers(weights)
    overrides = {} if p["expert_bytes"] is None else {"expert_bytes": p["expert_bytes"]}
    cost = CostModel.preset(p["hardware"], p["model_preset"] or "deepseek-v3", **overrides)

    def priced(plan):
        # (an identity change as its deployment: transfer_plan refuses a DeploymentChange that changes nothing)
        transfer = _moe_copies(transfer_plan(previous, plan, change.new if change.is_identity else change,
                                             expert_bytes=int(cost.expert_bytes)), moe)
        return transfer, cost.transfer_time(transfer)

    transfer, seconds = priced(placement)
    figures = {"before": previous.balancedness(weights, judge), "after": placement.balancedness(weights, judge),
               "bound": _plan_bound(placement, weights, None if judge == "shares" else judge, p["max_off_node"]),
               "transfer": transfer, "recovery_s": seconds, "cost": cost, "judge": judge, "moe": moe,
               "chosen": "rebalance" if p.get("rebalance") else "recovery"}
    figures["gap"] = metrics.gap(placement.gpu_loads(weights, judge).max(axis=-1), figures["bound"].values)
    other = "recovery" if p.get("rebalance") else "rebalance"
    if points.get(other) is not None:
        other_transfer, other_seconds = priced(points[other])
        figures["other"] = {"name": other, "transfer": other_transfer, "recovery_s": other_seconds,
                            "after": points[other].balancedness(weights, judge)}
    return figures


def _record_masked_ranks(output, ranks: list[int]) -> None:
    """Add ``masked_ranks`` to the SGLang side file of ``output``: the ranks the engine masks."""
    import json

    from ..io.formats.sglang import sidecar_path

    side = sidecar_path(output)
    document = json.loads(side.read_text())
    document["masked_ranks"] = ranks
    side.write_text(json.dumps(document) + "\n")


def _write_transfer(path, transfer, change, data) -> None:
    """The transfer plan as JSON (:meth:`eplb.TransferPlan.to_dict`: every copy in the plan's own
    order, with its source kind, slot and GPU, its destination and its bytes), beside the model
    layer of each row."""
    import json

    document = {"format": "eplb-transfer-plan", "change": change.describe(),
                "layer_ids": [int(i) for i in data.layer_ids], **transfer.to_dict(),
                "kinds": {"0": "within a GPU", "1": "over NVLink (same node)", "2": "across nodes",
                          "3": "from host memory"}}
    Path(path).write_text(json.dumps(document) + "\n")


def _change_records(p: dict, data, change, placement, options: dict, migration: dict, figures: dict) -> tuple[dict, dict]:
    """The ``configuration`` and ``diagnostics`` ``eplb plan`` writes beside a plan across a change."""
    new, old, info = change.new, change.old, placement.info
    configuration = {
        "num_slots": new.num_slots, "num_gpus": new.num_gpus, "num_nodes": new.num_nodes, "num_groups": new.num_groups,
        "slots_per_gpu": new.topology.slots_per_gpu.tolist(), "method": p["method"], "options": options,
        "counts_file": _counts_text(p["counts"]), "counts_format": data.format, "counts_shape": list(data.counts.shape),
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
        "judged_under": figures["judge"] if figures["judge"] != "shares" or placement.shares is not None else "uniform",
        "point": figures["chosen"],
        **({} if "other" not in figures else {figures["other"]["name"]: {
            "transfer": figures["other"]["transfer"].summary(), "recovery_s": figures["other"]["recovery_s"],
            "balancedness": figures["other"]["after"]}}),
    }
    return configuration, diagnostics


def _change_summary(p: dict, data, change, placement, figures: dict) -> list[str]:
    """The lines ``eplb plan`` prints for a plan across a deployment change (the time and what was
    written follow); dense layers (no tokens) are in no figure, every balancedness names its rule."""
    weights, new, info = data.weights, change.new, placement.info
    moe = figures["moe"]
    num_moe = int(moe.sum()) or weights.shape[0]
    before, after = figures["before"], figures["after"]
    under = f"under {_rule_name(figures['judge'], placement)}"
    serving = int((new.topology.slots_per_gpu > 0).sum())
    orphans = int(np.sum(np.asarray(info.get("orphans", np.zeros(len(moe))))[moe]))
    floor = int(np.sum(np.asarray(info.get("copy_floor", np.zeros(len(moe))))[moe]))
    copies = figures["transfer"].counts()
    over_floor = f", {copies['total'] / floor:.2f}x the floor of {floor:,}" if floor else ", the floor is 0"
    worst = after[moe].min() if moe.any() else after.min()
    lines = [
        f"counts   {data.path} ({data.format}): {_shape_text(data)}",
        *([] if change.is_identity else [f"change   {change.describe()}"]),
        f"plan     {p['method']}: {weights.shape[0]} layers x {weights.shape[1]} experts -> {new.num_slots} slots on "
        f"{serving} GPUs in {new.num_nodes} node{'s' if new.num_nodes > 1 else ''}"
        + _groups_text(new.num_groups, new.num_nodes)
        + f", re-planned from the placement in service ({p['previous']}), tolerance "
        f"{p['tolerance'] if p['tolerance'] is not None else RECOVERY_TOLERANCE:g}"
        + _point_text(figures["chosen"], data),
        f"balance  {moe_mean(before, weights):.4f} in service before the change -> {moe_mean(after, weights):.4f} with "
        f"the plan (mean over {moe_note(weights)}; worst layer {worst:.4f}); {under}",
        (f"orphans  {orphans:,} experts lost every replica ({orphans / num_moe:.1f} per MoE layer): each loaded from "
         "host memory once" if orphans else "orphans  0: every expert still has a replica on a surviving GPU"),
        f"copies   {copies['total']:,} weight copies{over_floor} (the fewest any re-plan makes): {copies['from_host']:,} "
        f"from host memory, {copies['intra_node']:,} over NVLink, {copies['cross_node']:,} across nodes, "
        f"{copies['intra_gpu']:,} within GPUs",
        _bytes_line(figures["transfer"], figures["cost"], p),
        f"recovery {_seconds_text(figures['recovery_s'])} estimated on {p['hardware']}: the host loads first (PCIe, "
        f"{figures['cost'].host_bandwidth / 1e9:.0f} GB/s per GPU, weights already in host memory; a load from disk "
        "takes longer), then the copies between GPUs (the busiest GPU's slowest link)",
    ]
    if "other" in figures:
        lines.append(_other_point_line(figures, weights, under, floor))
    if info.get("relaxed"):
        lines.append(f"relaxed  {info['relaxed']}")
    gap = figures["gap"]
    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    lines += [f"bound    {figures['bound'].description}",
              f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
              f" ({figures['bound'].kind}); {under}" if finite.size else "gap      n/a"]
    return lines


def _point_text(chosen: str, data) -> str:
    """How the written re-plan was made, for the plan line: the recovery or the rebalance of a series."""
    if data.num_windows == 1:
        return ""
    if chosen == "recovery":
        return "; the recovery: planned on the summed windows (--rebalance: hedged over them)"
    return "; the rebalance: hedged over the windows (without --rebalance: the recovery on their sum)"


def _bytes_line(transfer, cost, p: dict) -> str:
    gib = {kind: value / 2**30 for kind, value in transfer.bytes().items()}
    size = (f"{int(cost.expert_bytes):,} bytes per expert"
            + (f", {p['model_preset'] or 'deepseek-v3'}'s: --model or --expert-bytes for yours"
               if p["expert_bytes"] is None else ""))
    return (f"bytes    {gib['total']:.3g} GiB: {gib['from_host']:.3g} from host, {gib['intra_node']:.3g} over NVLink, "
            f"{gib['cross_node']:.3g} across nodes, {gib['intra_gpu']:.3g} within GPUs ({size})")


def _other_point_line(figures: dict, weights, under: str, floor: int) -> str:
    """The point not written (the rebalance beside the recovery, or the other way): its copies,
    bytes, seconds and balancedness, for the operator to weigh."""
    other = figures["other"]
    copies = other["transfer"].counts()["total"]
    ratio = f" ({copies / floor:.2f}x the floor)" if floor else ""
    flag = "with --rebalance" if other["name"] == "rebalance" else "without --rebalance"
    return (f"other    the {other['name']}: {copies:,} copies{ratio}, {other['transfer'].bytes()['total'] / 2**30:.3g} GiB, "
            f"{_seconds_text(other['recovery_s'])}, balance {moe_mean(other['after'], weights):.4f}; {under} "
            f"({flag}: {'hedged over the windows' if other['name'] == 'rebalance' else 'planned on their sum'})")



"""What ``eplb plan`` records beside a plan and prints about it: the bound, the held-out
estimate, the records and the summary lines.
"""

from __future__ import annotations

import shlex
import sys
import time

import numpy as np

import eplb

from .shared import _counts_text
from ..planning.methods import DEFAULT_METHOD
from ..analysis.metrics import moe_layers, moe_mean
from ..io.report import Bound, bound_for
from .wording import (
    DEPLOYED_BETTER_BY, _balance_line, _copy_cost_line, _dense_layers_note, engine_line, _engine_rows_line,
    _groups_text, _held_out_lines, _judge, _regrouped_lines, _rule_name, _served_without_shares, _shape_text,
)


def _plan_summary(*, data, phase, method, slots, gpus, nodes, groups, before, after, placement, weights, options,
                  engine, gap, detail, elapsed, command_start, output, model_layers, rule_lines=()) -> list[str]:
    """The lines ``eplb plan`` prints: the counts, the plan, the rule a deployed plan records
    (``rule_lines``), for a series the held-out estimate first (what the engine will see), then
    balancedness in sample, the details of :func:`_plan_detail_lines` (``detail``: its other
    keywords), the time and what was written."""
    num_layers, num_experts = weights.shape
    output_format = detail["output_format"]
    moe = moe_layers(weights)
    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    detail = dict(detail)
    held = detail.pop("held")
    lines = [
        f"counts   {data.path} ({data.format}): {_shape_text(data)}",
        *([f"phase    {phase}: {data.metadata['windows_selected']} of {data.metadata['windows_total']} passes "
           "selected"] if phase is not None else []),
        f"plan     {method}: {num_layers} layers x {num_experts} experts -> {slots} slots on {gpus} GPUs"
        f" in {nodes} node{'s' if nodes > 1 else ''}" + _groups_text(groups, nodes),
        *rule_lines,
        *([] if held is None else _held_out_lines(held, placement)),
        _balance_line(before, after, placement, weights, data.num_windows, options, engine),
    ]
    lines += _plan_detail_lines(data=data, placement=placement, weights=weights, options=options, engine=engine,
                                finite=finite, held=None, **detail)
    lines.append(f"time     {elapsed:.2f} s reading and planning; {time.perf_counter() - command_start:.2f} s for the "
                 "whole command (with the estimates, the bound and writing; Python's start-up not included)")
    lines.append(f"wrote    {output} ({output_format})")
    lines += [line for line in (_engine_rows_line(data.layer_ids, output_format, model_layers),
                                _dense_layers_note(weights, data.layer_ids, output_format)) if line]
    return lines


def _plan_bound(placement, weights, engine, max_off_node) -> Bound:
    """The bound ``eplb plan`` judges its plan by: :func:`bound_for` under ``engine``'s rule, or for
    a plan that splits experts by its shares and may serve tokens off node, the bound of that freedom."""
    if placement.shares is None:
        return bound_for(weights, placement, engine)
    return Bound(placement.lower_bound, "capped",
                 f"at most {max_off_node:.0%} of the tokens off their home node, any split among replicas")


def _global_balancedness(weights, method, engine, *, slots, gpus, nodes, groups):
    """``[L]`` balancedness of a plan free of groups on ``weights`` (made for ``engine``'s rule and
    judged under it): what keeping each group on one node costs; ``None`` without a hierarchy."""
    if groups is None or groups % nodes:
        return None
    global_plan = eplb.plan(weights, num_slots=slots, num_gpus=gpus, num_nodes=nodes,
                            method=DEFAULT_METHOD if method == "exact" else method,
                            **({} if engine is None else {"dispatch": engine}))
    return global_plan.balancedness(weights, engine or "uniform")


def _plan_records(*, slots, gpus, nodes, groups, method, options, counts, data, phase, previous, used_previous,
                  migration, before, after, gap, bound, placement, weights, global_bal, deployed_bal, elapsed, held,
                  moves, judge=None) -> tuple[dict, dict]:
    """The ``configuration`` and ``diagnostics`` ``eplb plan`` writes beside the placement; the
    windows judged under ``judge`` (``None``: the plan's own rule, :func:`_judge`)."""
    configuration = {
        "num_slots": slots, "num_gpus": gpus, "num_nodes": nodes, "num_groups": groups, "method": method,
        "options": options, "counts_file": _counts_text(counts), "counts_format": data.format,
        "counts_shape": list(data.counts.shape), "phase": phase,
        "previous": None if previous is None else str(previous),
        "migration_aware": used_previous, "migration": migration, "command": "eplb " + shlex.join(sys.argv[1:]),
    }
    diagnostics = {
        "balancedness_no_rebalancing": before, "balancedness": after, "gap": gap,
        "lower_bound": bound.values, "bound": bound.description, "max_load": placement.max_load,
        "moe_layers": moe_layers(weights), "balancedness_global_plan": global_bal,
        "balancedness_previous": deployed_bal,
        "replicas_sharing_a_gpu": placement.replicas_sharing_a_gpu(), "time_s": elapsed,
    }
    if data.num_windows > 1:
        diagnostics["windows_judged_under"] = judge or _judge(options)
        per_window = placement.balancedness(data.counts, diagnostics["windows_judged_under"])
        diagnostics["balancedness_per_window"] = moe_mean(per_window, data.counts)
    if held is not None:
        diagnostics["held_out"] = held
    if moves is not None:
        diagnostics["moves"] = {"slots_changed": moves.slots_changed, "gpu_copies": moves.gpu_copies,
                                "cross_node_copies": moves.cross_node_copies,
                                "per_layer_slots_changed": moves.per_layer_slots_changed}
    return configuration, diagnostics


def _plan_detail_lines(*, data, placement, weights, options, objective, held, global_bal, deployed_bal, max_off_node,
                       output_format, engine, bound, finite, moves, used_previous, prev, expert_bytes, model_preset,
                       hardware, diagnostics, migration=None) -> list[str]:
    """The summary lines of ``eplb plan`` after the balance line: the windows in sample (``held``:
    the held-out lines, when the caller has not printed them first), what the groups, the deployed
    plan and the cap cost, the engine's rule, the bound and gap, and the moves; each figure with
    the rule it is judged under."""
    lines = []
    under = f"under {_rule_name(engine or 'shares', placement)}"
    if data.num_windows > 1:
        window_bal = diagnostics["balancedness_per_window"]
        how = "their sum" if (objective or "") == "sum" else f"the windows ({placement.info.get('objective', 'hedged')})"
        lines.append(f"windows  planned from {how}; in sample, each window: {np.nanmean(window_bal):.4f} mean, "
                     f"{np.nanmin(window_bal):.4f} worst; under "
                     f"{_rule_name(diagnostics['windows_judged_under'], placement)}")
    if held is not None:
        lines += _held_out_lines(held, placement)
    if global_bal is not None:
        lines.append(f"global   {moe_mean(global_bal, weights):.4f} with a plan free of groups on the same counts "
                     f"(what keeping each group on one node costs); under {_rule_name(engine or 'uniform')}")
    if deployed_bal is not None:
        deployed, new = moe_mean(deployed_bal, weights), moe_mean(diagnostics["balancedness"], weights)
        lines.append(f"deployed {deployed:.4f} with the previous placement on these counts; {under}")
        if deployed > new + DEPLOYED_BETTER_BY:
            regrouped = np.asarray(placement.info.get("regrouped", False))
            why = [reason for reason, applies in (
                ("it keeps every expert group on one node where the deployed placement spreads them", regrouped.any()),
                ("it was hedged over the windows, not made for their sum",
                 data.num_windows > 1 and (objective or "") != "sum"),
                ("--max-moves/--tolerance kept it near the deployed placement",
                 bool(migration) and not regrouped.all())) if applies]
            lines.append(f"WARNING  the deployed placement serves these counts better than the new plan ({deployed:.4f} "
                         f"against {new:.4f}): keeping it balances them better"
                         + (f" (the new plan is lower because {'; '.join(why)})" if why else ""))
        lines += _regrouped_lines(placement, migration or {})
    if placement.shares is not None:
        even = placement.balancedness(weights, "uniform")
        lines.append(f"off node {100 * float(placement.off_node_fraction(weights).mean()):.1f}% of the tokens served off "
                     f"their group's home node (cap {max_off_node:.0%}), with the plan's shares; split evenly "
                     f"among replicas instead: balance {moe_mean(even, weights):.4f}")
        if output_format != "eplb":
            lines.append(_served_without_shares(placement, weights, output_format))
    if engine is not None:
        lines.append(engine_line(placement, weights, engine))
    lines += [
        f"bound    {bound.description}",
        f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
        f" ({bound.kind}); {under}" if finite.size else "gap      n/a",
    ]
    if moves is not None:
        total = placement.num_layers * placement.num_slots
        how = "migration-aware" if used_previous else "planned from scratch: this eplb.plan has no previous="
        lines.append(f"moves    {moves.slots_changed} of {total} slots changed ({100 * moves.slots_changed / total:.1f}%),"
                     f" {moves.gpu_copies} weight copies to GPUs, {moves.cross_node_copies} across nodes ({how})")
        if expert_bytes is not None or model_preset is not None:
            lines.append(_copy_cost_line(prev.placement, placement, expert_bytes, model_preset, hardware))
    return lines


def _held_out_estimates(counts, method, options, deployment, judge=None) -> dict | None:
    """Leave one window out (:func:`eplb.held_out`) for this plan's options and for the summed
    plan on ``deployment`` (:func:`eplb.plan`'s keywords: slots or a topology, GPUs, nodes,
    groups, previous), both judged under ``judge`` (``None``: the plan's rule, :func:`_judge`):
    ``{"folds", "plan": [F], "summed": [F], "empty": int, "judge": str}``, leaving out the held-out
    blocks whose windows carry no load (an idle pass has nothing to balance; :func:`eplb.held_out`
    scores them NaN), ``"empty"`` of them; ``None`` for the exact method (one exact plan per fold
    would take too long: say so instead)."""
    if method == "exact":
        return None
    judge = judge or _judge(options)
    deployment = {**deployment, "method": method}
    mine = eplb.held_out(counts, **deployment, **options, judge=judge)
    summed_options = {k: v for k, v in options.items() if k not in ("objective", "dispatch")}
    summed = mine if options.get("objective") == "sum" and "dispatch" not in options else \
        eplb.held_out(counts, **deployment, **summed_options, objective="sum", judge=judge)
    loaded = ~np.isnan(mine)  # the same blocks in both: a block's load does not depend on the plan
    return {"folds": int(loaded.sum()), "plan": mine[loaded], "summed": summed[loaded],
            "empty": int((~loaded).sum()), "judge": judge}

"""``eplb validate``: check a placement file and, with counts, how well it balances them.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from ..analysis.metrics import moe_layers, moe_mean
from ..io.report import bound_for, moe_note
from ..io.formats import COUNTS_FORMATS, PLACEMENT_FORMATS
from .group import main
from .shared import (
    allow_shape_option, _check_flag_sizes, engine_option, friendly_errors, gpus_hint, groups_hint, _read_counts,
    _recorded_engine, transpose_option,
)
from .wording import engine_line, _rule_name


@main.command()
@click.argument("plan_file", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--counts", "counts_file", type=click.Path(path_type=Path), multiple=True,
              help="Expert counts to measure the placement on (balancedness, gap to the lower bound): a file, a "
                   "folder of dumps, or repeated for several files (read as one series).")
@click.option("--format", "-f", "plan_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of PLAN (default: detected).")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None, help="Format of --counts.")
@click.option("--gpus", "-g", type=click.IntRange(min=1), default=None, help=gpus_hint)
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=None, help="Nodes (default: from the file, else 1).")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help=groups_hint)
@engine_option
@transpose_option
@allow_shape_option
@friendly_errors
def validate(plan_file, counts_file, plan_format, input_format, gpus, nodes, groups, engine, transpose, allow_shape):
    """Check a placement file of any supported format and print its metrics.

    Checks that it parses, that every expert has a replica in every layer and that the slots
    divide over the GPUs; with --counts, that it fits the counts and how well it balances them,
    against the same lower bound ``eplb plan`` reports (hierarchical when the deployment has
    groups: --groups or recorded in the file). Exits 1 when the file is not a valid placement.
    With --counts and --engine NAME, also its balancedness under that engine's dispatch rule.
    """
    from ..analysis import metrics
    from ..io.formats import FormatError, read_placement

    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups)
    counts_file = counts_file or None
    if engine is not None and counts_file is None:
        raise click.UsageError("--engine judges the plan on counts: give --counts")
    data = _read_counts(counts_file, input_format, transpose, allow_shape) if counts_file is not None else None
    # the experts come from the file (or its side file), so counts of another width are blamed on the counts
    loaded = read_placement(plan_file, plan_format, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    p = loaded.placement
    if gpus is not None and p.num_gpus != gpus:
        raise FormatError(plan_file, f"the file places slots on {p.num_gpus} GPUs, not --gpus {gpus}")
    replicas = p.logcnt
    lines = [
        f"valid    {plan_file} ({loaded.format})",
        f"shape    {p.num_layers} layers x {p.num_experts} experts, {p.num_slots} slots on {p.num_gpus} GPUs"
        f" in {p.num_nodes} node{'s' if p.num_nodes > 1 else ''}"
        + (f", {p.num_groups} groups" if p.num_groups else "")
        + ("" if p.topology.is_uniform else f" (slots per GPU {p.topology.slots_per_gpu.tolist()})"),
        f"replicas {replicas.min()}..{replicas.max()} per expert; {p.replicas_sharing_a_gpu().sum()} slots hold"
        " a second replica on a GPU that already has the expert",
    ]
    if data is not None:
        if (data.num_layers, data.num_experts) != (p.num_layers, p.num_experts):
            raise FormatError(data.path, f"counts have {data.num_layers} layers x {data.num_experts} experts but the "
                                           f"placement has {p.num_layers} x {p.num_experts}")
        engine, recorded_line = _recorded_engine(engine, p, plan_file)
        lines += recorded_line
        weights = data.weights
        judge = engine or "shares"  # the engine's split, else the plan's own (its shares when it carries them)
        under = f"; under {_rule_name(judge, p)}"
        loads = p.gpu_loads(weights, judge)
        bal = metrics.balancedness(loads, p.topology)
        live = int((p.topology.slots_per_gpu > 0).sum())
        before = metrics.balancedness(metrics.static_gpu_loads(weights, live))  # the experts over the GPUs that serve
        bound = bound_for(weights, p, engine)
        gap = metrics.gap(loads.max(axis=-1), bound.values)
        moe = moe_layers(weights)
        finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
        lines += [
            f"balance  {moe_mean(bal, weights):.4f} mean over {moe_note(weights)}, "
            f"{bal[moe].min() if moe.any() else bal.min():.4f} worst layer "
            f"(no rebalancing: {moe_mean(before, weights):.4f}){under}",
            f"imbalance {moe_mean(metrics.imbalance(loads, p.topology), weights):.4f} mean (max - mean) / mean over "
            f"the {live} GPUs that hold slots{under}",
            f"bound    {bound.description}",
            f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
            f" ({bound.kind}){under}" if finite.size else "gap      n/a",
        ]
        unrecorded = (loaded.format == "sglang" and "sidecar" not in loaded.metadata) or \
            (loaded.format == "trtllm" and not loaded.metadata.get("eplb_comment"))
        if unrecorded and nodes is None and groups is None and p.num_gpus > 1:
            lines.append(f"note     {plan_file.name} records no nodes or groups (no eplb side file or comment), so it "
                         "is judged against the global bound: pass --nodes and --groups for a hierarchical deployment")
        if data.num_windows > 1:
            window_loads = p.gpu_loads(data.counts, judge)                              # [T, L, G]
            series = moe_mean(metrics.balancedness(window_loads, p.topology), window_loads)  # [T], live GPUs only
            lines.append(f"windows  {data.num_windows}: balancedness per window {np.nanmin(series):.4f}.."
                         f"{np.nanmax(series):.4f} (mean over each window's MoE layers){under}")
        if engine is not None:
            lines.append(engine_line(p, weights, engine))
    click.echo("\n".join(lines))

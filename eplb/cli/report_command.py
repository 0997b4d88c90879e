"""``eplb report``: an HTML report with figures on how a plan balances counts.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

import eplb

from ..planning.methods import DEFAULT_METHOD
from ..analysis.metrics import moe_mean
from ..io.formats import COUNTS_FORMATS, PLACEMENT_FORMATS
from .group import main
from .plan_summary import _held_out_estimates
from .shared import (
    allow_shape_option, _check_flag_sizes, _check_previous, counts_argument, _counts_paths, engine_option,
    friendly_errors, gpus_hint, groups_hint, quiet_option, _read_counts, _recorded_engine, _refuse_input_as_output,
    show_progress, transpose_option,
)
from .wording import engine_line, _left_out_note, _rule_name


@main.command()
@counts_argument
@click.argument("plan_file", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Folder for index.html and the PNGs.")
@click.option("--previous", type=click.Path(path_type=Path), default=None, help="An earlier placement: show what moved.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None, help="Format of COUNTS.")
@click.option("--format", "-f", "plan_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of PLAN and --previous (default: detected).")
@click.option("--gpus", "-g", type=click.IntRange(min=1), default=None, help=gpus_hint)
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=None, help="Nodes (default: from the file, else 1).")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help=groups_hint)
@click.option("--top", type=click.IntRange(min=1), default=16, show_default=True, help="Hottest experts to show.")
@engine_option
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def report(counts, plan_file, output, previous, input_format, plan_format, gpus, nodes, groups, top, engine,
           transpose, allow_shape, quiet):
    """Write an HTML report with PNG figures on how PLAN balances COUNTS.

    Figures: per-layer balancedness of the plan against greedy and against no rebalancing, a
    per-GPU load heatmap (layers x GPUs), replica counts of the hottest experts, balancedness per
    window (for a series of counts) and, with --previous, what moved. Greedy and the lower bound use
    the deployment's groups (--groups or recorded in the file). Open OUTPUT/index.html. For a series,
    prints the plan's in-sample balancedness (summed and per window) beside a held-out estimate of
    planning from these windows (leave one window out): hedged over them and from their sum.
    With --engine NAME the summary also judges the plan under that engine's dispatch rule.
    """
    from ..io.formats import FormatError, read_placement
    from ..io.report import make_report
    from ..io.formats.errors import require

    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups)
    _refuse_input_as_output(output, [*_counts_paths(counts), plan_file, previous])
    data = _read_counts(counts, input_format, transpose, allow_shape)
    loaded = read_placement(plan_file, plan_format, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    p = loaded.placement
    if (data.num_layers, data.num_experts) != (p.num_layers, p.num_experts):
        raise FormatError(data.path, f"counts have {data.num_layers} layers x {data.num_experts} experts but the "
                                  f"placement {plan_file} has {p.num_layers} x {p.num_experts}")
    prev, change = _report_previous(previous, plan_format, loaded)
    if output.exists() and not output.is_dir():
        raise FormatError(output, "exists and is not a folder")
    engine, recorded_line = _recorded_engine(engine, p, plan_file)
    require("matplotlib", "report", "eplb report")  # before the folder is made: a failed report leaves none
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        result = make_report(data, loaded, output, previous=prev, top=top, progress=show_progress(quiet),
                             engine=engine, change=change)
    except BaseException:
        if created and not any(output.iterdir()):
            output.rmdir()
        raise
    if quiet:
        return
    lines = recorded_line + ([] if engine is None else [engine_line(p, data.weights, engine)])
    judge = engine or "shares"
    under = f"; under {_rule_name(judge, p)}"
    if data.num_windows > 1:
        # first what the engine will see: the plan `eplb plan` makes from these windows (for the engine's
        # rule with --engine), each window served by the plan made from the others, judged under it
        held = _held_out_estimates(data.counts, DEFAULT_METHOD, {} if engine is None else {"dispatch": engine},
                                   dict(topology=p.topology, num_groups=p.num_groups))
        skipped = _left_out_note(held)
        if held["plan"].size == 0:
            lines.append(f"held out  n/a: every held-out block of windows carries no load{under}")
        else:
            lines.append(f"held out  planning from these windows, each served by the plan made from the others: "
                         f"{held['plan'].mean():.4f} mean, {held['plan'].min():.4f} worst hedged over them "
                         f"(eplb's default); {held['summed'].mean():.4f} / {held['summed'].min():.4f} from their sum"
                         f"{skipped}; under {_rule_name(held['judge'])}")
        per_window = moe_mean(p.balancedness(data.counts, judge), data.counts)
        lines.append(f"in sample {moe_mean(p.balancedness(data.weights, judge), data.weights):.4f} on the summed "
                     f"windows; each of the {data.num_windows} windows: {np.nanmean(per_window):.4f} mean, "
                     f"{np.nanmin(per_window):.4f} worst (the plan may have been made from these windows){under}")
    lines.append(f"wrote    {result.html}")
    lines += [f"         {figure}" for figure in result.figures]
    click.echo("\n".join(lines))


def _report_previous(previous, plan_format, loaded):
    """``(prev, change)``: ``--previous`` read beside the plan ``loaded``; on the same deployment
    ``change`` is ``None``, on another (a plan made across a deployment change) the
    :class:`eplb.DeploymentChange` between them, with the GPU map the plan records (eplb JSON) or
    by index (issue 47 item 8)."""
    from ..io.formats import FormatError, read_placement

    if previous is None:
        return None, None
    p = loaded.placement
    try:  # files that do not record their GPUs (SGLang's without a side file) are on the plan's
        prev = read_placement(previous, plan_format, num_gpus=p.num_gpus, num_nodes=p.num_nodes,
                              num_experts=p.num_experts)
    except FormatError:  # a file that records other GPUs: a plan across a deployment change
        prev = read_placement(previous, plan_format, num_experts=p.num_experts)
    old = prev.placement
    if old.topology == p.topology:
        _check_previous(prev, dict(layers=p.num_layers, experts=p.num_experts, slots=p.num_slots, gpus=p.num_gpus,
                                   nodes=p.num_nodes), previous)
        return prev, None
    if (old.num_layers, old.num_experts) != (p.num_layers, p.num_experts):
        raise FormatError(previous, f"incompatible configuration: the previous placement has {old.num_layers} layers x "
                                    f"{old.num_experts} experts, the plan {p.num_layers} x {p.num_experts}")
    recorded = (loaded.metadata.get("configuration") or {}).get("change") or {}
    try:
        change = eplb.DeploymentChange(old.deployment, p.deployment, recorded.get("gpu_map"))
    except ValueError as exc:
        raise FormatError(previous, f"incompatible configuration: no deployment change leads from it to the plan "
                                    f"({exc})") from None
    return prev, change

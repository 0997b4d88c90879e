"""``eplb sweep``: replay a series through a grid of deployments and policies.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import click

from ..model.cost import HARDWARE as COST_HARDWARE, MODELS as COST_MODELS
from ..engines import SCORING
from ..serving.policy import POLICY_NAMES as SIMULATE_POLICIES
from ..io.progress import Progress
from ..io.formats import COUNTS_FORMATS
from .group import main
from .shared import (
    NamedChoice, allow_shape_option, _check_flag_sizes, _check_sweep_slots, counts_argument, _counts_paths,
    friendly_errors, _int_list, quiet_option, _read_counts, _refuse_input_as_output, transpose_option,
)


def _check_sweep_deployments(gpu_counts, node_counts, groups, num_experts: int) -> list[str]:
    """Usage errors for sweep axes that leave no deployment or name groups the experts cannot
    form; the notes (for stderr) on the pairs skipped or planned without groups."""
    pairs = [(g, n) for g in gpu_counts for n in node_counts]
    skipped = [(g, n) for g, n in pairs if g % n]
    if len(skipped) == len(pairs):
        raise click.BadParameter(f"no GPU count of --gpus divides by a node count of --nodes ({pairs[0][0]} GPUs on "
                                 f"{pairs[0][1]} nodes ...): every GPU count must divide by some node count",
                                 param_hint="--nodes")
    if groups is not None and num_experts % groups:
        raise click.BadParameter(f"{groups} groups do not divide the {num_experts} experts of the counts",
                                 param_hint="--groups")
    notes = []
    if skipped:
        notes.append("skipped " + ", ".join(f"{g} GPUs on {n} nodes" for g, n in skipped)
                     + ": the GPUs must divide by the nodes")
    global_nodes = sorted({n for g, n in pairs if not g % n and groups is not None and groups % n})
    if global_nodes:
        notes.append(f"--groups {groups} does not divide over {', '.join(map(str, global_nodes))} node(s): those "
                     "deployments are planned globally (no groups)")
    return notes


@main.command()
@counts_argument
@click.option("--extra-slots", default="0,1,2", show_default=True,
              help="Redundant slots per GPU beyond the fewest that hold every expert, comma-separated.")
@click.option("--gpus", "-g", default="32", show_default=True, help="GPU counts, comma-separated.")
@click.option("--nodes", "-n", default="1", show_default=True, help="Node counts, comma-separated.")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None,
              help="Expert groups (kept on one node each where they divide by the nodes).")
@click.option("--dispatch", "dispatches", multiple=True, type=click.Choice(SCORING),
              help="Dispatch modes (repeatable; default uniform).")
@click.option("--policy", "-p", "policies", multiple=True, type=click.Choice(SIMULATE_POLICIES),
              help="Policies (repeatable; default none and balancer).")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The GPUs of the cost model (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="Expert size and format for the cost model.")
@click.option("--regime", type=click.Choice(["roofline", "compute", "memory"]), default="roofline", show_default=True)
@click.option("--copy-mode", type=click.Choice(["stall", "overlap", "free"]), default="stall", show_default=True)
@click.option("--check-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between the Balancer's decisions (policy balancer), as in eplb simulate.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Processes (default: every core).")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Folder for sweep.csv and sweep.png.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def sweep(counts, extra_slots, gpus, nodes, groups, dispatches, policies, hardware, model, regime, copy_mode,
          check_every, workers, input_format, output, transpose, allow_shape, quiet):
    """What-if sweep: replay per-step COUNTS [T, L, E] through every combination of redundant slots,
    GPUs, nodes, dispatch modes and policies, and show what redundant slots buy.

    Writes sweep.csv (time lost with and without stalls, copies, bytes moved, replica memory per
    GPU) and sweep.png (time lost against replica memory, the knee of each line starred), and
    prints the knee per deployment: the fewest extra slots per GPU after which one more saves less
    than a point of MoE time.

    \b
    Example:
      eplb sweep steps.npz --extra-slots 0,1,2,3 --gpus 32,64 --nodes 4,8 --groups 8 -p vllm -p balancer -o sweep/
    """
    from ..model.cost import CostModel
    from ..io.simulation_report import write_sweep_report
    from ..model.deployment import Deployment
    from ..simulation.sweep import knee, sweep as run_sweep

    extras, gpu_counts, node_counts = (_int_list(extra_slots, "--extra-slots"), _int_list(gpus, "--gpus", 1),
                                       _int_list(nodes, "--nodes", 1))
    for value in gpu_counts:
        _check_flag_sizes(gpus=value)
    for value in node_counts:
        _check_flag_sizes(nodes=value)
    _check_flag_sizes(groups=groups)
    _refuse_input_as_output(output, _counts_paths(counts))
    data = _read_counts(counts, input_format, transpose, allow_shape)
    notes = _check_sweep_deployments(gpu_counts, node_counts, groups, data.counts.shape[-1])
    _check_sweep_slots(data.counts.shape[-1], gpu_counts, extras)
    cost = CostModel.preset(hardware, model, regime=regime, copy_mode=copy_mode)
    # each run's warning once (the sweep gathers them)
    with warnings.catch_warnings(record=True) as caught, Progress("sweep", unit="runs", quiet=quiet) as progress:
        warnings.simplefilter("always")
        grid = Deployment.grid(data.counts.shape[-1], extra_slots_per_gpu=extras, num_gpus=gpu_counts,
                               num_nodes=node_counts, num_groups=groups, dispatch=dispatches or ("uniform",))
        rows = run_sweep(data.counts, grid, policies=policies or ("none", "balancer"), cost_model=cost,
                         workers=workers, check_every=check_every, progress=progress)
    notes += list(dict.fromkeys(str(w.message) for w in caught))
    if not quiet:
        for note in notes:
            click.echo(f"note: {note}", err=True)
    knees = knee(rows)
    written = write_sweep_report(rows, output, knees)
    if written.get("missing"):
        click.echo(f"note: {written['missing']}", err=True)
    if quiet:
        return
    lines = [f"counts   {data.path} ({data.format}): {data.counts.shape[0]} steps; cost model {cost.name}, {regime}, "
             f"copies {copy_mode}",
             f"{'GPUs':>5} {'nodes':>5} {'dispatch':<8} {'policy':<38} {'extra/GPU':>9} {'lost':>8} {'w/ stalls':>9} "
             f"{'copies':>8} {'replicas GiB/GPU':>16} {'host ms p99/max':>16}"]
    for r in rows:
        lines.append(f"{r['num_gpus']:>5} {r['num_nodes']:>5} {r['dispatch']:<8} {r['policy'][:38]:<38} "
                     f"{r['extra_slots_per_gpu']:>9} {100 * r['lost_share']:>7.2f}% {100 * r['lost_with_stalls_share']:>8.2f}% "
                     f"{r['copies']:>8} {r['replica_memory_per_gpu_bytes'] / 2**30:>16.2f} "
                     f"{r['host_ms_p99']:>8.2f}/{r['host_ms_max']:<7.1f}")
    for (g, n, d, p), extra in knees.items():
        if extra is None:
            lines.append(f"knee     {g} GPUs / {n} nodes, {d}, {p}: none within the values tried (each extra slot "
                         "per GPU still saved a point or more; try more)")
        else:
            lines.append(f"knee     {g} GPUs / {n} nodes, {d}, {p}: {extra} extra slot(s) per GPU")
    lines.append(f"wrote    {written['table']}" + (f", {written['figure']}" if written["figure"] else ""))
    click.echo("\n".join(lines))

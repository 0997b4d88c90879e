"""``eplb recommend``: the redundant experts and the plan for one serving pool.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..model.cost import HARDWARE as COST_HARDWARE, MODELS as COST_MODELS
from ..io.progress import Progress
from ..io.formats import COUNTS_FORMATS
from .group import main
from .shared import (
    NamedChoice, allow_shape_option, _check_flag_sizes, _check_sweep_slots, counts_argument, _counts_paths,
    _counts_text, friendly_errors, _int_list, _note_overwrite, _output_format, quiet_option, _read_counts,
    _refuse_input_as_output, transpose_option,
)
from .wording import _shape_text


_RECOMMEND_FLAGS = {"num_gpus": "--gpus", "num_nodes": "--nodes", "num_groups": "--groups", "batch": "--batch",
                    "slot_counts": "--slots", "extra_slots_per_gpu": "--extra-slots", "passes": "--passes",
                    "model": "--model", "hardware": "--hardware", "the number of experts": "--groups",
                    "num_slots": "--deployed-slots"}


@main.command()
@counts_argument
@click.option("--gpus", "-g", type=click.IntRange(min=1), required=True, help="GPUs of the pool.")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
@click.option("--batch", "-b", type=click.IntRange(min=1, max=2 ** 40), required=True,
              help="Decode: sequences per GPU; prefill: tokens per GPU (per forward pass).")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The pool's GPUs (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="The pool's model (its experts must match the counts).")
@click.option("--extra-slots", default="0,1,2", show_default=True,
              help="Redundant slots per GPU the engine allows, comma-separated.")
@click.option("--slots", "-s", default=None, help="Instead of --extra-slots: slot counts in all, comma-separated.")
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help="Expert groups (as eplb plan).")
@click.option("--passes", type=click.IntRange(min=1, max=4096), default=16, show_default=True,
              help="Passes sampled per window to predict step times.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
              help="Write the recommended placement here (format from the name, as eplb plan).")
@click.option("--deployed-slots", type=click.IntRange(min=1), default=None,
              help="Slots the pool runs now: the layout every option is compared with. Default: the experts "
                   "plus one slot per GPU (256 experts on 32 GPUs: 288), the engines' default.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Write recommend.csv and recommend.png (every option's held-out step time) into this folder.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def recommend(counts, gpus, phase, batch, hardware, model, extra_slots, slots, nodes, groups, passes, seed,
              input_format, output, deployed_slots, report_dir, transpose, allow_shape, quiet):
    """Recommend the redundant experts and the plan for one serving pool from its COUNTS [T, L, E]
    (T >= 2 windows), judged held out: each window is served by plans made from the others, and
    every slot count is priced in predicted MoE step time beside the engine's layout (the
    published greedy at --deployed-slots, by default the experts plus one slot per GPU).

    \b
    Example:
      eplb recommend decode_pool.npz --gpus 32 --phase decode --batch 16 --hardware H100 \\
          --model deepseek-v3 --extra-slots 0,1,2 -o plan.json
    """
    from ..io.formats import placement_format_for_output, write_placement
    from ..model.deployment import Deployment
    from ..simulation.pools import recommend as run_recommend
    from ..model.deployment import slots_for

    extras = _int_list(extra_slots, "--extra-slots")
    slot_counts = None if slots is None else _int_list(slots, "--slots", 1)
    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups, **({"slots": max(slot_counts)} if slot_counts else {}),
                      **{"deployed-slots": deployed_slots})
    output_format = None
    if output is not None:
        _refuse_input_as_output(output, _counts_paths(counts))
        output_format = _output_format(output, placement_format_for_output)
    data = _read_counts(counts, input_format, transpose, allow_shape)
    if slot_counts is None:
        _check_sweep_slots(data.counts.shape[-1], [gpus], extras)
    try:
        num_experts = data.counts.shape[-1]
        deployed = slots_for(num_experts, gpus, 1) if deployed_slots is None else deployed_slots
        deployment = Deployment.of(num_experts, num_slots=deployed, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
        with Progress("recommend", quiet=quiet) as progress:
            result = run_recommend(data.counts, deployment, batch=batch, phase=phase, hardware=hardware, model=model,
                                   extra_slots_per_gpu=extras, slot_counts=slot_counts, passes=passes, seed=seed,
                                   progress=progress)
    except ValueError as exc:
        flag = next((f for name, f in _RECOMMEND_FLAGS.items() if str(exc).startswith(name)), None)
        if flag is None:
            raise
        raise click.BadParameter(str(exc), param_hint=flag) from None
    if output is not None:
        _note_overwrite(output, quiet)
        best = result.recommended
        write_placement(result.placement, output, output_format, layer_ids=data.layer_ids,
                        configuration=dict(num_slots=best.num_slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups,
                                           method=result.placement.method, counts=_counts_text(counts), phase=phase, batch=batch),
                        diagnostics=dict(recommended=result.rows(), default_step_ms=result.default_step_ms,
                                         bound_step_ms=result.bound_step_ms))
    if report_dir is not None:
        from ..io.simulation_report import write_recommend_report

        written = write_recommend_report(result, report_dir)
        if written["missing"]:
            click.echo(f"note: {written['missing']}", err=True)
    if not quiet:
        click.echo("\n".join(_recommend_lines(result, data, output, output_format)))
        if report_dir is not None:
            click.echo(f"report   {', '.join(str(p) for p in (written['table'], written['figure']) if p)}")


def _recommend_lines(result, data, output, output_format) -> list[str]:
    """The summary of ``eplb recommend``: the options table and the choice."""
    best = result.recommended
    lines = [f"counts   {data.path} ({data.format}): {_shape_text(data)}",
             f"pool     {result.phase}, batch {result.batch} per GPU ({result.routed_per_pass} routed tokens "
             f"per layer and pass, {result.passes} passes per window); {result.cost_model.name}; held out over "
             f"{result.folds} folds",
             f"default  published greedy at {result.default_slots} slots: {result.default_step_ms:.4f} ms per MoE step",
             f"{'slots':>6} {'redundant':>9} {'planner':<10} {'step ms':>9} {'vs default':>10} {'replicas GiB/GPU':>16}"]
    for o in result.options:
        mark = "  <- recommended" if o == best else ""
        lines.append(f"{o.num_slots:>6} {o.redundant_experts:>9} {o.planner:<10} {o.step_ms:>9.4f} "
                     f"{o.vs_default_pct:>+9.2f}% {o.replica_gib_per_gpu:>16.2f}{mark}")
    lines.append(f"choice   {best.redundant_experts} redundant experts ({best.num_slots} slots), {best.planner} plan: "
                 f"{best.step_ms:.4f} ms held out ({best.vs_default_pct:+.2f}% vs the default); in sample "
                 f"{result.in_sample_step_ms:.4f} ms (token plan {result.tokens_in_sample_step_ms:.4f} ms)")
    lines.append(f"bound    no layout at any slot count is below {result.bound_step_ms:.4f} ms held out on these "
                 f"passes: the choice is at most {100 * (1 - result.bound_step_ms / best.step_ms):.2f}% from the best")
    if output is not None:
        lines.append(f"wrote    {output} ({output_format})")
    return lines

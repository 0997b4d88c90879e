"""``eplb plan``: plan a placement from counts and write it for an engine (a change of deployment
is re-planned by :mod:`eplb.cli.plan_change`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import click

import eplb

from ..model.cost import HARDWARE as COST_HARDWARE, MODELS as COST_MODELS
from ..planning.methods import DEFAULT_METHOD, METHODS
from ..engines import ENGINE_RULES, SCORING
from ..planning.objectives import OBJECTIVES
from ..io.formats import COUNTS_FORMATS, PLACEMENT_FORMATS
from .change_flags import _plans_across_change
from .group import main
from .plan_change import _plan_across_change
from .plan_inputs import (
    _check_outputs, _model_layers, _plan_options, _plan_output_format, _planned_for_line, _read_plan_counts,
)
from .plan_summary import _global_balancedness, _held_out_estimates, _plan_bound, _plan_records, _plan_summary
from .shared import (
    NamedChoice, _accepts, allow_shape_option, _check_experts_fit, _check_flag_sizes, _check_previous,
    _counts_paths, deployment_arguments, friendly_errors, _note_global_groups, _note_overwrite, _note_plan_warnings,
    quiet_option, _read_previous, _recorded_engine, show_progress, transpose_option, _with_timer,
)


def plan_with_progress(weights, *, num_slots, num_gpus, num_nodes, num_groups, method, previous=None,
                       migration=None, progress=False, **options):
    """``eplb.plan`` with progress shown on stderr; passes ``previous`` (and ``migration``:
    ``tolerance``, ``max_moves``) when ``eplb.plan`` supports migration-aware planning.

    A method that draws its own per-layer progress bar (it takes ``progress=``, like ``exact``)
    gets ``progress``; for any other method other than greedy a timer runs on stderr while the
    plan is computed (on a worker thread: the kernels release the GIL). The plan is always
    exactly what one ``eplb.plan`` call returns.

    Returns:
        ``(placement, used_previous)``.
    """
    use_previous = previous is not None and _accepts(eplb.plan, "previous")
    migration = {k: v for k, v in (migration or {}).items() if use_previous and _accepts(eplb.plan, k)}
    kwargs = dict(num_slots=num_slots, num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups,
                  method=method, **options)
    if use_previous:
        kwargs.update(previous=previous, **migration)
    method_fn = METHODS[method]
    if _accepts(method_fn, "progress"):
        kwargs["progress"] = progress
        return eplb.plan(weights, **kwargs), use_previous
    if not progress or method == "greedy":
        return eplb.plan(weights, **kwargs), use_previous
    return _with_timer(lambda: eplb.plan(weights, **kwargs), f"planning {weights.shape[-2]} layers ({method})"), \
        use_previous


def _refuse_change_only_flags(across: dict) -> None:
    """``--rebalance`` and ``--transfer`` are for a plan across a deployment change only."""
    given = [flag for flag, name in (("--rebalance", "rebalance"), ("--transfer", "transfer")) if across.get(name)]
    if given:
        raise click.UsageError(f"{given[0]} applies across a deployment change only (--previous with --lost-gpus, "
                               "--gpu-map, --slots-per-gpu or other --slots/--gpus)")


def _deployed_plan(previous, fmt, data, engine, *, slots, gpus, nodes):
    """``eplb plan --previous``: ``(prev, engine, rule_lines)``, the deployed placement on the
    counts' layers (checked against the deployment; ``None`` without ``--previous``), and the rule
    every figure is judged under: ``--engine``, else the one the deployed plan records it was made
    for (the engine serves the next plan by it too), with the line that says so."""
    if previous is None:
        return None, engine, []
    prev = _read_previous(previous, fmt, gpus, nodes, data.num_experts, data)
    _check_previous(prev, dict(layers=data.num_layers, experts=data.num_experts, slots=slots, gpus=gpus,
                               nodes=nodes), previous, data.layer_ids)
    engine, rule_lines = _recorded_engine(engine, prev.placement, previous,
                                          also="; the new plan is judged under it too and written recording it")
    return prev, engine, rule_lines


@main.command()
@deployment_arguments
@click.option("--method", "-m", type=click.Choice(sorted(METHODS)), default=DEFAULT_METHOD, show_default=True,
              help="Planning method.")
@click.option("--previous", type=click.Path(path_type=Path), default=None,
              help="The placement now deployed (any placement format): plan close to it and count the moves.")
@click.option("--previous-format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of --previous (default: detected).")
@click.option("--lost-gpus", default=None,
              help="With --previous: its GPUs that are gone, comma-separated (e.g. 5,6). They keep their index with "
                   "no slots; the survivors keep their slots and weights. Re-plans across the change.")
@click.option("--gpu-map", default=None,
              help="With --previous on other GPUs: the new index of each of its GPUs, comma-separated, -1 for a GPU "
                   "that is gone (vLLM's rank_mapping); default by index (with --gpus above its count: growth).")
@click.option("--slots-per-gpu", type=click.IntRange(min=1), default=None,
              help="With --previous: slots on every GPU after the change (default: as before).")
@click.option("--rebalance", is_flag=True,
              help="Across a deployment change from a series: re-plan hedged over its windows (the rebalance) "
                   "instead of the recovery on their sum (the default); the summary shows both.")
@click.option("--transfer", type=click.Path(path_type=Path), default=None,
              help="Across a deployment change: write the transfer plan here as JSON, every copy in its order "
                   "with its source (kind, slot, GPU), destination and bytes.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=None,
              help="With --previous: accept a max GPU load up to (1 + tolerance) x planning from scratch, "
                   "to keep more experts in place (default: eplb.plan's).")
@click.option("--max-moves", type=click.IntRange(min=0), default=None,
              help="With --previous: at most this many slots change per layer.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Wall-clock seconds per layer, for methods that take a limit (exact).")
@click.option("--deterministic-time", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A reproducible work budget per layer (OR-Tools deterministic seconds) for exact: the same "
                   "plan on every machine.")
@click.option("--max-off-node", type=click.FloatRange(min=0, max=1), default=None,
              help="With groups on nodes: let hot experts' replicas sit off their group's home node for at most "
                   "this fraction of each layer's tokens (0 = hierarchical, 1 = the whole cluster); the plan "
                   "then carries shares, which eplb JSON keeps.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="How the windows of a series COUNTS [T, L, E] combine (eplb.planning.objectives). Default: the plan is "
                   "hedged over the windows (expected_peak_search under an even split, as eplb.plan does with a "
                   "series); 'sum' plans on the summed counts.")
@click.option("--window", "passes_per_window", type=click.IntRange(min=1), default=None,
              help="Cut the recording into windows of this many consecutive passes or iterations (an SGLang "
                   "per-pass dump, TensorRT-LLM iterations) before planning from its windows.")
@click.option("--no-held-out", is_flag=True,
              help="Skip the held-out estimate (leave one window out) printed for a series.")
@click.option("--dispatch", type=click.Choice(SCORING), default="uniform", show_default=True,
              help="How the engine splits an expert's tokens among its replicas; optimal: plan for an engine "
                   "that splits every batch optimally (eplb.dispatch), from the series' windows.")
@click.option("--engine", type=click.Choice(ENGINE_RULES), default=None,
              help="Plan for this engine's dispatch rule and judge the plan under it (sglang-static, "
                   "sglang-dynamic: made for SGLang's replica choice; vllm, tensorrt-llm: an even split).")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default=None,
              help="Plan from the passes of this phase only (a pool serving one phase); needs COUNTS that record "
                   "each pass's phase (SGLang's per_token dump).")
@click.option("--format", "-f", "output_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Output format (default: from the name of -o: .json eplb, .npz, .yaml trtllm, and SGLang's "
                   "for a .json named like init_expert_location.json; other SGLang names need --format sglang).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Where to write the placement.")
@click.option("--layer-updates-per-iter", type=click.IntRange(min=0), default=0, show_default=True,
              help="TensorRT-LLM YAML only (an error with another output format): layers the engine may "
                   "re-balance per iteration (0 = static).")
@click.option("--num-layers", type=click.IntRange(min=1), default=None,
              help="SGLang and TensorRT-LLM output: the model's layer count (num_hidden_layers, dense layers "
                   "included: 61 for DeepSeek-V3). Rows are placed by the counts' layer ids; SGLang's map has a "
                   "row per model layer (default: --model's, else the largest layer id + 1), the layers the counts "
                   "leave out holding SGLang's trivial placement. Counts that do not record their layers (a .npy) "
                   "with fewer rows need --layer-ids or --model.")
@click.option("--layer-ids", default=None,
              help="The model layer of each row of COUNTS, as ranges (3..60 for DeepSeek-V3's MoE layers), when "
                   "the file does not record them (a .npy, a CSV matrix): an engine's file places rows by model "
                   "layer, and --previous is matched by it.")
@click.option("--expert-bytes", type=click.IntRange(min=1), default=None,
              help="With --previous: bytes of one expert's weights in one layer; prints the bytes the moves copy "
                   "and how long the copies take (--hardware).")
@click.option("--model", "model_preset", type=NamedChoice(sorted(COST_MODELS)), default=None,
              help="The model the counts come from (eplb.model.cost.MODELS). Its layers name rows the file does "
                   "not (deepseek-v3: 58 rows are its MoE layers 3..60, 61 rows all its layers) and give "
                   "--num-layers; with --previous, its expert size prices the moves as --expert-bytes does.")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="With --expert-bytes or --model and --previous: the GPUs whose NVLink and network price the "
                   "copies (any case).")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def plan(counts, slots, gpus, nodes, groups, method, previous, previous_format, tolerance, max_moves, time_limit,
         deterministic_time, max_off_node, input_format, objective, passes_per_window, no_held_out, dispatch, engine,
         phase, output_format, output, layer_updates_per_iter, num_layers, layer_ids, expert_bytes, model_preset,
         hardware, transpose, allow_shape, quiet, **across):
    """Plan a placement from recorded expert COUNTS and write it for your engine.

    COUNTS is a file or a TensorRT-LLM statistics folder. A series [T, L, E] is planned hedged over
    its windows as eplb.plan does (--objective sum: from their sum; --window N first cuts a
    recording into windows of N passes). Prints balancedness (mean / max GPU load, 1.0 is perfect)
    in sample, without rebalancing and with the plan (means over the MoE layers), for a series a
    held-out estimate (each window served by the plan made from the others) of this plan and the
    summed plan, the gap to the proven lower bound and which bound, what the hierarchy costs, with
    --previous the deployed plan's balancedness and the moves, and the time taken.

    --phase prefill|decode plans a pool that serves one phase from the passes of that phase (and
    prints how many of the file's passes it kept); COUNTS must record each pass's phase.
    --engine NAME plans for that engine's dispatch rule (from the windows) and prints the plan's
    balancedness under it.

    -o must not name an input file; an existing output file is replaced (a note says so on
    stderr). SGLang output also writes <name>.eplb.json beside it with the configuration.

    \b
    Example:
      eplb plan expert_distribution_recorder.pt --slots 288 --gpus 32 --nodes 4 --groups 8 \\
          --format sglang -o init_expert_location.json
    """
    from ..analysis import metrics
    from ..io.formats import write_placement

    command_start = time.perf_counter()
    params = click.get_current_context().params
    if _plans_across_change(params):
        return _plan_across_change(params, command_start)
    _refuse_change_only_flags(across)
    migration, options = _plan_options(method, previous, tolerance, max_moves, time_limit, deterministic_time,
                                       engine=engine, dispatch=dispatch, objective=objective,
                                       max_off_node=max_off_node, expert_bytes=expert_bytes,
                                       model_preset=model_preset, groups=groups, nodes=nodes)
    output_format = _plan_output_format(output, output_format, num_layers, quiet)
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups, **{"num-layers": num_layers})
    _check_outputs([output], output_format, layer_updates_per_iter, [*_counts_paths(counts), previous])
    start = time.perf_counter()
    data = _read_plan_counts(counts, input_format, transpose, allow_shape, phase, passes_per_window)
    data, model_layers = _model_layers(data, layer_ids, model_preset, num_layers, output_format)
    _check_experts_fit(data, slots)
    weights = data.weights
    prev, engine, rule_lines = _deployed_plan(previous, previous_format, data, engine, slots=slots, gpus=gpus,
                                              nodes=nodes)

    with warnings.catch_warnings(record=True) as caught:  # said in one line each below, not raw
        warnings.simplefilter("always", RuntimeWarning)
        placement, used_previous = plan_with_progress(
            data.counts, num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups, method=method,
            previous=None if prev is None else prev.placement, migration=migration, progress=show_progress(quiet),
            **options)
    elapsed = time.perf_counter() - start
    _note_global_groups(groups, nodes, quiet)  # once the plan is made: never before a real error
    _note_plan_warnings(caught, quiet)
    if engine is not None and placement.dispatch != engine:  # written recording the rule it is judged and served under
        rule_lines = rule_lines + _planned_for_line(engine, placement.dispatch)
        placement = dataclasses.replace(placement, dispatch=engine)
    deployment = dict(num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups,
                      previous=None if prev is None else prev.placement)
    held = None if data.num_windows == 1 or no_held_out else _held_out_estimates(
        data.counts, method, options, deployment, judge=engine if rule_lines else None)

    judge = engine or "shares"  # every figure splits an expert's tokens as the engine does (else as the plan does)
    before = metrics.balancedness(metrics.static_gpu_loads(weights, gpus))  # one replica each: the same under any rule
    after = placement.balancedness(weights, judge)
    moves = None if prev is None else metrics.moves(prev.placement.phy2log, placement.phy2log, placement.topology)
    bound = _plan_bound(placement, weights, engine, max_off_node)
    gap = metrics.gap(placement.gpu_loads(weights, judge).max(axis=-1), bound.values)
    global_bal = _global_balancedness(weights, method, engine, slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    deployed_bal = None if prev is None else prev.placement.balancedness(weights, judge)
    configuration, diagnostics = _plan_records(
        slots=slots, gpus=gpus, nodes=nodes, groups=groups, method=method, options=options, counts=counts, data=data,
        phase=phase, previous=previous, used_previous=used_previous, migration=migration, before=before, after=after,
        gap=gap, bound=bound, placement=placement, weights=weights, global_bal=global_bal, deployed_bal=deployed_bal,
        elapsed=elapsed, held=held, moves=moves, judge=engine if rule_lines else None)
    # the split behind every balancedness and gap: an engine's rule, the plan's shares, or an even split
    diagnostics["judged_under"] = judge if judge != "shares" or placement.shares is not None else "uniform"
    _note_overwrite(output, quiet)
    write_placement(placement, output, output_format, layer_ids=data.layer_ids, configuration=configuration,
                    diagnostics=diagnostics, layer_updates_per_iter=layer_updates_per_iter, num_layers=model_layers)
    if quiet:
        return
    click.echo("\n".join(_plan_summary(
        data=data, phase=phase, method=method, slots=slots, gpus=gpus, nodes=nodes, groups=groups, before=before,
        after=after, placement=placement, weights=weights, options=options, engine=engine, gap=gap,
        detail=dict(objective=objective, held=held, global_bal=global_bal, deployed_bal=deployed_bal,
                    max_off_node=max_off_node, output_format=output_format, bound=bound, moves=moves,
                    used_previous=used_previous, prev=prev, expert_bytes=expert_bytes, model_preset=model_preset,
                    hardware=hardware, diagnostics=diagnostics, migration=migration),
        elapsed=elapsed, command_start=command_start, output=output, model_layers=model_layers,
        rule_lines=rule_lines)))

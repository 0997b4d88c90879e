"""``eplb simulate``: replay per-step counts through a deployment, rebalancing policies and
deployment changes.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import click

import eplb

from ..model.cost import HARDWARE as COST_HARDWARE, MODELS as COST_MODELS
from ..planning.methods import METHODS
from ..engines import SCORING
from ..io.progress import Progress, offset
from ..io.formats import COUNTS_FORMATS
from .group import main
from .shared import (
    ChangeRefused, Failure, NamedChoice, allow_shape_option, _check_experts_fit, _check_flag_sizes, _counts_paths,
    deployment_arguments, friendly_errors, _note_global_groups, quiet_option, _read_counts, _refuse_input_as_output,
    _require_deployment_flags, transpose_option,
)
from .wording import _seconds_text


DEFAULT_SIMULATE_POLICIES = ("none", "vllm", "sglang", "balancer")


def _load_function(spec: str):
    """``module:attribute`` -> the object (a user's own planning function)."""
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise click.BadParameter(f"expected MODULE:FUNCTION, got {spec!r}", param_hint="--rebalance-fn")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise Failure(f"--rebalance-fn {spec}: {exc}") from None


def _simulation_policy(name: str, method, check_every: int):
    """``--policy NAME``: a name of the one registry (:func:`eplb.serving.policy.policy_by_name`)."""
    from ..serving.policy import policy_by_name

    try:
        return policy_by_name(name, method, check_every)
    except ValueError as exc:
        raise click.BadParameter(f"{name!r}: {exc}", param_hint="--policy") from None


@main.command()
@deployment_arguments
@click.option("--policy", "-p", "policies", multiple=True,
              help="Rebalancing policy, repeatable: none, vllm (every 3000 steps from 1000), sglang (every 1000), "
                   "vllm-hedged / sglang-hedged (the same timers, each window planned hedged over 10 "
                   "sub-windows with eplb's default method), balancer (eplb.Balancer), every:N[/W] (every N "
                   "steps from the last W). Default: none, vllm, sglang, balancer.")
@click.option("--method", "-m", type=click.Choice(sorted(METHODS)), default="greedy", show_default=True,
              help="Planning method of the fixed-interval policies (from scratch).")
@click.option("--rebalance-fn", default=None,
              help="MODULE:FUNCTION with the published rebalance_experts(weight, num_replicas, num_groups, "
                   "num_nodes, num_gpus) signature, used by the fixed-interval policies instead of --method.")
@click.option("--check-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between the Balancer's decisions.")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The GPUs of the cost model (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="Expert size and format for the cost model.")
@click.option("--regime", type=click.Choice(["roofline", "compute", "memory"]), default="roofline", show_default=True,
              help="Layer time: max of compute and weight reads, or one of them.")
@click.option("--copy-mode", type=click.Choice(["stall", "overlap", "free"]), default="stall", show_default=True,
              help="Weight copies stall serving, run beside it, or cost nothing.")
@click.option("--layers-per-step", type=click.IntRange(min=1), default=None,
              help="Apply a rebalance this many layers per step, in layer order (default: all layers at once).")
@click.option("--dispatch", type=click.Choice(SCORING), default="uniform", show_default=True)
@click.option("--fail-gpu", multiple=True, metavar="GPUS@STEP[:SLOTS]",
              help="After step STEP these GPUs (comma-separated, e.g. 5 or 5,6) are lost; :SLOTS gives the survivors "
                   "that many slots each. Repeatable, as the three below.")
@click.option("--fail-node", multiple=True, metavar="NODE@STEP[:SLOTS]", help="After step STEP every GPU of NODE is lost.")
@click.option("--add-nodes", multiple=True, metavar="N@STEP[:SLOTS]",
              help="After step STEP, N nodes of empty GPUs join (as many GPUs as a node has, with the GPUs' slots).")
@click.option("--remove-nodes", multiple=True, metavar="N@STEP[:SLOTS]",
              help="After step STEP the last N nodes leave.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True,
              help="Folder for simulate.csv, steps.csv, the PNG figures and index.html.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def simulate(counts, slots, gpus, nodes, groups, policies, method, rebalance_fn, check_every, hardware, model, regime,
             copy_mode, layers_per_step, dispatch, input_format, output, transpose, allow_shape, quiet, **changes):
    """Replay recorded per-step COUNTS [T, L, E] through a deployment and rebalancing policies.

    Every policy starts from the greedy plan of the first step. Prints, per policy, the MoE time
    lost to imbalance (as a share of the perfectly balanced time; with the copies' stalls), the
    longest single stall, rebalances and expert-weight copies, and writes a table, per-step CSV,
    PNG figures and an HTML page into -o. --fail-gpu, --fail-node, --add-nodes and --remove-nodes
    change the deployment mid-series: each policy answers (default policies then: donor-repair,
    from-scratch, replan) and, per change, the recovery's copies, host loads, bytes and time and the
    token imbalance before, during (served by the answer) and after it are printed (events.csv).

    \b
    Example:
      eplb simulate steps.npz --slots 288 --gpus 32 --nodes 4 --groups 8 -p vllm -p balancer -o sim/
      eplb simulate steps.npz --slots 288 --gpus 32 --nodes 4 --fail-gpu 5@2000 --add-nodes 1@3000 -o sim/
    """
    from ..model.cost import CostModel
    from ..serving.policy import PolicyError
    from ..simulation.simulate import simulate as run_simulation
    from ..io.simulation_report import write_simulation_report

    _require_deployment_flags(slots, gpus)
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    _refuse_input_as_output(output, _counts_paths(counts))
    data = _read_counts(counts, input_format, transpose, allow_shape)
    _check_experts_fit(data, slots)
    events = _simulation_events(changes, data.counts.shape, eplb.Deployment.of(
        data.counts.shape[-1], num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups, dispatch=dispatch))
    plan_with = _load_function(rebalance_fn) if rebalance_fn else method
    cost = CostModel.preset(hardware, model, regime=regime, copy_mode=copy_mode)
    results = []
    names = policies or (CHANGE_SIMULATE_POLICIES if events else DEFAULT_SIMULATE_POLICIES)
    num_steps = data.counts.shape[0]
    caught = []
    with Progress("simulate", quiet=quiet) as progress:  # every policy's steps, one after the other
        for index, name in enumerate(names):
            policy = _simulation_policy(name, plan_with, check_every)
            part = offset(progress, index * num_steps, len(names) * num_steps, f"policy {name}")
            try:
                with warnings.catch_warnings(record=True) as raised:
                    warnings.simplefilter("always", RuntimeWarning)
                    deployment = eplb.Deployment.of(data.counts.shape[-1], num_slots=slots, num_gpus=gpus,
                                                    num_nodes=nodes, num_groups=groups, dispatch=dispatch)
                    results.append(run_simulation(data.counts, deployment, policy=policy, cost_model=cost,
                                                  layers_per_step=layers_per_step, progress=part,
                                                  events=events))
            except PolicyError as exc:  # the user's planning function: its error, not the configuration's
                raise Failure(str(exc)) from None
            caught += raised
    for message in dict.fromkeys(_simulation_note(str(w.message), bool(events)) for w in caught):
        if not quiet:  # after the progress bar is gone
            click.echo(f"note: {message}", err=True)
    _note_global_groups(groups, nodes, quiet)  # once the runs are done: never before a real error
    written = write_simulation_report(results, output, title=f"eplb simulate {data.path.name}")
    if written.get("missing"):
        click.echo(f"note: {written['missing']}", err=True)
    if quiet:
        return
    lines = [f"counts   {data.path} ({data.format}): {data.counts.shape[0]} steps x {data.counts.shape[1]} layers"
             f" x {data.counts.shape[2]} experts; cost model {cost.name}, {regime}, copies {copy_mode}"
             + (f", applied {layers_per_step} layer(s) per step" if layers_per_step else "")]
    lines += [_policy_line(r) for r in results]
    lines += _event_lines(results)
    lines.append(f"wrote    {written['html']}")
    click.echo("\n".join(lines))


CHANGE_SIMULATE_POLICIES = ("donor-repair", "from-scratch", "replan")
"""``eplb simulate``'s policies when the deployment changes and no ``--policy`` is given: the
engines' answers to a change and eplb's, none rebalancing between changes."""


def _simulation_events(changes: dict, shape: tuple, deployment) -> list:
    """``eplb simulate``'s change flags (``changes``: flag name -> its values) as
    :class:`eplb.simulation.events.Event` values in step order, each built on the deployment the one
    before left; a flag that cannot be done is :class:`ChangeRefused` (exit 2) naming it."""
    from ..simulation.events import Event, TooFewSlots, parse_event

    parsed = []
    for name, texts in changes.items():
        kind = name.replace("_", "-")
        for text in texts:
            try:
                step, resize = parse_event(kind, text)
            except ValueError as exc:
                raise ChangeRefused(f"--{kind}: {exc}") from None
            if step >= shape[0] - 1:
                raise ChangeRefused(f"--{kind} {text}: the series has {shape[0]} steps; a change comes after a step "
                                    f"below {shape[0] - 1}, so that a step is served after it")
            parsed.append((step, kind, text, resize))
    events, current = [], deployment
    for step, kind, text, resize in sorted(parsed, key=lambda item: item[0]):
        if events and events[-1].step == step:
            raise ChangeRefused(f"--{kind} {text}: another change comes after step {step} too; make them one "
                                "(--fail-gpu 5,6@STEP loses two GPUs at once)")
        _check_event_sizes(kind, text, resize, current)
        try:
            change = resize(current, deployment.num_groups)
        except TooFewSlots as exc:
            raise ChangeRefused(f"--{kind} {text}: {exc} (--{kind} {text.split(':')[0]}:{exc.slots_per_gpu})") from None
        except ValueError as exc:
            raise ChangeRefused(f"--{kind} {text}: {exc}") from None
        _refuse_nothing_removed(kind, text, current, change)
        events.append(Event(step, change, resize.label))
        current = change.new
    return events


def _refuse_nothing_removed(kind: str, text: str, current, change) -> None:
    """``--remove-nodes`` of nodes whose GPUs are all lost already removes nothing that serves: refused
    (:class:`ChangeRefused`), saying which nodes are gone, rather than charged as a change."""
    if kind != "remove-nodes":
        return
    removed = current.topology.slots_per_gpu[change.new.num_gpus:]
    if removed.size and not removed.any():
        raise ChangeRefused(f"--remove-nodes {text}: the last nodes' GPUs ({change.new.num_gpus} .. "
                            f"{current.num_gpus - 1}) are already lost (no slots): nothing that serves is removed")


def _check_event_sizes(kind: str, text: str, resize, current) -> None:
    """The GPUs and slots a change flag leads to (from ``current``, the deployment before it) within
    the limits, before the change is built (:class:`ChangeRefused`, exit 2; issue 47 item 16)."""
    from ..io.formats.limits import check_size

    gpus = current.num_gpus + (int(resize.value) * current.topology.gpus_per_node if kind == "add-nodes" else 0)
    try:
        check_size(gpus, "gpus", f"GPUs after --{kind} {text}")
        if resize.slots_per_gpu is not None:
            check_size(int(resize.slots_per_gpu) * gpus, "slots", f"slots after --{kind} {text}")
    except ValueError as exc:
        raise ChangeRefused(f"--{kind}: {exc}") from None


def _simulation_note(message: str, with_events: bool) -> str:
    """A warning of the runs as the note says it: with deployment changes a policy whose timer
    never fires still answers every change (issue 47 item 9), so it is not "the same as no
    rebalancing"."""
    if with_events and "never acts" in message:
        head = message.split(": it never acts")[0]
        return f"{head}: its timer never fires in this series, so it rebalances only in answer to the deployment changes"
    return message


def _policy_line(result) -> str:
    """A policy's line of ``eplb simulate``: the MoE time lost to imbalance (a share of the balanced
    time) and the MoE time per step itself, the stalls, the rebalances and the answers to deployment
    changes, the copies counted as the per-change lines count them (between GPUs, from host, local)."""
    s = result.summary()
    steps = max(int(s["steps"]), 1)
    answers = len(result.events)
    return (f"{s['policy']:<40} lost {100 * s['lost_share']:6.2f}%  with stalls {100 * s['lost_with_stalls_share']:6.2f}%"
            f"  step {1e3 * s['moe_time_s'] / steps:.4g} ms MoE (balanced {1e3 * s['balanced_time_s'] / steps:.4g} ms)"
            f"  max stall {s['max_stall_s']:.3g} s  rebalances {s['rebalances']:4d}"
            + (f" + {answers} answer{'s' if answers != 1 else ''} to changes" if answers else "")
            + f"  copies {s['copies']:,} between GPUs, {s['host_loads']:,} from host, {s['local_moves']:,} local"
            f"  host per step {s['host_ms_mean']:.3f} ms mean, {s['host_ms_p99']:.3f} p99, {s['host_ms_max']:.1f} max")


def _event_lines(results) -> list[str]:
    """Per deployment change, a line saying what changed, then one per policy: the recovery's copies
    by source, bytes and time, and the token imbalance before, during and after it."""
    lines = []
    if results and results[0].events:
        lines.append("imbalance (max - mean) / mean GPU load over the GPUs that serve, mean over MoE layers: 0 is "
                     "perfect, higher is worse (balancedness, mean / max, is 1 / (1 + imbalance))")
    for k, first in enumerate(results[0].events if results else ()):
        lines.append(f"change   after step {first['step']}: {first['label']}: {first['change'].split('; ')[-1]}")
        for r in results:
            e = r.events[k]
            c = e["copies"]
            lines.append(f"  {r.policy[:38]:<38} {c['total']:,} copies ({c['from_host']:,} from host, {c['intra_node']:,} "
                         f"NVLink, {c['cross_node']:,} across nodes, {c['intra_gpu']:,} local), "
                         f"{e['bytes']['total'] / 2**30:.3g} GiB, recovery {_seconds_text(e['recovery_s'])}; imbalance "
                         f"{e['imbalance_before']:.3f} before, {e['imbalance_during']:.3f} during, "
                         f"{e['imbalance_after']:.3f} after")
    return lines

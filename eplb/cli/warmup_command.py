"""``eplb warmup``: compile the kernels a configuration will use.
"""

from __future__ import annotations

import click

import eplb

from ..planning.methods import METHODS
from .group import main
from .shared import _check_flag_sizes, friendly_errors, quiet_option


@main.command()
@click.option("--experts", "-e", type=click.IntRange(min=1), required=True, help="Logical experts per layer (E).")
@click.option("--slots", "-s", type=click.IntRange(min=1), required=True, help="Physical expert slots in all (S >= E).")
@click.option("--gpus", "-g", type=click.IntRange(min=1), required=True, help="GPUs (ranks); S must divide by it.")
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes; GPUs must divide by it.")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help="Expert groups. Default: none.")
@click.option("--method", "-m", "methods", multiple=True, type=click.Choice(sorted(METHODS)),
              help="Method the engine will plan with (repeatable); default: the default method and greedy.")
@click.option("--no-balancer", is_flag=True, help="Skip the online Balancer's record/decide/rebalance cycle.")
@quiet_option
@friendly_errors
def warmup(experts, slots, gpus, nodes, groups, methods, no_balancer, quiet):
    """Compile every kernel this configuration will use, so serving never waits on a compile.

    Run it once while building the container (or starting the server) with the configuration the
    engine serves: Numba caches the compiled code on disk and later processes load it in a
    fraction of a second. Prints each step and its time (seconds when it compiled, milliseconds
    when it loaded from the cache).

    \b
    Example:
      eplb warmup --experts 256 --slots 288 --gpus 32 --nodes 4 --groups 8
    """
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    from ..io.formats.limits import check_size

    try:
        check_size(experts, "experts", "--experts")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--experts") from None
    deployment = eplb.Deployment.of(experts, num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    result = eplb.warmup(deployment, methods=list(methods) or None, balancer=not no_balancer)
    if quiet:
        return
    lines = [f"warmup   {experts} experts -> {slots} slots on {gpus} GPUs in {nodes} node{'s' if nodes > 1 else ''}"
             + (f", {groups} groups" if groups else "") + f"; methods {', '.join(result['methods'])}"]
    for name, seconds in result["steps"].items():
        lines.append(f"  {name:<28}" + (f"{seconds:8.2f} s" if seconds >= 1 else f"{1e3 * seconds:7.0f} ms"))
    lines.append(f"time     {result['time_s']:.2f} s (compiled code is cached on disk for later processes)")
    click.echo("\n".join(lines))

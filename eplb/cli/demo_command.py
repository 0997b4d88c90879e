"""``eplb demo``: the built-in DeepSeek-V3-sized example.
"""

from __future__ import annotations

import click

from ..planning.methods import METHODS
from .group import main


@main.command()
@click.option("--method", "methods", multiple=True, help="Method to run (repeatable); default: greedy and the default method.")
def demo(methods):
    """Plan the built-in DeepSeek-V3-sized example and compare with no rebalancing."""
    from ..demo import format_demo, run_demo
    from ..planning.methods import METHODS

    for method in methods:
        if method not in METHODS:
            raise click.BadParameter(f"must be one of {sorted(METHODS)}, got {method!r}", param_hint="--method")
    click.echo(format_demo(run_demo(tuple(methods) or None)))

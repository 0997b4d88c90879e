"""The ``eplb`` command line."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="eplb")
def main():
    """Expert-parallel load balancing for Mixture-of-Experts serving."""


@main.command()
@click.option("--method", "methods", multiple=True, help="Method to run (repeatable); default: greedy and the default method.")
def demo(methods):
    """Plan the built-in DeepSeek-V3-sized example and compare with no rebalancing."""
    from .demo import format_demo, run_demo
    from .methods import METHODS

    for method in methods:
        if method not in METHODS:
            raise click.BadParameter(f"must be one of {sorted(METHODS)}, got {method!r}", param_hint="--method")
    click.echo(format_demo(run_demo(tuple(methods) or None)))

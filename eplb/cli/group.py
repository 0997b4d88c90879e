"""The ``eplb`` command group; each command is a module of this package that adds itself to it.
"""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="eplb")
def main():
    """Expert-parallel load balancing for Mixture-of-Experts serving.

    Plan replicated expert placements from the expert counts your engine recorded, write them in
    the format your engine loads, and see what you got.

    \b
    Counts in:   .npy/.npz ([L, E] or [T, L, E]), .csv, JSON {"logical_count": ...},
                 SGLang expert-distribution dumps (.pt), TensorRT-LLM statistics folders.
    Plans out:   eplb JSON, .npz, SGLang --init-expert-location JSON, TensorRT-LLM YAML.

    Exit codes: 0 success, 1 failure (bad file, bad data, incompatible configuration),
    2 usage error.
    """

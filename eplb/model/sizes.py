"""Size limits every entry point checks before it allocates anything for a deployment or a file.

A small number can imply a huge array: ``DeploymentChange.lose(old, [5], slots_per_gpu=10**12)``
would build a slot table of 31 trillion entries; an expert id of 20,000,000 in a 37-byte CSV means
20 million experts. Every size is checked against these limits first (a ``ValueError`` naming the
size, the limit and the variable that raises it); they are far above any real deployment and can
be raised with an environment variable:

=====================  ============  ======================================================
variable               default       what it bounds
=====================  ============  ======================================================
``EPLB_MAX_EXPERTS``   65,536        logical experts per layer (an expert id is < this)
``EPLB_MAX_SLOTS``     1,048,576     physical slots per layer (and slots of one GPU)
``EPLB_MAX_GPUS``      4,096         GPUs of a deployment (and nodes)
``EPLB_MAX_LAYERS``    4,096         layers (a layer id in a file is < 2^31 whatever the limit)
``EPLB_MAX_WINDOWS``   1,048,576     recording windows of a series
``EPLB_MAX_CELLS``     134,217,728   numbers in one counts array (windows x layers x experts)
``EPLB_MAX_YAML_NODES`` 1,048,576    YAML nodes after alias expansion, beyond those written out
=====================  ============  ======================================================

The model layer checks experts, slots and GPUs (:class:`eplb.Topology`, :class:`eplb.Deployment`,
:class:`eplb.DeploymentChange` and the simulator's changes build on them); the file readers
(:mod:`eplb.io.formats.limits`) the rest.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "experts": 1 << 16,
    "slots": 1 << 20,
    "gpus": 1 << 12,
    "layers": 1 << 12,
    "windows": 1 << 20,
    "cells": 1 << 27,
    "yaml_nodes": 1 << 20,
}


def limit(name: str) -> int:
    """The limit ``name`` (a key of :data:`DEFAULTS`), from ``EPLB_MAX_<NAME>`` when set."""
    variable = f"EPLB_MAX_{name.upper()}"
    text = os.environ.get(variable)
    if text is None:
        return DEFAULTS[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{variable} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{variable} must be a positive integer, got {text!r}")
    return value


def check_limit(value, name: str, what: str) -> None:
    """``ValueError`` when ``value`` (an integer) exceeds the limit ``name``, naming ``what``, the
    limit and the variable that raises it."""
    bound = limit(name)
    if int(value) > bound:
        raise ValueError(f"{what} is {int(value):,}, above the limit of {bound:,} "
                         f"(set EPLB_MAX_{name.upper()} to allow more)")


__all__ = ["DEFAULTS", "limit", "check_limit"]

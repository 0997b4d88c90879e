"""Size limits checked before anything is allocated for a file or a command line (the table and
:func:`limit` live in :mod:`eplb.model.sizes`, which the deployment itself checks too).

A tiny file can imply a huge array (an expert id of 20,000,000 in a 37-byte CSV means 20 million
experts). Every size a file or a flag implies is checked against these limits first; they are far
above any real deployment and can be raised with an environment variable:

=====================  ============  ======================================================
variable               default       what it bounds
=====================  ============  ======================================================
``EPLB_MAX_EXPERTS``   65,536        logical experts per layer (an expert id is < this)
``EPLB_MAX_SLOTS``     1,048,576     physical slots per layer
``EPLB_MAX_GPUS``      4,096         GPUs (and nodes) of a deployment (``--gpus``, ``--nodes``)
``EPLB_MAX_LAYERS``    4,096         layers (a layer id in a file is < 2^31 whatever the limit)
``EPLB_MAX_WINDOWS``   1,048,576     recording windows of a series
``EPLB_MAX_CELLS``     134,217,728   numbers in one counts array (windows x layers x experts)
``EPLB_MAX_YAML_NODES`` 1,048,576    YAML nodes after alias expansion, beyond those written out
=====================  ============  ======================================================
"""

from __future__ import annotations


from ...model.sizes import DEFAULTS, limit  # noqa: F401  (the one table of limits)
from .errors import FormatError

#: largest id (layer, window, iteration) accepted in a file: ids are kept as int64 but must stay
#: far from its overflow
MAX_ID = (1 << 31) - 1


def check_size(value, name: str, what: str, path=None) -> None:
    """Raise when ``value`` (a Python or numpy integer) exceeds the limit ``name``.

    Raises:
        FormatError: naming ``path`` (when given), ``what`` and how to raise the limit; a plain
            ``ValueError`` (a :class:`FormatError` without a path) for command-line values.
    """
    bound = limit(name)
    if int(value) > bound:
        raise FormatError(path, f"{what} is {int(value):,}, above the limit of {bound:,} "
                                f"(set EPLB_MAX_{name.upper()} to allow more)")


def check_counts_shape(shape, path=None) -> None:
    """Check a counts shape ``[E]``, ``[L, E]`` or ``[T, L, E]`` against the limits before it is allocated."""
    shape = tuple(int(n) for n in shape)
    names = {1: ("experts",), 2: ("layers", "experts"), 3: ("windows", "layers", "experts")}.get(len(shape))
    if names is None:
        return
    for n, name in zip(shape, names):
        check_size(n, name, f"the number of {name}", path)
    cells = 1
    for n in shape:
        cells *= n
    check_size(cells, "cells", f"the counts array ({' x '.join(map(str, shape))} numbers)", path)

"""Counts from several files: a glob that matches several dumps (``eplb plan dump_*.pt``) or a
folder of dumps, read as one series whose windows are the files' windows, in name order.

Each file is read as :func:`eplb.io.formats.read_counts` reads it (``[L, E]`` is one window,
``[T, L, E]`` its ``T`` windows); all must hold the same layers (the same model layer ids) and
experts. A folder that is itself a counts format (a TensorRT-LLM statistics folder) is read as
that format, not as several files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .data import CountsFile
from .errors import FormatError
from .limits import check_size


def counts_files(paths, suffixes) -> list[Path]:
    """The files ``paths`` name: each path itself, a folder holding no recognised format expanded to
    its files whose suffix is one of ``suffixes`` (sorted by name). ``FormatError`` for an empty
    folder or one with no counts file."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
            if not inside:
                raise FormatError(path, f"a folder of counts must hold files named *{', *'.join(sorted(suffixes))}, "
                                        "or be a TensorRT-LLM statistics folder")
            found += inside
        else:
            found.append(path)
    return found


def join_counts(parts: list[CountsFile], path: Path) -> CountsFile:
    """``parts`` (each a :class:`CountsFile`) as one series ``[sum T, L, E]`` in their order, named
    ``path`` (the folder, or the first file and how many more); ``FormatError`` naming the first
    file whose layers or experts differ from the first's."""
    first = parts[0]
    for part in parts[1:]:
        if part.counts.shape[1:] != first.counts.shape[1:]:
            raise FormatError(part.path, f"holds {part.num_layers} layers x {part.num_experts} experts, but "
                                         f"{first.path} holds {first.num_layers} x {first.num_experts}: several count "
                                         "files must record the same layers and experts")
        if not np.array_equal(part.layer_ids, first.layer_ids):
            raise FormatError(part.path, f"records other model layers than {first.path}: several count files must "
                                         "record the same layers")
    check_size(sum(p.counts.shape[0] for p in parts), "windows", "windows of the count files together")
    counts = np.concatenate([p.counts for p in parts], axis=0)
    phases = (np.concatenate([p.phases for p in parts]) if all(p.phases is not None for p in parts) else None)
    formats = sorted({p.format for p in parts})
    metadata = {"files": [str(p.path) for p in parts], "windows_per_file": [int(p.counts.shape[0]) for p in parts]}
    return CountsFile(counts, first.layer_ids, "+".join(formats), path, metadata, phases,
                      layer_ids_recorded=all(p.layer_ids_recorded for p in parts))

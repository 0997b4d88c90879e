"""What a file format provides: :class:`Format`, which each format module declares for its own
formats (a module-level ``FORMATS`` tuple) and :data:`eplb.io.formats.FORMATS` collects.

The functions a format provides follow one protocol each (a format provides those it supports):

- ``read_counts(path) -> CountsFile``;
- ``read_placement(path, **hints) -> PlacementFile``, where ``hints`` are those of ``num_gpus``,
  ``num_nodes``, ``num_experts``, ``num_groups`` named in :attr:`Format.keywords` (a file that
  records the groups need not take ``num_groups``: the registry checks a given one against it);
- ``write_placement(placement, path, **options)``, where ``options`` are those of ``layer_ids``,
  ``configuration``, ``diagnostics``, ``layer_updates_per_iter``, ``num_layers`` named in
  :attr:`Format.keywords`. An engine's writer places each row at its model layer (``layer_ids``):
  SGLang's map has a row per layer of the model (``num_layers``), TensorRT-LLM's YAML is keyed by
  layer id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: the hints :func:`eplb.io.formats.read_placement` can pass a placement reader
READ_KEYWORDS = ("num_gpus", "num_nodes", "num_experts", "num_groups")
#: the options :func:`eplb.io.formats.write_placement` can pass a placement writer
WRITE_KEYWORDS = ("layer_ids", "configuration", "diagnostics", "layer_updates_per_iter", "num_layers")


@dataclass(frozen=True)
class Format:
    """One file format: its name, how its files are recognised, and what eplb reads and writes in it.

    Attributes:
        name: what ``format=`` and the CLI's ``--format`` / ``--input-format`` call it.
        title: how messages name it (``"TensorRT-LLM YAML"``).
        suffixes: file-name suffixes (lower case, with the dot) by which a file is detected as this
            format when read.
        output_suffixes: suffixes of an output name that choose this format when writing
            (``None``: the same as ``suffixes``).
        output_names: the names an engine gives this format's files (lower case, ``_`` for ``-``,
            without the suffix: ``"init_expert_location"``); an output name holding one (with one of
            :attr:`writes_to`) chooses this format over the suffix's default.
        folder: its counts are a folder, not a file (detected by :attr:`recognise`).
        read_counts, read_placement, write_placement: the functions it provides (see the module
            docstring for their protocols), ``None`` for those it does not.
        keywords: the hints and options (:data:`READ_KEYWORDS`, :data:`WRITE_KEYWORDS`) its
            placement reader and writer take; the others are not passed.
        parse: how to open a file to recognise it when several formats claim its suffix
            (``load_json``); ``None`` hands :attr:`recognise` the path itself.
        recognise: ``fn(parsed) -> bool``: whether the content (or folder) is in this format, for
            suffixes shared with another format and for folders; ``None`` takes any content.
        recognised_by: what :attr:`recognise` looks for, as error messages say it
            (``"'physical_to_logical_map' (SGLang)"``).
    """

    name: str
    title: str
    suffixes: tuple[str, ...] = ()
    output_suffixes: tuple[str, ...] | None = None
    output_names: tuple[str, ...] = ()
    folder: bool = False
    read_counts: Callable[..., Any] | None = None
    read_placement: Callable[..., Any] | None = None
    write_placement: Callable[..., None] | None = None
    keywords: tuple[str, ...] = ()
    parse: Callable[..., Any] | None = None
    recognise: Callable[[Any], bool] | None = None
    recognised_by: str = ""

    def __post_init__(self):
        unknown = sorted(set(self.keywords) - set(READ_KEYWORDS) - set(WRITE_KEYWORDS))
        if unknown:
            raise ValueError(f"format {self.name!r}: unknown keywords {unknown}")
        if any(s != s.lower() or not s.startswith(".") for s in (*self.suffixes, *(self.output_suffixes or ()))):
            raise ValueError(f"format {self.name!r}: suffixes must be lower case and start with a dot")

    @property
    def writes_to(self) -> tuple[str, ...]:
        """The suffixes of an output name that choose this format (:attr:`output_suffixes`)."""
        if self.write_placement is None:
            return ()
        return self.suffixes if self.output_suffixes is None else self.output_suffixes

    def named_by(self, path) -> bool:
        """Whether the output name ``path`` holds one of :attr:`output_names` and ends in one of
        :attr:`writes_to` (``decode-init-expert-location.json`` is SGLang's)."""
        name = Path(path).name.lower()
        suffix = next((s for s in self.writes_to if name.endswith(s)), None)
        if suffix is None:
            return False
        stem = name[: -len(suffix)].replace("-", "_")
        return any(known in stem for known in self.output_names)

    def taken(self, given: dict) -> dict:
        """The entries of ``given`` (hints or options) this format's functions take."""
        return {key: value for key, value in given.items() if key in self.keywords}

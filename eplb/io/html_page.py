"""What the HTML reports share (``eplb report``, ``eplb compare``, ``eplb simulate``): figures
embedded in the page, so that one file carries them."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Iterable, Mapping


def figure_blocks(figures: Iterable[Path], captions: Mapping[str, str], link: bool = False) -> str:
    """One ``<figure>`` per PNG file of ``figures``, the image embedded (base64), captioned by
    ``captions[file name]`` (else the file name); with ``link``, the caption also links the file."""
    blocks = []
    for path in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        caption = html.escape(captions.get(path.name, path.name))
        linked = f' (<a href="{html.escape(path.name)}">{html.escape(path.name)}</a>)' if link else ""
        blocks.append(f'<figure id="{path.stem}"><img src="data:image/png;base64,{data}" alt="{caption}">'
                      f"<figcaption>{caption}{linked}</figcaption></figure>")
    return "".join(blocks)

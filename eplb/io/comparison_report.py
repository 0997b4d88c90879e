"""What a comparison of methods writes: a terminal table, ``compare.csv``, ``run.json`` (versions,
seeds and configuration, enough to rerun it bit for bit), PNG figures and ``index.html``.

Figures (need matplotlib, ``pip install 'eplb[report]'``; without it they are left out with a note):

- ``layer_balance.png``: per workload and deployment, each method's in-sample balancedness per layer;
- ``layer_gap.png``: the same for the gap to the proven lower bound;
- ``time_quality.png``: warm plan time against held-out balancedness (in sample where no window
  is held out), one point per method and workload.
"""

from __future__ import annotations

import csv
import html
import json
import math
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Sequence

import numpy as np

from .._version import __version__
from ..simulation.comparison import OK, MethodResult
from .html_page import figure_blocks
from .formats.errors import MissingExtraError, require

COLUMNS = ("workload", "deployment", "method", "status", "balancedness", "worst_layer", "gap", "worst_gap", "bound",
           "held_out", "held_out_worst", "folds", "step_ms", "lost", "copies", "cross_node_copies", "slots_changed",
           "doubled", "groups_off_node", "first_call_s", "warm_call_s", "reason")
"""The CSV's columns, in order (see :mod:`eplb.simulation.comparison` for each figure)."""

_CAPTIONS = {
    "layer_balance.png": "In-sample balancedness (mean / max GPU load) per layer, even split.",
    "layer_gap.png": "Gap to eplb's proven lower bound per layer (max load / bound - 1): 0 is provably optimal.",
    "time_quality.png": "Warm plan time against held-out balancedness (in-sample where no window is held out).",
}


def versions() -> dict:
    """Python, the platform and the versions of the packages a comparison's figures depend on."""
    found = {"python": sys.version.split()[0], "platform": platform.platform(), "eplb": __version__}
    for name in ("numpy", "numba", "ortools", "torch", "matplotlib"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cell(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


#: the columns a person reads as percentages (the CSV keeps the fractions)
PERCENT_COLUMNS = ("gap", "worst_gap")


def _percent(fraction) -> str:
    """A fraction as the percentage ``eplb plan`` prints (``0.0046`` -> ``"0.46%"``), ``"-"`` when unknown."""
    if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)):
        return "-"
    return f"{100 * fraction:.2f}%"


def format_table(results: Sequence[MethodResult]) -> str:
    """The terminal table: one line a row, broken rows with their reason. The gap is a percentage
    (as ``eplb plan`` prints it); the deployment column is as wide as its longest entry."""
    wide = max([len("deployment"), *(len(r.deployment) for r in results)])
    header = (f"{'workload':<26} {'deployment':<{wide}} {'method':<28} {'balanced':>8} {'gap':>8} {'held out':>8} "
              f"{'step ms':>8} {'lost':>7} {'copies':>6} {'doubled':>7} {'off-node':>8} {'first s':>8} {'warm ms':>8}")
    lines = [header]
    for r in results:
        head = f"{r.workload[:26]:<26} {r.deployment:<{wide}} {r.method[-28:]:<28}"
        if r.status != OK:
            lines.append(f"{head} BROKEN: {r.reason}")
            continue
        f = r.figures
        warm = None if f["warm_call_s"] is None else 1e3 * f["warm_call_s"]
        lines.append(f"{head} {_cell(f['balancedness']):>8} {_percent(f['gap']):>8} {_cell(f['held_out']):>8} "
                     f"{_cell(f['step_ms'], 3):>8} {_cell(f['lost'], 4):>7} {_cell(f['copies']):>6} "
                     f"{_cell(f['doubled']):>7} {_cell(f['groups_off_node']):>8} {_cell(f['first_call_s'], 3):>8} "
                     f"{_cell(warm, 3):>8}")
    return "\n".join(lines)


def write_csv(results: Sequence[MethodResult], path) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow({key: r.row().get(key, "") for key in COLUMNS})
    return path


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    return value


def write_comparison_report(results: Sequence[MethodResult], out_dir, *, config: dict,
                            title: str = "eplb compare") -> dict:
    """Write ``compare.csv``, ``run.json``, the figures and ``index.html`` into ``out_dir``.

    Args:
        config: what the comparison was run with (methods, workloads, deployments, seeds, cost
            model, ...), recorded in ``run.json`` beside the versions and the rows.
    Returns:
        ``{"html", "csv", "record": path, "figures": [paths], "missing": text}`` (``missing`` says
        how to get the figures when matplotlib is absent, else ``""``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = write_csv(results, out_dir / "compare.csv")
    record = out_dir / "run.json"
    record.write_text(json.dumps(_jsonable({"config": config, "versions": versions(),
                                            "rows": [r.row() for r in results]}), indent=2) + "\n")
    try:
        matplotlib = require("matplotlib", "report", "eplb compare figures")
    except MissingExtraError as exc:
        figures, missing = [], str(exc)
    else:
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        figures = [_per_layer(plt, out_dir, results, "balancedness", "layer_balance.png"),
                   _per_layer(plt, out_dir, results, "gap", "layer_gap.png"),
                   _time_quality(plt, out_dir, results)]
        figures, missing = [f for f in figures if f is not None], ""
    page = out_dir / "index.html"
    page.write_text(_html(title, results, figures, config))
    return {"html": page, "csv": table, "record": record, "figures": figures, "missing": missing}


def _panels(results):
    keys = list(dict.fromkeys((r.workload, r.deployment) for r in results if r.status == OK))
    return keys, {key: [r for r in results if (r.workload, r.deployment) == key and r.status == OK] for key in keys}


def _per_layer(plt, out_dir: Path, results, figure: str, name: str) -> Path | None:
    keys, rows = _panels(results)
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.8 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        for r in rows[key]:
            values = r.per_layer[figure]
            ax.plot(np.arange(values.size), values, marker=".", lw=1, label=r.method[-30:])
        ax.set_title(f"{key[0]}, {key[1]}", fontsize=9)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel(figure)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return out_dir / name


def _time_quality(plt, out_dir: Path, results) -> Path | None:
    done = [r for r in results if r.status == OK and r.figures.get("warm_call_s") is not None]
    if not done:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r.method for r in done):
        mine = [r for r in done if r.method == method]
        quality = [r.figures["held_out"] if not math.isnan(r.figures["held_out"]) else r.figures["balancedness"]
                   for r in mine]
        ax.scatter([1e3 * r.figures["warm_call_s"] for r in mine], quality, label=method[-30:])
    ax.set_xscale("log")
    ax.set_xlabel("warm plan time (ms)")
    ax.set_ylabel("held-out balancedness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "time_quality.png", dpi=110)
    plt.close(fig)
    return out_dir / "time_quality.png"


def _html(title: str, results, figures, config: dict) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    shown = lambda r, c: _percent(r.row().get(c)) if c in PERCENT_COLUMNS else _cell(r.row().get(c))  # noqa: E731
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(shown(r, c))}</td>" for c in COLUMNS) + "</tr>"
                     for r in results)
    blocks = figure_blocks(figures, _CAPTIONS)
    rerun = html.escape(config.get("command", ""))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.85em; }}
th, td {{ text-align: left; padding: 0.25em 0.6em; border-bottom: 1px solid #ddd; }}
img {{ max-width: 100%; border: 1px solid #eee; }} figcaption {{ color: #555; font-size: 0.9em; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Every figure is computed from each plan's phy2log alike: balancedness = mean / max GPU load (mean over MoE
layers, even split); gap = max load / eplb's proven lower bound - 1 (in percent); held out = each block of
windows served by the plan made from the other windows' sum; step time from the cost model {html.escape(str(config.get("cost_model", "")))}.
Versions, seeds and the configuration are in run.json.</p>
{f"<p>Rerun: <code>{rerun}</code></p>" if rerun else ""}
<table id="rows"><tr>{head}</tr>
{body}
</table>
{blocks}
</body></html>
"""


__all__ = ["COLUMNS", "format_table", "versions", "write_comparison_report", "write_csv"]

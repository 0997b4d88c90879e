"""Run every benchmark section and collect the results: ``python bench/run.py [--quick]``.

Sections (each a ``bench/<name>.py`` with ``run(quick, results_dir) -> markdown``; those whose
script is absent are listed as such): what a user compares and the README and docs quote at the
top of ``bench/``, the research that chose the package's designs in ``bench/research/`` (named
``research.<name>``; see its README). Writes ``<results>/*.csv``, ``*.png`` and ``SUMMARY.md`` (every section's headline rows, then every
section), and writes the README's headline (at most 12 rows a user compares, from the sections'
``readme_rows``) between ``<!-- bench:headline:start -->`` and ``<!-- bench:headline:end -->``.

The full run writes ``bench/results/`` and updates the README; ``--quick`` (a smoke run at small
sizes: 10 minutes on a 2-core machine shared with other jobs, load average 7, of which 4 were the
start-up section compiling into its quick-run cache, which later quick runs reuse) writes
``bench/results/quick/`` and never touches the README. Every section's
markdown starts with the commit and time it ran at, so a partial re-run (``--only``) cannot pass an
old figure off as new; the README's headline is only written by a run in which every section that
feeds it ran (``--only`` may name just those), at one commit of a clean checkout (``--allow-dirty`` says in the README that it was not). A
failing section is reported in the summary and makes the exit status 1; the other sections still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import subprocess
import sys
import time
import traceback
from pathlib import Path

from _common import BENCH, ROOT, load_note, markdown_table

# (module name in bench/, title, what it measures)
SECTIONS = (
    ("speed", "Speed", "time per call vs experts, GPUs, layers, slots per GPU; NumPy port side by side"),
    ("startup", "Start-up", "cold Numba compile, warm-cache fresh process"),
    ("quality", "Quality", "every method on the quality configurations, synthetic and real traces"),
    ("research.generalisation", "Generalisation", "plan on one window, serve another"),
    ("research.exact_gap", "Exact solver", "gap of the methods to the exact optimum on small instances"),
    ("serving", "Serving", "online balancer in a serving simulation"),
    ("research.fewest_changes", "Fewest changes", "proven fewest slot changes per rebalance, gpt-oss-20b 40 slots"),
    ("research.gpt_oss_certificate", "Certificate", "gpt-oss-20b: how close to the bound a placement can get"),
    ("research.plan_latency", "Plan latency", "plan() alone and with its lower bound, DeepSeek-V3 size"),
    ("research.bound_speed", "Bound speed", "lower_bound at DeepSeek-V3 size; the hierarchical bound at 1024 experts"),
    ("greedy_net", "Greedy net", "how often the default's keep-greedy net fires"),
    ("background_thread", "Background thread", "planning beside a busy Python thread"),
    ("research.dispatch", "Dispatch", "optimal dispatch per batch: speed and balancedness"),
    ("out_of_sample", "Out of sample", "held-out windows: objectives, even split and optimal dispatch"),
    ("research.locality", "Locality", "balancedness against off-node tokens (max_off_node), in and out of sample"),
    ("research.split_bias", "Split bias", "a replica's activation as its expectation against the split drawn, per batch"),
    ("simulate", "Simulate", "rebalancing policies in step time and copies on drifting traffic"),
    ("decision_rule", "Decision rule", "Balancer settings chosen on tuning series, judged on held-out ones"),
    ("loop_frontier", "Loop frontier", "time lost against copies: the Balancer and a clairvoyant planner, held out"),
    ("rack_online", "Rack-scale online loop", "the Balancer at 4 and 2 slots per GPU beside the engines' timers and the free re-plan"),
    ("simulate_chunks", "Rebalance in chunks", "a rebalance applied a few layers per step: stalls and time lost"),
    ("engine_dispatch", "Engine dispatch", "what each engine's replica choice serves: SGLang static, even split, optimal"),
    ("robust_default", "Robust by default", "the default plan of a series, held out, on real traces and structured families"),
    ("engine_planning", "Engine planning", "plans made for SGLang's dispatch rules, held out"),
    ("host_loop", "Host loop", "the README's serving loop: the caller's time in eplb per pass, p99 and max"),
    ("compare_quick", "eplb compare", "eplb compare --quick timed; the published algorithm from a file beside greedy"),
    ("pools", "Pools", "eplb.recommend: redundant experts and plans per pool, in predicted step time, held out"),
    ("elastic", "Elastic", "re-planned across a lost or added GPU: copies and balance beside from scratch and donor repair"),
    ("elastic_serving", "Elastic serving", "rebalance(deployment=) across a lost or joining GPU, DeepSeek-V3 size"),
    ("simulate_elastic", "Simulated changes", "a GPU lost mid-series and nodes joining and leaving in eplb.simulate, beside the engines' answers"),
    ("survive", "Survive", "survive= against the plain plan: a lost GPU or node, in and out of sample; the exposure's cost"),
    ("rack", "Rack scale", "58 x 256 on 32 to 320 GPUs (1 to 9 slots each): balance, held out, plan and decision time"),
    ("rack_nodes", "Racks as nodes", "racks as nodes (2 x 72, 4 x 36 GPUs), recommend at 72 and 144 GPUs, a GPU or a rack lost"),
    ("rack_bounds", "Rack-scale bounds", "gap to the bound and layers proven optimal at 1 to 4 slots a GPU, DeepSeek-V3 size"),
    ("exact_contract", "Exact contract", "the exact method on issue 43's reproductions: avoidable doubled replicas, time per layer"),
    # the rack sections (rack, rack_bounds, rack_online, rack_nodes) go here, with their rows in bench/README.md
)

README_ROWS = 12
"""The README's headline holds at most this many rows: figures a user compares, eplb beside what it
replaces, each in the configuration its row names. A section offers them with ``readme_rows(results_dir)
-> [(figure, eplb, compared with)]``; the README is written when every such section ran in this run."""

START = "<!-- bench:headline:start -->"
END = "<!-- bench:headline:end -->"


def short_name(name: str) -> str:
    """A section's name without its folder (``research.locality`` -> ``locality``): its files' stem."""
    return name.rsplit(".", 1)[-1]


def section_path(name: str) -> Path:
    """The script of section ``name`` (``research.x`` is ``bench/research/x.py``)."""
    return BENCH / (name.replace(".", "/") + ".py")


def run_sections(names: list[str], quick: bool, results_dir: Path, stamp: str = "") -> list[dict]:
    """Import and run each section; one record per section with its markdown (headed by ``stamp``:
    the commit and time of this run), status and time."""
    records = []
    for name in names:
        title = next((t for n, t, _ in SECTIONS if n == name), name)
        record = {"name": name, "title": title, "markdown": "", "status": "ok", "seconds": 0.0, "headline": []}
        if not section_path(name).exists():
            record["status"] = "absent"
            record["markdown"] = f"## {title}\n\n`{section_path(name).relative_to(BENCH.parent)}` is not in the repository yet.\n"
            records.append(record)
            continue
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(name)
            markdown = module.run(quick, results_dir)
            head, _, rest = markdown.partition("\n")
            record["markdown"] = f"{head}\n\n_{stamp}_\n{rest}" if stamp else markdown
            if hasattr(module, "headline"):
                record["headline"] = list(module.headline(results_dir))
            if hasattr(module, "readme_rows"):
                record["readme"] = list(module.readme_rows(results_dir))
        except Exception:  # a broken section must not hide the others' results
            record["status"] = "FAILED"
            record["markdown"] = f"## {title}\n\nFAILED:\n\n```\n{traceback.format_exc()[-3000:]}```\n"
        record["seconds"] = time.perf_counter() - start
        if record["status"] == "ok":  # kept so that a partial re-run (--only) still shows this section
            (results_dir / f"section_{short_name(name)}.md").write_text(record["markdown"])
        print(f"[bench] {name}: {record['status']} in {record['seconds']:.1f} s", file=sys.stderr, flush=True)
        records.append(record)
    return records


def collect_headlines(records: list[dict], results_dir: Path) -> None:
    """Give the sections not run this time (``--only``) the headline rows and markdown of their
    results recorded earlier in ``results_dir``, so a partial re-run keeps the whole summary."""
    ran = {r["name"] for r in records}
    for name, title, _ in SECTIONS:
        if name in ran or not section_path(name).exists():
            continue
        try:
            module = importlib.import_module(name)
            rows = list(module.headline(results_dir)) if hasattr(module, "headline") else []
        except Exception:  # an old or broken section has no headline rows
            rows = []
        recorded = results_dir / f"section_{short_name(name)}.md"
        markdown = (f"{recorded.read_text()}\n\n(recorded by an earlier run; not re-run this time)\n"
                    if recorded.exists() else f"## {title}\n\nNot run this time; see its files in this folder.\n")
        records.append({"name": name, "title": title, "markdown": markdown, "status": "not run (recorded earlier)",
                        "seconds": 0.0, "headline": rows})
    order = [n for n, _, _ in SECTIONS]
    records.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))


def headline_table(records: list[dict], quick: bool, when: str, results_dir: Path, commit: str | None = None) -> str:
    """The headline figures of every section as one markdown table, with how they were measured."""
    rows = [row for record in records for row in record["headline"]]
    if not rows:
        return "(no headline figures: no section produced any)"
    table = markdown_table(("figure", "measured", "target"), rows)
    try:
        where = results_dir.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        where = str(results_dir)
    earlier = [r["title"] for r in records if r["status"].startswith("not run") and r["headline"]]
    note = f" {', '.join(earlier)}: figures recorded by an earlier run." if earlier else ""
    return (f"{table}\n\nMeasured by `python bench/run.py{' --quick' if quick else ''}` at commit {commit or git_commit()} "
            f"on {when} ({load_note()}; the machine is shared, times are medians).{note} "
            f"All results: `{where}/SUMMARY.md`.")


def readme_sections() -> list[str]:
    """The sections whose ``readme_rows`` feed the README's headline."""
    return [name for name, _, _ in SECTIONS
            if section_path(name).exists() and hasattr(importlib.import_module(name), "readme_rows")]


def readme_table(records: list[dict], when: str, commit: str | None = None) -> str:
    """The README's headline: every section's ``readme_rows`` (at most :data:`README_ROWS`), with how
    and where they were measured."""
    rows = [row for record in records for row in record.get("readme", [])]
    if len(rows) > README_ROWS:
        raise ValueError(f"the README's headline takes at most {README_ROWS} rows, the sections gave {len(rows)}")
    table = markdown_table(("figure", "eplb", "compared with"), rows)
    ran = ", ".join(r["title"] for r in records if r.get("readme"))
    return (f"{table}\n\nMeasured by `python bench/run.py` at commit {commit or git_commit()} on {when} "
            f"({load_note()}; the machine is shared; times are medians unless a row says otherwise). "
            f"Sections: {ran}; each section's own figures and targets: `bench/results/SUMMARY.md`.")


def git_commit() -> str:
    """The short commit of the checkout, with ``+uncommitted`` when tracked files differ from it."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)
        commit = done.stdout.strip() or "unknown"
        return commit + ("+uncommitted" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def summary(records: list[dict], quick: bool, when: str, total_s: float, results_dir: Path,
            commit: str | None = None) -> str:
    timing = markdown_table(("section", "status", "seconds"),
                            [(r["title"], r["status"], f"{r['seconds']:.1f}") for r in records])
    parts = [
        "# eplb benchmark results", "",
        f"`python bench/run.py{' --quick' if quick else ''}` at commit {commit or git_commit()}, {when}; "
        f"{load_note()}. Total {total_s:.0f} s.", "",
        "## Headline", "", headline_table(records, quick, when, results_dir, commit), "",
        "## Sections run", "", timing, "",
    ]
    parts += [r["markdown"] for r in records]
    return "\n".join(parts) + "\n"


def update_readme(readme: Path, table: str) -> None:
    """Put ``table`` between the headline markers; add a ``## Benchmarks`` section above
    ``## Design`` (or at the end) with the markers when the README has none."""
    text = readme.read_text()
    block = f"{START}\n{table}\n{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        section = ("## Benchmarks\n\n"
                   "```bash\npython bench/run.py            # every section; writes bench/results/ and this table\n"
                   "python bench/run.py --quick    # the same at small sizes, a smoke run (minutes)\n```\n\n"
                   "eplb is measured against a pure-NumPy port of the published greedy algorithm "
                   "(`bench/published_greedy.py`) in the same run, so speed-ups are ratios measured side by "
                   "side. Results: `bench/results/` (CSV, PNG plots, `SUMMARY.md`). Executed examples with "
                   "plots: `notebooks/quickstart.ipynb`, `notebooks/algorithms.ipynb`, "
                   "`notebooks/serving.ipynb`.\n\n"
                   f"{block}\n\n")
        if "\n## Design" in text:
            head, tail = text.split("\n## Design", 1)
            text = head + "\n" + section + "## Design" + tail
        else:
            text = text.rstrip("\n") + "\n\n" + section
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run eplb's benchmarks (every section of bench/).")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats: a smoke run (minutes; see the module docstring)")
    parser.add_argument("--only", nargs="+", choices=[n for n, _, _ in SECTIONS], help="run these sections only")
    parser.add_argument("--results-dir", type=Path, help="default: bench/results (bench/results/quick with --quick)")
    parser.add_argument("--no-readme", action="store_true", help="do not copy the headline table into README.md")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write the README even from a checkout with uncommitted changes (the table says so)")
    args = parser.parse_args(argv)
    results_dir = args.results_dir or (BENCH / "results" / ("quick" if args.quick else ""))
    results_dir.mkdir(parents=True, exist_ok=True)
    names = args.only or [n for n, _, _ in SECTIONS]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    commit = git_commit()  # the code measured is the checkout at the start (docs may change meanwhile)
    stamp = f"`bench/run.py{' --quick' if args.quick else ''}` at commit {commit}, {when}"
    start = time.perf_counter()
    records = run_sections(names, args.quick, results_dir, stamp)
    total = time.perf_counter() - start
    if args.only:
        collect_headlines(records, results_dir)
    (results_dir / "SUMMARY.md").write_text(summary(records, args.quick, when, total, results_dir, commit))
    ran_ok = {r["name"] for r in records if r["status"] == "ok"}
    complete = set(readme_sections()) <= ran_ok
    clean = "+uncommitted" not in commit or args.allow_dirty
    if not (args.quick or args.no_readme):
        if complete and clean:
            update_readme(ROOT / "README.md", readme_table([r for r in records if r["name"] in ran_ok], when, commit))
        else:
            why = ("not every section of the README's headline ran and succeeded (" + ", ".join(readme_sections())
                   + ")" if not complete else "the checkout has uncommitted changes")
            print(f"[bench] README left alone: {why} (its headline comes from one run at one commit)",
                  file=sys.stderr)
    print(f"[bench] {total:.0f} s in all; summary: {results_dir / 'SUMMARY.md'}", file=sys.stderr)
    return 1 if any(r["status"] == "FAILED" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

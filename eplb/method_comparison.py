"""Compare placement methods, eplb's and anyone's, on the same workloads and deployments:
:func:`compare` (one call) and the ``eplb compare`` command (:func:`build_command`).

Methods are ``eplb.METHODS`` names, ``package.module:function`` or ``file.py[:function]`` with the
published ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`` signature;
each runs in a fresh worker process with a time limit (:mod:`eplb.simulation.method_runner`), and
every figure is computed from the plans it returned (:mod:`eplb.simulation.comparison`).
Workloads are files, synthetic families and the real traces (:mod:`eplb.io.workloads`); what is
written is described in :mod:`eplb.io.comparison_report`.
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .io.comparison_report import format_table, write_comparison_report
from .io.progress import Progress
from .io.workloads import TRACE_DEPLOYMENTS, WorkloadMissing, read_workload, tile_experts as tiled
from .model.cost import CostModel
from .model.deployment import make_deployment
from .planning.methods import DEFAULT_METHOD
from .simulation.comparison import STEP_ROUTINGS, MethodResult, Workload, compare_on, deployment_label
from .simulation.method_runner import NUMPY, TORCH, DeploymentSpec, MethodSpec, parse_method

QUICK_FOLDS, QUICK_WARM_CALLS = 4, 1
"""``quick=True``: at most this many held-out blocks and warm repeats."""


@dataclass
class Comparison:
    """What :func:`compare` found.

    Attributes:
        results: one :class:`eplb.simulation.comparison.MethodResult` per workload, deployment and
            method (``.row()`` gives the flat row; ``.placement`` the in-sample plan).
        notes: workloads or deployments skipped, and why (a trace absent, a deployment too small).
        config: the configuration, as recorded in ``run.json``.
        written: the files written (``{"html", "csv", "record", "figures", "missing"}``) or ``{}``.
    """

    results: list[MethodResult]
    notes: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    written: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        return [r.row() for r in self.results]

    def table(self) -> str:
        return format_table(self.results)


def _method_spec(method) -> MethodSpec:
    """A method name, a spec string, or a function importable by its module and name."""
    if isinstance(method, MethodSpec):
        return method
    if isinstance(method, str):
        return parse_method(method)
    if callable(method):
        module, name = getattr(method, "__module__", None), getattr(method, "__qualname__", "")
        if module and module != "__main__" and name.isidentifier():
            return MethodSpec(f"{module}:{name}", module=module, function=name)
        raise ValueError(f"methods: {method!r} cannot be imported by a worker process (a lambda, a nested "
                         "function or one defined in __main__); give it as 'module:function' or 'file.py:function'")
    raise ValueError(f"methods must hold method names, 'module:function' / 'file.py[:function]' strings or "
                     f"functions, got {method!r}")


def _deployment(value) -> DeploymentSpec:
    if isinstance(value, DeploymentSpec):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"num_slots", "num_gpus", "num_nodes", "num_groups"}
        if unknown:
            raise ValueError(f"deployments: unknown keys {sorted(unknown)}; a deployment has num_slots, num_gpus, "
                             "num_nodes, num_groups")
        return DeploymentSpec(**value)
    raise ValueError(f"deployments must hold dicts of num_slots, num_gpus, num_nodes, num_groups, got {value!r}")


def _workload(value, seed: int, input_format: str | None) -> Workload:
    if isinstance(value, Workload):
        return value
    if isinstance(value, (str, Path)):
        return read_workload(str(value), seed=seed, input_format=input_format)
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ValueError(f"workloads: an array must be [L, E] or [T, L, E], got shape {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError("workloads: counts must be finite and non-negative")
    return Workload("array", array, tuple(f"window {t}" for t in range(array.shape[0])), "an array")


def _fitting_pairs(loaded: list[Workload], given, notes: list[str]) -> list[tuple[Workload, DeploymentSpec]]:
    """Every (workload, deployment) to compare on: ``given`` deployments, or a trace's own; one that
    does not fit its workload is left out with a note in ``notes``."""
    pairs = []
    for workload in loaded:
        key = workload.name.partition(":")[2].split(" ")[0] if workload.name.startswith("trace:") else None
        if given is None and key not in TRACE_DEPLOYMENTS:
            raise ValueError(f"deployments are needed for workload {workload.name} (only traces have their own)")
        chosen = given if given is not None else [DeploymentSpec(**TRACE_DEPLOYMENTS[key])]
        for deployment in chosen:
            try:
                make_deployment(workload.counts.shape[2], deployment.num_slots, deployment.num_gpus,
                                deployment.num_nodes, deployment.num_groups)
            except ValueError as exc:
                notes.append(f"skipped {workload.name} on {deployment_label(deployment)}: {exc}")
                continue
            pairs.append((workload, deployment))
    return pairs


def compare(methods=("greedy", DEFAULT_METHOD), workloads=("trace:gpt-oss-20b",), deployments=None, *,
            cost_model: CostModel | None = None, previous=None, folds: int = 16, time_limit: float = 120.0,
            warm_calls: int = 3, array_type: str | None = None, seed: int = 0, tile_experts: int | None = None,
            step_routings: float = STEP_ROUTINGS, quick: bool = False, input_format: str | None = None,
            output=None, progress=None, command: str = "") -> Comparison:
    """Compare placement methods side by side on the same workloads and deployments.

    Args:
        methods: ``eplb.METHODS`` names, ``"module:function"`` / ``"file.py[:function]"`` strings or
            importable functions with the published ``rebalance_experts`` signature (numpy or torch
            in and out; ``phy2log [L, S]`` alone or a tuple of at most three starting with it).
        workloads: paths (any counts format eplb reads), ``"synthetic:FAMILY[:LxExT]"``,
            ``"trace:NAME"`` (skipped with a note when absent), :class:`Workload` objects or arrays
            ``[T, L, E]`` / ``[L, E]``.
        deployments: dicts of :func:`eplb.plan`'s ``num_slots, num_gpus, num_nodes, num_groups``;
            ``None``: each trace's own (:data:`eplb.io.workloads.TRACE_DEPLOYMENTS`). A deployment
            that does not fit a workload is skipped for it with a note.
        cost_model: for the simulated step time (default ``CostModel.preset()``, DeepSeek-V3 on H100).
        previous: ``phy2log [L, S]`` (or a :class:`eplb.Placement`) in service, for weight copies.
        folds: at most this many held-out blocks (leave one block of windows out).
        time_limit: seconds a method's worker may take in all (its plans and repeats), then killed.
        warm_calls: timed repeats of the in-sample call after the first.
        array_type: ``"torch"`` or ``"numpy"`` for foreign functions; ``None``: torch when installed.
        seed: of the synthetic workloads. tile_experts: widen every workload to this many experts
            (:func:`eplb.io.workloads.tile_experts`). step_routings: routed tokens per layer and
            simulated step. quick: at most :data:`QUICK_FOLDS` blocks and :data:`QUICK_WARM_CALLS` repeats.
        output: a folder to write the report into (:func:`eplb.io.comparison_report.write_comparison_report`).
        progress: ``None``, or called as ``progress(methods done, methods in all, what runs now)``
            before each method runs and once at the end (:class:`eplb.io.progress.Progress` shows
            it). command: the command line, for the record.
    Returns:
        A :class:`Comparison`. A method that fails (raises, hangs, returns a malformed plan) gets a
        ``"broken"`` row with a one-line reason; the others are unaffected.
    """
    specs = [_method_spec(m) for m in ([methods] if isinstance(methods, str) else methods)]
    if not specs:
        raise ValueError("methods must name at least one method")
    if isinstance(workloads, (str, Path, Workload)):
        workloads = [workloads]
    if array_type is None:
        try:
            import torch  # noqa: F401
        except ImportError:
            array_type = NUMPY
        else:
            array_type = TORCH
    if quick:
        folds, warm_calls = min(folds, QUICK_FOLDS), min(warm_calls, QUICK_WARM_CALLS)
    cost_model = CostModel.preset() if cost_model is None else cost_model
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be an eplb.CostModel, got {type(cost_model).__name__}")
    given = None if deployments is None else [_deployment(d) for d in deployments]
    if previous is not None:
        previous = np.asarray(getattr(previous, "phy2log", previous))
    notes, loaded = [], []
    for value in workloads:
        try:
            workload = _workload(value, seed, input_format)
        except WorkloadMissing as exc:
            notes.append(f"skipped {exc}")
            continue
        loaded.append(tiled(workload, tile_experts) if tile_experts else workload)
    pairs = _fitting_pairs(loaded, given, notes)
    results = []
    total = len(pairs) * len(specs)
    for workload, deployment in pairs:
        announce = None
        if progress is not None:  # called before each method: the ones before it are done
            def announce(label, w=workload, d=deployment, started=itertools.count(len(results))):
                progress(next(started), total, f"{label} on {w.name}, {d.num_slots} slots")
        results += compare_on(workload, deployment, specs, cost_model=cost_model, previous=previous,
                              folds=folds, time_limit=time_limit, warm_calls=warm_calls, array_type=array_type,
                              step_routings=step_routings, progress=announce)
    if progress is not None and results:
        progress(total, total, "")
    if not results:
        raise ValueError("nothing to compare: " + ("; ".join(notes) if notes else "no workloads"))
    config = {
        "command": command,
        "methods": [dataclasses.asdict(s) for s in specs],
        "workloads": [{"name": w.name, "source": w.source, "shape": list(w.counts.shape),
                       "windows": list(w.window_names)} for w in loaded],
        "deployments": None if given is None else [dataclasses.asdict(d) for d in given],
        "seed": seed, "folds": folds, "warm_calls": warm_calls, "time_limit_s": time_limit,
        "array_type": array_type, "tile_experts": tile_experts, "step_routings": step_routings, "quick": quick,
        "cost_model": cost_model.name, "cost_model_fields": dataclasses.asdict(cost_model),
        "previous": None if previous is None else "given", "notes": notes,
    }
    comparison = Comparison(results, notes, config)
    if output is not None:
        comparison.written = write_comparison_report(results, output, config=config)
    return comparison


# -- the command ---------------------------------------------------------------------------------


def _parse_deployment(text: str) -> DeploymentSpec:
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not 2 <= len(values) <= 4 or min(values) < 1:
        raise ValueError(f"--deployment must be SLOTS:GPUS[:NODES[:GROUPS]] with positive whole numbers, "
                         f"got {text!r}")
    slots, gpus, nodes, groups = values + [1, None][len(values) - 2:]
    return DeploymentSpec(slots, gpus, nodes, groups)


def _command_line(context) -> str:
    """The ``eplb compare`` command line that reruns ``context``'s parameters (defaults left out)."""
    words = ["eplb", "compare", *context.params["workloads"]]
    for param in context.command.params:
        value = context.params.get(param.name)
        if param.param_type_name != "option" or value is None or value == param.default or value == ():
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            words.append(flag)
        else:
            for item in (value if param.multiple else [value]):
                words += [flag, str(item)]
    return shlex.join(words)


def _given_deployments(given: dict) -> list[DeploymentSpec]:
    """The deployments of the ``eplb compare`` options ``given``: ``--slots`` / ``--gpus`` first, then
    every ``--deployment``."""
    import click

    deployments = [_parse_deployment(text) for text in given["deployment_texts"]]
    if given["slots"] is not None or given["gpus"] is not None:
        if given["slots"] is None or given["gpus"] is None:
            raise click.UsageError("--slots and --gpus go together (or use --deployment)")
        deployments.insert(0, DeploymentSpec(given["slots"], given["gpus"], given["nodes"], given["groups"]))
    return deployments


def _previous_plan(given: dict, deployments: list[DeploymentSpec]) -> np.ndarray | None:
    """``phy2log [L, S]`` of the ``--previous`` placement of the options ``given`` (read for the first
    deployment and the workloads' experts), or None."""
    if given["previous"] is None:
        return None
    from .io.formats import read_placement

    first = deployments[0] if deployments else None
    experts = given["tile_experts"] or read_workload(given["workloads"][0], seed=given["seed"],
                                                     input_format=given["input_format"]).counts.shape[2]
    return read_placement(given["previous"], given["previous_format"], num_gpus=first and first.num_gpus,
                          num_nodes=first and first.num_nodes, num_experts=experts).phy2log


def _run_compare(**given) -> None:
    """The ``eplb compare`` command's callback: ``given`` holds every option by its parameter name."""
    import click

    workloads, seed, quiet = given["workloads"], given["seed"], given["quiet"]
    deployments = _given_deployments(given)
    previous_plan = _previous_plan(given, deployments)
    with Progress("compare", unit="methods", quiet=quiet) as progress:
        result = compare(given["methods"] or ("greedy", DEFAULT_METHOD), workloads, deployments or None,
                         cost_model=CostModel.preset(given["hardware"], given["model"], regime=given["regime"]),
                         previous=previous_plan, folds=given["folds"], time_limit=given["time_limit"],
                         warm_calls=given["warm_calls"], array_type=given["array_type"], seed=seed,
                         tile_experts=given["tile_experts"], quick=given["quick"], input_format=given["input_format"],
                         output=given["output"], progress=progress, command=_command_line(click.get_current_context()))
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if result.written.get("missing"):
        click.echo(f"note: {result.written['missing']}", err=True)
    if not quiet:
        click.echo(result.table())
        if result.written:
            click.echo(f"wrote    {result.written['html']}, {result.written['csv'].name}, "
                       f"{result.written['record'].name}")


def _compare_options() -> list:
    """The arguments and options of ``eplb compare`` (click decorators), in the order of its help."""
    import click

    from .model.cost import HARDWARE, MODELS, REGIMES
    from .io.formats import COUNTS_FORMATS, PLACEMENT_FORMATS

    return [
        click.argument("workloads", nargs=-1, required=True),
        click.option("--method", "-m", "methods", multiple=True,
                     help="A method, repeatable: an eplb method name, MODULE:FUNCTION or FILE.py[:FUNCTION] with the "
                          f"published rebalance_experts signature. Default: greedy and {DEFAULT_METHOD}."),
        click.option("--slots", "-s", type=click.IntRange(min=1), default=None, help="Physical expert slots (S >= E)."),
        click.option("--gpus", "-g", type=click.IntRange(min=1), default=None, help="GPUs; S must divide by it."),
        click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes."),
        click.option("--groups", "-k", type=click.IntRange(min=1), default=None,
                     help="Expert groups (kept on one node each when groups divide by nodes)."),
        click.option("--deployment", "deployment_texts", multiple=True,
                     help="Another deployment, SLOTS:GPUS[:NODES[:GROUPS]], repeatable. Without any, a trace "
                          "uses its own."),
        click.option("--tile-experts", type=click.IntRange(min=1), default=None,
                     help="Widen every workload to this many experts by interleaving the experts of consecutive "
                          "layers (e.g. 256 from gpt-oss-20b's 32: 8 layers a row)."),
        click.option("--previous", type=click.Path(path_type=Path), default=None,
                     help="The placement in service: count each plan's weight copies from it."),
        click.option("--previous-format", type=click.Choice(PLACEMENT_FORMATS), default=None),
        click.option("--hardware", type=click.Choice(sorted(HARDWARE)), default="H100", show_default=True),
        click.option("--model", type=click.Choice(sorted(MODELS)), default="deepseek-v3", show_default=True,
                     help="Expert size for the cost model's step time."),
        click.option("--regime", type=click.Choice(REGIMES), default="roofline", show_default=True),
        click.option("--folds", type=click.IntRange(min=2), default=16, show_default=True,
                     help="At most this many held-out blocks of windows."),
        click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
                     help="Seconds a method may take in all before it is killed and its row marked broken."),
        click.option("--warm-calls", type=click.IntRange(min=0), default=3, show_default=True,
                     help="Timed warm repeats of the in-sample call."),
        click.option("--array", "array_type", type=click.Choice([TORCH, NUMPY]), default=None,
                     help="What foreign functions get. Default: torch when installed, else numpy."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workloads."),
        click.option("--quick", is_flag=True,
                     help=f"At most {QUICK_FOLDS} held-out blocks and {QUICK_WARM_CALLS} warm repeat."),
        click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
                     help="Format of workload files (default: detected from the name)."),
        click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
                     help="Folder for compare.csv, run.json, the PNG figures and index.html."),
        click.option("-q", "--quiet", is_flag=True, help="No progress and no table."),
        ]


def build_command(wrap):
    """The ``eplb compare`` click command, its callback wrapped by ``wrap`` (the CLI's error handler:
    a user's mistake becomes one line and exit code 1)."""
    import click

    callback = wrap(_run_compare)
    for option in reversed(_compare_options()):
        callback = option(callback)
    return click.command("compare", context_settings={"max_content_width": 100},
                         help="""Compare placement methods on the same WORKLOADS and deployments, side by side.

    WORKLOADS: counts files (any format eplb reads), synthetic:FAMILY[:LxExT] (lognormal, zipf, uniform,
    hot), trace:NAME (gpt-oss-20b, olmoe-1b-7b, mixtral-8x7b from the shared traces; EPLB_TRACES).

    Every method plans from the summed windows (in sample) and from the sum of the other windows for
    each held-out block; every figure is computed from the plans: balancedness, gap to eplb's proven
    lower bound, held-out balancedness, simulated MoE step time and time lost, weight copies from
    --previous, validity (doubled replicas on a GPU, groups off their node), first and warm plan
    time. A method that raises, hangs or returns a malformed plan gets a BROKEN row with its reason.

    \b
    Example:
      eplb compare trace:gpt-oss-20b -m greedy -m best -m published_eplb.py --slots 40 --gpus 8 -o cmp/
    """)(callback)


__all__ = ["Comparison", "build_command", "compare"]

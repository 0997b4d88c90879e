"""The ``eplb`` command line: ``plan``, ``report``, ``validate``, ``warmup`` and ``demo``.

Exit codes: 0 success; 2 the command line is wrong (unknown option, missing argument, a value of
the wrong type); 1 the command could not be done (a file missing, unreadable or invalid, counts
with NaN or the wrong shape, a configuration that does not fit the counts, a missing optional
dependency). Errors are one line naming the file and the problem, never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import shlex
import sys
import time
import warnings
from pathlib import Path

import click
import numpy as np

import eplb

from . import __version__
from .model.cost import HARDWARE as COST_HARDWARE, MODELS as COST_MODELS
from .planning.methods import DEFAULT_METHOD, METHODS
from .engines import DISPATCH_RULES, ENGINE_RULES, ENGINES, SCORING
from .planning.objectives import OBJECTIVES
from .planning.pipeline import combination_error
from .serving.policy import POLICY_NAMES as SIMULATE_POLICIES
from .analysis.metrics import moe_layers, moe_mean
from .io.progress import Progress, offset
from .io.report import Bound, bound_for, moe_note

# the registry's names (eplb.io.formats.FORMATS), for --format / --input-format / --previous-format
from .io.formats import COUNTS_FORMATS, PLACEMENT_FORMATS


class Failure(click.ClickException):
    """Exit 1 with ``Error: <message>`` on one line and no traceback."""

    exit_code = 1

    def __init__(self, message: str):
        message = " ".join(str(message).split())
        super().__init__(message if len(message) <= 600 else message[:597] + "...")


def friendly_errors(command):
    """Turn the errors a user can cause into one-line messages with exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from .io.formats import FormatError, MissingExtraError

        try:
            return command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (FormatError, MissingExtraError) as exc:
            raise Failure(str(exc)) from None
        except ValueError as exc:
            raise Failure(f"incompatible configuration: {exc}") from None
        except OSError as exc:
            name = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            raise Failure(f"{name}{exc.strerror or exc}") from None
        except (OverflowError, RecursionError, MemoryError) as exc:
            raise Failure(f"input too large or too deeply nested to process ({type(exc).__name__}: {exc})") from None

    return wrapper


class NamedChoice(click.Choice):
    """A choice of registered names taken in any case (``h100``, ``H100``), whose help, errors and
    value spell each name as registered (``H100``): the same spelling in the list and the default."""

    def __init__(self, choices):
        super().__init__(choices, case_sensitive=True)
        self._by_folded = {str(choice).casefold(): choice for choice in choices}

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            value = self._by_folded.get(value.casefold(), value)
        return super().convert(value, param, ctx)


def show_progress(quiet: bool) -> bool:
    """Progress bars only for a person watching: not with ``--quiet``, not when stderr is not a terminal."""
    return not quiet and sys.stderr.isatty()


transpose_option = click.option("--transpose", is_flag=True,
                                help="The counts file holds [experts, layers] (or [T, E, L]): swap the last two axes.")
allow_shape_option = click.option("--allow-shape", is_flag=True,
                                  help="Accept counts whose shape looks transposed or misread "
                                       "(over 128 layers and more than twice as many layers as experts).")
groups_hint = ("Expert groups of the deployment (the bound is hierarchical when they divide over the nodes). "
               "Default: recorded in the file (eplb JSON/npz, the '# eplb:' YAML comment, the SGLang side file "
               "<name>.eplb.json), else none.")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary (errors still go to stderr).")
gpus_hint = "GPUs (ranks); needed to read SGLang and TensorRT-LLM placement files, which do not record it."
engine_option = click.option("--engine", type=click.Choice(ENGINE_RULES), default=None,
                             help="Judge the plan under this engine's dispatch rule (sglang-static: SGLang's "
                                  "per-rank table; vllm, tensorrt-llm: an even split).")


def engine_line(placement, weights, engine: str) -> str:
    """The summary line judging ``placement`` on ``weights [L, E]`` under ``engine``'s dispatch rule,
    saying that every figure of the summary is judged under it, and what an even split would give."""
    bal = placement.balancedness(weights, engine)
    moe = moe_layers(weights)
    line = (f"engine   balancedness under {DISPATCH_RULES[engine].label}: {moe_mean(bal, weights):.4f} "
            f"(mean over {moe_note(weights)}; worst layer {bal[moe].min() if moe.any() else bal.min():.4f}); "
            "every figure of this summary is judged under this rule")
    if DISPATCH_RULES[engine].kind != "uniform":
        line += f" (split evenly among replicas: {moe_mean(placement.balancedness(weights, 'shares'), weights):.4f})"
    return line


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


@main.command()
@click.option("--method", "methods", multiple=True, help="Method to run (repeatable); default: greedy and the default method.")
def demo(methods):
    """Plan the built-in DeepSeek-V3-sized example and compare with no rebalancing."""
    from .demo import format_demo, run_demo
    from .planning.methods import METHODS

    for method in methods:
        if method not in METHODS:
            raise click.BadParameter(f"must be one of {sorted(METHODS)}, got {method!r}", param_hint="--method")
    click.echo(format_demo(run_demo(tuple(methods) or None)))


@main.command()
@click.option("--experts", "-e", type=click.IntRange(min=1), required=True, help="Logical experts per layer (E).")
@click.option("--slots", "-s", type=click.IntRange(min=1), required=True, help="Physical expert slots in all (S >= E).")
@click.option("--gpus", "-g", type=click.IntRange(min=1), required=True, help="GPUs (ranks); S must divide by it.")
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes; GPUs must divide by it.")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help="Expert groups. Default: none.")
@click.option("--method", "-m", "methods", multiple=True, type=click.Choice(sorted(METHODS)),
              help="Method the engine will plan with (repeatable); default: the default method and greedy.")
@click.option("--no-balancer", is_flag=True, help="Skip the online Balancer's record/decide/rebalance cycle.")
@quiet_option
@friendly_errors
def warmup(experts, slots, gpus, nodes, groups, methods, no_balancer, quiet):
    """Compile every kernel this configuration will use, so serving never waits on a compile.

    Run it once while building the container (or starting the server) with the configuration the
    engine serves: Numba caches the compiled code on disk and later processes load it in a
    fraction of a second. Prints each step and its time (seconds when it compiled, milliseconds
    when it loaded from the cache).

    \b
    Example:
      eplb warmup --experts 256 --slots 288 --gpus 32 --nodes 4 --groups 8
    """
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    from .io.formats.limits import check_size

    try:
        check_size(experts, "experts", "--experts")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--experts") from None
    deployment = eplb.Deployment.of(experts, num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    result = eplb.warmup(deployment, methods=list(methods) or None, balancer=not no_balancer)
    if quiet:
        return
    lines = [f"warmup   {experts} experts -> {slots} slots on {gpus} GPUs in {nodes} node{'s' if nodes > 1 else ''}"
             + (f", {groups} groups" if groups else "") + f"; methods {', '.join(result['methods'])}"]
    for name, seconds in result["steps"].items():
        lines.append(f"  {name:<28}" + (f"{seconds:8.2f} s" if seconds >= 1 else f"{1e3 * seconds:7.0f} ms"))
    lines.append(f"time     {result['time_s']:.2f} s (compiled code is cached on disk for later processes)")
    click.echo("\n".join(lines))


# -- plan ------------------------------------------------------------------------------------------


def deployment_arguments(command):
    """COUNTS and the deployment flags (--slots, --gpus, --nodes, --groups) of plan and simulate."""
    options = [
        click.argument("counts", type=click.Path(path_type=Path)),
        click.option("--slots", "-s", type=click.IntRange(min=1), default=None,
                     help="Physical expert slots in all (S >= E). Required but for eplb plan --previous (from the file)."),
        click.option("--gpus", "-g", type=click.IntRange(min=1), default=None,
                     help="GPUs (ranks); S must divide by it. Required but for eplb plan --previous (from the file)."),
        click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Nodes; GPUs must divide by it."),
        click.option("--groups", "-k", type=click.IntRange(min=1), default=None,
                     help="Expert groups (kept on one node each when groups divide by nodes). Default: none."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _accepts(fn, name: str) -> bool:
    parameters = inspect.signature(fn).parameters
    return name in parameters


def plan_with_progress(weights, *, num_slots, num_gpus, num_nodes, num_groups, method, previous=None,
                       migration=None, progress=False, **options):
    """``eplb.plan`` with progress shown on stderr; passes ``previous`` (and ``migration``:
    ``tolerance``, ``max_moves``) when ``eplb.plan`` supports migration-aware planning.

    A method that draws its own per-layer progress bar (it takes ``progress=``, like ``exact``)
    gets ``progress``; for any other method other than greedy a timer runs on stderr while the
    plan is computed (on a worker thread: the kernels release the GIL). The plan is always
    exactly what one ``eplb.plan`` call returns.

    Returns:
        ``(placement, used_previous)``.
    """
    use_previous = previous is not None and _accepts(eplb.plan, "previous")
    migration = {k: v for k, v in (migration or {}).items() if use_previous and _accepts(eplb.plan, k)}
    kwargs = dict(num_slots=num_slots, num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups,
                  method=method, **options)
    if use_previous:
        kwargs.update(previous=previous, **migration)
    method_fn = METHODS[method]
    if _accepts(method_fn, "progress"):
        kwargs["progress"] = progress
        return eplb.plan(weights, **kwargs), use_previous
    if not progress or method == "greedy":
        return eplb.plan(weights, **kwargs), use_previous
    return _with_timer(lambda: eplb.plan(weights, **kwargs), f"planning {weights.shape[-2]} layers ({method})"), \
        use_previous


def _with_timer(work, description: str):
    """Run ``work()`` on a daemon thread while a tqdm timer ticks on stderr; return its result
    (or raise its exception)."""
    import threading

    from tqdm import tqdm

    outcome = {}

    def target():
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    with tqdm(desc=description, bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False) as timer:
        while thread.is_alive():
            thread.join(0.2)
            timer.refresh()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _deployed_plan(previous, fmt, data, engine, *, slots, gpus, nodes):
    """``eplb plan --previous``: ``(prev, engine, rule_lines)``, the deployed placement on the
    counts' layers (checked against the deployment; ``None`` without ``--previous``), and the rule
    every figure is judged under: ``--engine``, else the one the deployed plan records it was made
    for (the engine serves the next plan by it too), with the line that says so."""
    if previous is None:
        return None, engine, []
    prev = _read_previous(previous, fmt, gpus, nodes, data.num_experts, data)
    _check_previous(prev, dict(layers=data.num_layers, experts=data.num_experts, slots=slots, gpus=gpus,
                               nodes=nodes), previous, data.layer_ids)
    engine, rule_lines = _recorded_engine(engine, prev.placement, previous,
                                          also="; the new plan is judged under it too and written recording it")
    return prev, engine, rule_lines


def _read_previous(path, fmt, num_gpus, num_nodes, num_experts, data=None):
    """The deployed placement as its file records it; the flags only fill in what the file does not
    record (SGLang's map, a YAML without eplb's comment), and a flag that disagrees with the file's
    record is an error naming both. With ``data`` (the counts), a file of more layers gives its rows
    of the counts' model layers (:func:`_previous_on_layers`)."""
    from .io.formats import FormatError, detect_placement_format, read_placement

    if fmt is None:
        try:
            fmt = detect_placement_format(path)
        except FormatError as exc:
            raise FormatError(path, f"--previous must be the placement deployed now: {exc.problem}") from None
    loaded = read_placement(path, fmt, num_gpus=num_gpus, num_nodes=num_nodes, num_experts=num_experts)
    return loaded if data is None else _previous_on_layers(loaded, data)


def _previous_on_layers(previous, data):
    """The previous placement on the layers of the counts ``data`` (``data.layer_ids [L]``, the
    model's index of each): its rows of those layers when it covers more of them (SGLang's map has
    a row per model layer, counts may hold the MoE layers only); else as it is. Counts that do not
    record their layers (a ``.npy``) cannot say which rows are theirs: refused, asking for them."""
    from .io.formats import FormatError, PlacementFile
    from .io.formats.data import layer_ranges

    old_ids, new_ids = previous.layer_ids.tolist(), [int(i) for i in data.layer_ids]
    if len(old_ids) > len(new_ids) and not data.layer_ids_recorded:
        dense = len(old_ids) - len(new_ids)
        raise FormatError(previous.path, f"holds {len(old_ids)} layers (model layers {layer_ranges(old_ids)}), the "
                                         f"counts {data.path} {len(new_ids)}, which do not record which model layers "
                                         f"they are: pass --layer-ids (--layer-ids {old_ids[dense]}..{old_ids[-1]} "
                                         "if they are its last layers) or --model NAME")
    if old_ids == new_ids or len(old_ids) <= len(new_ids) or not set(new_ids) <= set(old_ids):
        return previous
    rows = [old_ids.index(i) for i in new_ids]
    p = previous.placement
    placement = eplb.Placement(p.phy2log[rows], p.num_experts, p.topology, p.num_groups, p.method)
    return PlacementFile(placement, np.asarray(new_ids, dtype=np.int64), previous.format, previous.path,
                         previous.metadata)


def _check_previous(previous, placement_like, path, layer_ids=None):
    """The previous plan must describe the same layers, experts, slots, GPUs and nodes (and, given
    ``layer_ids``, the same model layers: :func:`_check_previous_layers`)."""
    from .io.formats import FormatError

    old = previous.placement
    mine = (placement_like["layers"], placement_like["experts"], placement_like["slots"],
            placement_like["gpus"], placement_like["nodes"])
    theirs = (old.num_layers, old.num_experts, old.num_slots, old.num_gpus, old.num_nodes)
    if mine != theirs:
        names = ("layers", "experts", "slots", "GPUs", "nodes")
        diffs = ", ".join(f"{n} {t} vs {m}" for n, t, m in zip(names, theirs, mine) if t != m)
        raise FormatError(path, f"incompatible configuration: the previous placement differs from this plan ({diffs})")
    if layer_ids is not None:
        _check_previous_layers(previous, layer_ids, path)


def _check_previous_layers(previous, layer_ids, path) -> None:
    """The previous placement's rows must be the counts' layers (same model layer ids)."""
    from .io.formats import FormatError
    from .io.formats.data import layer_ranges

    if previous.layer_ids.tolist() != [int(i) for i in layer_ids]:
        raise FormatError(path, f"incompatible configuration: the previous placement covers model layers "
                                f"{layer_ranges(previous.layer_ids)}, the counts layers {layer_ranges(layer_ids)} "
                                "(rows of counts that do not record their layers are 0 .. L-1: --layer-ids names "
                                "them)")


@main.command()
@deployment_arguments
@click.option("--method", "-m", type=click.Choice(sorted(METHODS)), default=DEFAULT_METHOD, show_default=True,
              help="Planning method.")
@click.option("--previous", type=click.Path(path_type=Path), default=None,
              help="The placement now deployed (any placement format): plan close to it and count the moves.")
@click.option("--previous-format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of --previous (default: detected).")
@click.option("--lost-gpus", default=None,
              help="With --previous: its GPUs that are gone, comma-separated (e.g. 5,6). They keep their index with "
                   "no slots; the survivors keep their slots and weights. Re-plans across the change.")
@click.option("--gpu-map", default=None,
              help="With --previous on other GPUs: the new index of each of its GPUs, comma-separated, -1 for a GPU "
                   "that is gone (vLLM's rank_mapping); default by index (with --gpus above its count: growth).")
@click.option("--slots-per-gpu", type=click.IntRange(min=1), default=None,
              help="With --previous: slots on every GPU after the change (default: as before).")
@click.option("--tolerance", type=click.FloatRange(min=0), default=None,
              help="With --previous: accept a max GPU load up to (1 + tolerance) x planning from scratch, "
                   "to keep more experts in place (default: eplb.plan's).")
@click.option("--max-moves", type=click.IntRange(min=0), default=None,
              help="With --previous: at most this many slots change per layer.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Wall-clock seconds per layer, for methods that take a limit (exact).")
@click.option("--deterministic-time", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A reproducible work budget per layer (OR-Tools deterministic seconds) for exact: the same "
                   "plan on every machine.")
@click.option("--max-off-node", type=click.FloatRange(min=0, max=1), default=None,
              help="With groups on nodes: let hot experts' replicas sit off their group's home node for at most "
                   "this fraction of each layer's tokens (0 = hierarchical, 1 = the whole cluster); the plan "
                   "then carries shares, which eplb JSON keeps.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="How the windows of a series COUNTS [T, L, E] combine (eplb.planning.objectives). Default: the plan is "
                   "hedged over the windows (expected_peak_search under an even split, as eplb.plan does with a "
                   "series); 'sum' plans on the summed counts.")
@click.option("--window", "passes_per_window", type=click.IntRange(min=1), default=None,
              help="Cut the recording into windows of this many consecutive passes or iterations (an SGLang "
                   "per-pass dump, TensorRT-LLM iterations) before planning from its windows.")
@click.option("--no-held-out", is_flag=True,
              help="Skip the held-out estimate (leave one window out) printed for a series.")
@click.option("--dispatch", type=click.Choice(SCORING), default="uniform", show_default=True,
              help="How the engine splits an expert's tokens among its replicas; optimal: plan for an engine "
                   "that splits every batch optimally (eplb.dispatch), from the series' windows.")
@click.option("--engine", type=click.Choice(ENGINE_RULES), default=None,
              help="Plan for this engine's dispatch rule and judge the plan under it (sglang-static, "
                   "sglang-dynamic: made for SGLang's replica choice; vllm, tensorrt-llm: an even split).")
@click.option("--phase", type=click.Choice(["prefill", "decode"]), default=None,
              help="Plan from the passes of this phase only (a pool serving one phase); needs COUNTS that record "
                   "each pass's phase (SGLang's per_token dump).")
@click.option("--format", "-f", "output_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Output format (default: from the name of -o: .json eplb, .npz, .yaml trtllm, and SGLang's "
                   "for a .json named like init_expert_location.json; other SGLang names need --format sglang).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Where to write the placement.")
@click.option("--layer-updates-per-iter", type=click.IntRange(min=0), default=0, show_default=True,
              help="TensorRT-LLM YAML only (an error with another output format): layers the engine may "
                   "re-balance per iteration (0 = static).")
@click.option("--num-layers", type=click.IntRange(min=1), default=None,
              help="SGLang and TensorRT-LLM output: the model's layer count (num_hidden_layers, dense layers "
                   "included: 61 for DeepSeek-V3). Rows are placed by the counts' layer ids; SGLang's map has a "
                   "row per model layer (default: --model's, else the largest layer id + 1), the layers the counts "
                   "leave out holding SGLang's trivial placement. Counts that do not record their layers (a .npy) "
                   "with fewer rows need --layer-ids or --model.")
@click.option("--layer-ids", default=None,
              help="The model layer of each row of COUNTS, as ranges (3..60 for DeepSeek-V3's MoE layers), when "
                   "the file does not record them (a .npy, a CSV matrix): an engine's file places rows by model "
                   "layer, and --previous is matched by it.")
@click.option("--expert-bytes", type=click.IntRange(min=1), default=None,
              help="With --previous: bytes of one expert's weights in one layer; prints the bytes the moves copy "
                   "and how long the copies take (--hardware).")
@click.option("--model", "model_preset", type=NamedChoice(sorted(COST_MODELS)), default=None,
              help="The model the counts come from (eplb.model.cost.MODELS). Its layers name rows the file does "
                   "not (deepseek-v3: 58 rows are its MoE layers 3..60, 61 rows all its layers) and give "
                   "--num-layers; with --previous, its expert size prices the moves as --expert-bytes does.")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="With --expert-bytes or --model and --previous: the GPUs whose NVLink and network price the "
                   "copies (any case).")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def plan(counts, slots, gpus, nodes, groups, method, previous, previous_format, tolerance, max_moves, time_limit,
         deterministic_time, max_off_node, input_format, objective, passes_per_window, no_held_out, dispatch, engine,
         phase, output_format, output, layer_updates_per_iter, num_layers, layer_ids, expert_bytes, model_preset,
         hardware, transpose, allow_shape, quiet, **across):
    """Plan a placement from recorded expert COUNTS and write it for your engine.

    COUNTS is a file or a TensorRT-LLM statistics folder. A series [T, L, E] is planned hedged over
    its windows as eplb.plan does (--objective sum: from their sum; --window N first cuts a
    recording into windows of N passes). Prints balancedness (mean / max GPU load, 1.0 is perfect)
    in sample, without rebalancing and with the plan (means over the MoE layers), for a series a
    held-out estimate (each window served by the plan made from the others) of this plan and the
    summed plan, the gap to the proven lower bound and which bound, what the hierarchy costs, with
    --previous the deployed plan's balancedness and the moves, and the time taken.

    --phase prefill|decode plans a pool that serves one phase from the passes of that phase (and
    prints how many of the file's passes it kept); COUNTS must record each pass's phase.
    --engine NAME plans for that engine's dispatch rule (from the windows) and prints the plan's
    balancedness under it.

    -o must not name an input file; an existing output file is replaced (a note says so on
    stderr). SGLang output also writes <name>.eplb.json beside it with the configuration.

    \b
    Example:
      eplb plan expert_distribution_recorder.pt --slots 288 --gpus 32 --nodes 4 --groups 8 \\
          --format sglang -o init_expert_location.json
    """
    from .analysis import metrics
    from .io.formats import write_placement

    command_start = time.perf_counter()
    if _plans_across_change(click.get_current_context().params):
        return _plan_across_change(click.get_current_context().params, command_start)
    migration, options = _plan_options(method, previous, tolerance, max_moves, time_limit, deterministic_time,
                                       engine=engine, dispatch=dispatch, objective=objective,
                                       max_off_node=max_off_node, expert_bytes=expert_bytes,
                                       model_preset=model_preset, groups=groups, nodes=nodes)
    output_format = _plan_output_format(output, output_format, num_layers, quiet)
    if layer_updates_per_iter and output_format != "trtllm":
        raise click.BadParameter(f"applies to TensorRT-LLM YAML output only, not to {output_format} output",
                                 param_hint="--layer-updates-per-iter")
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups, **{"num-layers": num_layers})
    _refuse_input_as_output(output, [counts, previous])
    if output_format == "sglang":
        from .io.formats.sglang import sidecar_path

        _refuse_input_as_output(sidecar_path(output), [counts, previous], what="the SGLang side file of -o")

    start = time.perf_counter()
    data = _read_plan_counts(counts, input_format, transpose, allow_shape, phase, passes_per_window)
    data, model_layers = _model_layers(data, layer_ids, model_preset, num_layers, output_format)
    _check_experts_fit(data, slots)
    weights = data.weights
    prev, engine, rule_lines = _deployed_plan(previous, previous_format, data, engine, slots=slots, gpus=gpus,
                                              nodes=nodes)

    with warnings.catch_warnings(record=True) as caught:  # said in one line each below, not raw
        warnings.simplefilter("always", RuntimeWarning)
        placement, used_previous = plan_with_progress(
            data.counts, num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups, method=method,
            previous=None if prev is None else prev.placement, migration=migration, progress=show_progress(quiet),
            **options)
    elapsed = time.perf_counter() - start
    _note_global_groups(groups, nodes, quiet)  # once the plan is made: never before a real error
    _note_plan_warnings(caught, quiet)
    if rule_lines:  # written recording the rule it is judged and served under
        placement = dataclasses.replace(placement, dispatch=engine)
    deployment = dict(num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups,
                      previous=None if prev is None else prev.placement)
    held = None if data.num_windows == 1 or no_held_out else _held_out_estimates(
        data.counts, method, options, deployment, judge=engine if rule_lines else None)

    judge = engine or "shares"  # every figure splits an expert's tokens as the engine does (else as the plan does)
    before = metrics.balancedness(metrics.static_gpu_loads(weights, gpus))  # one replica each: the same under any rule
    after = placement.balancedness(weights, judge)
    moves = None if prev is None else metrics.moves(prev.placement.phy2log, placement.phy2log, placement.topology)
    bound = _plan_bound(placement, weights, engine, max_off_node)
    gap = metrics.gap(placement.gpu_loads(weights, judge).max(axis=-1), bound.values)
    global_bal = _global_balancedness(weights, method, engine, slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    deployed_bal = None if prev is None else prev.placement.balancedness(weights, judge)
    configuration, diagnostics = _plan_records(
        slots=slots, gpus=gpus, nodes=nodes, groups=groups, method=method, options=options, counts=counts, data=data,
        phase=phase, previous=previous, used_previous=used_previous, migration=migration, before=before, after=after,
        gap=gap, bound=bound, placement=placement, weights=weights, global_bal=global_bal, deployed_bal=deployed_bal,
        elapsed=elapsed, held=held, moves=moves, judge=engine if rule_lines else None)
    diagnostics["judged_under"] = judge  # the split behind every balancedness and gap: an engine's rule or the plan's
    _note_overwrite(output, quiet)
    write_placement(placement, output, output_format, layer_ids=data.layer_ids, configuration=configuration,
                    diagnostics=diagnostics, layer_updates_per_iter=layer_updates_per_iter, num_layers=model_layers)
    if quiet:
        return
    click.echo("\n".join(_plan_summary(
        data=data, phase=phase, method=method, slots=slots, gpus=gpus, nodes=nodes, groups=groups, before=before,
        after=after, placement=placement, weights=weights, options=options, engine=engine, gap=gap,
        detail=dict(objective=objective, held=held, global_bal=global_bal, deployed_bal=deployed_bal,
                    max_off_node=max_off_node, output_format=output_format, bound=bound, moves=moves,
                    used_previous=used_previous, prev=prev, expert_bytes=expert_bytes, model_preset=model_preset,
                    hardware=hardware, diagnostics=diagnostics, migration=migration),
        elapsed=elapsed, command_start=command_start, output=output, model_layers=model_layers,
        rule_lines=rule_lines)))


def _read_plan_counts(counts, input_format, transpose, allow_shape, phase, passes_per_window):
    """The counts ``eplb plan`` plans from: read, then the passes of ``phase`` only, then cut into
    windows of ``passes_per_window`` passes (each when given)."""
    from .io.formats import read_counts

    data = read_counts(counts, input_format, transpose=transpose, allow_shape=allow_shape)
    if phase is not None:
        if data.phases is None:
            raise click.BadParameter(f"{counts} records no phase per pass (only SGLang's per_token detail dump "
                                     "records one): plan it without --phase", param_hint="--phase")
        data = data.select_phase(phase)
    if passes_per_window is not None:
        data = data.in_windows(passes_per_window)
    return data


def _plan_options(method, previous, tolerance, max_moves, time_limit, deterministic_time, *, engine, dispatch,
                  objective, max_off_node, expert_bytes, model_preset, groups, nodes) -> tuple[dict, dict]:
    """``eplb plan``'s flags as ``(migration, options)`` keywords of :func:`eplb.plan`, each flag
    checked against the others it needs or excludes (a usage error naming them)."""
    if previous is None and (tolerance is not None or max_moves is not None):
        raise click.UsageError("--tolerance and --max-moves apply only with --previous")
    if previous is None and expert_bytes is not None:
        raise click.UsageError("--expert-bytes prices the moves: flags that price them apply only with --previous")
    migration = {k: v for k, v in (("tolerance", tolerance), ("max_moves", max_moves)) if v is not None}
    options = {}
    if time_limit is not None:
        if not _accepts(METHODS[method], "time_limit"):
            takers = [m for m, fn in sorted(METHODS.items()) if _accepts(fn, "time_limit")]
            raise click.BadParameter(f"method {method!r} takes no time limit (methods that do: {', '.join(takers) or 'none'})",
                                     param_hint="--time-limit")
        options["time_limit"] = time_limit
    if deterministic_time is not None:
        if method != "exact":
            raise click.BadParameter(f"applies to method 'exact' only, not {method!r}", param_hint="--deterministic-time")
        options["deterministic_time"] = deterministic_time
    if engine is not None and dispatch != "uniform":
        raise click.UsageError("--engine sets the dispatch rule: not with --dispatch optimal")
    rule = engine or dispatch
    refusal = combination_error(rule, objective=objective, previous=previous is not None,
                                max_off_node=max_off_node is not None, is_series=None,
                                hierarchical=groups is not None and groups % nodes == 0, names=_PLAN_FLAGS)
    if refusal:  # the rest (e.g. --objective with --previous on a series) once the counts are read
        raise click.UsageError(refusal)
    options.update({k: v for k, v in (("dispatch", None if rule == "uniform" else rule), ("objective", objective),
                                      ("max_off_node", max_off_node)) if v is not None})
    return migration, options


_PLAN_FLAGS = {"previous": "--previous", "max_off_node": "--max-off-node", "dispatch": "--engine",
               "objective": "--objective", "num_groups": "--groups", "num_nodes": "--nodes"}
"""How ``eplb plan`` names :func:`eplb.planning.pipeline.combination_error`'s options."""


def _plan_summary(*, data, phase, method, slots, gpus, nodes, groups, before, after, placement, weights, options,
                  engine, gap, detail, elapsed, command_start, output, model_layers, rule_lines=()) -> list[str]:
    """The lines ``eplb plan`` prints: the counts, the plan, the rule a deployed plan records
    (``rule_lines``), for a series the held-out estimate first (what the engine will see), then
    balancedness in sample, the details of :func:`_plan_detail_lines` (``detail``: its other
    keywords), the time and what was written."""
    num_layers, num_experts = weights.shape
    output_format = detail["output_format"]
    moe = moe_layers(weights)
    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    detail = dict(detail)
    held = detail.pop("held")
    lines = [
        f"counts   {data.path} ({data.format}): {_shape_text(data)}",
        *([f"phase    {phase}: {data.metadata['windows_selected']} of {data.metadata['windows_total']} passes "
           "selected"] if phase is not None else []),
        f"plan     {method}: {num_layers} layers x {num_experts} experts -> {slots} slots on {gpus} GPUs"
        f" in {nodes} node{'s' if nodes > 1 else ''}" + _groups_text(groups, nodes),
        *rule_lines,
        *([] if held is None else _held_out_lines(held, placement)),
        _balance_line(before, after, placement, weights, data.num_windows, options, engine),
    ]
    lines += _plan_detail_lines(data=data, placement=placement, weights=weights, options=options, engine=engine,
                                finite=finite, held=None, **detail)
    lines.append(f"time     {elapsed:.2f} s reading and planning; {time.perf_counter() - command_start:.2f} s for the "
                 "whole command (with the estimates, the bound and writing; Python's start-up not included)")
    lines.append(f"wrote    {output} ({output_format})")
    lines += [line for line in (_engine_rows_line(data.layer_ids, output_format, model_layers),
                                _dense_layers_note(weights, data.layer_ids, output_format)) if line]
    return lines


def _plan_bound(placement, weights, engine, max_off_node) -> Bound:
    """The bound ``eplb plan`` judges its plan by: :func:`bound_for` under ``engine``'s rule, or for
    a plan that splits experts by its shares and may serve tokens off node, the bound of that freedom."""
    if placement.shares is None:
        return bound_for(weights, placement, engine)
    return Bound(placement.lower_bound, "capped",
                 f"at most {max_off_node:.0%} of the tokens off their home node, any split among replicas")


def _global_balancedness(weights, method, engine, *, slots, gpus, nodes, groups):
    """``[L]`` balancedness of a plan free of groups on ``weights`` (made for ``engine``'s rule and
    judged under it): what keeping each group on one node costs; ``None`` without a hierarchy."""
    if groups is None or groups % nodes:
        return None
    global_plan = eplb.plan(weights, num_slots=slots, num_gpus=gpus, num_nodes=nodes,
                            method=DEFAULT_METHOD if method == "exact" else method,
                            **({} if engine is None else {"dispatch": engine}))
    return global_plan.balancedness(weights, engine or "uniform")


def _balance_line(before, after, placement, weights, num_windows: int, options: dict, engine) -> str:
    """The in-sample line of ``eplb plan``: balancedness without rebalancing and with the plan
    (``[L]`` each), and the rule it is judged under."""
    moe = moe_layers(weights)
    return (f"balance  {moe_mean(before, weights):.4f} without rebalancing -> {moe_mean(after, weights):.4f} with the "
            f"plan (mean over {moe_note(weights)}; worst layer {after[moe].min() if moe.any() else after.min():.4f})"
            + ("; on the summed windows, in sample" if num_windows > 1 else "")
            + f"; under {_rule_name(engine or 'shares', placement)}"
            + (f", {moe_mean(placement.balancedness(weights, 'optimal'), weights):.4f} with optimal "
               "dispatch" if options.get("dispatch") == "optimal" else ""))


def _rule_name(judge: str, placement=None) -> str:
    """What a figure judged under ``judge`` is judged under, for the line that prints it: a rule of
    :data:`eplb.engines.DISPATCH_RULES` by its label (``"SGLang static dispatch"``), or ``"shares"``,
    the plan's own split: ``"the plan's shares"`` when ``placement`` carries shares, else ``"an even split"``."""
    if judge == "shares":
        return "the plan's shares" if placement is not None and placement.shares is not None else \
            DISPATCH_RULES["uniform"].label
    return DISPATCH_RULES[judge].label


def _plan_records(*, slots, gpus, nodes, groups, method, options, counts, data, phase, previous, used_previous,
                  migration, before, after, gap, bound, placement, weights, global_bal, deployed_bal, elapsed, held,
                  moves, judge=None) -> tuple[dict, dict]:
    """The ``configuration`` and ``diagnostics`` ``eplb plan`` writes beside the placement; the
    windows judged under ``judge`` (``None``: the plan's own rule, :func:`_judge`)."""
    configuration = {
        "num_slots": slots, "num_gpus": gpus, "num_nodes": nodes, "num_groups": groups, "method": method,
        "options": options, "counts_file": str(counts), "counts_format": data.format,
        "counts_shape": list(data.counts.shape), "phase": phase,
        "previous": None if previous is None else str(previous),
        "migration_aware": used_previous, "migration": migration, "command": "eplb " + shlex.join(sys.argv[1:]),
    }
    diagnostics = {
        "balancedness_no_rebalancing": before, "balancedness": after, "gap": gap,
        "lower_bound": bound.values, "bound": bound.description, "max_load": placement.max_load,
        "moe_layers": moe_layers(weights), "balancedness_global_plan": global_bal,
        "balancedness_previous": deployed_bal,
        "replicas_sharing_a_gpu": placement.replicas_sharing_a_gpu(), "time_s": elapsed,
    }
    if data.num_windows > 1:
        diagnostics["windows_judged_under"] = judge or _judge(options)
        per_window = placement.balancedness(data.counts, diagnostics["windows_judged_under"])
        diagnostics["balancedness_per_window"] = moe_mean(per_window, data.counts)
    if held is not None:
        diagnostics["held_out"] = held
    if moves is not None:
        diagnostics["moves"] = {"slots_changed": moves.slots_changed, "gpu_copies": moves.gpu_copies,
                                "cross_node_copies": moves.cross_node_copies,
                                "per_layer_slots_changed": moves.per_layer_slots_changed}
    return configuration, diagnostics


def _plan_detail_lines(*, data, placement, weights, options, objective, held, global_bal, deployed_bal, max_off_node,
                       output_format, engine, bound, finite, moves, used_previous, prev, expert_bytes, model_preset,
                       hardware, diagnostics, migration=None) -> list[str]:
    """The summary lines of ``eplb plan`` after the balance line: the windows in sample (``held``:
    the held-out lines, when the caller has not printed them first), what the groups, the deployed
    plan and the cap cost, the engine's rule, the bound and gap, and the moves; each figure with
    the rule it is judged under."""
    lines = []
    under = f"under {_rule_name(engine or 'shares', placement)}"
    if data.num_windows > 1:
        window_bal = diagnostics["balancedness_per_window"]
        how = "their sum" if (objective or "") == "sum" else f"the windows ({placement.info.get('objective', 'hedged')})"
        lines.append(f"windows  planned from {how}; in sample, each window: {np.nanmean(window_bal):.4f} mean, "
                     f"{np.nanmin(window_bal):.4f} worst; under "
                     f"{_rule_name(diagnostics['windows_judged_under'], placement)}")
    if held is not None:
        lines += _held_out_lines(held, placement)
    if global_bal is not None:
        lines.append(f"global   {moe_mean(global_bal, weights):.4f} with a plan free of groups on the same counts "
                     f"(what keeping each group on one node costs); under {_rule_name(engine or 'uniform')}")
    if deployed_bal is not None:
        deployed, new = moe_mean(deployed_bal, weights), moe_mean(diagnostics["balancedness"], weights)
        lines.append(f"deployed {deployed:.4f} with the previous placement on these counts; {under}")
        if deployed > new + DEPLOYED_BETTER_BY:
            regrouped = np.asarray(placement.info.get("regrouped", False))
            why = [reason for reason, applies in (
                ("it keeps every expert group on one node where the deployed placement spreads them", regrouped.any()),
                ("it was hedged over the windows, not made for their sum",
                 data.num_windows > 1 and (objective or "") != "sum"),
                ("--max-moves/--tolerance kept it near the deployed placement",
                 bool(migration) and not regrouped.all())) if applies]
            lines.append(f"WARNING  the deployed placement serves these counts better than the new plan ({deployed:.4f} "
                         f"against {new:.4f}): keeping it balances them better"
                         + (f" (the new plan is lower because {'; '.join(why)})" if why else ""))
        lines += _regrouped_lines(placement, migration or {})
    if placement.shares is not None:
        even = placement.balancedness(weights, "uniform")
        lines.append(f"off node {100 * float(placement.off_node_fraction(weights).mean()):.1f}% of the tokens served off "
                     f"their group's home node (cap {max_off_node:.0%}), with the plan's shares; split evenly "
                     f"among replicas instead: balance {moe_mean(even, weights):.4f}")
        if output_format != "eplb":
            lines.append(_served_without_shares(placement, weights, output_format))
    if engine is not None:
        lines.append(engine_line(placement, weights, engine))
    lines += [
        f"bound    {bound.description}",
        f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
        f" ({bound.kind}); {under}" if finite.size else "gap      n/a",
    ]
    if moves is not None:
        total = placement.num_layers * placement.num_slots
        how = "migration-aware" if used_previous else "planned from scratch: this eplb.plan has no previous="
        lines.append(f"moves    {moves.slots_changed} of {total} slots changed ({100 * moves.slots_changed / total:.1f}%),"
                     f" {moves.gpu_copies} weight copies to GPUs, {moves.cross_node_copies} across nodes ({how})")
        if expert_bytes is not None or model_preset is not None:
            lines.append(_copy_cost_line(prev.placement, placement, expert_bytes, model_preset, hardware))
    return lines


DEPLOYED_BETTER_BY = 5e-4
"""How much higher the deployed placement's balancedness must be than the new plan's on the same
counts for ``eplb plan --previous`` to warn that the deployed one serves them better (the fourth
decimal the summary prints)."""


def _note_plan_warnings(caught, quiet: bool) -> None:
    """The ``RuntimeWarning``s of planning, each once on stderr as one ``note:`` line; the warning
    that the deployed plan spreads groups over nodes is said by :func:`_regrouped_lines` instead."""
    from .planning.migration import SPREAD_WARNING

    seen = set()
    for warning in caught:
        message = str(warning.message)
        if quiet or message.startswith(SPREAD_WARNING) or message in seen:
            continue
        seen.add(message)
        click.echo(f"note: {message}", err=True)


def _regrouped_lines(placement, migration: dict) -> list[str]:
    """One summary line when the deployed placement spread expert groups over nodes and the plan
    gathered them again (``placement.info["regrouped"] [L]``), saying where it changed more slots
    than ``--max-moves`` allows."""
    regrouped = np.asarray(placement.info.get("regrouped", np.zeros(0, bool)), bool)
    if not regrouped.any():
        return []
    layers = np.flatnonzero(regrouped)
    changed = np.asarray(placement.info.get("slots_changed", np.zeros(len(regrouped))), np.int64)[layers]
    shown = ", ".join(str(int(i)) for i in layers[:6]) + (", ..." if layers.size > 6 else "")
    line = (f"regroup  the deployed placement spreads expert groups over nodes in {layers.size} layer"
            f"{'s' if layers.size > 1 else ''} ({shown}): the plan keeps every group on one node there, changing "
            f"{changed.min()}..{changed.max()} slots per layer")
    budget = migration.get("max_moves")
    if budget is not None and (changed > budget).any():
        line += f", more than --max-moves {budget} in {int((changed > budget).sum())} of them"
    return [line]


def _recorded_engine(engine, placement, plan_file, also: str = "") -> tuple[str | None, list[str]]:
    """``--engine``, else the rule the placement file records the plan was made for (eplb JSON and
    ``.npz``, the SGLang side file, the YAML's ``# eplb:`` comment) when it is not an even split,
    with the line that says so (and ``also``): a plan made for SGLang's static table is judged under it."""
    recorded = placement.dispatch
    if engine is not None or DISPATCH_RULES[recorded].kind == "uniform":
        return engine, []
    return recorded, [f"rule     judged under {DISPATCH_RULES[recorded].label}, the rule {plan_file} records the plan "
                      f"was made for{also} (--engine NAME judges under another; --engine vllm: an even split)"]


def _judge(options: dict) -> str:
    """How a plan made with ``options`` is split among replicas when judged: its own rule (an even
    split, or its shares, unless it was made for optimal dispatch or an engine's rule)."""
    rule = options.get("dispatch", "uniform")
    return rule if DISPATCH_RULES[rule].kind in ("optimal", "engine") else "shares"


def _held_out_estimates(counts, method, options, deployment, judge=None) -> dict | None:
    """Leave one window out (:func:`eplb.held_out`) for this plan's options and for the summed
    plan on ``deployment`` (:func:`eplb.plan`'s keywords: slots or a topology, GPUs, nodes,
    groups, previous), both judged under ``judge`` (``None``: the plan's rule, :func:`_judge`):
    ``{"folds", "plan": [F], "summed": [F], "empty": int, "judge": str}``, leaving out the held-out
    blocks whose windows carry no load (an idle pass has nothing to balance; :func:`eplb.held_out`
    scores them NaN), ``"empty"`` of them; ``None`` for the exact method (one exact plan per fold
    would take too long: say so instead)."""
    if method == "exact":
        return None
    judge = judge or _judge(options)
    deployment = {**deployment, "method": method}
    mine = eplb.held_out(counts, **deployment, **options, judge=judge)
    summed_options = {k: v for k, v in options.items() if k not in ("objective", "dispatch")}
    summed = mine if options.get("objective") == "sum" and "dispatch" not in options else \
        eplb.held_out(counts, **deployment, **summed_options, objective="sum", judge=judge)
    loaded = ~np.isnan(mine)  # the same blocks in both: a block's load does not depend on the plan
    return {"folds": int(loaded.sum()), "plan": mine[loaded], "summed": summed[loaded],
            "empty": int((~loaded).sum()), "judge": judge}


def _left_out_note(held: dict) -> str:
    """``"; 1 block of windows carrying no load left out"`` for :func:`_held_out_estimates`' result (or ``""``)."""
    empty = held.get("empty", 0)
    return f"; {empty} block{'s' if empty > 1 else ''} of windows carrying no load left out" if empty else ""


def _held_out_lines(held: dict, placement) -> list[str]:
    """The summary lines of the held-out estimate (what windows the plan was not made from get:
    what the engine will see), with a recommendation only from held-out figures."""
    mine, summed = held["plan"], held["summed"]
    skipped = _left_out_note(held)
    under = f"under {_rule_name(held['judge'], placement)}"
    if mine.size == 0:
        return [f"held out n/a: every held-out block of windows carries no load; {under}"]
    lines = [f"held out {mine.mean():.4f} mean, {mine.min():.4f} worst window with this plan's options; "
             f"{summed.mean():.4f} / {summed.min():.4f} planned on the summed windows "
             f"(each of {held['folds']} blocks of windows served by the plan made from the others{skipped}); "
             f"{under}"]
    if mine.mean() < summed.mean() - 0.002:
        lines.append("note     held out, the summed plan serves unseen windows better here: consider --objective sum")
    return lines


def _copy_cost_line(old, new, expert_bytes, model_preset, hardware) -> str:
    """The bytes the copies from ``old`` to ``new`` move and their time on ``hardware``
    (:func:`eplb.transfer_plan`, :meth:`eplb.CostModel.transfer_time`: all layers at once, each GPU's
    slowest link)."""
    from .model.cost import CostModel
    from .serving.transfer import transfer_plan

    overrides = {} if expert_bytes is None else {"expert_bytes": expert_bytes}
    cost = CostModel.preset(hardware, model_preset or "deepseek-v3", **overrides)
    transfer = transfer_plan(old, new, expert_bytes=int(cost.expert_bytes))
    moved = transfer.bytes()
    between = moved["intra_node"] + moved["cross_node"]
    source = f"{int(cost.expert_bytes):,} bytes per expert" + (f" ({model_preset})" if expert_bytes is None else "")
    return (f"copies   {between / 2**30:.3g} GiB between GPUs ({moved['intra_node'] / 2**30:.3g} GiB over NVLink, "
            f"{moved['cross_node'] / 2**30:.3g} GiB across nodes) and {moved['intra_gpu'] / 2**30:.3g} GiB within GPUs, "
            f"{source}; {1e3 * cost.transfer_time(transfer):.3g} ms all at once on {hardware} "
            f"(the busiest GPU's slowest link)")


ENGINE_ROWS = tuple(name for name in PLACEMENT_FORMATS if name in {engine.loads for engine in ENGINES.values()})
"""The output formats an engine loads (:data:`eplb.engines.ENGINES`), whose rows ``eplb plan`` places by
model layer (``--num-layers``): ``("sglang", "trtllm")``."""


def _plan_output_format(output, output_format, num_layers, quiet: bool) -> str:
    """The format ``eplb plan`` writes: ``--format``, else from the name of ``-o`` (an engine's file
    name picks its format, with a note on stderr); ``--num-layers`` only with an engine's format."""
    from .io.formats import placement_format_for_output

    if output_format is None:
        output_format = _output_format(output, placement_format_for_output)
        _note_engine_file_name(output, output_format, quiet)
    if num_layers is not None and output_format not in ENGINE_ROWS:
        raise click.BadParameter(f"applies to engine output ({', '.join(ENGINE_ROWS)}) only, not to {output_format} "
                                 "output (which keeps the counts' layer ids)", param_hint="--num-layers")
    return output_format


def _check_experts_fit(data, slots: int) -> None:
    """Every expert needs a slot: a flat array (read as one layer of experts) with more numbers
    than ``--slots`` is refused saying so, the shapes counts take and, when a model's expert count
    divides it, the layers x experts it may hold (other shapes get the planner's message)."""
    if data.num_experts <= slots or data.num_layers > 1 or data.num_windows > 1:
        return
    per_layer = sorted({m.num_experts for m in COST_MODELS.values()
                        if m.num_experts <= slots and data.num_experts % m.num_experts == 0})
    guess = (f" (e.g. [{data.num_experts // per_layer[-1]}, {per_layer[-1]}] for {per_layer[-1]} experts a layer)"
             if per_layer else "")
    raise Failure(f"{data.path} holds one row of {data.num_experts} numbers, read as one layer of "
                  f"{data.num_experts} experts: more experts than --slots {slots} (every expert needs a slot). "
                  f"Counts are [E] (one layer), [L, E] or [T, L, E]: if the numbers are several layers flattened, "
                  f"save them as [layers, experts]{guess}")


def _model_layers(data, layer_ids, model_preset, num_layers, output_format):
    """``(data, model_layers)``: the counts with the model layer of each row, and the model's layer
    count for an engine's file (``--num-layers``, else ``--model``'s; ``None``: the largest id + 1).

    A file that records its layers (a layer column, an ``.npz``'s ``layer_ids``, SGLang's and
    TensorRT-LLM's files) says which they are; ``--layer-ids`` says it for one that does not (and
    must agree with one that does); else ``--model`` does, when the rows are its MoE layers
    (DeepSeek-V3: 58 rows are layers 3..60) or all its layers. Rows no one names are layers
    ``0 .. L-1``, which an engine's file of more layers (``--num-layers``) would put on the wrong
    rows: refused, asking which model layers they are."""
    from dataclasses import replace

    from .io.formats import FormatError
    from .io.formats.data import layer_ranges, parse_layer_ranges

    if layer_ids is not None:
        try:
            ids = parse_layer_ranges(layer_ids, None, "--layer-ids")
        except FormatError as exc:
            raise click.BadParameter(exc.problem, param_hint="--layer-ids") from None
        if ids.size != data.num_layers:
            raise click.BadParameter(f"{layer_ranges(ids)} names {ids.size} layers, but {data.path} holds "
                                     f"{data.num_layers} rows of counts", param_hint="--layer-ids")
        if data.layer_ids_recorded and not np.array_equal(ids, data.layer_ids):
            raise click.BadParameter(f"{data.path} records its rows as model layers {layer_ranges(data.layer_ids)}, "
                                     f"not {layer_ranges(ids)}", param_hint="--layer-ids")
        data = replace(data, layer_ids=ids, layer_ids_recorded=True)
    model = None if model_preset is None else COST_MODELS[model_preset]
    fits = model is not None and data.num_experts == model.num_experts and \
        data.num_layers in (model.num_moe_layers, model.num_layers)
    if fits and not data.layer_ids_recorded:
        ids = model.moe_layer_ids if data.num_layers == model.num_moe_layers else np.arange(model.num_layers)
        data = replace(data, layer_ids=ids, layer_ids_recorded=True)
    if output_format not in ENGINE_ROWS:
        return data, num_layers
    if model is not None and not fits:
        raise click.BadParameter(
            f"{model.name} has {model.num_layers} layers ({model.num_moe_layers} MoE layers "
            f"{layer_ranges(model.moe_layer_ids)}) of {model.num_experts} experts, but {data.path} holds "
            f"{data.num_layers} layers x {data.num_experts} experts: for another model pass --num-layers and "
            "--layer-ids", param_hint="--model")
    if model is not None and num_layers is not None and num_layers != model.num_layers:
        raise click.BadParameter(f"{num_layers}, but {model.name} has {model.num_layers} layers",
                                 param_hint="--num-layers")
    num_layers = model.num_layers if model is not None else num_layers
    if num_layers is not None and data.layer_ids.max() >= num_layers:
        raise click.BadParameter(f"{num_layers} layers, but {data.path} holds counts of model layer "
                                 f"{int(data.layer_ids.max())}: the model's layer count must exceed every layer id",
                                 param_hint="--num-layers")
    if num_layers is not None and num_layers > data.num_layers and not data.layer_ids_recorded:
        dense = num_layers - data.num_layers
        raise click.BadParameter(
            f"{num_layers} layers, but {data.path} holds {data.num_layers} rows of counts and does not record which "
            f"model layers they are: pass --layer-ids (--layer-ids {dense}..{num_layers - 1} if the first {dense} "
            "layers are dense) or --model NAME", param_hint="--num-layers")
    return data, num_layers


def _engine_rows_line(layer_ids, output_format: str, num_layers) -> str:
    """The summary line saying where the rows of an engine's file go: SGLang's map has a row per
    model layer (``layer_ids [L]`` from the counts, the others SGLang's trivial rows);
    TensorRT-LLM's YAML is keyed by the layer ids. ``""`` for other formats."""
    from .io.formats.data import layer_ranges

    if output_format not in ENGINE_ROWS:
        return ""
    planned = layer_ranges(layer_ids)
    if output_format == "trtllm":
        return (f"layers   {planned}: the YAML's keys, the model's layer ids (TensorRT-LLM looks each MoE layer's "
                "row up by its layer index)")
    rows = int(num_layers) if num_layers is not None else int(np.max(layer_ids)) + 1
    rest = sorted(set(range(rows)) - {int(i) for i in layer_ids})
    return (f"layers   SGLang's map has {rows} rows, one per model layer (row l is layer l"
            + (", --num-layers" if num_layers is not None else "; the largest layer id + 1, else pass --num-layers")
            + f"): {planned} planned from the counts"
            + (f", {layer_ranges(rest)} (not in the counts) SGLang's trivial placement" if rest else ""))


def _served_without_shares(placement, weights, output_format: str) -> str:
    """The note for a plan with shares written where they cannot go: what the engine's own rule serves."""
    head = f"note     {output_format} files cannot carry the shares (eplb JSON does): "
    even = moe_mean(placement.balancedness(weights, "uniform"), weights)
    if output_format == "sglang":
        static = moe_mean(placement.balancedness(weights, "sglang-static"), weights)
        return (head + f"SGLang serves it by its own rule: balance {static:.4f} under {DISPATCH_RULES['sglang-static'].label} "
                f"(its default with an all-to-all backend such as DeepEP), {even:.4f} under dynamic dispatch with "
                "--moe-a2a-backend none (an even split)")
    if output_format == "trtllm":
        return head + f"TensorRT-LLM splits each expert's tokens evenly among its replicas: balance {even:.4f}"
    return head + f"an engine loading it splits by its own rule (an even split: balance {even:.4f})"


def _note_engine_file_name(output, output_format: str, quiet: bool) -> None:
    """Say on stderr when the name of ``-o`` chose an engine's format that its suffix alone would not."""
    from .io.formats import named_output_format

    if named_output_format(output) == output_format and not quiet:
        click.echo(f"note: {Path(output).name} is the name of a {output_format} file: writing {output_format}'s format "
                   "(pass --format eplb for eplb's JSON)", err=True)


DENSE_LAYERS_IN = {engine.loads: engine.dense_layers for engine in ENGINES.values() if engine.loads is not None}
"""What each engine does with the placement rows of dense layers (all-zero counts), by the format
it loads (:attr:`eplb.engines.contract.Engine.dense_layers`)."""


def _dense_layers_note(weights: np.ndarray, layer_ids, output_format: str) -> str:
    """A summary line naming the dense layers (no tokens) and what the engine of ``output_format``
    does with their rows; ``""`` when there are none or the format is not an engine's."""
    dense = np.flatnonzero(~moe_layers(weights))
    if dense.size == 0 or output_format not in DENSE_LAYERS_IN:
        return ""
    ids = np.asarray(layer_ids)[dense] if layer_ids is not None else dense
    shown = ", ".join(str(int(i)) for i in ids[:8]) + (", ..." if ids.size > 8 else "")
    return (f"dense    layer{'s' if ids.size > 1 else ''} {shown} carr{'y' if ids.size > 1 else 'ies'} no tokens "
            f"(any placement serves them): {DENSE_LAYERS_IN[output_format]}")


def _note_global_groups(groups, nodes, quiet: bool) -> None:
    """Say on stderr when ``--groups`` does not divide over ``--nodes``: the published rule then
    plans a global placement and ignores the groups."""
    if groups is None or groups % nodes == 0 or quiet:
        return
    click.echo(f"note: --groups {groups} is not a multiple of --nodes {nodes}, so the placement is global and the "
               f"groups are ignored (the published rule); for a hierarchical plan (every group on one node) pass "
               f"--groups as a multiple of --nodes (and a divisor of the experts)", err=True)


def _groups_text(groups, nodes) -> str:
    if not groups:
        return ""
    return f", {groups} groups" + (" (ignored: global placement)" if groups % nodes else "")


def _check_flag_sizes(**values) -> None:
    """Refuse sizes on the command line beyond the documented limits before anything is allocated."""
    from .io.formats.limits import check_size

    names = {"slots": "slots", "gpus": "gpus", "nodes": "gpus", "groups": "experts", "deployed-slots": "slots",
             "num-layers": "layers"}
    for flag, value in values.items():
        if value is not None:
            try:
                check_size(value, names[flag], f"--{flag}")
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=f"--{flag}") from None


def _refuse_input_as_output(output, inputs, what: str = "-o") -> None:
    """``-o`` must not name (or link to) an input: writing it would destroy the input."""
    output = Path(output)
    for path in inputs:
        if path is None:
            continue
        path = Path(path)
        same = output.resolve() == path.resolve()
        if not same and output.exists() and path.exists():
            try:
                same = output.samefile(path)
            except OSError:
                same = False
        if not same and path.is_dir():
            same = path.resolve() in output.resolve().parents
        if same:
            raise click.BadParameter(f"{what} {output} is an input file ({path}); write the plan elsewhere",
                                     param_hint="--output")


def _note_overwrite(output, quiet: bool) -> None:
    if Path(output).exists() and not quiet:
        click.echo(f"note: replacing the existing file {output}", err=True)


def _output_format(path, infer):
    try:
        return infer(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--format") from None


def _shape_text(data) -> str:
    text = f"{data.num_layers} layers x {data.num_experts} experts"
    if data.num_windows > 1:
        text = f"{data.num_windows} windows x {text}"
        if data.metadata.get("passes_per_window"):
            text += f" (windows of {data.metadata['passes_per_window']} passes)"
    return text


# -- plan across a deployment change (--lost-gpus, --gpu-map, --slots-per-gpu, --gpus) ----------------


class ChangeRefused(Failure):
    """Exit 2 with ``Error: <message>`` on one line: flags that describe a deployment change that
    cannot be made (nothing is written)."""

    exit_code = 2


CHANGE_FLAGS = {"lost_gpus": "--lost-gpus", "gpu_map": "--gpu-map", "slots_per_gpu": "--slots-per-gpu"}
"""``eplb plan``'s flags that describe a change from the deployment of ``--previous``."""


def _plans_across_change(params: dict) -> bool:
    """Whether ``eplb plan`` re-plans across a deployment change: ``--previous`` with a change flag
    (:data:`CHANGE_FLAGS`), without ``--slots``/``--gpus`` (taken from it), or with slots or GPUs
    other than the file records. Without ``--previous``, a change flag is refused and
    ``--slots``/``--gpus`` are required."""
    given = [flag for name, flag in CHANGE_FLAGS.items() if params[name] is not None]
    if params["previous"] is None:
        if given:
            raise ChangeRefused(f"{given[0]} describes a change from the deployed placement: give --previous")
        missing = [f"--{name}" for name in ("slots", "gpus") if params[name] is None]
        if missing:
            raise click.UsageError(f"Missing option '{missing[0]}' (or give --previous: the deployment is then "
                                   "taken from it)")
        return False
    if given or params["slots"] is None or params["gpus"] is None:
        return True
    recorded = _recorded_topology(params["previous"], params["previous_format"])
    if recorded is None:  # unreadable here: the usual path says why
        return False
    # other slots or GPUs; other nodes alone are a mismatch the usual path names (a flag forgotten)
    return (params["slots"], params["gpus"]) != (recorded.num_slots, recorded.num_gpus)


def _flag_given(name: str) -> bool:
    """Whether the command line set parameter ``name`` (not its default)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _recorded_topology(path, fmt):
    """The topology a placement file records, or ``None`` when it records none or cannot be read."""
    from .io.formats import FormatError, read_placement

    try:
        return read_placement(path, fmt).placement.topology
    except (FormatError, ValueError, OSError):
        return None


def _index_list(text: str, flag: str, minimum: int = 0) -> list[int]:
    """``"5,6"`` -> ``[5, 6]`` (whole numbers ``>= minimum``), else :class:`ChangeRefused` naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise ChangeRefused(f"{flag}: expected whole numbers >= {minimum} separated by commas, got {text!r}")
    return values


def _lost_deployment(old, lost_text: str, *, slots_per_gpu, slots, gpus, nodes_given, nodes) -> "eplb.Topology":
    """The topology of ``old`` (an :class:`eplb.Deployment`) with the GPUs of ``--lost-gpus`` holding
    no slots, the survivors ``--slots-per-gpu`` each (default: theirs)."""
    topology = old.topology
    if gpus is not None and gpus != topology.num_gpus:
        raise ChangeRefused(f"--gpus {gpus} with --lost-gpus: lost GPUs keep their index, so the deployment keeps "
                            f"{topology.num_gpus} GPUs; to renumber the survivors give --gpu-map instead")
    if nodes_given and nodes != topology.num_nodes:
        raise ChangeRefused(f"--nodes {nodes} with --lost-gpus: the GPUs keep their nodes ({topology.num_nodes})")
    lost = np.unique(_index_list(lost_text, "--lost-gpus"))
    if lost.max() >= topology.num_gpus:
        raise ChangeRefused(f"--lost-gpus: the GPUs of --previous are 0 ... {topology.num_gpus - 1}, got "
                            f"{', '.join(map(str, lost[lost >= topology.num_gpus].tolist()))}")
    empty = lost[topology.slots_per_gpu[lost] == 0]
    if empty.size:
        raise ChangeRefused(f"--lost-gpus: GPU {', '.join(map(str, empty.tolist()))} holds no slots in --previous already")
    new = topology.slots_per_gpu.copy()
    if slots_per_gpu is not None:
        new[new > 0] = slots_per_gpu
    new[lost] = 0
    survivors = int((new > 0).sum())
    if survivors == 0:
        raise ChangeRefused(f"--lost-gpus: every GPU lost, no slot left for {old.num_experts} experts")
    if new.sum() < old.num_experts:
        raise ChangeRefused(f"{lost.size} GPU{'s' if lost.size > 1 else ''} lost: {int(new.sum())} slots for "
                            f"{old.num_experts} experts; give the survivors --slots-per-gpu "
                            f"{-(-old.num_experts // survivors)}")
    if slots is not None and slots != int(new.sum()):
        raise ChangeRefused(f"--slots {slots}: after the loss the survivors hold {int(new.sum())} slots (--slots-per-gpu "
                            "sets theirs)")
    return eplb.Topology(new, topology.num_nodes)


def _resized_deployment(old, gpu_map, *, slots_per_gpu, slots, gpus, nodes_given, nodes) -> "eplb.Topology":
    """The uniform topology of ``--gpus`` GPUs (default: as many as ``--gpu-map`` reaches, else
    ``old``'s), ``--slots-per-gpu`` each (else ``--slots / --gpus``, else ``old``'s), in ``--nodes``
    nodes (default: nodes of as many GPUs as ``old``'s)."""
    topology = old.topology
    count = gpus if gpus is not None else (max(gpu_map) + 1 if gpu_map is not None else topology.num_gpus)
    if count < 1:
        raise ChangeRefused("--gpu-map: every GPU gone (-1): give --gpus for the new deployment")
    if slots_per_gpu is None and slots is not None:
        if slots % count:
            raise ChangeRefused(f"--slots {slots} does not divide over {count} GPUs")
        slots_per_gpu = slots // count
    if slots_per_gpu is None:
        serving = np.unique(topology.slots_per_gpu[topology.slots_per_gpu > 0])
        if serving.size > 1:
            raise ChangeRefused(f"--previous holds {serving.tolist()} slots on its GPUs: give --slots-per-gpu for the "
                                "new deployment")
        slots_per_gpu = int(serving[0])
    if slots is not None and slots != slots_per_gpu * count:
        raise ChangeRefused(f"--slots {slots} is not {count} GPUs x --slots-per-gpu {slots_per_gpu}")
    per_node = topology.gpus_per_node
    if not nodes_given and count % per_node:
        raise ChangeRefused(f"{count} GPUs do not fill nodes of {per_node} GPUs (those of --previous): give --nodes")
    node_count = nodes if nodes_given else count // per_node
    if count % node_count:
        raise ChangeRefused(f"--nodes {node_count}: {count} GPUs do not divide over them")
    if slots_per_gpu * count < old.num_experts:
        raise ChangeRefused(f"{count} GPUs x {slots_per_gpu} slots: {slots_per_gpu * count} slots for {old.num_experts} "
                            f"experts; give --slots-per-gpu {-(-old.num_experts // count)}")
    return eplb.Topology.uniform(slots_per_gpu * count, count, node_count)


def _deployment_change(old, params: dict) -> "eplb.DeploymentChange":
    """The change ``eplb plan``'s flags describe from ``old`` (the deployment of ``--previous``), or
    :class:`ChangeRefused` naming the flag and the rule."""
    sizes = dict(slots_per_gpu=params["slots_per_gpu"], slots=params["slots"], gpus=params["gpus"],
                 nodes_given=_flag_given("nodes"), nodes=params["nodes"])
    if params["lost_gpus"] is not None and params["gpu_map"] is not None:
        raise ChangeRefused("--lost-gpus and --gpu-map: give one (-1 in --gpu-map loses that GPU)")
    gpu_map = None if params["gpu_map"] is None else _index_list(params["gpu_map"], "--gpu-map", minimum=-1)
    if gpu_map is not None and len(gpu_map) != old.num_gpus:
        raise ChangeRefused(f"--gpu-map: one new index per GPU of --previous: {old.num_gpus} entries, got {len(gpu_map)}")
    kept = [g for g in gpu_map or () if g >= 0]
    if len(set(kept)) < len(kept):
        twice = sorted({g for g in kept if kept.count(g) > 1})
        raise ChangeRefused(f"--gpu-map maps two GPUs of --previous to one new GPU ({', '.join(map(str, twice))})")
    if params["lost_gpus"] is not None:
        topology = _lost_deployment(old, params["lost_gpus"], **sizes)
    else:
        topology = _resized_deployment(old, gpu_map, **sizes)
    groups = params["groups"] if params["groups"] is not None else old.num_groups
    try:
        new = eplb.Deployment.of(old.num_experts, topology=topology, num_groups=groups)
    except ValueError as exc:
        raise ChangeRefused(f"--groups: {exc}") from None
    try:
        return eplb.DeploymentChange(old, new, gpu_map)
    except ValueError as exc:
        raise ChangeRefused(f"--gpu-map: {exc}") from None


def _check_engine_layout(change, output_format: str) -> None:
    """Refuse an engine's format for a deployment whose GPUs hold different slot counts (a lost GPU
    holds none), saying how to renumber the survivors for the engine restarted on them."""
    topology = change.new.topology
    if output_format not in ENGINE_ROWS or topology.is_uniform:
        return
    serving = np.flatnonzero(topology.slots_per_gpu > 0)
    ranks = np.full(topology.num_gpus, -1)
    ranks[serving] = np.arange(serving.size)
    mapped = np.where(change.gpu_map >= 0, ranks[np.maximum(change.gpu_map, 0)], -1)
    slots = np.unique(topology.slots_per_gpu[serving])
    per_node = change.old.topology.gpus_per_node
    hint = (f"--gpus {serving.size} --gpu-map {','.join(map(str, mapped.tolist()))}"
            + (f" --slots-per-gpu {int(slots[0])}" if slots.size == 1 else "")
            + (" --nodes 1" if serving.size % per_node else ""))
    raise ChangeRefused(f"--format {output_format}: the engine needs the same slots on every GPU and the new deployment "
                        f"holds {topology.slots_per_gpu.tolist()}: write eplb JSON (.json) or .npz, or renumber the "
                        f"survivors for the engine restarted on them: {hint}")


def _plan_across_change(params: dict, command_start: float) -> None:
    """``eplb plan --previous FILE`` across a deployment change: the placement in service re-planned
    for the deployment the flags describe (:func:`_deployment_change`), its transfer plan priced,
    written and summarised."""
    from .analysis import metrics
    from .io.formats import FormatError, write_placement
    from .model.cost import CostModel
    from .serving.transfer import transfer_plan

    p, quiet = params, params["quiet"]
    migration, options = _plan_options(p["method"], p["previous"], p["tolerance"], p["max_moves"], p["time_limit"],
                                       p["deterministic_time"], engine=p["engine"], dispatch=p["dispatch"],
                                       objective=p["objective"], max_off_node=p["max_off_node"],
                                       expert_bytes=p["expert_bytes"], model_preset=p["model_preset"], groups=p["groups"],
                                       nodes=p["nodes"])
    output_format = _plan_output_format(p["output"], p["output_format"], p["num_layers"], quiet)
    if p["layer_updates_per_iter"] and output_format != "trtllm":
        raise click.BadParameter(f"applies to TensorRT-LLM YAML output only, not to {output_format} output",
                                 param_hint="--layer-updates-per-iter")
    _check_flag_sizes(slots=p["slots"], gpus=p["gpus"], nodes=p["nodes"], groups=p["groups"],
                      **{"num-layers": p["num_layers"]})
    _refuse_input_as_output(p["output"], [p["counts"], p["previous"]])
    if output_format == "sglang":
        from .io.formats.sglang import sidecar_path

        _refuse_input_as_output(sidecar_path(p["output"]), [p["counts"], p["previous"]], what="the SGLang side file of -o")
    start = time.perf_counter()
    data = _read_plan_counts(p["counts"], p["input_format"], p["transpose"], p["allow_shape"], p["phase"],
                             p["passes_per_window"])
    weights = data.weights
    data, model_layers = _model_layers(data, p["layer_ids"], p["model_preset"], p["num_layers"], output_format)
    prev = _read_previous(p["previous"], p["previous_format"], None, None, None, data)
    old = prev.placement
    if all(p[name] is None for name in CHANGE_FLAGS) and (old.num_layers, old.num_experts) != weights.shape:
        # flags that differ from a placement of other experts or layers: not a change, a mismatch (exit 1)
        _check_previous(prev, dict(layers=weights.shape[0], experts=weights.shape[1], slots=p["slots"] or old.num_slots,
                                   gpus=p["gpus"] or old.num_gpus, nodes=p["nodes"]), p["previous"])
    if prev.placement.num_experts != weights.shape[1]:
        raise ChangeRefused(f"--previous {p['previous']} places {prev.placement.num_experts} experts and the counts have "
                            f"{weights.shape[1]}: a deployment change keeps the experts")
    if prev.placement.num_layers != weights.shape[0]:
        raise FormatError(p["previous"], f"incompatible configuration: the previous placement has "
                                         f"{prev.placement.num_layers} layers, the counts {weights.shape[0]}")
    _check_previous_layers(prev, data.layer_ids, p["previous"])
    change = _deployment_change(prev.placement.deployment, p)
    _check_engine_layout(change, output_format)
    _note_global_groups(p["groups"] or change.old.num_groups, change.new.num_nodes, quiet)
    if _accepts(METHODS[p["method"]], "progress"):
        options["progress"] = show_progress(quiet)
    with warnings.catch_warnings(record=True) as caught:  # said in one line each below, not raw
        warnings.simplefilter("always", RuntimeWarning)
        work = functools.partial(eplb.plan, data.counts, change, previous=prev.placement, method=p["method"],
                                 **migration, **options)
        timed = show_progress(quiet) and p["method"] != "greedy" and "progress" not in options
        placement = _with_timer(work, f"re-planning {weights.shape[0]} layers across the change") if timed else work()
    options.pop("progress", None)
    elapsed = time.perf_counter() - start
    _note_plan_warnings(caught, quiet)
    overrides = {} if p["expert_bytes"] is None else {"expert_bytes": p["expert_bytes"]}
    cost = CostModel.preset(p["hardware"], p["model_preset"] or "deepseek-v3", **overrides)
    # (an identity change as its deployment: transfer_plan refuses a DeploymentChange that changes nothing)
    transfer = transfer_plan(prev.placement, placement, change.new if change.is_identity else change,
                             expert_bytes=int(cost.expert_bytes))
    judge = p["engine"] or "shares"
    figures = {"before": prev.placement.balancedness(weights, judge), "after": placement.balancedness(weights, judge),
               "bound": _plan_bound(placement, weights, p["engine"], p["max_off_node"]), "transfer": transfer,
               "recovery_s": cost.transfer_time(transfer), "cost": cost, "elapsed": elapsed, "judge": judge}
    figures["gap"] = metrics.gap(placement.gpu_loads(weights, judge).max(axis=-1), figures["bound"].values)
    configuration, diagnostics = _change_records(p, data, change, placement, options, migration, figures)
    _note_overwrite(p["output"], quiet)
    write_placement(placement, p["output"], output_format, layer_ids=data.layer_ids, configuration=configuration,
                    diagnostics=diagnostics, layer_updates_per_iter=p["layer_updates_per_iter"], num_layers=model_layers)
    if not quiet:
        lines = _change_summary(p, data, change, placement, figures)
        lines.append(f"time     {elapsed:.2f} s reading and planning; {time.perf_counter() - command_start:.2f} s for "
                     "the whole command")
        lines.append(f"wrote    {p['output']} ({output_format})")
        lines += [line for line in (_engine_rows_line(data.layer_ids, output_format, model_layers),
                                    _dense_layers_note(weights, data.layer_ids, output_format)) if line]
        click.echo("\n".join(lines))


def _change_records(p: dict, data, change, placement, options: dict, migration: dict, figures: dict) -> tuple[dict, dict]:
    """The ``configuration`` and ``diagnostics`` ``eplb plan`` writes beside a plan across a change."""
    new, old, info = change.new, change.old, placement.info
    configuration = {
        "num_slots": new.num_slots, "num_gpus": new.num_gpus, "num_nodes": new.num_nodes, "num_groups": new.num_groups,
        "slots_per_gpu": new.topology.slots_per_gpu.tolist(), "method": p["method"], "options": options,
        "counts_file": str(p["counts"]), "counts_format": data.format, "counts_shape": list(data.counts.shape),
        "phase": p["phase"], "previous": str(p["previous"]), "migration_aware": True, "migration": migration,
        "command": "eplb " + shlex.join(sys.argv[1:]),
        "change": {"description": change.describe(), "gpu_map": change.gpu_map.tolist(),
                   "lost_gpus": change.lost_gpus.tolist(), "added_gpus": change.added_gpus.tolist(),
                   "previous_slots_per_gpu": old.topology.slots_per_gpu.tolist(),
                   "previous_num_nodes": old.num_nodes},
    }
    transfer = figures["transfer"]
    diagnostics = {
        "balancedness_previous": figures["before"], "balancedness": figures["after"], "gap": figures["gap"],
        "lower_bound": figures["bound"].values, "bound": figures["bound"].description,
        "max_load": placement.max_load, "moe_layers": moe_layers(data.weights), "orphans": info.get("orphans"),
        "copy_floor": info.get("copy_floor"), "copies": info.get("copies"), "relaxed": info.get("relaxed"),
        "transfer": transfer.summary(), "recovery_s": figures["recovery_s"], "hardware": figures["cost"].name,
        "expert_bytes": int(figures["cost"].expert_bytes), "time_s": figures["elapsed"],
        "judged_under": figures["judge"],
    }
    return configuration, diagnostics


def _change_summary(p: dict, data, change, placement, figures: dict) -> list[str]:
    """The lines ``eplb plan`` prints for a plan across a deployment change (the time and what was
    written follow)."""
    weights, new, info = data.weights, change.new, placement.info
    moe = moe_layers(weights)
    before, after = figures["before"], figures["after"]
    serving = int((new.topology.slots_per_gpu > 0).sum())
    orphans = int(np.sum(info.get("orphans", 0)))
    floor = int(np.sum(info.get("copy_floor", 0)))
    copies, moved = figures["transfer"].counts(), figures["transfer"].bytes()
    cost = figures["cost"]
    over_floor = f", {copies['total'] / floor:.2f}x the floor of {floor:,}" if floor else ", the floor is 0"
    size = (f"{int(cost.expert_bytes):,} bytes per expert"
            + (f", {p['model_preset'] or 'deepseek-v3'}'s: --model or --expert-bytes for yours"
               if p["expert_bytes"] is None else ""))
    gib = {kind: value / 2**30 for kind, value in moved.items()}
    lines = [
        f"counts   {data.path} ({data.format}): {_shape_text(data)}",
        f"change   {change.describe()}",
        f"plan     {p['method']}: {weights.shape[0]} layers x {weights.shape[1]} experts -> {new.num_slots} slots on "
        f"{serving} GPUs in {new.num_nodes} node{'s' if new.num_nodes > 1 else ''}"
        + _groups_text(new.num_groups, new.num_nodes)
        + f", re-planned from the placement in service ({p['previous']})",
        f"balance  {moe_mean(before, weights):.4f} in service before the change -> {moe_mean(after, weights):.4f} with "
        f"the plan (mean over {moe_note(weights)}; worst layer {after[moe].min() if moe.any() else after.min():.4f})"
        + ("" if p["engine"] is None else f"; under {DISPATCH_RULES[p['engine']].label}"),
        f"orphans  {orphans:,} experts lost every replica ({orphans / weights.shape[0]:.1f} a layer): each loaded from "
        "host memory once",
        f"copies   {copies['total']:,} weight copies{over_floor} (the fewest any re-plan makes): {copies['from_host']:,} "
        f"from host memory, {copies['intra_node']:,} over NVLink, {copies['cross_node']:,} across nodes, "
        f"{copies['intra_gpu']:,} within GPUs",
        f"bytes    {gib['total']:.3g} GiB: {gib['from_host']:.3g} from host, {gib['intra_node']:.3g} over NVLink, "
        f"{gib['cross_node']:.3g} across nodes, {gib['intra_gpu']:.3g} within GPUs ({size})",
        f"recovery {_seconds_text(figures['recovery_s'])} estimated on {p['hardware']}: the host loads first (PCIe, "
        f"{cost.host_bandwidth / 1e9:.0f} GB/s per GPU), then the copies between GPUs (the busiest GPU's slowest link)",
    ]
    if info.get("relaxed"):
        lines.append(f"relaxed  {info['relaxed']}")
    gap = figures["gap"]
    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    lines += [f"bound    {figures['bound'].description}",
              f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
              f" ({figures['bound'].kind})" if finite.size else "gap      n/a"]
    return lines


def _seconds_text(seconds: float) -> str:
    """``0.0856`` -> ``"85.6 ms"``; ``12.3`` -> ``"12.3 s"``."""
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


# -- validate --------------------------------------------------------------------------------------


@main.command()
@click.argument("plan_file", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--counts", "counts_file", type=click.Path(path_type=Path), default=None,
              help="Expert counts to measure the placement on (balancedness, gap to the lower bound).")
@click.option("--format", "-f", "plan_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of PLAN (default: detected).")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None, help="Format of --counts.")
@click.option("--gpus", "-g", type=click.IntRange(min=1), default=None, help=gpus_hint)
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=None, help="Nodes (default: from the file, else 1).")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help=groups_hint)
@engine_option
@transpose_option
@allow_shape_option
@friendly_errors
def validate(plan_file, counts_file, plan_format, input_format, gpus, nodes, groups, engine, transpose, allow_shape):
    """Check a placement file of any supported format and print its metrics.

    Checks that it parses, that every expert has a replica in every layer and that the slots
    divide over the GPUs; with --counts, that it fits the counts and how well it balances them,
    against the same lower bound ``eplb plan`` reports (hierarchical when the deployment has
    groups: --groups or recorded in the file). Exits 1 when the file is not a valid placement.
    With --counts and --engine NAME, also its balancedness under that engine's dispatch rule.
    """
    from .analysis import metrics
    from .io.formats import FormatError, read_counts, read_placement

    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups)
    if engine is not None and counts_file is None:
        raise click.UsageError("--engine judges the plan on counts: give --counts")
    data = (read_counts(counts_file, input_format, transpose=transpose, allow_shape=allow_shape)
            if counts_file is not None else None)
    # the experts come from the file (or its side file), so counts of another width are blamed on the counts
    loaded = read_placement(plan_file, plan_format, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    p = loaded.placement
    if gpus is not None and p.num_gpus != gpus:
        raise FormatError(plan_file, f"the file places slots on {p.num_gpus} GPUs, not --gpus {gpus}")
    replicas = p.logcnt
    lines = [
        f"valid    {plan_file} ({loaded.format})",
        f"shape    {p.num_layers} layers x {p.num_experts} experts, {p.num_slots} slots on {p.num_gpus} GPUs"
        f" in {p.num_nodes} node{'s' if p.num_nodes > 1 else ''}"
        + (f", {p.num_groups} groups" if p.num_groups else "")
        + ("" if p.topology.is_uniform else f" (slots per GPU {p.topology.slots_per_gpu.tolist()})"),
        f"replicas {replicas.min()}..{replicas.max()} per expert; {p.replicas_sharing_a_gpu().sum()} slots hold"
        " a second replica on a GPU that already has the expert",
    ]
    if data is not None:
        if (data.num_layers, data.num_experts) != (p.num_layers, p.num_experts):
            raise FormatError(counts_file, f"counts have {data.num_layers} layers x {data.num_experts} experts but the "
                                           f"placement has {p.num_layers} x {p.num_experts}")
        engine, recorded_line = _recorded_engine(engine, p, plan_file)
        lines += recorded_line
        weights = data.weights
        judge = engine or "shares"  # the engine's split, else the plan's own (its shares when it carries them)
        under = f"; under {_rule_name(judge, p)}"
        loads = p.gpu_loads(weights, judge)
        bal = metrics.balancedness(loads, p.topology)
        before = metrics.balancedness(metrics.static_gpu_loads(weights, p.num_gpus))
        bound = bound_for(weights, p, engine)
        gap = metrics.gap(loads.max(axis=-1), bound.values)
        moe = moe_layers(weights)
        finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
        lines += [
            f"balance  {moe_mean(bal, weights):.4f} mean over {moe_note(weights)}, "
            f"{bal[moe].min() if moe.any() else bal.min():.4f} worst layer "
            f"(no rebalancing: {moe_mean(before, weights):.4f}){under}",
            f"imbalance {moe_mean(metrics.imbalance(loads), weights):.4f} mean (max - mean) / mean{under}",
            f"bound    {bound.description}",
            f"gap      {100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max above the proven lower bound"
            f" ({bound.kind}){under}" if finite.size else "gap      n/a",
        ]
        unrecorded = (loaded.format == "sglang" and "sidecar" not in loaded.metadata) or \
            (loaded.format == "trtllm" and not loaded.metadata.get("eplb_comment"))
        if unrecorded and nodes is None and groups is None and p.num_gpus > 1:
            lines.append(f"note     {plan_file.name} records no nodes or groups (no eplb side file or comment), so it "
                         "is judged against the global bound: pass --nodes and --groups for a hierarchical deployment")
        if data.num_windows > 1:
            window_loads = p.gpu_loads(data.counts, judge)                              # [T, L, G]
            series = moe_mean(metrics.balancedness(window_loads), window_loads)  # [T]
            lines.append(f"windows  {data.num_windows}: balancedness per window {np.nanmin(series):.4f}.."
                         f"{np.nanmax(series):.4f} (mean over each window's MoE layers){under}")
        if engine is not None:
            lines.append(engine_line(p, weights, engine))
    click.echo("\n".join(lines))


# -- report ----------------------------------------------------------------------------------------


@main.command()
@click.argument("counts", type=click.Path(path_type=Path))
@click.argument("plan_file", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Folder for index.html and the PNGs.")
@click.option("--previous", type=click.Path(path_type=Path), default=None, help="An earlier placement: show what moved.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None, help="Format of COUNTS.")
@click.option("--format", "-f", "plan_format", type=click.Choice(PLACEMENT_FORMATS), default=None,
              help="Format of PLAN and --previous (default: detected).")
@click.option("--gpus", "-g", type=click.IntRange(min=1), default=None, help=gpus_hint)
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=None, help="Nodes (default: from the file, else 1).")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help=groups_hint)
@click.option("--top", type=click.IntRange(min=1), default=16, show_default=True, help="Hottest experts to show.")
@engine_option
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def report(counts, plan_file, output, previous, input_format, plan_format, gpus, nodes, groups, top, engine,
           transpose, allow_shape, quiet):
    """Write an HTML report with PNG figures on how PLAN balances COUNTS.

    Figures: per-layer balancedness of the plan against greedy and against no rebalancing, a
    per-GPU load heatmap (layers x GPUs), replica counts of the hottest experts, balancedness per
    window (for a series of counts) and, with --previous, what moved. Greedy and the lower bound use
    the deployment's groups (--groups or recorded in the file). Open OUTPUT/index.html. For a series,
    prints the plan's in-sample balancedness (summed and per window) beside a held-out estimate of
    planning from these windows (leave one window out): hedged over them and from their sum.
    With --engine NAME the summary also judges the plan under that engine's dispatch rule.
    """
    from .io.formats import FormatError, read_counts, read_placement
    from .io.report import make_report
    from .io.formats.errors import require

    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups)
    _refuse_input_as_output(output, [counts, plan_file, previous])
    data = read_counts(counts, input_format, transpose=transpose, allow_shape=allow_shape)
    loaded = read_placement(plan_file, plan_format, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    p = loaded.placement
    if (data.num_layers, data.num_experts) != (p.num_layers, p.num_experts):
        raise FormatError(counts, f"counts have {data.num_layers} layers x {data.num_experts} experts but the "
                                  f"placement {plan_file} has {p.num_layers} x {p.num_experts}")
    prev = None
    if previous is not None:
        prev = read_placement(previous, plan_format, num_gpus=p.num_gpus, num_nodes=p.num_nodes,
                              num_experts=p.num_experts)
        _check_previous(prev, dict(layers=p.num_layers, experts=p.num_experts, slots=p.num_slots, gpus=p.num_gpus,
                                   nodes=p.num_nodes), previous)
        if prev.placement.topology != p.topology:
            raise FormatError(previous, "incompatible configuration: slots per GPU differ from the plan's")
    if output.exists() and not output.is_dir():
        raise FormatError(output, "exists and is not a folder")
    engine, recorded_line = _recorded_engine(engine, p, plan_file)
    require("matplotlib", "report", "eplb report")  # before the folder is made: a failed report leaves none
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        result = make_report(data, loaded, output, previous=prev, top=top, progress=show_progress(quiet),
                             engine=engine)
    except BaseException:
        if created and not any(output.iterdir()):
            output.rmdir()
        raise
    if quiet:
        return
    lines = recorded_line + ([] if engine is None else [engine_line(p, data.weights, engine)])
    judge = engine or "shares"
    under = f"; under {_rule_name(judge, p)}"
    if data.num_windows > 1:
        # first what the engine will see: the plan `eplb plan` makes from these windows (for the engine's
        # rule with --engine), each window served by the plan made from the others, judged under it
        held = _held_out_estimates(data.counts, DEFAULT_METHOD, {} if engine is None else {"dispatch": engine},
                                   dict(topology=p.topology, num_groups=p.num_groups))
        skipped = _left_out_note(held)
        if held["plan"].size == 0:
            lines.append(f"held out  n/a: every held-out block of windows carries no load{under}")
        else:
            lines.append(f"held out  planning from these windows, each served by the plan made from the others: "
                         f"{held['plan'].mean():.4f} mean, {held['plan'].min():.4f} worst hedged over them "
                         f"(eplb's default); {held['summed'].mean():.4f} / {held['summed'].min():.4f} from their sum"
                         f"{skipped}; under {_rule_name(held['judge'])}")
        per_window = moe_mean(p.balancedness(data.counts, judge), data.counts)
        lines.append(f"in sample {moe_mean(p.balancedness(data.weights, judge), data.weights):.4f} on the summed "
                     f"windows; each of the {data.num_windows} windows: {np.nanmean(per_window):.4f} mean, "
                     f"{np.nanmin(per_window):.4f} worst (the plan may have been made from these windows){under}")
    lines.append(f"wrote    {result.html}")
    lines += [f"         {figure}" for figure in result.figures]
    click.echo("\n".join(lines))


# -- simulate --------------------------------------------------------------------------------------

DEFAULT_SIMULATE_POLICIES = ("none", "vllm", "sglang", "balancer")


def _load_function(spec: str):
    """``module:attribute`` -> the object (a user's own planning function)."""
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise click.BadParameter(f"expected MODULE:FUNCTION, got {spec!r}", param_hint="--rebalance-fn")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise Failure(f"--rebalance-fn {spec}: {exc}") from None


def _simulation_policy(name: str, method, check_every: int):
    """``--policy NAME``: a name of the one registry (:func:`eplb.serving.policy.policy_by_name`)."""
    from .serving.policy import policy_by_name

    try:
        return policy_by_name(name, method, check_every)
    except ValueError as exc:
        raise click.BadParameter(f"{name!r}: {exc}", param_hint="--policy") from None


@main.command()
@deployment_arguments
@click.option("--policy", "-p", "policies", multiple=True,
              help="Rebalancing policy, repeatable: none, vllm (every 3000 steps from 1000), sglang (every 1000), "
                   "vllm-hedged / sglang-hedged (the same timers, each window planned hedged over 10 "
                   "sub-windows with eplb's default method), balancer (eplb.Balancer), every:N[/W] (every N "
                   "steps from the last W). Default: none, vllm, sglang, balancer.")
@click.option("--method", "-m", type=click.Choice(sorted(METHODS)), default="greedy", show_default=True,
              help="Planning method of the fixed-interval policies (from scratch).")
@click.option("--rebalance-fn", default=None,
              help="MODULE:FUNCTION with the published rebalance_experts(weight, num_replicas, num_groups, "
                   "num_nodes, num_gpus) signature, used by the fixed-interval policies instead of --method.")
@click.option("--check-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between the Balancer's decisions.")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The GPUs of the cost model (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="Expert size and format for the cost model.")
@click.option("--regime", type=click.Choice(["roofline", "compute", "memory"]), default="roofline", show_default=True,
              help="Layer time: max of compute and weight reads, or one of them.")
@click.option("--copy-mode", type=click.Choice(["stall", "overlap", "free"]), default="stall", show_default=True,
              help="Weight copies stall serving, run beside it, or cost nothing.")
@click.option("--layers-per-step", type=click.IntRange(min=1), default=None,
              help="Apply a rebalance this many layers per step, in layer order (default: all layers at once).")
@click.option("--dispatch", type=click.Choice(SCORING), default="uniform", show_default=True)
@click.option("--fail-gpu", multiple=True, metavar="GPUS@STEP[:SLOTS]",
              help="After step STEP these GPUs (comma-separated, e.g. 5 or 5,6) are lost; :SLOTS gives the survivors "
                   "that many slots each. Repeatable, as the three below.")
@click.option("--fail-node", multiple=True, metavar="NODE@STEP[:SLOTS]", help="After step STEP every GPU of NODE is lost.")
@click.option("--add-nodes", multiple=True, metavar="N@STEP[:SLOTS]",
              help="After step STEP, N nodes of empty GPUs join (as many GPUs as a node has, with the GPUs' slots).")
@click.option("--remove-nodes", multiple=True, metavar="N@STEP[:SLOTS]",
              help="After step STEP the last N nodes leave.")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True,
              help="Folder for simulate.csv, steps.csv, the PNG figures and index.html.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def simulate(counts, slots, gpus, nodes, groups, policies, method, rebalance_fn, check_every, hardware, model, regime,
             copy_mode, layers_per_step, dispatch, input_format, output, transpose, allow_shape, quiet, **changes):
    """Replay recorded per-step COUNTS [T, L, E] through a deployment and rebalancing policies.

    Every policy starts from the greedy plan of the first step. Prints, per policy, the MoE time
    lost to imbalance (as a share of the perfectly balanced time; with the copies' stalls), the
    longest single stall, rebalances and expert-weight copies, and writes a table, per-step CSV,
    PNG figures and an HTML page into -o. --fail-gpu, --fail-node, --add-nodes and --remove-nodes
    change the deployment mid-series: each policy answers (default policies then: donor-repair,
    from-scratch, replan) and, per change, the recovery's copies, host loads, bytes and time and the
    token imbalance before, during (served by the answer) and after it are printed (events.csv).

    \b
    Example:
      eplb simulate steps.npz --slots 288 --gpus 32 --nodes 4 --groups 8 -p vllm -p balancer -o sim/
      eplb simulate steps.npz --slots 288 --gpus 32 --nodes 4 --fail-gpu 5@2000 --add-nodes 1@3000 -o sim/
    """
    from .model.cost import CostModel
    from .io.formats import read_counts
    from .serving.policy import PolicyError
    from .simulation.simulate import simulate as run_simulation
    from .io.simulation_report import write_simulation_report

    _require_deployment_flags(slots, gpus)
    _check_flag_sizes(slots=slots, gpus=gpus, nodes=nodes, groups=groups)
    _refuse_input_as_output(output, [counts])
    data = read_counts(counts, input_format, transpose=transpose, allow_shape=allow_shape)
    _check_experts_fit(data, slots)
    events = _simulation_events(changes, data.counts.shape, eplb.Deployment.of(
        data.counts.shape[-1], num_slots=slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups, dispatch=dispatch))
    plan_with = _load_function(rebalance_fn) if rebalance_fn else method
    cost = CostModel.preset(hardware, model, regime=regime, copy_mode=copy_mode)
    results = []
    names = policies or (CHANGE_SIMULATE_POLICIES if events else DEFAULT_SIMULATE_POLICIES)
    num_steps = data.counts.shape[0]
    caught = []
    with Progress("simulate", quiet=quiet) as progress:  # every policy's steps, one after the other
        for index, name in enumerate(names):
            policy = _simulation_policy(name, plan_with, check_every)
            part = offset(progress, index * num_steps, len(names) * num_steps, f"policy {name}")
            try:
                with warnings.catch_warnings(record=True) as raised:
                    warnings.simplefilter("always", RuntimeWarning)
                    deployment = eplb.Deployment.of(data.counts.shape[-1], num_slots=slots, num_gpus=gpus,
                                                    num_nodes=nodes, num_groups=groups, dispatch=dispatch)
                    results.append(run_simulation(data.counts, deployment, policy=policy, cost_model=cost,
                                                  layers_per_step=layers_per_step, progress=part,
                                                  events=events))
            except PolicyError as exc:  # the user's planning function: its error, not the configuration's
                raise Failure(str(exc)) from None
            caught += raised
    for warning in caught:  # after the progress bar is gone
        if not quiet:
            click.echo(f"note: {warning.message}", err=True)
    _note_global_groups(groups, nodes, quiet)  # once the runs are done: never before a real error
    written = write_simulation_report(results, output, title=f"eplb simulate {data.path.name}")
    if written.get("missing"):
        click.echo(f"note: {written['missing']}", err=True)
    if quiet:
        return
    lines = [f"counts   {data.path} ({data.format}): {data.counts.shape[0]} steps x {data.counts.shape[1]} layers"
             f" x {data.counts.shape[2]} experts; cost model {cost.name}, {regime}, copies {copy_mode}"
             + (f", applied {layers_per_step} layer(s) per step" if layers_per_step else "")]
    for r in results:
        s = r.summary()
        lines.append(f"{s['policy']:<40} lost {100 * s['lost_share']:6.2f}%  with stalls "
                     f"{100 * s['lost_with_stalls_share']:6.2f}%  max stall {s['max_stall_s']:.3g} s  "
                     f"rebalances {s['rebalances']:4d}  copies {s['copies']}  host per step "
                     f"{s['host_ms_mean']:.3f} ms mean, {s['host_ms_p99']:.3f} p99, {s['host_ms_max']:.1f} max")
    lines += _event_lines(results)
    lines.append(f"wrote    {written['html']}")
    click.echo("\n".join(lines))


# -- simulate across deployment changes (--fail-gpu, --fail-node, --add-nodes, --remove-nodes) -----

CHANGE_SIMULATE_POLICIES = ("donor-repair", "from-scratch", "replan")
"""``eplb simulate``'s policies when the deployment changes and no ``--policy`` is given: the
engines' answers to a change and eplb's, none rebalancing between changes."""


def _require_deployment_flags(slots, gpus) -> None:
    """``--slots`` and ``--gpus`` are required (a usage error naming the first missing)."""
    missing = [flag for flag, value in (("--slots", slots), ("--gpus", gpus)) if value is None]
    if missing:
        raise click.UsageError(f"Missing option '{missing[0]}'.")


def _simulation_events(changes: dict, shape: tuple, deployment) -> list:
    """``eplb simulate``'s change flags (``changes``: flag name -> its values) as
    :class:`eplb.simulation.events.Event` values in step order, each built on the deployment the one
    before left; a flag that cannot be done is :class:`ChangeRefused` (exit 2) naming it."""
    from .simulation.events import Event, TooFewSlots, parse_event

    parsed = []
    for name, texts in changes.items():
        kind = name.replace("_", "-")
        for text in texts:
            try:
                step, resize = parse_event(kind, text)
            except ValueError as exc:
                raise ChangeRefused(f"--{kind}: {exc}") from None
            if step >= shape[0] - 1:
                raise ChangeRefused(f"--{kind} {text}: the series has {shape[0]} steps; a change comes after a step "
                                    f"below {shape[0] - 1}, so that a step is served after it")
            parsed.append((step, kind, text, resize))
    events, current = [], deployment
    for step, kind, text, resize in sorted(parsed, key=lambda item: item[0]):
        if events and events[-1].step == step:
            raise ChangeRefused(f"--{kind} {text}: another change comes after step {step} too; make them one "
                                "(--fail-gpu 5,6@STEP loses two GPUs at once)")
        try:
            change = resize(current, deployment.num_groups)
        except TooFewSlots as exc:
            raise ChangeRefused(f"--{kind} {text}: {exc} (--{kind} {text.split(':')[0]}:{exc.slots_per_gpu})") from None
        except ValueError as exc:
            raise ChangeRefused(f"--{kind} {text}: {exc}") from None
        events.append(Event(step, change, resize.label))
        current = change.new
    return events


def _event_lines(results) -> list[str]:
    """Per deployment change, a line saying what changed, then one per policy: the recovery's copies
    by source, bytes and time, and the token imbalance before, during and after it."""
    lines = []
    for k, first in enumerate(results[0].events if results else ()):
        lines.append(f"change   after step {first['step']}: {first['label']}: {first['change'].split('; ')[-1]}")
        for r in results:
            e = r.events[k]
            c = e["copies"]
            lines.append(f"  {r.policy[:38]:<38} {c['total']:,} copies ({c['from_host']:,} from host, {c['intra_node']:,} "
                         f"NVLink, {c['cross_node']:,} across nodes, {c['intra_gpu']:,} local), "
                         f"{e['bytes']['total'] / 2**30:.3g} GiB, recovery {_seconds_text(e['recovery_s'])}; imbalance "
                         f"{e['imbalance_before']:.3f} before, {e['imbalance_during']:.3f} during, "
                         f"{e['imbalance_after']:.3f} after")
    return lines


# -- sweep -----------------------------------------------------------------------------------------


def _int_list(text: str, flag: str, minimum: int = 0) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``: whole numbers ``>= minimum``, each once, or a usage error naming ``flag``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected whole numbers separated by commas, got {text!r}", param_hint=flag) from None
    if not values or min(values) < minimum:
        raise click.BadParameter(f"expected whole numbers >= {minimum} separated by commas, got {text!r}",
                                 param_hint=flag)
    if len(set(values)) < len(values):
        raise click.BadParameter(f"each value once, got {text!r}", param_hint=flag)
    return values


def _check_sweep_deployments(gpu_counts, node_counts, groups, num_experts: int) -> list[str]:
    """Usage errors for sweep axes that leave no deployment or name groups the experts cannot
    form; the notes (for stderr) on the pairs skipped or planned without groups."""
    pairs = [(g, n) for g in gpu_counts for n in node_counts]
    skipped = [(g, n) for g, n in pairs if g % n]
    if len(skipped) == len(pairs):
        raise click.BadParameter(f"no GPU count of --gpus divides by a node count of --nodes ({pairs[0][0]} GPUs on "
                                 f"{pairs[0][1]} nodes ...): every GPU count must divide by some node count",
                                 param_hint="--nodes")
    if groups is not None and num_experts % groups:
        raise click.BadParameter(f"{groups} groups do not divide the {num_experts} experts of the counts",
                                 param_hint="--groups")
    notes = []
    if skipped:
        notes.append("skipped " + ", ".join(f"{g} GPUs on {n} nodes" for g, n in skipped)
                     + ": the GPUs must divide by the nodes")
    global_nodes = sorted({n for g, n in pairs if not g % n and groups is not None and groups % n})
    if global_nodes:
        notes.append(f"--groups {groups} does not divide over {', '.join(map(str, global_nodes))} node(s): those "
                     "deployments are planned globally (no groups)")
    return notes


def _check_sweep_slots(num_experts: int, gpu_counts, extras) -> None:
    """The largest deployment a sweep implies (most GPUs, most extra slots) within the slot limit."""
    from .io.formats.limits import check_size
    from .model.deployment import slots_for

    slots = slots_for(num_experts, max(gpu_counts), max(extras))
    try:
        check_size(slots, "slots", f"slots per layer of --extra-slots {max(extras)} with --gpus {max(gpu_counts)}")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--extra-slots") from None


@main.command()
@click.argument("counts", type=click.Path(path_type=Path))
@click.option("--extra-slots", default="0,1,2", show_default=True,
              help="Redundant slots per GPU beyond the fewest that hold every expert, comma-separated.")
@click.option("--gpus", "-g", default="32", show_default=True, help="GPU counts, comma-separated.")
@click.option("--nodes", "-n", default="1", show_default=True, help="Node counts, comma-separated.")
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None,
              help="Expert groups (kept on one node each where they divide by the nodes).")
@click.option("--dispatch", "dispatches", multiple=True, type=click.Choice(SCORING),
              help="Dispatch modes (repeatable; default uniform).")
@click.option("--policy", "-p", "policies", multiple=True, type=click.Choice(SIMULATE_POLICIES),
              help="Policies (repeatable; default none and balancer).")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The GPUs of the cost model (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="Expert size and format for the cost model.")
@click.option("--regime", type=click.Choice(["roofline", "compute", "memory"]), default="roofline", show_default=True)
@click.option("--copy-mode", type=click.Choice(["stall", "overlap", "free"]), default="stall", show_default=True)
@click.option("--check-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between the Balancer's decisions (policy balancer), as in eplb simulate.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Processes (default: every core).")
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Folder for sweep.csv and sweep.png.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def sweep(counts, extra_slots, gpus, nodes, groups, dispatches, policies, hardware, model, regime, copy_mode,
          check_every, workers, input_format, output, transpose, allow_shape, quiet):
    """What-if sweep: replay per-step COUNTS [T, L, E] through every combination of redundant slots,
    GPUs, nodes, dispatch modes and policies, and show what redundant slots buy.

    Writes sweep.csv (time lost with and without stalls, copies, bytes moved, replica memory per
    GPU) and sweep.png (time lost against replica memory, the knee of each line starred), and
    prints the knee per deployment: the fewest extra slots per GPU after which one more saves less
    than a point of MoE time.

    \b
    Example:
      eplb sweep steps.npz --extra-slots 0,1,2,3 --gpus 32,64 --nodes 4,8 --groups 8 -p vllm -p balancer -o sweep/
    """
    from .model.cost import CostModel
    from .io.formats import read_counts
    from .io.simulation_report import write_sweep_report
    from .model.deployment import Deployment
    from .simulation.sweep import knee, sweep as run_sweep

    extras, gpu_counts, node_counts = (_int_list(extra_slots, "--extra-slots"), _int_list(gpus, "--gpus", 1),
                                       _int_list(nodes, "--nodes", 1))
    for value in gpu_counts:
        _check_flag_sizes(gpus=value)
    for value in node_counts:
        _check_flag_sizes(nodes=value)
    _check_flag_sizes(groups=groups)
    _refuse_input_as_output(output, [counts])
    data = read_counts(counts, input_format, transpose=transpose, allow_shape=allow_shape)
    notes = _check_sweep_deployments(gpu_counts, node_counts, groups, data.counts.shape[-1])
    _check_sweep_slots(data.counts.shape[-1], gpu_counts, extras)
    cost = CostModel.preset(hardware, model, regime=regime, copy_mode=copy_mode)
    # each run's warning once (the sweep gathers them)
    with warnings.catch_warnings(record=True) as caught, Progress("sweep", unit="runs", quiet=quiet) as progress:
        warnings.simplefilter("always")
        grid = Deployment.grid(data.counts.shape[-1], extra_slots_per_gpu=extras, num_gpus=gpu_counts,
                               num_nodes=node_counts, num_groups=groups, dispatch=dispatches or ("uniform",))
        rows = run_sweep(data.counts, grid, policies=policies or ("none", "balancer"), cost_model=cost,
                         workers=workers, check_every=check_every, progress=progress)
    notes += list(dict.fromkeys(str(w.message) for w in caught))
    if not quiet:
        for note in notes:
            click.echo(f"note: {note}", err=True)
    knees = knee(rows)
    written = write_sweep_report(rows, output, knees)
    if written.get("missing"):
        click.echo(f"note: {written['missing']}", err=True)
    if quiet:
        return
    lines = [f"counts   {data.path} ({data.format}): {data.counts.shape[0]} steps; cost model {cost.name}, {regime}, "
             f"copies {copy_mode}",
             f"{'GPUs':>5} {'nodes':>5} {'dispatch':<8} {'policy':<38} {'extra/GPU':>9} {'lost':>8} {'w/ stalls':>9} "
             f"{'copies':>8} {'replicas GiB/GPU':>16} {'host ms p99/max':>16}"]
    for r in rows:
        lines.append(f"{r['num_gpus']:>5} {r['num_nodes']:>5} {r['dispatch']:<8} {r['policy'][:38]:<38} "
                     f"{r['extra_slots_per_gpu']:>9} {100 * r['lost_share']:>7.2f}% {100 * r['lost_with_stalls_share']:>8.2f}% "
                     f"{r['copies']:>8} {r['replica_memory_per_gpu_bytes'] / 2**30:>16.2f} "
                     f"{r['host_ms_p99']:>8.2f}/{r['host_ms_max']:<7.1f}")
    for (g, n, d, p), extra in knees.items():
        if extra is None:
            lines.append(f"knee     {g} GPUs / {n} nodes, {d}, {p}: none within the values tried (each extra slot "
                         "per GPU still saved a point or more; try more)")
        else:
            lines.append(f"knee     {g} GPUs / {n} nodes, {d}, {p}: {extra} extra slot(s) per GPU")
    lines.append(f"wrote    {written['table']}" + (f", {written['figure']}" if written["figure"] else ""))
    click.echo("\n".join(lines))


# -- recommend (eplb/simulation/pools.py) ----------------------------------------------------------

_RECOMMEND_FLAGS = {"num_gpus": "--gpus", "num_nodes": "--nodes", "num_groups": "--groups", "batch": "--batch",
                    "slot_counts": "--slots", "extra_slots_per_gpu": "--extra-slots", "passes": "--passes",
                    "model": "--model", "hardware": "--hardware", "the number of experts": "--groups",
                    "num_slots": "--deployed-slots"}


@main.command()
@click.argument("counts", type=click.Path(path_type=Path))
@click.option("--gpus", "-g", type=click.IntRange(min=1), required=True, help="GPUs of the pool.")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
@click.option("--batch", "-b", type=click.IntRange(min=1, max=2 ** 40), required=True,
              help="Decode: sequences per GPU; prefill: tokens per GPU (per forward pass).")
@click.option("--hardware", type=NamedChoice(sorted(COST_HARDWARE)), default="H100", show_default=True,
              help="The pool's GPUs (any case).")
@click.option("--model", type=NamedChoice(sorted(COST_MODELS)), default="deepseek-v3", show_default=True,
              help="The pool's model (its experts must match the counts).")
@click.option("--extra-slots", default="0,1,2", show_default=True,
              help="Redundant slots per GPU the engine allows, comma-separated.")
@click.option("--slots", "-s", default=None, help="Instead of --extra-slots: slot counts in all, comma-separated.")
@click.option("--nodes", "-n", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--groups", "-k", type=click.IntRange(min=1), default=None, help="Expert groups (as eplb plan).")
@click.option("--passes", type=click.IntRange(min=1, max=4096), default=16, show_default=True,
              help="Passes sampled per window to predict step times.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--input-format", type=click.Choice(COUNTS_FORMATS), default=None,
              help="Format of COUNTS (default: detected from the name).")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
              help="Write the recommended placement here (format from the name, as eplb plan).")
@click.option("--deployed-slots", type=click.IntRange(min=1), default=None,
              help="Slots the pool runs now: the layout every option is compared with. Default: the experts "
                   "plus one slot per GPU (256 experts on 32 GPUs: 288), the engines' default.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Write recommend.csv and recommend.png (every option's held-out step time) into this folder.")
@transpose_option
@allow_shape_option
@quiet_option
@friendly_errors
def recommend(counts, gpus, phase, batch, hardware, model, extra_slots, slots, nodes, groups, passes, seed,
              input_format, output, deployed_slots, report_dir, transpose, allow_shape, quiet):
    """Recommend the redundant experts and the plan for one serving pool from its COUNTS [T, L, E]
    (T >= 2 windows), judged held out: each window is served by plans made from the others, and
    every slot count is priced in predicted MoE step time beside the engine's layout (the
    published greedy at --deployed-slots, by default the experts plus one slot per GPU).

    \b
    Example:
      eplb recommend decode_pool.npz --gpus 32 --phase decode --batch 16 --hardware H100 \\
          --model deepseek-v3 --extra-slots 0,1,2 -o plan.json
    """
    from .io.formats import placement_format_for_output, read_counts, write_placement
    from .model.deployment import Deployment
    from .simulation.pools import recommend as run_recommend
    from .model.deployment import slots_for

    extras = _int_list(extra_slots, "--extra-slots")
    slot_counts = None if slots is None else _int_list(slots, "--slots", 1)
    _check_flag_sizes(gpus=gpus, nodes=nodes, groups=groups, **({"slots": max(slot_counts)} if slot_counts else {}),
                      **{"deployed-slots": deployed_slots})
    output_format = None
    if output is not None:
        _refuse_input_as_output(output, [counts])
        output_format = _output_format(output, placement_format_for_output)
    data = read_counts(counts, input_format, transpose=transpose, allow_shape=allow_shape)
    if slot_counts is None:
        _check_sweep_slots(data.counts.shape[-1], [gpus], extras)
    try:
        num_experts = data.counts.shape[-1]
        deployed = slots_for(num_experts, gpus, 1) if deployed_slots is None else deployed_slots
        deployment = Deployment.of(num_experts, num_slots=deployed, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
        with Progress("recommend", quiet=quiet) as progress:
            result = run_recommend(data.counts, deployment, batch=batch, phase=phase, hardware=hardware, model=model,
                                   extra_slots_per_gpu=extras, slot_counts=slot_counts, passes=passes, seed=seed,
                                   progress=progress)
    except ValueError as exc:
        flag = next((f for name, f in _RECOMMEND_FLAGS.items() if str(exc).startswith(name)), None)
        if flag is None:
            raise
        raise click.BadParameter(str(exc), param_hint=flag) from None
    if output is not None:
        _note_overwrite(output, quiet)
        best = result.recommended
        write_placement(result.placement, output, output_format, layer_ids=data.layer_ids,
                        configuration=dict(num_slots=best.num_slots, num_gpus=gpus, num_nodes=nodes, num_groups=groups,
                                           method=result.placement.method, counts=str(counts), phase=phase, batch=batch),
                        diagnostics=dict(recommended=result.rows(), default_step_ms=result.default_step_ms,
                                         bound_step_ms=result.bound_step_ms))
    if report_dir is not None:
        from .io.simulation_report import write_recommend_report

        written = write_recommend_report(result, report_dir)
        if written["missing"]:
            click.echo(f"note: {written['missing']}", err=True)
    if not quiet:
        click.echo("\n".join(_recommend_lines(result, data, output, output_format)))
        if report_dir is not None:
            click.echo(f"report   {', '.join(str(p) for p in (written['table'], written['figure']) if p)}")


def _recommend_lines(result, data, output, output_format) -> list[str]:
    """The summary of ``eplb recommend``: the options table and the choice."""
    best = result.recommended
    lines = [f"counts   {data.path} ({data.format}): {_shape_text(data)}",
             f"pool     {result.phase}, batch {result.batch} per GPU ({result.routed_per_pass} routed tokens "
             f"per layer and pass, {result.passes} passes per window); {result.cost_model.name}; held out over "
             f"{result.folds} folds",
             f"default  published greedy at {result.default_slots} slots: {result.default_step_ms:.4f} ms per MoE step",
             f"{'slots':>6} {'redundant':>9} {'planner':<10} {'step ms':>9} {'vs default':>10} {'replicas GiB/GPU':>16}"]
    for o in result.options:
        mark = "  <- recommended" if o == best else ""
        lines.append(f"{o.num_slots:>6} {o.redundant_experts:>9} {o.planner:<10} {o.step_ms:>9.4f} "
                     f"{o.vs_default_pct:>+9.2f}% {o.replica_gib_per_gpu:>16.2f}{mark}")
    lines.append(f"choice   {best.redundant_experts} redundant experts ({best.num_slots} slots), {best.planner} plan: "
                 f"{best.step_ms:.4f} ms held out ({best.vs_default_pct:+.2f}% vs the default); in sample "
                 f"{result.in_sample_step_ms:.4f} ms (token plan {result.tokens_in_sample_step_ms:.4f} ms)")
    lines.append(f"bound    no layout at any slot count is below {result.bound_step_ms:.4f} ms held out on these "
                 f"passes: the choice is at most {100 * (1 - result.bound_step_ms / best.step_ms):.2f}% from the best")
    if output is not None:
        lines.append(f"wrote    {output} ({output_format})")
    return lines


# -- compare (eplb/method_comparison.py) ------------------------------------------------------------

from .method_comparison import build_command as _build_compare_command  # noqa: E402

main.add_command(_build_compare_command(friendly_errors))


if __name__ == "__main__":  # pragma: no cover
    main()

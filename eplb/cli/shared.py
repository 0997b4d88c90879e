"""The options and readers the ``eplb`` commands share: the one-line errors (exit 1, exit 2 for a
change that cannot be made), the common flags, size and path checks, and the reading of the
placement in service (``--previous``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path

import click
import numpy as np

import eplb

from ..model.cost import MODELS as COST_MODELS
from ..engines import DISPATCH_RULES, ENGINE_RULES


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
        from ..io.formats import FormatError, MissingExtraError

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


counts_argument = click.argument("counts", nargs=-1, required=True, type=click.Path(path_type=Path))
"""COUNTS: one file or folder, or several (a glob matching several dumps, a folder of dumps), read
as one series (:func:`eplb.io.formats.read_counts_many`)."""


def _read_counts(counts, input_format, transpose: bool, allow_shape: bool):
    """The counts of COUNTS (one path or several: :func:`eplb.io.formats.read_counts_many`)."""
    from ..io.formats import read_counts_many

    return read_counts_many(_counts_paths(counts), input_format, transpose=transpose, allow_shape=allow_shape)


def _counts_paths(counts) -> list:
    """COUNTS as a list of paths (one path, or the several of ``nargs=-1``)."""
    return [counts] if isinstance(counts, (str, Path)) else list(counts)


def _counts_text(counts) -> str:
    """COUNTS as written in a record: the path, or the paths separated by spaces."""
    return " ".join(str(p) for p in _counts_paths(counts))


def deployment_arguments(command):
    """COUNTS and the deployment flags (--slots, --gpus, --nodes, --groups) of plan and simulate."""
    options = [
        counts_argument,
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


def _read_previous(path, fmt, num_gpus, num_nodes, num_experts, data=None):
    """The deployed placement as its file records it; the flags only fill in what the file does not
    record (SGLang's map, a YAML without eplb's comment), and a flag that disagrees with the file's
    record is an error naming both. With ``data`` (the counts), a file of more layers gives its rows
    of the counts' model layers (:func:`_previous_on_layers`)."""
    from ..io.formats import FormatError, detect_placement_format, read_placement

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
    from ..io.formats import FormatError, PlacementFile
    from ..io.formats.data import layer_ranges

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
    from ..io.formats import FormatError

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
    from ..io.formats import FormatError
    from ..io.formats.data import layer_ranges

    if previous.layer_ids.tolist() != [int(i) for i in layer_ids]:
        raise FormatError(path, f"incompatible configuration: the previous placement covers model layers "
                                f"{layer_ranges(previous.layer_ids)}, the counts layers {layer_ranges(layer_ids)} "
                                "(rows of counts that do not record their layers are 0 .. L-1: --layer-ids names "
                                "them)")


def _note_plan_warnings(caught, quiet: bool) -> None:
    """The ``RuntimeWarning``s of planning, each once on stderr as one ``note:`` line; the warning
    that the deployed plan spreads groups over nodes is said by :func:`_regrouped_lines` instead."""
    from ..planning.migration import SPREAD_WARNING

    seen = set()
    for warning in caught:
        message = str(warning.message)
        if quiet or message.startswith(SPREAD_WARNING) or message in seen:
            continue
        seen.add(message)
        click.echo(f"note: {message}", err=True)


def _recorded_engine(engine, placement, plan_file, also: str = "") -> tuple[str | None, list[str]]:
    """``--engine``, else the rule the placement file records the plan was made for (eplb JSON and
    ``.npz``, the SGLang side file, the YAML's ``# eplb:`` comment) when it is not an even split,
    with the line that says so (and ``also``): a plan made for SGLang's static table is judged under it."""
    recorded = placement.dispatch
    if engine is not None or DISPATCH_RULES[recorded].kind == "uniform":
        return engine, []
    return recorded, [f"rule     judged under {DISPATCH_RULES[recorded].label}, the rule {plan_file} records the plan "
                      f"was made for{also} (--engine NAME judges under another; --engine vllm: an even split)"]


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


def _note_global_groups(groups, nodes, quiet: bool) -> None:
    """Say on stderr when ``--groups`` does not divide over ``--nodes``: the published rule then
    plans a global placement and ignores the groups."""
    if groups is None or groups % nodes == 0 or quiet:
        return
    click.echo(f"note: --groups {groups} is not a multiple of --nodes {nodes}, so the placement is global and the "
               f"groups are ignored (the published rule); for a hierarchical plan (every group on one node) pass "
               f"--groups as a multiple of --nodes (and a divisor of the experts)", err=True)


def _check_flag_sizes(**values) -> None:
    """Refuse sizes on the command line beyond the documented limits before anything is allocated."""
    from ..io.formats.limits import check_size

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


class ChangeRefused(Failure):
    """Exit 2 with ``Error: <message>`` on one line: flags that describe a deployment change that
    cannot be made (nothing is written)."""

    exit_code = 2


def _flag_given(name: str) -> bool:
    """Whether the command line set parameter ``name`` (not its default)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _recorded_topology(path, fmt):
    """The topology a placement file records, or ``None`` when it records none or cannot be read."""
    from ..io.formats import FormatError, read_placement

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


def _require_deployment_flags(slots, gpus) -> None:
    """``--slots`` and ``--gpus`` are required (a usage error naming the first missing)."""
    missing = [flag for flag, value in (("--slots", slots), ("--gpus", gpus)) if value is None]
    if missing:
        raise click.UsageError(f"Missing option '{missing[0]}'.")


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


def _check_sweep_slots(num_experts: int, gpu_counts, extras) -> None:
    """The largest deployment a sweep implies (most GPUs, most extra slots) within the slot limit."""
    from ..io.formats.limits import check_size
    from ..model.deployment import slots_for

    slots = slots_for(num_experts, max(gpu_counts), max(extras))
    try:
        check_size(slots, "slots", f"slots per layer of --extra-slots {max(extras)} with --gpus {max(gpu_counts)}")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--extra-slots") from None

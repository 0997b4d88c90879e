"""Run a placement method (one of eplb's or anyone's) in a worker process with a time limit.

A method is named by a string: an ``eplb.METHODS`` name, ``package.module:function``, or a Python
file ``path/to/file.py`` (its ``rebalance_experts``) or ``path/to/file.py:function``. A foreign
function has the published signature ``rebalance_experts(weight, num_replicas, num_groups,
num_nodes, num_gpus)`` and returns ``phy2log [L, S]`` or a tuple of at most three starting with it
(the published ``(phy2log, log2phy, logcnt)``), numpy or torch; anything longer is refused. A file's
path may hold ``:`` (``d:ir/meth.py``): a spec ending in ``.py`` is a file, and ``FILE.py:FUNCTION``
splits at the last ``:``.

Each method runs in its own fresh interpreter (nothing compiled or imported is inherited),
so its first call is what a new serving process pays, a crash or a hang costs only that method's
outcome (its whole process group is killed at the time limit), and a function's module is
imported there, never in the caller's process. The worker sends back what the function returned, converted to
numpy with its dtype kept, in ``.npz`` files read without pickles;
:func:`eplb.simulation.comparison.check_plan` judges it in the caller.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..planning.methods import METHODS

TORCH, NUMPY = "torch", "numpy"
ARRAY_TYPES = (TORCH, NUMPY)
"""What a foreign function is given: torch tensors (as the published code takes) or numpy arrays."""


@dataclass(frozen=True)
class MethodSpec:
    """A method to compare.

    Attributes:
        label: how rows name it (the string the user gave).
        method: the ``eplb.METHODS`` name, or ``None`` for a foreign function.
        module: the module name (``package.module:function``) or ``None``.
        file: the Python file (``file.py[:function]``) or ``None``.
        function: the function's name in that module or file.
    """

    label: str
    method: str | None = None
    module: str | None = None
    file: str | None = None
    function: str = "rebalance_experts"

    @property
    def foreign(self) -> bool:
        return self.method is None


def parse_method(spec: str) -> MethodSpec:
    """``spec`` (see the module docstring) -> a :class:`MethodSpec`; ``ValueError`` for a name that
    is neither an eplb method nor a ``MODULE:FUNCTION`` / ``FILE.py[:FUNCTION]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method must be a non-empty string, got {spec!r}")
    if spec in METHODS:
        return MethodSpec(spec, method=spec)
    if spec.endswith(".py"):  # a file, its rebalance_experts (a ':' before is part of the path: d:ir/meth.py)
        return MethodSpec(spec, file=spec)
    head, colon, tail = spec.rpartition(":")
    if colon and head.endswith(".py") and (tail.isidentifier() or not tail):  # a file and a function (the last ':')
        return MethodSpec(spec, file=head, function=tail or "rebalance_experts")
    if colon and head and tail and all(part.isidentifier() for part in head.split(".")) and tail.isidentifier():
        return MethodSpec(spec, module=head, function=tail)
    raise ValueError(f"method must be one of eplb's {sorted(METHODS)}, MODULE:FUNCTION or FILE.py[:FUNCTION], "
                     f"got {spec!r}")


def load_function(spec: MethodSpec):
    """Import the foreign function of ``spec`` (in the process that calls it)."""
    if spec.file is not None:
        path = Path(spec.file)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        module_spec = importlib.util.spec_from_file_location(f"eplb_compared_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec.module)
    function = getattr(module, spec.function, None)
    if not callable(function):
        raise AttributeError(f"{spec.file or spec.module} has no function {spec.function!r}")
    return function


@dataclass(frozen=True)
class DeploymentSpec:
    """The published entry point's arguments beside the weights (``num_groups`` ``None``: global)."""

    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int | None = None


@dataclass
class MethodRun:
    """What one method returned for a list of weights, or why it returned nothing.

    Attributes:
        returned: per weights given, what the method returned: ``(phy2log, log2phy, logcnt)`` as
            numpy arrays with their own dtypes (``log2phy``/``logcnt`` ``None`` when the method gave
            only ``phy2log``; eplb's methods give all three), or a one-line error for that call.
        first_call_s: seconds of the first call in the fresh process (compilation or loading included).
        warm_call_s: median seconds of the warm repeats of that call (``None`` without repeats).
        error: a one-line reason when the method produced nothing (import error, crash, time limit).
    """

    returned: list = field(default_factory=list)
    first_call_s: float | None = None
    warm_call_s: float | None = None
    error: str | None = None


def _as_numpy(value):
    if type(value).__module__.split(".")[0] == "torch":
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _unpack(result) -> tuple:
    """A method's return value -> ``(phy2log, log2phy or None, logcnt or None)`` as numpy arrays."""
    parts = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    if not parts or parts[0] is None:
        raise ValueError(f"returned {type(result).__name__} {result!r:.80}: expected phy2log [L, S] or a tuple "
                         "starting with it")
    if len(parts) > 3:  # not the published return value: refused rather than read as its first three
        raise ValueError(f"returned a {type(result).__name__} of {len(parts)} values: expected phy2log [L, S] or "
                         "a tuple of at most 3, (phy2log, log2phy, logcnt) as the published rebalance_experts returns")
    arrays = [None if p is None else _as_numpy(p) for p in parts[:3]]
    for name, array in zip(("phy2log", "log2phy", "logcnt"), arrays):
        if array is not None and array.dtype.kind not in "biuf":
            raise ValueError(f"returned {name} of {array.dtype} values, expected a numeric array")
    return tuple(arrays + [None] * (3 - len(arrays)))


def _caller(spec: MethodSpec, deployment: DeploymentSpec, array_type: str):
    """A function ``weights [L, E] float64 -> returned value`` for ``spec``."""
    if not spec.foreign:
        from ..planning.api import plan

        def run_eplb(weights):
            placement = plan(weights, num_slots=deployment.num_slots, num_gpus=deployment.num_gpus,
                                  num_nodes=deployment.num_nodes, num_groups=deployment.num_groups,
                                  method=spec.method)
            return placement.phy2log, placement.log2phy, placement.logcnt

        return run_eplb
    function = load_function(spec)
    groups = deployment.num_groups if deployment.num_groups is not None else 1
    if array_type == TORCH:
        import torch

        convert = torch.from_numpy
    else:
        convert = np.array
    return lambda weights: function(convert(weights.copy()), deployment.num_slots, groups, deployment.num_nodes,
                                    deployment.num_gpus)


def _work(spec: MethodSpec, deployment: DeploymentSpec, weights: list, warm_calls: int, array_type: str) -> MethodRun:
    """In the worker: call the method on every ``weights [L, E]``; the first twice or more (warm)."""
    run = MethodRun()
    try:
        call = _caller(spec, deployment, array_type)
    except BaseException as exc:  # the user's module failed to import
        run.error = f"could not load: {_one_line(exc)}"
        return run
    warm = []
    for index, w in enumerate(weights):
        repeats = 1 + (warm_calls if index == 0 else 0)
        for repeat in range(repeats):
            start = time.perf_counter()
            try:
                result = call(w)
            except Exception as exc:
                result, failure = None, f"raised {_one_line(exc)}"
            else:
                failure = None
            elapsed = time.perf_counter() - start
            if index == 0 and repeat == 0:
                run.first_call_s = elapsed
            elif index == 0:
                warm.append(elapsed)
            if repeat == 0:
                if failure is None:
                    try:
                        run.returned.append(_unpack(result))
                    except Exception as exc:
                        run.returned.append(_one_line(exc))
                else:
                    run.returned.append(failure)
            if failure is not None:
                break  # no warm repeats of a call that raised
    run.warm_call_s = statistics.median(warm) if warm else None
    return run


def _write_run(run: MethodRun, path: str) -> None:
    """Save ``run`` as an ``.npz`` without pickles: the arrays, and the rest as JSON."""
    arrays, calls = {}, []
    for index, returned in enumerate(run.returned):
        if isinstance(returned, str):
            calls.append(returned)
            continue
        calls.append(None)
        for name, array in zip(("phy2log", "log2phy", "logcnt"), returned):
            if array is not None:
                arrays[f"{name}_{index}"] = array
    meta = {"calls": calls, "first_call_s": run.first_call_s, "warm_call_s": run.warm_call_s, "error": run.error}
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)


def _read_run(path: str) -> MethodRun:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        returned = []
        for index, failure in enumerate(meta["calls"]):
            returned.append(failure if failure is not None else tuple(
                data[f"{name}_{index}"] if f"{name}_{index}" in data.files else None
                for name in ("phy2log", "log2phy", "logcnt")))
    return MethodRun(returned, meta["first_call_s"], meta["warm_call_s"], meta["error"])


def serve(job_path: str, result_path: str) -> None:
    """The worker's entry point: read the job, run it, write the outcome (both ``.npz``, no pickles)."""
    with np.load(job_path, allow_pickle=False) as data:
        job = json.loads(str(data["job"]))
        weights = [data[f"weights_{i}"] for i in range(job["num_weights"])]
    spec, deployment = MethodSpec(**job["spec"]), DeploymentSpec(**job["deployment"])
    try:
        run = _work(spec, deployment, weights, job["warm_calls"], job["array_type"])
        _write_run(run, result_path)
    except BaseException as exc:  # e.g. a return value numpy cannot store without pickles
        _write_run(MethodRun(error=f"the worker failed: {_one_line(exc)}"), result_path)


def run_method(spec: MethodSpec, deployment: DeploymentSpec, weights: list, *, time_limit: float = 120.0,
               warm_calls: int = 3, array_type: str = TORCH) -> MethodRun:
    """Call ``spec`` on each of ``weights`` (``[L, E]`` float64 arrays) in a fresh worker process.

    The first weights are called ``1 + warm_calls`` times (the first call and the warm repeats are
    timed); the others once. After ``time_limit`` seconds in all the worker is killed and the
    outcome says so; a worker that dies (a segfault, ``os._exit``) likewise, with the last line it
    wrote to stderr. The worker is a new interpreter (``python -c``): it inherits nothing compiled
    or imported, and the caller's script is not re-run (no ``if __name__ == "__main__"`` needed).

    Args:
        array_type: ``"torch"`` or ``"numpy"``, what a foreign function gets (eplb's are called
            with numpy through :func:`eplb.plan`, the deployment as given).
    """
    if array_type not in ARRAY_TYPES:
        raise ValueError(f"array_type must be one of {ARRAY_TYPES}, got {array_type!r}")
    if isinstance(time_limit, bool) or not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    with tempfile.TemporaryDirectory(prefix="eplb-compare-") as folder:
        job_path, result_path = os.path.join(folder, "job.npz"), os.path.join(folder, "result.npz")
        job = {"spec": asdict(spec), "deployment": asdict(deployment), "warm_calls": int(warm_calls),
               "array_type": array_type, "num_weights": len(weights)}
        np.savez(job_path, job=np.array(json.dumps(job)),
                 **{f"weights_{i}": np.ascontiguousarray(w, dtype=np.float64) for i, w in enumerate(weights)})
        # `python -c` puts the current folder first on the import path: a file there named like a
        # package (DeepSeek's file of that name) would shadow eplb itself, so the folder joins the path only
        # once eplb is imported (for the methods given as module:function)
        command = [sys.executable, "-c", f"import sys; here = sys.path.pop(0); from {__name__} import serve; "
                   f"sys.path.append(here); serve({job_path!r}, {result_path!r})"]
        stderr_path = os.path.join(folder, "stderr.txt")
        with open(stderr_path, "wb") as stderr_file:
            returncode = _run_in_own_group(command, stderr_file, time_limit)
        if returncode is None:
            return MethodRun(error=f"timed out after {time_limit:g} s (killed)")
        if not os.path.exists(result_path):
            return MethodRun(error=f"the worker process died (exit code {returncode}){_last_line(stderr_path)}")
        return _read_run(result_path)


def _run_in_own_group(command: list, stderr_file, time_limit: float) -> int | None:
    """Run ``command`` in a new session (its own process group) with stderr to ``stderr_file``;
    return its exit code, or ``None`` when it outlived ``time_limit`` seconds. Either way every
    process still in the group (the method's own children) is killed before this returns.

    Stderr goes to a file, not a pipe: a child the method starts inherits it, and reading a pipe
    to its end would wait for that child too, past any time limit."""
    grouped = hasattr(os, "killpg") and hasattr(os, "waitid")
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr_file,
                               cwd=os.getcwd(), start_new_session=grouped)
    ended = False
    try:
        if grouped:
            ended = _wait_unreaped(process.pid, time_limit)
        else:
            try:
                process.wait(timeout=time_limit)
                ended = True
            except subprocess.TimeoutExpired:
                pass
    finally:
        if grouped:
            try:  # the worker is not reaped yet, so the group's id is still its group's: nothing else is hit
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.kill()
        returncode = process.wait()  # ended or killed: no wait
    return returncode if ended else None


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (a child) ended within ``timeout`` seconds, leaving it unreaped."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _last_line(path: str) -> str:
    """``": <the last non-empty line of the file>"`` (at most 200 characters), or ``""``."""
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - 4096))
        lines = [line for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    return f": {lines[-1].strip()[:200]}" if lines else ""

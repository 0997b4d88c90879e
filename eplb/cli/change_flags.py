"""``eplb plan``'s flags that describe a deployment change from ``--previous`` (``--lost-gpus``,
``--gpu-map``, ``--slots-per-gpu``, ``--gpus``), read into an :class:`eplb.DeploymentChange`.
"""

from __future__ import annotations

import click
import numpy as np

import eplb

from .shared import ChangeRefused, _flag_given, _index_list, _recorded_topology
from .wording import ENGINE_ROWS


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


def _lost_deployment(old, lost_text: str, *, slots_per_gpu, slots, gpus, nodes_given, nodes) -> "eplb.Topology":
    """The topology of ``old`` (an :class:`eplb.Deployment`) with the GPUs of ``--lost-gpus`` holding
    no slots, the survivors ``--slots-per-gpu`` each (default: theirs)."""
    topology = old.topology
    if gpus is not None and gpus != topology.num_gpus:
        raise ChangeRefused(f"--gpus {gpus} with --lost-gpus: lost GPUs keep their index, so the deployment keeps "
                            f"{topology.num_gpus} GPUs; to renumber the survivors give --gpu-map instead")
    if nodes_given and nodes != topology.num_nodes:
        raise ChangeRefused(f"--nodes {nodes} with --lost-gpus: the GPUs keep their nodes ({topology.num_nodes})")
    listed = _index_list(lost_text, "--lost-gpus")
    if len(set(listed)) < len(listed):
        twice = sorted({g for g in listed if listed.count(g) > 1})
        raise ChangeRefused(f"--lost-gpus names GPU {', '.join(map(str, twice))} twice: each lost GPU once")
    lost = np.unique(listed)
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
    from ..io.formats.limits import check_size

    try:
        check_size(count, "gpus", "GPUs --gpu-map reaches")
    except ValueError as exc:
        raise ChangeRefused(f"--gpu-map: {exc}") from None
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


def _check_slots_per_gpu(slots_per_gpu, num_gpus: int) -> None:
    """``--slots-per-gpu`` on ``num_gpus`` GPUs within the slot limit, before any array is made
    (:class:`ChangeRefused`)."""
    from ..io.formats.limits import check_size

    if slots_per_gpu is None:
        return
    try:
        check_size(int(slots_per_gpu) * int(num_gpus), "slots", f"--slots-per-gpu {slots_per_gpu} on {num_gpus} GPUs")
    except ValueError as exc:
        raise ChangeRefused(f"--slots-per-gpu: {exc}") from None


def _deployment_change(old, params: dict, dispatch: str = "uniform") -> "eplb.DeploymentChange":
    """The change ``eplb plan``'s flags describe from ``old`` (the deployment of ``--previous``) to a
    deployment planned for ``dispatch``, or :class:`ChangeRefused` naming the flag and the rule."""
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
    _check_slots_per_gpu(params["slots_per_gpu"], max(old.num_gpus, params["gpus"] or 0, len(gpu_map or ())))
    if params["lost_gpus"] is not None:
        topology = _lost_deployment(old, params["lost_gpus"], **sizes)
    else:
        topology = _resized_deployment(old, gpu_map, **sizes)
    groups = params["groups"] if params["groups"] is not None else old.num_groups
    try:
        new = eplb.Deployment.of(old.num_experts, topology=topology, num_groups=groups, dispatch=dispatch)
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
    if output_format == "sglang" and _masked_ranks_fit(change):
        return  # written with the lost ranks masked (:func:`_with_masked_ranks`)
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


def _masked_ranks_fit(change) -> bool:
    """Whether the new deployment is the old one with some GPUs lost and every survivor keeping its
    slot count: SGLang's elastic EP then keeps the lost ranks in its map and masks them."""
    old, new = change.old.topology.slots_per_gpu, change.new.topology.slots_per_gpu
    return (change.old.num_gpus == change.new.num_gpus and np.array_equal(change.gpu_map, np.arange(len(old)))
            and bool(np.all((new == old) | (new == 0))) and np.unique(old).size == 1)


def _with_masked_ranks(placement, change):
    """``placement`` (the re-plan, lost GPUs holding no slots) as SGLang's elastic EP keeps it: every
    rank with its slots, a lost rank's slots holding expert 0 (as SGLang's ``elasticity_aware``
    algorithm fills an inactive rank; the engine masks the rank, so no token reaches them), the
    survivors' slots the re-plan's. ``[L, G * k]`` on the old, even layout."""
    old_top, new_top = change.old.topology, change.new.topology
    phy2log = np.zeros((placement.num_layers, old_top.num_slots), np.int64)
    for gpu in np.flatnonzero(new_top.slots_per_gpu > 0).tolist():
        start, k = int(new_top.slot_offsets[gpu]), int(new_top.slots_per_gpu[gpu])
        phy2log[:, old_top.slot_offsets[gpu]:old_top.slot_offsets[gpu] + k] = placement.phy2log[:, start:start + k]
    return eplb.Placement(phy2log, placement.num_experts, old_top, placement.num_groups, placement.method,
                          dispatch=placement.dispatch)

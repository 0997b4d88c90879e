"""The vLLM adapter against each policy interface vLLM has shipped.

Two sources of truth:
- ``tests/engine_interfaces/vllm.json``: facts (method kind, parameter names, return annotation,
  how the engine calls the policy) written from vLLM's released wheels; stand-in abstract classes
  are built from them, and the adapter is driven the way vLLM's caller drives it.
- vLLM's own files: with ``EPLB_VLLM_SOURCES`` set to a folder holding vLLM wheels
  (``vllm-X-*.whl``) or unpacked trees (``X/vllm/...``), or with vLLM installed, each version's
  ``policy/abstract.py`` is loaded and the adapter is checked against it (a vLLM wheel is
  250-490 MB, too large to download in CI; these tests skip with the reason otherwise).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
import types
import zipfile
from abc import ABC, abstractmethod
from dataclasses import make_dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the vLLM adapter returns torch tensors; torch is not installed")

import eplb  # noqa: E402
from eplb.serving.adapters import vllm as adapter  # noqa: E402
from eplb.simulation.synthetic import drifting_counts  # noqa: E402

FACTS = json.loads((Path(__file__).parent.parent / "engine_interfaces" / "vllm.json").read_text())
INTERFACES = FACTS["interfaces"]
POLICY_INTERFACES = [name for name, facts in INTERFACES.items() if facts["policy_package"]]
# 64 experts in 8 groups, 80 slots on 8 GPUs in 2 nodes
L, E, S, GROUPS, NODES, RANKS = 4, 64, 80, 8, 2, 8


def _method(parameters: list[str], returns: str, defaults: dict):
    """A function with exactly the documented signature (the body is never run)."""

    def method(*args, **kwargs):
        raise NotImplementedError

    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=defaults.get(name, inspect.Parameter.empty)) for name in parameters]
    method.__signature__ = inspect.Signature(params, return_annotation=returns)
    return method


def stand_in_module(interface: str, variant: str | None = None) -> types.ModuleType:
    """A module holding ``AbstractEplbPolicy`` (and, for ``context``, its dataclasses) as the facts
    describe them."""
    facts = INTERFACES[interface]
    spec = dict(facts["abstract"])
    spec.update(facts.get("variants", {}).get(variant, {}))
    module = types.ModuleType(f"stand_in_vllm_{interface}_{variant or 'x'}".replace(".", "_"))
    method = abstractmethod(_method(spec["parameters"], spec["returns"], spec.get("defaults", {})))
    namespace = {"__module__": module.__name__, spec["method"]: classmethod(method)
                 if spec["kind"] == "classmethod" else method}
    for name, parameters in spec.get("other_methods", {}).items():
        namespace[name] = _method(parameters, "None", {})
    module.AbstractEplbPolicy = type(ABC)(spec["name"], (ABC,), namespace)
    for name, fields in facts.get("dataclasses", {}).items():
        setattr(module, name, make_dataclass(name, fields, frozen=True))
    if "state_class" in facts:
        setattr(module, facts["state_class"], type(facts["state_class"], (), {}))
    sys.modules[module.__name__] = module
    return module


def _series(seed=0, windows=3):
    return drifting_counts(windows, L, E, num_groups=GROUPS, drift=0.05, tokens=65536, seed=seed)


def _expected(weight, previous=None):
    return eplb.plan(np.asarray(weight), num_slots=S, num_gpus=RANKS, num_nodes=NODES, num_groups=GROUPS,
                     previous=previous)


def _call_like_vllm(interface: str, module, policy_class, window, old):
    """Drive the policy the way vLLM's caller does (facts' ``caller``); returns phy2log ``[L, S]``."""
    caller = INTERFACES[interface]["caller"]
    if interface == "context":
        context = module.EplbRebalanceContext(
            load_window_cpu=torch.tensor(window), physical_to_logical_map_cpu=old,
            topology=module.EplbTopology(num_groups=GROUPS, num_nodes=NODES, num_ranks=RANKS),
            num_replicas=S, cpu_group=None)
        policy = policy_class()
        state = policy.create_state(L)
        plan = policy.rebalance_experts(context, state)
        assert isinstance(plan, module.EplbPlan)
        table = plan.physical_to_logical_map
        assert table.device.type == "cpu" and table.dtype in (torch.int32, torch.int64)  # plan_check
        for layer in range(L):
            policy.on_layer_committed(state, plan, layer)
        np.testing.assert_array_equal(state.committed, table.numpy())
        assert isinstance(state, module.EplbPolicyState) and state.plans == 1 and state.commits == L
        return table
    weight = torch.tensor(window.sum(axis=0))
    args = [weight, S, GROUPS, NODES, RANKS]
    if "physical_to_logical_map" in caller["positional"] and old is not None:
        args.append(old)
    result = policy_class.rebalance_experts(*args)
    if "unpacks" in caller:
        phy2log, log2phy, logcnt = result
        assert log2phy.shape[:2] == (L, E) and logcnt.shape == (L, E)
        assert (logcnt.sum(dim=1) == S).all()
        for layer in range(L):  # log2phy lists exactly the slots holding each expert
            for expert in range(E):
                slots = log2phy[layer, expert][log2phy[layer, expert] >= 0]
                assert len(slots) == logcnt[layer, expert]
                assert (phy2log[layer, slots] == expert).all()
    else:
        phy2log = result
    assert phy2log.dtype == torch.int64 and phy2log.device.type == "cpu"
    return phy2log


@pytest.mark.parametrize("interface", POLICY_INTERFACES)
def test_detects_each_documented_interface(interface):
    module = stand_in_module(interface)
    assert adapter.detect_interface(module.AbstractEplbPolicy) == interface
    policy = adapter.policy_for(module.AbstractEplbPolicy)
    assert issubclass(policy, module.AbstractEplbPolicy)
    policy()  # vLLM instantiates it (context) or calls the classmethod: no abstract method is left


def test_detects_the_five_argument_classmethod_of_vllm_0_13():
    module = stand_in_module("triple", "0.13.0")
    assert adapter.detect_interface(module.AbstractEplbPolicy) == "triple"
    series = _series(seed=5)
    phy2log, _, _ = adapter.policy_for(module.AbstractEplbPolicy).rebalance_experts(
        torch.tensor(series.sum(axis=0)), S, GROUPS, NODES, RANKS)
    np.testing.assert_array_equal(phy2log.numpy(), _expected(series.sum(axis=0)).phy2log)


@pytest.mark.parametrize("interface", POLICY_INTERFACES)
def test_plans_like_eplb_plan_when_called_as_vllm_calls_it(interface):
    module = stand_in_module(interface)
    policy = adapter.policy_for(module.AbstractEplbPolicy)
    first, second = _series(seed=1), _series(seed=2)
    old = _call_like_vllm(interface, module, policy, first, None if interface != "context" else
                          torch.tensor(_expected(first.sum(axis=0)).phy2log))
    # the context interface passes the load window [samples, L, E]: planned hedged over it, as a series
    planned_on = second if interface == "context" else second.sum(axis=0)
    fresh = _expected(planned_on)
    near = _call_like_vllm(interface, module, policy, second, old)
    expected = _expected(planned_on, previous=old.numpy())
    np.testing.assert_array_equal(near.numpy(), expected.phy2log)
    # planning near the placement in service moves fewer slots than planning from scratch
    assert (near.numpy() != old.numpy()).sum() < (fresh.phy2log != old.numpy()).sum()


def test_unknown_interfaces_are_refused_with_the_reason():
    class Renamed(ABC):
        @classmethod
        @abstractmethod
        def rebalance_experts(cls, loads, num_replicas, num_groups, num_nodes, num_ranks):
            ...

    class NewInstance(ABC):
        @abstractmethod
        def rebalance_experts(self, context):
            ...

    class NoAnnotation(ABC):
        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            ...

    with pytest.raises(ValueError, match="expected"):
        adapter.detect_interface(Renamed)
    with pytest.raises(ValueError, match="context, policy_state"):
        adapter.detect_interface(NewInstance)
    with pytest.raises(ValueError, match="return annotation"):
        adapter.detect_interface(NoAnnotation)
    with pytest.raises(ValueError, match="rebalance_experts"):
        adapter.detect_interface(object)


def test_settings_reach_every_adapter():
    for interface in POLICY_INTERFACES:
        policy = adapter.policy_for(stand_in_module(interface).AbstractEplbPolicy, method="greedy")
        assert policy.method == "greedy"
    with pytest.raises(ValueError, match="method"):
        adapter.policy_for(stand_in_module("phy2log").AbstractEplbPolicy, method="nope")


def test_groups_that_do_not_divide_among_nodes_plan_globally_as_vllm_does():
    weight = torch.tensor(_series(seed=3).sum(axis=0))
    phy2log = adapter.EplbPolicy.rebalance_experts(weight, S, 3, NODES, RANKS)  # 3 groups, 2 nodes
    expected = eplb.plan(weight.numpy(), num_slots=S, num_gpus=RANKS, num_nodes=NODES)
    np.testing.assert_array_equal(phy2log.numpy(), expected.phy2log)


def _fake_vllm(monkeypatch, interface: str):
    """Install a minimal ``vllm`` package (stand-in modules) into ``sys.modules``."""
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    if interface == "function":
        algo = types.ModuleType("vllm.distributed.eplb.rebalance_algo")
        algo.rebalance_experts = _method(INTERFACES["function"]["function"]["parameters"], "tuple", {})
        state = types.ModuleType("vllm.distributed.eplb.eplb_state")
        state.rebalance_experts = algo.rebalance_experts
        monkeypatch.setitem(sys.modules, algo.__name__, algo)
        monkeypatch.setitem(sys.modules, state.__name__, state)
        monkeypatch.setitem(sys.modules, "vllm.distributed.eplb.policy", None)  # import fails
        return state
    policy = stand_in_module(interface)
    policy.EPLB_POLICIES = {"default": policy.AbstractEplbPolicy}
    monkeypatch.setitem(sys.modules, "vllm.distributed.eplb.policy", policy)
    return policy


@pytest.mark.parametrize("interface", POLICY_INTERFACES)
def test_install_registers_the_policy_for_the_installed_vllm(monkeypatch, interface):
    policy_module = _fake_vllm(monkeypatch, interface)
    assert adapter.detect_interface() == interface
    installed = adapter.install(tolerance=None)
    assert policy_module.EPLB_POLICIES["default"] is installed and installed.tolerance is None
    assert issubclass(installed, policy_module.AbstractEplbPolicy)


def test_install_replaces_the_function_of_vllm_0_12(monkeypatch):
    state = _fake_vllm(monkeypatch, "function")
    assert adapter.detect_interface() == "function"
    with pytest.raises(ValueError, match="install"):
        adapter.policy_for()
    function = adapter.install(method="greedy")
    assert state.rebalance_experts is function
    caller = INTERFACES["function"]["caller"]
    weight = torch.tensor(_series(seed=4).sum(axis=0))
    phy2log, log2phy, logcnt = state.rebalance_experts(*[
        {"weight": weight, "num_replicas": S, "num_groups": GROUPS, "num_nodes": NODES, "num_gpus": RANKS}[name]
        for name in caller["positional"]])
    expected = eplb.rebalance_experts(weight.numpy(), S, GROUPS, NODES, RANKS, method="greedy")
    for got, want in zip((phy2log, log2phy, logcnt), expected):
        np.testing.assert_array_equal(got.numpy(), want)


def test_without_vllm_detection_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vLLM"):
        adapter.detect_interface()


# ---- vLLM's own files ---------------------------------------------------------------------------

ABSTRACT = "vllm/distributed/eplb/policy/abstract.py"
ALGO = "vllm/distributed/eplb/rebalance_algo.py"


def _vllm_sources() -> dict[str, dict[str, str]]:
    """``{version: {path: source}}`` for the EPLB files of each vLLM in EPLB_VLLM_SOURCES or installed."""
    found: dict[str, dict[str, str]] = {}
    folder = os.environ.get("EPLB_VLLM_SOURCES")
    if folder:
        for entry in sorted(Path(folder).iterdir()):
            if entry.suffix == ".whl":
                version = entry.name.split("-")[1]
                with zipfile.ZipFile(entry) as wheel:
                    names = set(wheel.namelist())
                    found[version] = {p: wheel.read(p).decode() for p in (ABSTRACT, ALGO) if p in names}
            elif (entry / "vllm").is_dir():
                found[entry.name] = {p: (entry / p).read_text() for p in (ABSTRACT, ALGO) if (entry / p).is_file()}
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        root = Path(spec.origin).parent.parent
        from importlib.metadata import version

        found[version("vllm")] = {p: (root / p).read_text() for p in (ABSTRACT, ALGO) if (root / p).is_file()}
    return found


SOURCES = _vllm_sources()
needs_vllm = pytest.mark.skipif(not SOURCES, reason="no vLLM files: install vllm or set EPLB_VLLM_SOURCES to a "
                                                    "folder of vLLM wheels / unpacked trees (a wheel is 250-490 MB)")


def _load_abstract(version: str, source: str) -> types.ModuleType:
    """vLLM's ``policy/abstract.py`` as a module of its own (it imports only abc, dataclasses, torch)."""
    name = "vllm_abstract_" + re.sub(r"\W", "_", version)
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"vllm-{version}/{ABSTRACT}", "exec"), module.__dict__)
    return module


@needs_vllm
@pytest.mark.parametrize("version", sorted(SOURCES))
def test_facts_and_adapter_against_vllms_own_files(version):
    files = SOURCES[version]
    expected = FACTS["versions_checked"].get(version)
    if ABSTRACT not in files:
        assert ALGO in files, f"vLLM {version} has neither {ABSTRACT} nor {ALGO}"
        assert expected in (None, "function")
        assert re.search(r"def rebalance_experts\(\s*weight[^)]*num_gpus", files[ALGO])
        return
    module = _load_abstract(version, files[ABSTRACT])
    abstract = module.AbstractEplbPolicy
    interface = adapter.detect_interface(abstract)
    if expected is not None:
        assert interface == expected, f"vLLM {version}: detected {interface}, the facts say {expected}"
    documented = dict(INTERFACES[interface]["abstract"])
    documented.update(INTERFACES[interface].get("variants", {}).get(version, {}))
    real = inspect.getattr_static(abstract, "rebalance_experts")
    function = real.__func__ if isinstance(real, classmethod) else real
    assert list(inspect.signature(function).parameters) == documented["parameters"]
    policy = adapter.policy_for(abstract)
    assert issubclass(policy, abstract)
    policy()  # every abstract method of vLLM's class is implemented
    if interface == "context":
        for name, fields in INTERFACES["context"]["dataclasses"].items():
            assert [f for f in getattr(module, name).__dataclass_fields__] == fields
    window, old = _series(seed=6), None
    if interface == "context":
        context = module.EplbRebalanceContext(
            load_window_cpu=torch.tensor(window),
            physical_to_logical_map_cpu=torch.tensor(_expected(window[:1].sum(axis=0)).phy2log),
            topology=module.EplbTopology(num_groups=GROUPS, num_nodes=NODES, num_ranks=RANKS),
            num_replicas=S, cpu_group=None)
        p = policy()
        plan = p.rebalance_experts(context, p.create_state(L))
        assert isinstance(plan, module.EplbPlan)
        phy2log = plan.physical_to_logical_map
    else:
        args = [torch.tensor(window.sum(axis=0)), S, GROUPS, NODES, RANKS]
        if "old_global_expert_indices" in documented["parameters"]:
            args.append(old)
        result = policy.rebalance_experts(*args)
        phy2log = result[0] if interface == "triple" else result
    assert phy2log.shape == (L, S) and phy2log.dtype == torch.int64
    eplb.Placement(phy2log.numpy(), E, eplb.Topology.uniform(S, RANKS, NODES))  # a valid placement


# ---- a resize: vLLM's elastic expert parallelism -------------------------------------------------

ELASTIC = FACTS["elastic_ep"]


def _stand_in_state(monkeypatch, group_size: int, physical_experts: int):
    """``vllm.distributed.eplb.eplb_state`` with an ``EplbState`` whose ``rearrange`` calls the
    registered policy as the facts say vLLM's does (``elastic_ep``): on a scale-down (a mapping as
    long as the group) the surviving ranks with the old slots per rank, else the group's ranks and
    the model's physical experts; the placement in service last, the rank mapping kept to itself."""
    facts = ELASTIC["rearrange"]
    module = types.ModuleType(facts["module"])

    class EplbState:
        def __init__(self, old, weight):
            self.physical_to_logical_map, self.weight = old, weight

        def rearrange(self, is_profile=False, rank_mapping=None):
            policy = sys.modules[_POLICY].EPLB_POLICIES["default"]
            if rank_mapping is not None and len(rank_mapping) == group_size:  # scale down
                ranks = sum(new != -1 for new in rank_mapping.values())
                replicas = self.physical_to_logical_map.shape[1] // group_size * ranks
            else:
                ranks, replicas = group_size, physical_experts
            return policy.rebalance_experts(self.weight, replicas, GROUPS, NODES, ranks, self.physical_to_logical_map)

    assert facts["parameter"] in inspect.signature(EplbState.rearrange).parameters
    setattr(module, facts["class"], EplbState)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return EplbState


_POLICY = "vllm.distributed.eplb.policy"
PER_RANK = 12  # slots per rank, kept across a resize (64 experts fit on 6 ranks)


def _in_service(seed: int) -> np.ndarray:
    """A placement in service ``[L, 96]`` on 8 ranks of 12 slots."""
    return eplb.plan(_series(seed=seed).sum(axis=0), num_slots=8 * PER_RANK, num_gpus=8, num_nodes=NODES,
                     num_groups=GROUPS).phy2log


@pytest.mark.parametrize("interface", ["triple", "phy2log"])
@pytest.mark.parametrize("resize", ["scale down", "scale up", "removed in the middle"])
def test_a_resize_is_replanned_from_the_placement_in_service_with_the_rank_mapping(monkeypatch, interface, resize):
    _fake_vllm(monkeypatch, interface)
    weight = _series(seed=8).sum(axis=0)
    old = _in_service(7)
    mapping, ranks, group = {
        "scale down": ({r: r if r < 6 else -1 for r in range(8)}, 6, 8),  # _eplb_before_scale_down
        "scale up": ({r: r for r in range(8)}, 12, 12),  # _eplb_after_scale_up: 4 ranks appended
        "removed in the middle": ({0: 0, 1: 1, 2: -1, 3: -1, 4: 2, 5: 3, 6: 4, 7: 5}, 6, 8),
    }[resize]
    state_class = _stand_in_state(monkeypatch, group, PER_RANK * ranks)
    adapter.install()
    result = state_class(torch.tensor(old), torch.tensor(weight)).rearrange(rank_mapping=mapping)
    phy2log = (result[0] if interface == "triple" else result).numpy()
    change = eplb.DeploymentChange(eplb.Deployment.of(E, num_slots=8 * PER_RANK, num_gpus=8),
                                   eplb.Deployment.of(E, num_slots=PER_RANK * ranks, num_gpus=ranks, num_nodes=NODES,
                                                      num_groups=GROUPS),
                                   [mapping[r] for r in range(8)])
    expected = eplb.plan(weight, change, previous=old)
    np.testing.assert_array_equal(phy2log, expected.phy2log)
    # the survivors keep what they held: far fewer copies than vLLM's plan from scratch
    fresh = eplb.plan(weight, change.new)
    carried = change.carry(old)
    assert (phy2log != carried).sum() < (fresh.phy2log != carried).sum()
    if resize != "scale up":
        assert expected.info["orphans"].sum() > 0  # some experts lived only on the removed ranks


def test_without_a_rank_mapping_a_resize_maps_ranks_by_index_as_vllm_does():
    weight = torch.tensor(_series(seed=9).sum(axis=0))
    old = torch.tensor(_in_service(10))
    plain = adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old)
    with adapter.rank_mapping({r: r if r < 6 else -1 for r in range(8)}):  # vLLM's scale-down mapping
        mapped = adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old)
    assert torch.equal(plain, mapped)
    with adapter.rank_mapping({r: (r + 3) % 8 for r in range(8)}):  # the same ranks, renumbered: a change too
        renumbered = adapter.EplbPolicy.rebalance_experts(weight, 8 * PER_RANK, GROUPS, NODES, 8, old)
    change = eplb.DeploymentChange(eplb.Deployment.of(E, num_slots=8 * PER_RANK, num_gpus=8),
                                   eplb.Deployment.of(E, num_slots=8 * PER_RANK, num_gpus=8, num_nodes=NODES,
                                                      num_groups=GROUPS),
                                   [(r + 3) % 8 for r in range(8)])
    np.testing.assert_array_equal(renumbered.numpy(), eplb.plan(weight.numpy(), change, previous=old.numpy()).phy2log)


def test_the_context_interface_plans_a_resize_from_the_placement_in_service():
    module = stand_in_module("context")
    policy = adapter.policy_for(module.AbstractEplbPolicy)()
    window = _series(seed=11)
    old = _in_service(12)
    context = module.EplbRebalanceContext(
        load_window_cpu=torch.tensor(window), physical_to_logical_map_cpu=torch.tensor(old),
        topology=module.EplbTopology(num_groups=GROUPS, num_nodes=NODES, num_ranks=10), num_replicas=10 * PER_RANK,
        cpu_group=None)
    plan = policy.rebalance_experts(context, policy.create_state(L))
    change = eplb.DeploymentChange(eplb.Deployment.of(E, num_slots=8 * PER_RANK, num_gpus=8),
                                   eplb.Deployment.of(E, num_slots=10 * PER_RANK, num_gpus=10, num_nodes=NODES,
                                                      num_groups=GROUPS))
    np.testing.assert_array_equal(plan.physical_to_logical_map.numpy(), eplb.plan(window, change, previous=old).phy2log)


def test_a_rank_mapping_that_does_not_fit_the_placement_in_service_is_refused():
    weight = torch.tensor(_series(seed=13).sum(axis=0))
    old = torch.tensor(_in_service(14))  # 96 slots
    with adapter.rank_mapping({r: r for r in range(5)}), pytest.raises(ValueError, match="names 5 old ranks"):
        adapter.EplbPolicy.rebalance_experts(weight, 72, GROUPS, NODES, 6, old)
    with adapter.rank_mapping({0: 0, 2: 1}), pytest.raises(ValueError, match="every old rank"):
        adapter.EplbPolicy.rebalance_experts(weight, 72, GROUPS, NODES, 6, old)


def test_item17_a_short_or_float_rank_mapping_is_refused_never_read_another_way():
    """Issue 47 item 17: a mapping of 6 ranks for a placement of 8 ranks x 12 slots divides its 96
    slots and was read as 6 old ranks of 16; a float rank was truncated (1.7 -> 1). vLLM keeps a
    rank's slots across a resize, so the old ranks are 96 / 12 = 8: both are one clear ValueError."""
    weight = torch.tensor(_series(seed=13).sum(axis=0))
    old = torch.tensor(_in_service(14))  # 96 slots on 8 ranks
    with adapter.rank_mapping({r: r for r in range(6)}), pytest.raises(ValueError, match="names 6 old ranks.*8 old ranks"):
        adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old)
    floats = {r: (r if r < 6 else -1) + (0.7 if r == 1 else 0) for r in range(8)}
    with adapter.rank_mapping(floats), pytest.raises(ValueError, match=r"rank_mapping\[1\] must be an integer"):
        adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old)
    whole = {r: float(r if r < 6 else -1) for r in range(8)}  # floats, even whole ones: not ranks
    with adapter.rank_mapping(whole), pytest.raises(ValueError, match="must be an integer"):
        adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old)
    numpy_ints = {np.int64(r): np.int64(r if r < 6 else -1) for r in range(8)}  # numpy integers are ranks
    with adapter.rank_mapping(numpy_ints):
        assert adapter.EplbPolicy.rebalance_experts(weight, 6 * PER_RANK, GROUPS, NODES, 6, old).shape == (L, 72)


def test_install_wraps_rearrange_once(monkeypatch):
    _fake_vllm(monkeypatch, "phy2log")
    state_class = _stand_in_state(monkeypatch, 8, S)
    adapter.install()
    wrapped = state_class.rearrange
    adapter.install()
    assert state_class.rearrange is wrapped and wrapped.eplb_rank_mapping

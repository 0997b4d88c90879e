"""One contract for every method (``eplb.METHODS``), on every kind of deployment, under every
dispatch rule (docs/methods.md): every expert present; no avoidable doubled replica (the spread
rule, checked by ``checks.avoidable_doubled`` from its words); every group on its home node when
hierarchical; ``lower_bound <= max_load``; the same plan in a fresh process. A method may refuse a
deployment only with a ``ValueError`` its documentation names (``REFUSALS``).

The published ``greedy`` is held to its own documented behaviour instead of the spread rule: it is
the published algorithm (the same GPU loads as ``bench/published_greedy.py``) and may put two
replicas of an expert on one GPU, which docs/methods.md says.

The fast tier draws a few examples per (method, deployment kind); the ``slow`` tests draw many more.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checks import assert_valid, avoidable_doubled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import counts_for

import eplb
from eplb.engines import DISPATCH_RULES, dispatch_rule

import published_greedy  # bench/ (tests/conftest.py puts it on sys.path)

ROOT = Path(__file__).resolve().parents[2]
METHODS = tuple(eplb.METHODS)
KINDS = ("uniform", "uneven slots", "masked GPUs", "hierarchical", "hierarchical, masked GPU", "slots = experts",
         "slots = GPUs x experts")
RULES = tuple(DISPATCH_RULES)
# the exact method with a reproducible budget (the instances are small enough to be proven in it)
OPTIONS = {"exact": {"deterministic_time": 0.5}}
# what a method may refuse, and the message it then gives (anything else is a failure)
REFUSALS = {
    "greedy": r"method 'greedy' needs the same number of slots on every GPU",
    None: r"dispatch='sglang-[a-z-]+' needs the same number of slots on every GPU",
}
FAST = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
DEEP = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


# -- the deployments --------------------------------------------------------------------------------

@st.composite
def deployments(draw, kind: str) -> eplb.Deployment:
    """A small deployment of ``kind`` (the exact method proves these in a fraction of a second)."""
    if kind in ("hierarchical", "hierarchical, masked GPU"):
        return draw(hierarchical_deployments(masked=kind != "hierarchical"))
    gpus = draw(st.integers(1, 4) if kind in ("uniform", "slots = experts") else st.integers(2, 4))
    if kind == "uniform":
        experts = draw(st.integers(1, 8))
        per_gpu = draw(st.integers(-(-experts // gpus), -(-experts // gpus) + 2))
        topology = eplb.Topology.uniform(gpus * per_gpu, gpus)
    elif kind == "slots = experts":
        experts = draw(st.integers(gpus, 8))
        topology = eplb.Topology.from_layout(experts, gpus)  # one slot more on the first GPUs
    elif kind == "slots = GPUs x experts":
        experts = draw(st.integers(1, 4))
        topology = eplb.Topology.uniform(gpus * experts, gpus)
    else:
        slots = draw(st.lists(st.integers(1, 5), min_size=gpus, max_size=gpus))
        if kind == "uneven slots" and len(set(slots)) == 1:
            slots[0] += 1
        if kind == "masked GPUs":
            for g in draw(st.sets(st.integers(0, gpus - 1), min_size=1, max_size=gpus - 1)):
                slots[g] = 0
        topology = eplb.Topology(np.asarray(slots, np.int64))
        experts = draw(st.integers(1, min(8, topology.num_slots)))
    return eplb.Deployment.of(experts, topology=topology)


@st.composite
def hierarchical_deployments(draw, masked: bool) -> eplb.Deployment:
    """2 nodes, each holding the same number of groups; with ``masked``, one GPU of 2 on a node
    holds no slots."""
    per_node = 2 if masked else draw(st.integers(1, 2))
    groups_per_node, size = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    slots = []
    for node in range(2):
        active = per_node - (masked and node == 0)
        least = -(-groups_per_node * size // active)
        slots += [draw(st.integers(least, least + 2))] * active + [0] * (per_node - active)
    topology = eplb.Topology(np.asarray(slots, np.int64), num_nodes=2)
    return eplb.Deployment.of(2 * groups_per_node * size, topology=topology, num_groups=2 * groups_per_node)


@st.composite
def cases(draw, method: str | None = None, kind: str | None = None) -> dict:
    """One call: a method, a deployment under a dispatch rule, counts ``[L, E]`` or a series ``[2, L, E]``."""
    method = method or draw(st.sampled_from(METHODS))
    kind = kind or draw(st.sampled_from(KINDS))
    deployment = draw(deployments(kind))
    rule = draw(st.sampled_from(RULES))
    counts = draw(counts_for(deployment.num_experts, num_layers=draw(st.integers(1, 2))))
    if draw(st.booleans()):  # a series of two windows
        counts = np.stack([counts, draw(counts_for(deployment.num_experts, num_layers=counts.shape[0]))])
    return dict(method=method, kind=kind, rule=rule, counts=counts, experts=deployment.num_experts,
                slots=deployment.topology.slots_per_gpu.tolist(), nodes=deployment.topology.num_nodes,
                groups=deployment.num_groups)


def deployment_of(case: dict) -> eplb.Deployment:
    topology = eplb.Topology(np.asarray(case["slots"], np.int64), case["nodes"])
    return eplb.Deployment.of(case["experts"], topology=topology, num_groups=case["groups"], dispatch=case["rule"])


def plan(case: dict):
    """The case's placement, or the ``ValueError`` it was refused with."""
    try:
        return eplb.plan(np.asarray(case["counts"]), deployment_of(case), method=case["method"],
                         **OPTIONS.get(case["method"], {}))
    except ValueError as exc:
        return exc


# -- the contract ----------------------------------------------------------------------------------

def check_refusal(case: dict, refusal: ValueError) -> None:
    """A refusal names the method's or the rule's documented limit."""
    allowed = [REFUSALS[None]] + ([REFUSALS[case["method"]]] if case["method"] in REFUSALS else [])
    assert any(re.search(pattern, str(refusal)) for pattern in allowed), f"{case['method']}: {refusal}"
    assert not eplb.Topology(np.asarray(case["slots"], np.int64)).is_uniform


def check_contract(case: dict, placement: eplb.Placement) -> None:
    deployment = deployment_of(case)
    assert_valid(placement, case["experts"])  # every expert present, the three arrays agree
    assert (placement.lower_bound <= placement.max_load * (1 + 1e-9) + 1e-300).all()
    if deployment.hierarchical:
        assert placement.home_node is not None
        node_of_slot = placement.topology.node_of_gpu[placement.topology.gpu_of_slot]
        group = placement.phy2log // (case["experts"] // case["groups"])
        for layer in range(placement.num_layers):
            np.testing.assert_array_equal(node_of_slot, placement.home_node[layer, group[layer]])
    if case["method"] == "greedy":
        check_greedy_is_the_published_algorithm(case, placement)
    else:
        assert (avoidable_doubled(placement, deployment.hierarchical) == 0).all(), placement.phy2log
    if case["method"] == "exact" and planned_by_the_method_alone(case):
        assert (placement.info["doubled"] == placement.replicas_sharing_a_gpu()).all()


def planned_by_the_method_alone(case: dict) -> bool:
    """An even split and counts planned as their sum: the plan is the method's own, as it returned it
    (a series is hedged, and other rules remake the plan, after the method)."""
    return dispatch_rule(case["rule"]).kind == "uniform" and np.asarray(case["counts"]).ndim == 2


def check_greedy_is_the_published_algorithm(case: dict, placement: eplb.Placement) -> None:
    """Where greedy's plan is served as it is (an even split, counts planned as their sum), it has the
    published algorithm's GPU loads, doubled replicas included."""
    counts = np.asarray(case["counts"])
    if not planned_by_the_method_alone(case):
        return  # the contract above holds
    deployment = deployment_of(case)
    groups, nodes = (case["groups"], case["nodes"]) if deployment.hierarchical else (1, 1)
    published, _, _ = published_greedy.rebalance_experts(counts.astype(np.float32), deployment.num_slots, groups,
                                                         nodes, deployment.num_gpus)
    reference = eplb.Placement(published, case["experts"], deployment.topology)
    np.testing.assert_allclose(placement.gpu_loads(counts), reference.gpu_loads(counts), rtol=1e-12, atol=0)


def check_case(case: dict) -> None:
    placement = plan(case)
    if isinstance(placement, ValueError):
        check_refusal(case, placement)
    else:
        check_contract(case, placement)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
@FAST
@given(data=st.data())
def test_every_method_keeps_the_contract_on_every_deployment_and_dispatch_rule(method, kind, data):
    check_case(data.draw(cases(method, kind)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
@DEEP
@given(data=st.data())
def test_every_method_keeps_the_contract_deeper(method, kind, data):
    check_case(data.draw(cases(method, kind)))


# -- the same plan in a fresh process --------------------------------------------------------------

CHILD = """
import json, sys
import numpy as np
sys.path[:0] = {paths!r}
from test_method_contract import plan
for case in json.load(sys.stdin):
    case["counts"] = np.asarray(case["counts"])
    out = plan(case)
    print(json.dumps(str(out) if isinstance(out, ValueError) else out.phy2log.tolist()))
"""


def plans_in_a_fresh_process(batch: list[dict]) -> list:
    paths = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "planning"), str(ROOT / "bench")]
    payload = json.dumps([{**case, "counts": np.asarray(case["counts"]).tolist()} for case in batch])
    done = subprocess.run([sys.executable, "-c", CHILD.format(paths=paths)], input=payload, capture_output=True,
                          text=True, check=True, cwd=ROOT)
    return [json.loads(line) for line in done.stdout.splitlines()]


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.tuples(*(cases(method) for method in METHODS)))
def test_the_same_plan_in_a_fresh_process(batch):
    """Every method, a drawn deployment and rule each: one child process plans them all again."""
    here = [plan(case) for case in batch]
    there = plans_in_a_fresh_process(list(batch))
    for case, mine, theirs in zip(batch, here, there):
        expected = str(mine) if isinstance(mine, ValueError) else mine.phy2log.tolist()
        assert theirs == expected, case["method"]


# -- greedy: its documented behaviour -------------------------------------------------------------

def test_the_docs_say_greedy_may_double_replicas_and_needs_the_same_slots_on_every_gpu():
    methods = (ROOT / "docs" / "methods.md").read_text()
    row = next(line for line in methods.splitlines() if line.startswith("| `greedy`"))
    assert "two replicas of an expert on one GPU" in row and "same number of slots on every GPU" in row
    assert "except the published `greedy`" in methods


def test_greedy_doubles_a_replica_the_counts_let_every_other_method_spread():
    """The documented exception is real: 12 experts on 24 slots / 8 GPUs, 2 nodes, 4 groups (issue 22)."""
    counts = np.array([[27481.2, 2791.8, 2183, 3020.3, 4568.7, 18017, 19920, 4664.7, 4583.9, 3533.4, 12763.6,
                        1303.1]])
    config = dict(num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
    greedy = eplb.plan(counts, method="greedy", **config)
    assert avoidable_doubled(greedy, True)[0] > 0
    for method in METHODS:
        if method != "greedy":
            placement = eplb.plan(counts, method=method, **config, **OPTIONS.get(method, {}))
            assert avoidable_doubled(placement, True)[0] == 0, method


# -- the same slots on every GPU: never twice ---------------------------------------------------------

@FAST
@given(data=st.data(), method=st.sampled_from([m for m in METHODS if m != "greedy"]),
       kind=st.sampled_from(["uniform", "hierarchical", "slots = GPUs x experts"]))
def test_with_the_same_slots_on_every_gpu_no_expert_is_ever_twice_on_a_gpu(data, method, kind):
    """In every domain (all GPUs, or a node with the groups the plan put there) whose GPUs hold the
    same slots, at most as many as its experts, no GPU holds an expert twice."""
    case = data.draw(cases(method, kind))
    placement = plan(case)
    if isinstance(placement, ValueError):
        return
    topology = placement.topology
    hierarchical = deployment_of(case).hierarchical
    domain_of_slot = topology.node_of_gpu[topology.gpu_of_slot] if hierarchical else np.zeros(topology.num_slots, int)
    for layer, row in enumerate(placement.phy2log):
        for domain in np.unique(domain_of_slot):
            inside = domain_of_slot == domain
            gpus = np.unique(topology.gpu_of_slot[inside])
            if len(set(topology.slots_per_gpu[gpus])) == 1 and topology.slots_per_gpu[gpus[0]] <= len(set(row[inside])):
                pairs = set(zip(topology.gpu_of_slot[inside].tolist(), row[inside].tolist()))
                assert len(pairs) == inside.sum(), (layer, row)


# -- every promise about methods, backed by a test named for it -------------------------------------

PROMISES = [
    # (page, the promise as it reads there, tests named for it: "file::name")
    ("docs/methods.md", "never more replicas of an expert than GPUs",
     ["planning/test_method_contract.py::test_every_method_keeps_the_contract_on_every_deployment_and_dispatch_rule"]),
    ("docs/methods.md", "Every layer's row depends on that layer alone",
     ["planning/test_default_method.py::test_a_layers_row_depends_only_on_that_layers_loads"]),
    ("docs/methods.md", "the best spread placement an exact branch and bound finds",
     ["kernels/test_tiny.py::test_the_search_finds_the_brute_force_optimum",
      "kernels/test_tiny.py::test_spread_placements_keep_every_replica_on_its_own_gpu"]),
    ("docs/methods.md", "| `best` | the default, then",
     ["planning/test_default_method.py::test_best_is_never_worse_than_the_default"]),
    ("docs/methods.md", "the lowest max load among the placements that keep the spread rule, with optimality certificates",
     ["planning/test_exact.py::test_exact_matches_brute_force_and_certifies_every_method",
      "planning/test_exact.py::test_exact_matches_brute_force_hierarchical"]),
    ("docs/methods.md", "the published DeepSeek algorithm: it may put two replicas of an expert on one GPU where the "
                        "counts allow otherwise, and needs the same number of slots on every GPU",
     ["kernels/test_greedy.py::test_same_gpu_loads_as_the_published_algorithm",
      "planning/test_method_contract.py::test_the_docs_say_greedy_may_double_replicas_and_needs_the_same_slots_on_every_gpu",
      "planning/test_method_contract.py::test_greedy_doubles_a_replica_the_counts_let_every_other_method_spread"]),
    ("docs/methods.md", "so it is never worse than greedy where greedy spreads its replicas",
     ["planning/test_default_method.py::test_never_worse_than_greedy_on_any_layer"]),
    ("docs/methods.md", "Every method gives every expert a replica in every layer, the same plan in every process, "
                        "every group on its home node when hierarchical, and `lower_bound <= max_load`",
     ["planning/test_method_contract.py::test_every_method_keeps_the_contract_on_every_deployment_and_dispatch_rule",
      "planning/test_method_contract.py::test_the_same_plan_in_a_fresh_process"]),
    ("docs/methods.md", "every method except the published `greedy` takes any `Topology` and keeps the **spread rule**",
     ["planning/test_method_contract.py::test_every_method_keeps_the_contract_on_every_deployment_and_dispatch_rule",
      "planning/test_spread.py::test_avoidable_doubled_agrees_with_the_rule_in_its_own_words"]),
    ("docs/methods.md", "no expert is ever twice on a GPU",
     ["planning/test_method_contract.py::test_with_the_same_slots_on_every_gpu_no_expert_is_ever_twice_on_a_gpu"]),
    ("docs/methods.md", "`eplb compare` counts every method's doubled replicas, a foreign one's too",
     ["simulation/test_compare.py::test_doubled_replicas_and_groups_off_their_node_are_flagged_not_refused",
      "simulation/test_compare.py::test_figures_agree_with_an_independent_computation_from_phy2log"]),
    ("docs/methods.md", "groups go to nodes by a search over assignments",
     ["planning/test_default_method.py::test_hierarchical_placement_keeps_every_group_on_one_node",
      "planning/test_hierarchy.py::test_groups_go_to_nodes_that_can_hold_their_hot_expert"]),
    ("docs/methods.md", "never above a CP-SAT-proven optimum or a brute-force optimum on random small instances",
     ["analysis/test_bounds.py::test_every_bound_is_at_most_the_brute_force_optimum",
      "planning/test_exact.py::test_medium_instances_certify_every_method"]),
    ("docs/methods.md", "which keeps the bound useful at many groups (e.g. 1024 experts / 32 groups / 16 nodes)",
     ["planning/test_hierarchy.py::test_hierarchical_bound_at_1024_experts_32_groups_16_nodes"]),
    ("docs/methods.md", "so they are exact from denormal to 1e300 totals",
     ["planning/test_scale_free.py::test_bounds_scale_exactly_from_denormal_to_huge_counts"]),
    ("docs/methods.md", "so a plan that breaks the rule (greedy's) can be lighter than that bound; the closed-form "
                        "bounds (`eplb.lower_bound`) hold for every placement",
     ["planning/test_exact.py::test_exact_matches_brute_force_and_certifies_every_method"]),
    ("docs/methods.md", "so when the budget ends before a proof the plan is the best found so far, keeps the rule, "
                        "and says so",
     ["planning/test_exact.py::test_when_the_budget_ends_before_a_proof_the_plan_keeps_the_rule_and_says_so",
      "planning/test_exact.py::test_a_warm_start_that_breaks_the_rule_is_rearranged_to_keep_it"]),
    ("docs/methods.md", "building the model (stopped at the limit, the warm start then kept)",
     ["planning/test_exact.py::test_a_time_limit_spent_building_the_model_keeps_the_warm_start_and_says_so"]),
    ("docs/methods.md", "a second search for the fewest doubled replicas where the rule allows some",
     ["planning/test_exact.py::test_where_the_counts_force_a_doubled_replica_exact_keeps_the_fewest",
      "planning/test_exact.py::test_exact_reports_its_doubled_replicas_and_where_its_plan_came_from"]),
    ("docs/methods.md", "work budget per layer, shared the same way (the same plan on every machine)",
     ["planning/test_exact.py::test_same_input_same_placement",
      "planning/test_method_contract.py::test_the_same_plan_in_a_fresh_process"]),
    ("docs/methods.md", "Integer loads are scaled so \"optimal\" is exact where the counts allow",
     ["planning/test_exact.py::test_fractional_counts_use_rounded_loads_and_stay_exact_within_precision"]),
    ("docs/methods.md", "brackets the optimum of small global layers",
     ["planning/test_certificate.py::test_certificate_brackets_the_brute_force_optimum"]),
    ("README.md", "the published algorithm, same loads",
     ["kernels/test_greedy.py::test_same_gpu_loads_as_the_published_algorithm"]),
    ("README.md", "every other method puts them on different GPUs wherever the counts allow",
     ["planning/test_method_contract.py::test_every_method_keeps_the_contract_on_every_deployment_and_dispatch_rule"]),
]


def test_every_promise_about_methods_is_backed_by_a_test_named_for_it():
    """Each promise still reads as quoted (reworded, this table follows) and each test it names exists."""
    import ast

    for page, promise, tests in PROMISES:
        text = " ".join((ROOT / page).read_text().split())
        assert promise in text, f"{page} no longer says: {promise}"
        for test in tests:
            path, name = test.split("::")
            tree = ast.parse((ROOT / "tests" / path).read_text())
            assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, test

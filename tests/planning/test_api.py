"""The public entry points: DeepSeek-compatible ``rebalance_experts`` and ``plan``."""

import numpy as np
import pytest
from checks import assert_valid, assert_valid_arrays
from hypothesis import given
from strategies import problems

import eplb

README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_readme_case_of_the_published_algorithm():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8, method="greedy")
    assert phy2log.tolist() == README_PHY2LOG
    assert_valid_arrays(phy2log, log2phy, logcnt, 12, 16)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    weight = torch.tensor(README_WEIGHT, dtype=torch.float32)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 16, 4, 2, 8, method="greedy")
    for tensor in (phy2log, log2phy, logcnt):
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int64 and tensor.device.type == "cpu"
    assert phy2log.tolist() == README_PHY2LOG


def test_numpy_in_numpy_out_and_one_layer():
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array(README_WEIGHT[0]), 16, 4, 2, 8, method="greedy")
    assert isinstance(phy2log, np.ndarray) and phy2log.shape == (16,)
    assert logcnt.shape == (12,) and log2phy.shape[0] == 12
    assert phy2log.tolist() == README_PHY2LOG[0]


@pytest.mark.slow  # a fresh interpreter (14 s on an empty cache)
def test_torch_is_not_imported_for_numpy_callers():
    import subprocess
    import sys

    code = ("import sys, numpy as np, eplb; eplb.plan(np.ones((2, 8)), num_slots=8, num_gpus=2);"
            "eplb.rebalance_experts(np.ones((2, 8)), 8, 1, 1, 2); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_plan_reports_bound_and_gap():
    counts = np.array(README_WEIGHT, dtype=float)
    placement = eplb.plan(counts, num_slots=16, num_gpus=8, num_nodes=2, num_groups=4, method="greedy")
    assert_valid(placement, 12)
    loads = placement.gpu_loads(counts)
    assert loads.shape == (2, 8)
    np.testing.assert_allclose(loads.sum(axis=1), counts.sum(axis=1))
    np.testing.assert_allclose(placement.max_load, loads.max(axis=1))
    assert (placement.lower_bound <= placement.max_load + 1e-9).all()
    np.testing.assert_allclose(placement.gap, placement.max_load / placement.lower_bound - 1)
    assert placement.method == "greedy" and placement.info["time_s"] >= 0


@given(problems())
def test_every_method_gives_a_valid_placement_within_its_bound(deployment):
    config, counts = deployment
    for method in eplb.METHODS:
        if method == "exact":
            continue  # covered by the exact solver's own tests
        placement = eplb.plan(counts, method=method, **{k: v for k, v in config.items() if k != "num_experts"})
        assert_valid(placement, config["num_experts"])
        assert (placement.lower_bound <= placement.max_load * (1 + 1e-9) + 1e-9).all()


def test_series_counts_are_summed_over_windows_with_the_sum_objective():
    rng = np.random.default_rng(0)
    series = rng.integers(0, 100, (4, 3, 16))
    a = eplb.plan(series, num_slots=20, num_gpus=4, method="greedy", objective="sum")
    b = eplb.plan(series.sum(axis=0), num_slots=20, num_gpus=4, method="greedy")
    assert a == b
    assert a.gpu_loads(series).shape == (4, 3, 4)


def test_dense_layers_and_a_single_gpu_are_valid():
    counts = np.zeros((2, 8))
    placement = eplb.plan(counts, num_slots=8, num_gpus=1, method="greedy")
    assert_valid(placement, 8)
    assert (placement.balancedness(counts) == 1.0).all()
    assert (placement.gap == 0).all()


BAD_INPUTS = [
    (dict(counts=[[1.0, -1.0]]), "non-negative"),
    (dict(counts=[[1.0, np.nan]]), "NaN"),
    (dict(counts=[[1.0, np.inf]]), "finite"),
    (dict(counts=np.ones((2, 2, 2, 2))), "shape"),
    (dict(counts=[[]]), "at least one expert"),
    (dict(counts="abc"), "numeric"),
    (dict(num_slots=4), "num_slots"),
    (dict(num_slots=10), "divisible by num_gpus"),
    (dict(num_nodes=3), "divisible by num_nodes"),
    (dict(num_groups=6), "divisible by num_groups"),  # 6 % 2 nodes == 0: hierarchical, needs E % 6 == 0
    (dict(num_gpus=2.5), "num_gpus must be an integer"),
    (dict(num_slots=8.0), "num_slots must be an integer"),
    (dict(num_gpus=True), "bool"),
    (dict(num_gpus=0), "num_gpus must be >= 1"),
    (dict(num_groups=0), "num_groups must be >= 1"),
    (dict(method="nope"), "method must be one of"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS)
def test_bad_input_names_the_argument_and_the_rule(change, message):
    args = dict(counts=np.ones((2, 8)), num_slots=8, num_gpus=4, num_nodes=2, num_groups=4, method="greedy")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        eplb.plan(args.pop("counts"), **args)


# the published entry point ignores nodes when groups do not split over them (num_nodes=3 here)
@pytest.mark.parametrize("change, message", [case for case in BAD_INPUTS[:6] + BAD_INPUTS[7:]
                                             if "num_nodes" not in case[0]])
def test_bad_input_to_rebalance_experts(change, message):
    args = dict(counts=np.ones((2, 8)), num_slots=8, num_gpus=4, num_nodes=2, num_groups=4, method="greedy")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        eplb.rebalance_experts(args["counts"], args["num_slots"], args["num_groups"], args["num_nodes"],
                               args["num_gpus"], method=args["method"])


def test_too_few_slots_is_named():
    with pytest.raises(ValueError, match=r"num_slots \(4\) must be >= the number of experts \(8\)"):
        eplb.rebalance_experts(np.ones((1, 8)), 4, 1, 1, 2)

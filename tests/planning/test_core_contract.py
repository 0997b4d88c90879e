"""The core API's contract: the bound only when asked for, declared options, the published group
fallback, the exact method's time options and optional OR-Tools, extreme magnitudes."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
import eplb.planning.pipeline
from eplb.model.counts import power_of_two_scale
from eplb.simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts

CONFIG = dict(num_slots=24, num_gpus=4, num_nodes=2)


def counts(layers=3, experts=16, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, (layers, experts)).astype(float)


# -- 1. the lower bound is computed only when asked for --------------------------------------------


def test_plan_does_not_compute_the_bound_until_it_is_read(monkeypatch):
    calls = []
    real = eplb.planning.pipeline.strongest_bound
    monkeypatch.setattr(eplb.planning.pipeline, "strongest_bound", lambda *a, **k: calls.append(1) or real(*a, **k))
    placement = eplb.plan(counts(), num_groups=2, **CONFIG)
    assert calls == []
    gap = placement.gap
    assert calls == [1] and gap.shape == (3,) and (gap >= 0).all()
    placement.lower_bound, placement.gap  # cached: not computed again
    assert calls == [1]


def test_lazy_bound_equals_the_bound_of_the_planning_counts():
    c = counts(seed=3)
    placement = eplb.plan(c, num_groups=2, **CONFIG)
    expected = eplb.lower_bound(c, eplb.Deployment.of(c.shape[-1], topology=placement.topology, num_groups=2))
    np.testing.assert_array_equal(placement.lower_bound, expected)
    np.testing.assert_array_equal(placement.max_load, placement.gpu_loads(c).max(axis=1))
    with pytest.raises(AttributeError):
        placement.lower_bound = expected  # frozen
    restored = eplb.Placement.from_dict(placement.to_dict())
    np.testing.assert_array_equal(restored.lower_bound, placement.lower_bound)
    np.testing.assert_array_equal(restored.gap, placement.gap)


# -- 2. options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method, options, message", [
    ("balanced", {"num_start": 3}, r"unknown option\(s\) num_start; accepted options: greedy_fallback, max_steps, num_starts, recount"),
    ("greedy", {"seed": 1}, r"unknown option\(s\) seed; accepted options: none"),
    ("best", {"nums_starts": 1}, "unknown option.*nums_starts.*capped_budget"),
    ("balanced", {"num_starts": -5}, r"option num_starts must be an integer >= 1 and <= 9223372036854775807, got -5"),
    ("best", {"capped_budget": -1}, "option capped_budget must be an integer >= 0"),
    ("best", {"seed": 1.5}, "option seed must be an integer"),
    ("balanced", {"greedy_fallback": 1}, "option greedy_fallback must be True or False"),
    ("exact", {"time_limit": -1}, "option time_limit must be a finite number > 0"),
    ("exact", {"deterministic_time": float("nan")}, "option deterministic_time must be a finite number > 0"),
    ("exact", {"workers": 0}, "option workers must be an integer >= 1"),
    ("exact", {"time_limit": "10"}, "option time_limit"),
])
def test_bad_options_raise_a_value_error_naming_them(method, options, message):
    with pytest.raises(ValueError, match=message):
        eplb.plan(counts(), method=method, **CONFIG, **options)
    with pytest.raises(ValueError, match=message):
        eplb.rebalance_experts(counts(), 24, 2, 2, 4, method=method, **options)


# -- 3. the published group rule -------------------------------------------------------------------


@pytest.mark.parametrize("experts, slots, groups, nodes, gpus", [
    (4, 4, 3, 2, 4),  # a case of vLLM's EPLB tests: 3 groups on 2 nodes
    (256, 288, 8, 3, 32),  # 32 GPUs on 3 nodes
    (10, 12, 3, 2, 4),  # 10 experts in 3 groups: the groups are ignored
])
def test_rebalance_experts_falls_back_to_global_like_the_published_one(experts, slots, groups, nodes, gpus):
    weight = counts(2, experts, seed=1) + 1
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, slots, groups, nodes, gpus, method="greedy")
    expected = eplb.rebalance_experts(weight, slots, 1, 1, gpus, method="greedy")
    for got, want in zip((phy2log, log2phy, logcnt), expected):
        np.testing.assert_array_equal(got, want)
    assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == slots).all()
    default, _, _ = eplb.rebalance_experts(weight, slots, groups, nodes, gpus)
    assert default.shape == (2, slots)


def test_plan_follows_the_fallback_but_keeps_invalid_topologies_an_error():
    weight = counts(2, 10, seed=1)
    placement = eplb.plan(weight, num_slots=12, num_gpus=4, num_nodes=2, num_groups=3)
    assert placement.num_groups is None and not placement.info["hierarchical"]
    with pytest.raises(ValueError, match="divisible by num_nodes"):
        eplb.plan(weight, num_slots=96, num_gpus=32, num_nodes=3, num_groups=8)
    with pytest.raises(ValueError, match="divisible by num_groups"):
        eplb.plan(counts(2, 10), num_slots=12, num_gpus=4, num_nodes=2, num_groups=4)


# -- 4. exact: options and optional OR-Tools -----------------------------------------------------


def test_import_eplb_never_imports_ortools():
    code = "import sys, eplb; eplb.plan([[1.0, 2.0]], num_slots=2, num_gpus=1); print('ortools' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exact_without_ortools_says_which_extra_to_install():
    code = ("import sys; sys.modules['ortools'] = None; import eplb\n"
            "try:\n    eplb.plan([[1.0, 2.0]], num_slots=2, num_gpus=1, method='exact')\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'eplb[exact]'" in out.stdout


def test_exact_deterministic_time_is_reproducible():
    pytest.importorskip("ortools", reason="method='exact' needs OR-Tools: pip install 'eplb[exact]'")
    c = counts(1, 16, seed=4)
    runs = [eplb.plan(c, method="exact", deterministic_time=0.5, progress=False, **CONFIG) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].phy2log, runs[1].phy2log)
    assert runs[0].info["deterministic_time"] == 0.5 and runs[0].info["time_limit"] is None


# -- 5. extreme magnitudes -------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1.7e308 / 16000, 1e40, 1e-40, 5e-324])
@pytest.mark.parametrize("method", ["greedy", "balanced", "best"])
def test_extreme_magnitudes_give_the_same_placement_and_finite_diagnostics(method, factor):
    c = counts(2, 16, seed=2) + 1
    reference = eplb.plan(c, method=method, **CONFIG)
    if factor == 5e-324:
        scaled = c * factor  # integer multiples of the smallest denormal: exact
    else:
        scaled = c * 2.0 ** np.round(np.log2(factor))
    placement = eplb.plan(scaled, method=method, **CONFIG)
    np.testing.assert_array_equal(placement.phy2log, reference.phy2log)
    assert np.isfinite(placement.max_load).all() and np.isfinite(placement.lower_bound).all()
    assert (placement.gap >= 0).all() and np.isfinite(placement.gap).all()


def test_exact_takes_extreme_magnitudes():
    pytest.importorskip("ortools", reason="method='exact' needs OR-Tools: pip install 'eplb[exact]'")
    c = counts(1, 16, seed=2) + 1
    for factor in (2.0**1010, 2.0**-1060, 2.0**130):
        placement = eplb.plan(c * factor, method="exact", deterministic_time=0.2, progress=False, **CONFIG)
        assert np.isfinite(placement.gap).all() and (placement.gap >= 0).all()
        assert np.isfinite(placement.info["proven_bound"]).all()


def test_a_layer_total_overflowing_float64_is_refused():
    with pytest.raises(ValueError, match="total of layer 1 overflows float64"):
        eplb.plan([[1.0, 2.0], [1.5e308, 1.5e308]], num_slots=2, num_gpus=1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=8, max_size=8), st.integers(-300, 300),
       st.sampled_from(["greedy", "balanced", "best"]))
def test_placements_do_not_change_when_counts_are_multiplied_by_a_power_of_two(values, exponent, method):
    c = np.asarray(values, dtype=float)[None, :]
    config = dict(num_slots=12, num_gpus=4, num_nodes=2)
    a = eplb.plan(c, method=method, **config)
    b = eplb.plan(np.ldexp(c, exponent), method=method, **config)
    np.testing.assert_array_equal(a.phy2log, b.phy2log)


def test_power_of_two_scale_is_exact_and_canonical():
    c = counts(4, 16) + 0.5
    c[2] = 0.0
    scaled, shift = power_of_two_scale(c)
    np.testing.assert_array_equal(np.ldexp(scaled, -shift[:, None].astype(np.int32)), c)
    again, _ = power_of_two_scale(c * 2.0**-500)
    np.testing.assert_array_equal(again, scaled)
    assert shift[2] == 0


# -- 6. the default's own quality, without the greedy net -------------------------------------------


def test_the_default_without_the_greedy_net_is_near_the_bound_on_deepseek_v3_loads():
    c = deepseek_v3_counts(seed=5)[:16]
    config = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes")}
    for groups, mean_gap in ((None, 5e-4), (8, 5e-3)):
        own = eplb.plan(c, num_groups=groups, greedy_fallback=False, **config)
        greedy = eplb.plan(c, num_groups=groups, method="greedy", **config)
        assert own.info["layers_from_greedy"] == 0
        assert own.gap.mean() < mean_gap
        assert (own.max_load <= greedy.max_load * (1 + 1e-12)).all()

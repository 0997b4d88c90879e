"""plan() as a pipeline of stages (eplb.planning.pipeline): each call gets the stages its options
ask for, in order, options that do not combine are refused, the Balancer plans through the same
stages, and a move budget holds for a hedged series."""

import numpy as np
import pytest
from cli_runner import invoke

import eplb
from eplb.planning.pipeline import build, windows_of
from eplb.model.deployment import make_deployment

DEPLOY = dict(num_slots=40, num_gpus=8, num_nodes=2, num_groups=4)


def _series(seed=0, windows=4, layers=3, experts=32):
    rng = np.random.default_rng(seed)
    base = rng.gamma(0.6, size=(layers, experts))
    return rng.poisson(400 * base[None] * rng.gamma(2.0, size=(windows, layers, experts)) / 2.0).astype(float)


def test_every_start_and_rule_is_reached_and_named_in_info():
    series = _series()
    counts = series.sum(axis=0)
    plans = {
        ("method",): eplb.plan(counts, **DEPLOY),
        ("method", "hedge"): eplb.plan(series, **DEPLOY),
        ("estimate",): eplb.plan(series, objective="expected_peak", **DEPLOY),
        ("estimate", "for optimal dispatch"): eplb.plan(series, dispatch="optimal", **DEPLOY),
        ("near", "hedge"): eplb.plan(series, previous=eplb.plan(counts, method="greedy", **DEPLOY), **DEPLOY),
        ("capped",): eplb.plan(counts, max_off_node=0.1, **DEPLOY),
        ("capped", "hedge"): eplb.plan(series, max_off_node=0.1, **DEPLOY),
        ("method", "hedge", "for the engine's rule"): eplb.plan(series, dispatch="sglang-static", **DEPLOY),
    }
    for stages, placement in plans.items():
        assert placement.info["stages"] == stages
        assert placement.home_node is not None  # hierarchical: every pipeline reports the groups' nodes
        assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all()


def _stage_names(counts, deployment, **options):
    windows, objective = windows_of(counts, deployment.dispatch, options.pop("objective", None))
    return [stage.name for stage in build(windows, deployment, method="balanced", objective=objective, **options)]


def test_the_start_is_the_first_that_applies_and_the_rest_follow_in_order():
    deployment = make_deployment(32, 40, 8, 2, 4)
    series = _series()
    previous = eplb.plan(series.sum(axis=0), method="greedy", **DEPLOY).phy2log
    assert _stage_names(series, deployment) == ["method", "hedge"]
    assert _stage_names(series[:1], deployment) == ["method"]
    assert _stage_names(series, deployment, objective="sum") == ["estimate"]
    assert _stage_names(series, deployment, previous=previous) == ["near", "hedge"]
    assert _stage_names(series, deployment, previous=previous, max_moves=2) == ["near"]  # the budget is near's
    assert _stage_names(series[0], deployment, max_off_node=0.0) == ["capped"]
    engine = make_deployment(32, 40, 8, 2, 4, dispatch="sglang-dynamic")
    assert _stage_names(series, engine) == ["method", "hedge", "for the engine's rule"]
    optimal = make_deployment(32, 40, 8, 2, 4, dispatch="optimal")
    assert _stage_names(series, optimal) == ["estimate", "for optimal dispatch"]


@pytest.mark.parametrize("options, message", [
    (dict(dispatch="sglang-static", previous=True), "plans from scratch"),
    (dict(dispatch="sglang-static", max_off_node=0.1), "plans from scratch"),
    (dict(objective="worst_window", previous=True), "combines with objective="),
    (dict(dispatch="optimal", objective="expected_peak_search"), "is for dispatch='uniform'"),
    (dict(max_off_node=0.1, previous=True), "cannot be combined with previous"),
])
def test_options_that_do_not_combine_are_refused_naming_them(options, message):
    series = _series()
    if options.pop("previous", False):
        options["previous"] = eplb.plan(series.sum(axis=0), method="greedy", **DEPLOY)
    with pytest.raises(ValueError, match=message):
        eplb.plan(series, **DEPLOY, **options)


def test_windows_plan_for_given_weights_of_the_windows_shape_only():
    series = _series()
    forecast = series[-1] * 2.0
    np.testing.assert_array_equal(windows_of(series, weights=forecast)[0].weights, forecast)
    with pytest.raises(ValueError, match="weights must have the windows' shape"):
        windows_of(series, weights=forecast[:, :16])


@pytest.mark.parametrize("max_moves", [0, 2, 6])
def test_a_hedged_series_near_a_placement_keeps_the_move_budget(max_moves):
    series = _series(1)
    previous = eplb.plan(_series(2).sum(axis=0), **DEPLOY)
    placement = eplb.plan(series, previous=previous, max_moves=max_moves, **DEPLOY)
    changed = (placement.phy2log != previous.phy2log).sum(axis=1)
    assert (changed <= max_moves).all(), changed
    np.testing.assert_array_equal(changed, placement.info["slots_changed"])


def test_the_balancer_plans_through_the_same_stages():
    series = _series(3, windows=12)
    balancer = eplb.Balancer(3, eplb.Deployment.of(32, **DEPLOY), compile="lazy", subwindows=4)
    for counts in series:
        balancer.record(counts)
    placement, _ = balancer.rebalance()
    assert placement.info["stages"] == ("near", "hedge")
    assert placement.home_node is not None
    assert (placement.lower_bound <= placement.max_load * (1 + 1e-9)).all()


@pytest.mark.parametrize("keywords", [
    dict(num_slots=40, num_gpus=8),
    DEPLOY,
    dict(DEPLOY, dispatch="sglang-static"),
    dict(num_slots=40, num_gpus=8, dispatch="optimal"),
])
def test_one_deployment_value_plans_as_its_keywords_and_the_placement_carries_it(keywords):
    series = _series(4)
    deployment = eplb.Deployment.of(32, **keywords)
    by_value, by_keywords = eplb.plan(series, deployment), eplb.plan(series, **keywords)
    np.testing.assert_array_equal(by_value.phy2log, by_keywords.phy2log)
    assert by_value.deployment == by_keywords.deployment == deployment
    assert by_value.dispatch == deployment.dispatch  # its metrics judge under the rule it was planned for
    np.testing.assert_array_equal(eplb.held_out(series, deployment=deployment), eplb.held_out(series, **keywords))


def test_a_deployment_value_is_checked_against_the_counts_and_the_keywords():
    series = _series()
    deployment = eplb.Deployment.of(32, **DEPLOY)
    with pytest.raises(ValueError, match="not both: got deployment and num_gpus"):
        eplb.plan(series, deployment, num_gpus=8)
    with pytest.raises(ValueError, match="deployment is for 32 experts, but counts has 16"):
        eplb.plan(series[..., :16], deployment)
    with pytest.raises(ValueError, match="deployment must be an eplb.Deployment"):
        eplb.plan(series, DEPLOY)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        eplb.plan(series, eplb.Deployment.of(32, num_slots=40, num_gpus=8, dispatch="round-robin"))


def test_a_previous_placement_on_another_topology_is_re_planned_across_the_change():
    series = _series()
    previous = eplb.plan(series.sum(axis=0), num_slots=48, num_gpus=8)
    shrunk = eplb.plan(series, previous=previous, num_slots=40, num_gpus=8)  # 6 -> 5 slots per GPU
    assert shrunk.info["change"].startswith("8 GPUs with 40 slots (were 8 with 48)")
    assert (shrunk.info["copies"] >= shrunk.info["copy_floor"]).all()
    assert all(set(row) == set(range(32)) for row in shrunk.phy2log)


@pytest.mark.parametrize("flags, message", [
    (["--engine", "sglang-static", "--max-off-node", "0.1", "--groups", "4", "--nodes", "2"], "not with --max-off-node"),
    (["--max-off-node", "0.1", "--previous", "previous.json", "--groups", "4", "--nodes", "2"],
     "--max-off-node cannot be combined with --previous"),
    (["--max-off-node", "0.1", "--groups", "3", "--nodes", "2"], "--groups a multiple of --nodes"),
])
def test_the_cli_refuses_the_same_combinations_by_its_flags_before_reading_the_counts(tmp_path, flags, message):
    """One rule (``combination_error``) for ``plan`` and ``eplb plan``: a usage error (exit 2) naming
    the flags, before the (here absent) counts file is read. (``--engine sglang-static`` with
    ``--previous`` is the command line's own: it re-plans near the placement in service and makes
    the result for the static table, tests/cli/test_cli_failure_path.py, issue 47 item 3.)"""
    _, err = invoke("plan", "absent.npy", "--slots", "40", "--gpus", "8", "-o", "plan.json", *flags, cwd=tmp_path,
                    expect=2)
    assert message in err and "absent.npy" not in err

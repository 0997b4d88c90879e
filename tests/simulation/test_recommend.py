"""eplb.recommend: an answer per pool (how many redundant experts, which plan), judged held out."""

from __future__ import annotations

import csv
import dataclasses
import numpy as np
import pytest
from cli_runner import invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eplb
from eplb.io.formats import read_placement
from eplb.model.cost import CostModel, MoEModel
from eplb.simulation.pools import plan_for_step_time
from eplb.simulation.synthetic import drifting_counts

GPUS, BATCH, PASSES, SEED = 8, 4, 6, 3
POOL = eplb.Deployment.of(64, num_slots=72, num_gpus=GPUS)
"""The pool as the engine runs it: 64 experts on 8 GPUs at E + G slots."""


@pytest.fixture(scope="module")
def series() -> np.ndarray:
    """``[4, 3, 64]`` drifting OLMoE-sized windows (64 experts, as the olmoe-1b-7b preset)."""
    return drifting_counts(4, 3, 64, tokens=2048, drift=0.3, seed=5)


@pytest.fixture(scope="module")
def result(series):
    return eplb.recommend(series, POOL, batch=BATCH, model="olmoe-1b-7b", passes=PASSES, seed=SEED)


def predicted_step_time(window, phy2log, cost, routed, seed, t) -> float:
    """The step time of ``phy2log [L, S]`` on ``window [L, E]``, computed here from the definition:
    ``PASSES`` multinomial passes seeded by ``(seed, t)``, each token sent to one replica of its
    expert (the module's seeded split, checked on its own below), a slot read when it receives a
    token, a layer its slowest GPU."""
    from eplb.simulation.step_time import _split_tokens

    num_layers, num_experts = window.shape
    rng = np.random.default_rng([seed, t])
    totals = window.sum(axis=1, keepdims=True)
    probs = np.where(totals > 0, window / np.where(totals > 0, totals, 1), 1.0 / num_experts)
    passes = rng.multinomial(routed, probs, size=(PASSES, num_layers)).astype(float)
    passes[:, totals[:, 0] == 0] = 0
    replicas = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])  # [L, E]
    slot_tokens = _split_tokens(passes, phy2log, replicas, 0)  # [P, L, S]
    num_slots = phy2log.shape[1]
    tokens = slot_tokens.reshape(PASSES, num_layers, GPUS, num_slots // GPUS).sum(axis=3)
    active = (slot_tokens > 0).reshape(PASSES, num_layers, GPUS, num_slots // GPUS).sum(axis=3)
    return float(cost.gpu_time(tokens, active).max(axis=2).sum(axis=1).mean())


@pytest.mark.slow  # 25 sampled series: 18 s
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(8, 24), st.integers(0, 2**16))
def test_each_token_goes_to_one_replica_of_its_expert_at_random(num_gpus, extra, seed):
    """The split that prices a pass: every expert's tokens land on its own replicas and nowhere
    else, all of them; an expert without replicas keeps them on its slot; and over many draws each
    replica takes ``c / r`` tokens on average and is read with probability ``1 - (1 - 1/r)^c``."""
    from eplb.simulation.step_time import _split_tokens, sample_passes

    rng = np.random.default_rng(seed)
    num_experts, num_slots = 16, 16 + num_gpus * (extra // num_gpus + 1)  # every GPU as many slots
    phy2log = np.stack([rng.permutation(np.arange(num_slots) % num_experts) for _ in range(2)])  # [2, S]
    replicas = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
    passes = sample_passes(rng.gamma(0.5, size=(2, num_experts)), 12, 3, rng)  # [3, 2, E]
    split = _split_tokens(passes, phy2log, replicas, seed)
    for layer in range(2):
        per_expert = np.zeros((3, num_experts))
        np.add.at(per_expert.T, phy2log[layer], split[:, layer].T)
        np.testing.assert_array_equal(per_expert, passes[:, layer])
        alone = replicas[layer, phy2log[layer]] == 1
        np.testing.assert_array_equal(split[:, layer, alone], passes[:, layer, phy2log[layer, alone]])
    draws = np.stack([_split_tokens(passes, phy2log, replicas, draw) for draw in range(2000)])  # [D, 3, 2, S]
    c = passes[:, np.arange(2)[:, None], phy2log]  # [3, 2, S]: each slot's expert's tokens
    r = replicas[np.arange(2)[:, None], phy2log]
    assert (np.abs(draws.mean(axis=0) - c / r) <= 6 * np.sqrt(c / 2000) + 1e-12).all()
    read = np.where(c > 0, 1 - (1 - 1 / r) ** c, 0.0)
    assert (np.abs((draws > 0).mean(axis=0) - read) <= 6 * np.sqrt(read * (1 - read) / 2000) + 1e-12).all()


def held_out_ms(series, num_slots, **plan_options) -> float:
    """Leave one window out, computed here: plan from the others, judge on the one left out."""
    cost = CostModel.preset("H100", "olmoe-1b-7b")
    routed = BATCH * GPUS * eplb.model.cost.MODELS["olmoe-1b-7b"].top_k
    times = []
    for t in range(len(series)):
        others = np.delete(series, t, axis=0)
        placement = eplb.plan(others, num_slots=num_slots, num_gpus=GPUS, **plan_options)
        times.append(predicted_step_time(series[t], placement.phy2log, cost, routed, SEED, t))
    return 1e3 * float(np.mean(times))


def test_recommends_the_option_with_the_lowest_held_out_step_time(series, result):
    steps = [o.step_ms for o in result.options]
    assert result.recommended.step_ms == min(steps)
    assert result.recommended == result.options[int(np.argmin(steps))]
    tokens = {o.num_slots: o.step_ms for o in result.options if o.planner == "tokens"}
    for num_slots, step_ms in tokens.items():
        assert step_ms == pytest.approx(held_out_ms(series, num_slots), rel=1e-9)
    default = held_out_ms(series, 72, method="greedy", objective="sum")
    assert result.default_slots == 72 and result.default_step_ms == pytest.approx(default, rel=1e-9)
    for o in result.options:
        assert o.vs_default_pct == pytest.approx(100 * (o.step_ms / default - 1), rel=1e-6, abs=1e-9)
    assert 0 < result.bound_step_ms <= min(steps + [default]) * (1 + 1e-12)  # no option beats the bound


def test_options_cover_the_allowed_slot_counts(series, result):
    assert sorted({o.num_slots for o in result.options}) == [64, 72, 80]
    assert [(o.num_slots, o.planner) for o in result.options] == [(s, p) for s in (64, 72, 80)
                                                                  for p in ("tokens", "step-time")]
    for o in result.options:
        assert o.redundant_experts == o.num_slots - 64
        assert o.replica_gib_per_gpu == pytest.approx(o.redundant_experts / GPUS * 16 * 3 * 2048 * 1024 * 2 / 2**30)
        assert len(o.step_ms_folds) == 4
        assert (o.beats_tokens is None) == (o.planner == "tokens")
    explicit = eplb.recommend(series, POOL, batch=BATCH, model="olmoe-1b-7b", passes=2, slot_counts=[96, 64])
    assert sorted({o.num_slots for o in explicit.options}) == [64, 96]
    assert result.placement.num_slots == result.recommended.num_slots


def test_the_deprecated_keywords_recommend_the_same_with_a_warning(series, result):
    with pytest.warns(DeprecationWarning, match="Deployment.of"):
        old = eplb.recommend(series, num_gpus=GPUS, batch=BATCH, model="olmoe-1b-7b", passes=PASSES, seed=SEED)
    assert old.options == result.options and old.default_slots == result.default_slots == 72
    with pytest.warns(DeprecationWarning, match="slot_counts"), pytest.warns(DeprecationWarning, match="Deployment.of"):
        listed = eplb.recommend(series, num_gpus=GPUS, batch=BATCH, model="olmoe-1b-7b", passes=2, num_slots=[64])
    assert [o.num_slots for o in listed.options] == [64, 64]


def test_the_default_is_the_deployment_as_the_engine_runs_it(series):
    """The deployment's own slot count is the layout every option is compared with."""
    at_80 = eplb.recommend(series, POOL.with_slots(80), batch=BATCH, model="olmoe-1b-7b", passes=2, seed=SEED,
                           extra_slots_per_gpu=(0,))
    at_72 = eplb.recommend(series, POOL, batch=BATCH, model="olmoe-1b-7b", passes=2, seed=SEED,
                           extra_slots_per_gpu=(0,))
    assert (at_80.default_slots, at_72.default_slots) == (80, 72)
    assert at_80.default_step_ms != at_72.default_step_ms
    assert at_80.options == tuple(dataclasses.replace(o, vs_default_pct=100.0 * (o.step_ms / at_80.default_step_ms - 1.0))
                                  for o in at_72.options)


def test_the_plan_comes_from_all_windows(series, result):
    best = result.recommended
    if best.planner == "tokens":
        expected = eplb.plan(series, POOL.with_slots(best.num_slots)).phy2log
    else:
        expected = plan_for_step_time(series, POOL.with_slots(best.num_slots), batch=BATCH,
                                      model="olmoe-1b-7b", passes=PASSES, seed=SEED)[0].phy2log
    np.testing.assert_array_equal(result.placement.phy2log, expected)
    assert result.in_sample_step_ms <= result.tokens_in_sample_step_ms * (1 + 1e-12)


def test_deterministic(series, result):
    again = eplb.recommend(series, POOL, batch=BATCH, model="olmoe-1b-7b", passes=PASSES, seed=SEED)
    assert again.options == result.options and again.recommended == result.recommended
    np.testing.assert_array_equal(again.placement.phy2log, result.placement.phy2log)


@st.composite
def pools(draw):
    num_experts = draw(st.sampled_from([4, 6, 8]))
    gpus = draw(st.sampled_from([1, 2]))
    windows = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    counts = np.array(draw(st.lists(st.integers(0, 50), min_size=windows * layers * num_experts,
                                    max_size=windows * layers * num_experts))).reshape(windows, layers, num_experts)
    extra = draw(st.integers(0, 2))
    return counts, gpus, gpus * (-(-num_experts // gpus) + extra), draw(st.integers(1, 6)), draw(st.integers(0, 3))


def in_sample_layer_times(counts, placements, batch, gpus, model, seed) -> np.ndarray:
    """``[C, T, L]`` layer times of each placement on each window, 4 passes seeded by ``(seed, t)``."""
    from eplb.simulation.step_time import _Sampler, layer_times

    cost = CostModel.preset("H100", model)
    sampler = _Sampler(counts.astype(float), batch * gpus * model.top_k, 4, seed)
    return np.array([[layer_times(sampler(t), p, cost) for t in range(len(counts))] for p in placements])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools())
def test_step_time_plan_is_never_slower_in_sample_than_the_token_plan(pool):
    """Layer by layer, on the windows planned from (the rule keeps the per-layer best or the token plan)."""
    counts, gpus, num_slots, batch, seed = pool
    model = MoEModel("tiny", 64, 32, counts.shape[2], 2, counts.shape[1], 2.0, "bf16")
    deployment = eplb.Deployment.of(counts.shape[2], num_slots=num_slots, num_gpus=gpus)
    mixed, tokens = plan_for_step_time(counts, deployment, batch=batch, model=model, passes=4, seed=seed)
    times = in_sample_layer_times(counts, (mixed, tokens), batch, gpus, model, seed).sum(axis=1)  # [2, L]
    assert (times[0] <= times[1] * (1 + 1e-12)).all()
    assert mixed.num_slots == num_slots and (mixed.logcnt >= 1).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(0, 10 ** 6), st.sampled_from([0.0, 0.3, 1.0]))
def test_the_rule_departs_from_the_token_plan_only_beyond_the_inner_held_out_noise(candidates, windows, layers, seed,
                                                                                   edge):
    """The rule's invariant, from its definition on layer times ``[C, W, L]`` (the token plan first):
    the choice is the token plan on every layer, or the per-layer lowest total; the latter only when,
    leaving each window out in turn (choice from the others, timed on it), the gains' mean plus
    ``NOISE_MARGIN`` standard deviations times ``sqrt(1 + 1/W)`` is below zero; one window: the token plan."""
    from eplb.simulation.pools import NOISE_MARGIN, _choose

    rng = np.random.default_rng(seed)
    shift = np.r_[0.0, np.full(candidates - 1, -0.1 * edge)][:, None, None]  # the others faster by edge / 10
    times = 1.0 + rng.random((1, windows, layers)) + shift + rng.normal(0.0, 0.05, (candidates, windows, layers))
    choice = _choose(times)
    best = np.argmin(times.sum(axis=1), axis=0)
    assert choice.shape == (layers,) and (not choice.any() or (choice == best).all())
    if windows == 1 or not best.any():
        assert not choice.any()
        return
    gains = np.array([(times[np.argmin(np.delete(times, w, axis=1).sum(axis=1), axis=0), w, np.arange(layers)]
                       - times[0, w]).sum() for w in range(windows)])
    departs = gains.mean() + NOISE_MARGIN * gains.std(ddof=1) * np.sqrt(1 + 1 / windows) < 0
    assert choice.any() == departs
    if departs:  # then it is faster than the token plan in sample, and on every layer at least as fast
        chosen = times[choice, :, np.arange(layers)].sum(axis=1)
        assert (chosen <= times[0].sum(axis=0)).all() and chosen.sum() < times[0].sum()


def test_the_step_time_plan_keeps_a_large_consistent_gain_and_one_window_gives_the_token_plan(series):
    """At a small batch with slots to spare (replicas cost reads) the gain clears the noise; from a
    single window there is no noise to measure, so the token plan."""
    options = dict(batch=1, model="olmoe-1b-7b", passes=PASSES, seed=SEED)
    mixed, tokens = plan_for_step_time(series, POOL.with_slots(80), **options)
    assert mixed.info["candidate_per_layer"].any()
    single, single_tokens = plan_for_step_time(series[:1], POOL.with_slots(80), **options)
    assert not single.info["candidate_per_layer"].any()
    np.testing.assert_array_equal(single.phy2log, single_tokens.phy2log)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([(16, 4, 1, None), (16, 4, 2, 4), (32, 8, 2, 8), (12, 4, 1, None)]), st.integers(1, 2),
       st.integers(1, 3), st.integers(0, 10 ** 6))
def test_cold_replicas_keep_the_base_and_fill_the_extra_slots_with_the_coldest_experts(shape, extra, layers, seed):
    """Every GPU keeps its slots of the fewest-slots plan in order, then holds ``extra`` replicas of
    the coldest experts it lacks (of its node's groups when groups stay on nodes): the extra slots
    go to the fewest, coldest experts, as a further replica of one adds fewer reads than a first of another."""
    from eplb.simulation.pools import cold_replicas

    num_experts, gpus, nodes, groups = shape
    weights = np.random.default_rng(seed).integers(0, 100, (layers, num_experts)).astype(float)
    base = eplb.plan(weights, num_slots=num_experts, num_gpus=gpus, num_nodes=nodes, num_groups=groups)
    grown_topology = eplb.Topology.uniform(num_experts + extra * gpus, gpus, nodes)
    grown = cold_replicas(base, weights, grown_topology)
    per_gpu = num_experts // gpus
    assert grown.topology == grown_topology and (grown.logcnt >= 1).all()
    node_of_gpu = grown_topology.node_of_gpu
    for layer in range(layers):
        for gpu in range(gpus):
            row = grown.phy2log[layer, gpu * (per_gpu + extra):(gpu + 1) * (per_gpu + extra)]
            own, picks = row[:per_gpu], row[per_gpu:]
            np.testing.assert_array_equal(own, base.phy2log[layer, gpu * per_gpu:(gpu + 1) * per_gpu])
            allowed = np.ones(num_experts, bool)
            if base.home_node is not None:
                allowed = base.home_node[layer, np.arange(num_experts) // (num_experts // groups)] == node_of_gpu[gpu]
            allowed[own] = False
            assert allowed[picks].all() and len(set(picks)) == extra
            # the picks are the coldest allowed experts (ties: the lower id)
            key = sorted(np.flatnonzero(allowed), key=lambda e: (weights[layer, e], e))[:extra]
            assert sorted(picks.tolist()) == sorted(int(e) for e in key)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools(), st.sampled_from(["roofline", "compute", "memory"]), st.sampled_from([0.0, 1e-5]))
def test_layer_time_bound_is_below_every_placement(pool, regime, overhead):
    """No placement, token plan, step-time plan or a random layout, is faster than the bound, on
    any regime; and with one GPU (nothing to balance) the bound is the time itself."""
    from eplb.simulation.step_time import _Sampler, layer_time_bound, layer_times

    counts, gpus, num_slots, batch, seed = pool
    model = MoEModel("tiny", 64, 32, counts.shape[2], 2, counts.shape[1], 2.0, "bf16")
    cost = CostModel.preset("H100", model).with_(regime=regime, layer_overhead_s=overhead)
    passes = _Sampler(counts.astype(float), batch * gpus * 2, 4, seed)(0)
    bound = layer_time_bound(passes, gpus, cost)
    rng = np.random.default_rng(seed)
    deployment = eplb.Deployment.of(counts.shape[2], num_slots=num_slots, num_gpus=gpus)
    layouts = list(plan_for_step_time(counts, deployment, batch=batch, model=model, passes=4, seed=seed))
    layouts.append(eplb.Placement(np.stack([rng.permutation(np.arange(num_slots) % counts.shape[2])
                                            for _ in range(counts.shape[1])]), counts.shape[2], layouts[0].topology))
    for placement in layouts:
        assert (bound <= layer_times(passes, placement, cost) * (1 + 1e-12)).all()
    if gpus == 1 and num_slots == counts.shape[2]:
        np.testing.assert_allclose(bound, layer_times(passes, layouts[-1], cost), rtol=1e-12)


@pytest.mark.parametrize("change, name", [
    (dict(counts=np.ones((1, 2, 64))), "counts"),
    (dict(counts=np.full((2, 2, 64), np.nan)), "counts"),
    (dict(counts=np.ones((2, 2, 32)), deployment=eplb.Deployment.of(32, num_slots=40, num_gpus=GPUS)), "model"),
    (dict(batch=0), "batch"),
    (dict(phase="train"), "phase"),
    (dict(deployment=eplb.Deployment.of(32, num_slots=40, num_gpus=GPUS)), "deployment is for 32 experts"),
    (dict(deployment=eplb.Deployment.of(64, num_slots=72, num_gpus=GPUS, dispatch="optimal")), "dispatch"),
    (dict(deployment=None), "needs the deployment"),
    (dict(extra_slots_per_gpu=(-1,)), "extra_slots_per_gpu"),
    (dict(extra_slots_per_gpu=()), "extra_slots_per_gpu"),
    (dict(slot_counts=[65]), "slot_counts"),
    (dict(slot_counts=[32]), "slot_counts"),
    (dict(hardware="A100"), "hardware"),
    (dict(model="gpt-5"), "model"),
    (dict(passes=0), "passes"),
])
def test_bad_input_is_refused_by_name(change, name):
    arguments = dict(counts=np.ones((2, 2, 64)), deployment=POOL, batch=2, model="olmoe-1b-7b", passes=2)
    arguments.update(change)
    with pytest.raises(ValueError, match=name):
        eplb.recommend(**arguments)


def test_cli_writes_a_plan_eplb_reads_back(tmp_path, series):
    np.save(tmp_path / "pool.npy", series)
    out, _ = invoke("recommend", "pool.npy", "--gpus", str(GPUS), "--phase", "decode", "--batch", str(BATCH),
                    "--hardware", "h100", "--model", "olmoe-1b-7b", "--extra-slots", "0,1", "--passes", str(PASSES),
                    "--seed", str(SEED), "-o", "plan.json", cwd=tmp_path)
    assert "recommended" in out and "published greedy at 72 slots" in out
    expected = eplb.recommend(series, POOL, batch=BATCH, model="olmoe-1b-7b", extra_slots_per_gpu=(0, 1),
                              passes=PASSES, seed=SEED)
    room = 100 * (1 - expected.bound_step_ms / expected.recommended.step_ms)
    assert f"below {expected.bound_step_ms:.4f} ms held out" in out and f"at most {room:.2f}% from the best" in out
    written = read_placement(tmp_path / "plan.json")
    np.testing.assert_array_equal(written.placement.phy2log, expected.placement.phy2log)
    assert written.placement.num_gpus == GPUS


@pytest.mark.parametrize("flags, hint", [
    (["--batch", "0"], "--batch"),
    (["--batch", "2", "--extra-slots", "0,x"], "--extra-slots"),
    (["--batch", "2", "--slots", "65"], "--slots"),
    (["--batch", "2", "--model", "deepseek-v3"], "--model"),
])
def test_cli_refuses_bad_flags_with_exit_2(tmp_path, series, flags, hint):
    np.save(tmp_path / "pool.npy", series)
    _, err = invoke("recommend", "pool.npy", "--gpus", str(GPUS), "--model", "olmoe-1b-7b", *flags, cwd=tmp_path,
                    expect=2)
    assert hint in err and "Traceback" not in err


def test_cli_report_writes_every_option_and_its_figure_against_the_deployed_layout(tmp_path, series):
    pytest.importorskip("matplotlib")
    np.save(tmp_path / "pool.npy", series)
    out, _ = invoke("recommend", "pool.npy", "--gpus", str(GPUS), "--batch", str(BATCH), "--model", "olmoe-1b-7b",
                    "--extra-slots", "0,1", "--passes", "2", "--seed", str(SEED), "--deployed-slots", "80",
                    "--report", "pool_report", cwd=tmp_path)
    expected = eplb.recommend(series, POOL.with_slots(80), batch=BATCH, model="olmoe-1b-7b",
                              extra_slots_per_gpu=(0, 1), passes=2, seed=SEED)
    assert "published greedy at 80 slots" in out and "recommend.png" in out
    with open(tmp_path / "pool_report" / "recommend.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(int(r["num_slots"]), r["planner"]) for r in rows] == [(o.num_slots, o.planner) for o in expected.options]
    assert [float(r["step_ms"]) for r in rows] == pytest.approx([o.step_ms for o in expected.options], rel=1e-12)
    assert [r["recommended"] for r in rows].count("True") == 1
    assert (tmp_path / "pool_report" / "recommend.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_names_the_flag_of_a_deployed_layout_that_does_not_fit(tmp_path, series):
    np.save(tmp_path / "pool.npy", series)
    _, err = invoke("recommend", "pool.npy", "--gpus", str(GPUS), "--batch", str(BATCH), "--model", "olmoe-1b-7b",
                    "--deployed-slots", "60", cwd=tmp_path, expect=2)
    assert "--deployed-slots" in err


def test_the_recommendation_reports_its_exposure_and_one_node_survives_nothing(series, result):
    from eplb.analysis.exposure import worst_loss

    expected = worst_loss(series.sum(axis=0), result.placement.phy2log, result.placement.topology)
    assert (result.worst_gpu_loss, result.worst_node_loss) == (expected["worst_gpu_loss"], expected["worst_node_loss"])
    assert result.worst_node_loss == 1.0  # one node: its loss orphans every token
    assert result.node_loss_slots is None and result.node_loss_redundant is None
    assert "with one node no slot count survives its loss" in result.node_loss_note


def test_the_slots_that_make_a_node_loss_survivable_do(series):
    pool = eplb.Deployment.of(64, num_slots=72, num_gpus=GPUS, num_nodes=2)
    found = eplb.recommend(series, pool, batch=BATCH, model="olmoe-1b-7b", passes=2, seed=SEED,
                           extra_slots_per_gpu=(1,))
    assert (found.node_loss_slots, found.node_loss_redundant) == (128, 64)
    assert "from 128 slots (64 redundant, 8 more per GPU than the fewest)" in found.node_loss_note
    assert found.worst_node_loss > 0  # 72 slots cannot put every expert on two nodes
    survived = eplb.plan(series, pool.with_slots(found.node_loss_slots), survive="node")
    assert survived.info["worst_node_loss"] == 0.0
    fewer = eplb.plan(series, pool.with_slots(found.node_loss_slots - GPUS), survive="node")
    assert fewer.info["worst_node_loss"] > 0  # and no fewer slots do


@pytest.mark.parametrize("experts, gpus, nodes, groups, slots", [
    (64, 8, 2, None, 128), (64, 12, 2, None, 132), (256, 32, 4, 8, 512), (8, 4, 4, None, 16), (64, 8, 1, None, None)])
def test_node_loss_slots(experts, gpus, nodes, groups, slots):
    from eplb.simulation.pools import node_loss_note, node_loss_slots

    deployment = eplb.Deployment.of(experts, num_slots=gpus * -(-experts // gpus), num_gpus=gpus, num_nodes=nodes,
                                    num_groups=groups)
    assert node_loss_slots(deployment) == slots
    note = node_loss_note(deployment, deployment.num_slots, 0.25, slots)
    assert ("without groups" in note) == bool(groups)


def test_every_option_reports_its_held_out_balancedness(series, result):
    """Each option's held-out token balancedness is its plans' on the windows they did not see: the
    token plan's at each slot count recomputed here from leave-one-window-out plans."""
    for option in result.options:
        assert 0.0 < option.balancedness_held_out <= 1.0
    row = {(r["num_slots"], r["planner"]): r for r in result.rows()}
    for num_slots in sorted({o.num_slots for o in result.options}):
        values = []
        for t in range(len(series)):
            kept = np.concatenate([series[:t], series[t + 1:]])
            placement = eplb.plan(kept, POOL.with_slots(num_slots))
            per_layer = placement.balancedness(series[t])
            moe = series[t].sum(axis=1) > 0
            values.append(per_layer[moe].mean())
        assert row[(num_slots, "tokens")]["balancedness_held_out"] == pytest.approx(np.mean(values), rel=1e-9)

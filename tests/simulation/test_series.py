"""Realistic per-step series: token totals, determinism, batch noise, shifting mixes, traces."""

import os
from pathlib import Path

import numpy as np
import pytest

from eplb.simulation.series import BLOCK, Series, mixture_path, prefill_share_from_lengths, synthetic_workloads, trace_workloads

TRACES = Path(os.environ.get("EPLB_TRACES", Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"))


def small(**kwargs):
    workloads = synthetic_workloads(3, 4, 16, seed=2)
    options = dict(num_steps=40, tokens_per_step=64, top_k=2, seed=5)
    options.update(kwargs)
    return Series(workloads, **options)


def test_every_step_routes_tokens_times_top_k():
    workloads = synthetic_workloads(2, 3, 8, seed=0)
    workloads[:, 1] = 0.0  # a dense layer: nothing routed
    tokens = np.arange(10) * 7
    series = Series(workloads, num_steps=10, tokens_per_step=tokens, top_k=3, prefill_share=0.3, seed=1)
    counts = series.to_array()
    assert counts.shape == (10, 3, 8) == series.shape
    np.testing.assert_array_equal(counts[:, [0, 2]].sum(axis=2), np.repeat(tokens[:, None] * 3, 2, axis=1))
    assert (counts[:, 1] == 0).all()
    np.testing.assert_array_equal(series.prefill_tokens + series.decode_tokens, tokens)


def test_same_seed_same_counts_any_block_order():
    series = small(num_steps=BLOCK + 30)
    whole = series.to_array()
    again = small(num_steps=BLOCK + 30)
    np.testing.assert_array_equal(again.block(BLOCK - 5, BLOCK + 7), whole[BLOCK - 5:BLOCK + 7])
    np.testing.assert_array_equal(again.block(3, 9), whole[3:9])
    np.testing.assert_array_equal(np.stack(list(again)), whole)
    assert again.block(4, 4).shape == (0, 4, 16)
    assert not np.array_equal(small(num_steps=BLOCK + 30, seed=6).to_array(), whole)


def test_small_batches_are_noisy_and_long_windows_are_not():
    """A decode step of 64 tokens strays far from the routing distribution; 1000 such steps summed
    come close to it (multinomial sampling noise of the batch size)."""
    workloads = synthetic_workloads(1, 2, 64, seed=3)
    series = Series(workloads, num_steps=1000, tokens_per_step=64, top_k=8, seed=4)
    counts = series.to_array().astype(float)
    p = workloads[0]
    step_error = np.abs(counts[0] / counts[0].sum(axis=1, keepdims=True) - p).sum(axis=1).mean()
    window = counts.sum(axis=0)
    window_error = np.abs(window / window.sum(axis=1, keepdims=True) - p).sum(axis=1).mean()
    assert step_error > 0.15
    assert window_error < 0.03
    assert window_error < step_error / 10


def test_traffic_follows_the_mixture():
    workloads = np.zeros((2, 1, 4))
    workloads[0, 0, :2] = 1.0  # workload 0 uses experts 0-1, workload 1 experts 2-3
    workloads[1, 0, 2:] = 1.0
    path = mixture_path(100, 2, transition=0.4)
    counts = Series(workloads, num_steps=100, tokens_per_step=50, top_k=1, mixture=path, seed=0).to_array()
    assert counts[:30, 0, 2:].sum() == 0  # the first segment is workload 0 alone
    assert counts[-50:, 0, :2].sum() == 0  # the last is workload 1 alone
    share = counts[:, 0, 2:].sum(axis=1) / 50
    assert share[:50].mean() < share[50:].mean()


def test_prefill_and_decode_draw_from_their_own_distributions():
    prompt = np.zeros((1, 1, 4))
    prompt[0, 0, 0] = 1.0
    generated = np.zeros((1, 1, 4))
    generated[0, 0, 3] = 1.0
    series = Series(prompt, decode_workloads=generated, num_steps=3, tokens_per_step=100, top_k=1,
                    prefill_share=[0.0, 0.25, 1.0])
    counts = series.to_array()[:, 0]
    np.testing.assert_array_equal(counts[:, 0], [0, 25, 100])
    np.testing.assert_array_equal(counts[:, 3], [100, 75, 0])


def test_mixture_path_shape_and_rows():
    path = mixture_path(70, 7, order=[6, 0, 3], transition=0.5, background=0.1)
    assert path.shape == (70, 7)
    np.testing.assert_allclose(path.sum(axis=1), 1.0)
    assert path[0].argmax() == 6 and path[-1].argmax() == 3
    assert path[0, 1] == pytest.approx(0.1 / 7)
    middle = mixture_path(10, 2, transition=1.0)[:5, 1]  # linear ramp over the whole first segment
    np.testing.assert_allclose(middle, np.arange(5) / 5)


def test_prefill_share_from_lengths():
    np.testing.assert_allclose(prefill_share_from_lengths([1000, 3000], 1000), [0.5, 0.75])
    with pytest.raises(ValueError, match="positive"):
        prefill_share_from_lengths(0, 0)


def test_synthetic_workloads_shift():
    same = synthetic_workloads(3, 2, 32, shift=0.0, seed=1)
    np.testing.assert_allclose(same[0], same[2])
    moved = synthetic_workloads(3, 2, 32, shift=1.0, seed=1)
    np.testing.assert_allclose(moved.sum(axis=2), 1.0)
    assert np.abs(moved[0] - moved[1]).sum() > 0.2


def test_trace_workloads_from_a_file(tmp_path):
    counts = np.arange(3 * 2 * 4, dtype=float).reshape(3, 2, 4)
    path = tmp_path / "trace.npz"
    np.savez(path, counts=counts, window_names=np.array(["a", "b", "c"]), benchmark=np.array(["x", "y", "x"]))
    names, probs = trace_workloads(path)
    assert names == ["a", "b", "c"]
    np.testing.assert_allclose(probs[1, 0], counts[1, 0] / counts[1, 0].sum())
    names, probs = trace_workloads(path, group_by="benchmark")
    assert names == ["x", "y"]
    summed = counts[0] + counts[2]
    np.testing.assert_allclose(probs[0], summed / summed.sum(axis=1, keepdims=True))
    with pytest.raises(ValueError, match="group_by must be a key"):
        trace_workloads(path, group_by="domain")
    with pytest.raises(ValueError, match="does not exist"):
        trace_workloads(tmp_path / "missing.npz")


def test_real_trace_workloads():
    path = TRACES / "gpt_oss_20b_benchmark_windows.npz"
    if not path.exists():
        pytest.skip(f"real traces absent from {TRACES} (set EPLB_TRACES)")
    names, probs = trace_workloads(path, group_by="benchmark")
    assert probs.shape[1:] == (24, 32) and len(names) == probs.shape[0] >= 5
    series = Series(probs, num_steps=5, tokens_per_step=128, top_k=4, mixture=mixture_path(5, len(names)))
    assert (series.to_array().sum(axis=2) == 512).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_per_step=-1), "tokens_per_step must be finite"),
    (dict(tokens_per_step=1.5), "whole numbers"),
    (dict(tokens_per_step=[1, 2]), "tokens_per_step must be a number or an array of shape"),
    (dict(prefill_share=1.5), "prefill_share must be finite, >= 0 and <= 1.0"),
    (dict(mixture=np.ones((40, 2))), "mixture must have shape"),
    (dict(mixture=np.zeros((40, 3))), "positive total"),
    (dict(top_k=0), "top_k must be >= 1"),
    (dict(num_steps=0), "num_steps must be >= 1"),
    (dict(decode_workloads=np.ones((3, 4, 15))), "decode_workloads must have the shape"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small(**kwargs)


def test_bad_workloads_raise():
    with pytest.raises(ValueError, match="workloads must have 3 dimensions"):
        Series(np.ones((4, 16)), num_steps=2, tokens_per_step=1, top_k=1)
    with pytest.raises(ValueError, match="workloads must be finite and non-negative"):
        Series(-np.ones((1, 4, 16)), num_steps=2, tokens_per_step=1, top_k=1)
    with pytest.raises(ValueError, match="start <= stop"):
        small().block(5, 2)

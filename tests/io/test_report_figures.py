"""What the report's figures show, checked on the matplotlib objects before they are saved: a load
ratio scale that starts at 0 with node boundaries, the load per replica of the hottest experts,
tick labels that do not overlap, whole-number window ticks, and dense layers left out."""

import numpy as np
import pytest

import eplb
from eplb.io import report
from eplb.io.formats.data import CountsFile, PlacementFile

pytest.importorskip("matplotlib", reason="matplotlib is the optional 'report' extra")


@pytest.fixture()
def figures(tmp_path, monkeypatch):
    """Make a report on 2 windows of very uneven counts (a GPU far above twice the mean) with a
    dense layer and a previous plan, on 4 nodes; return {file name: the figure} as saved."""
    saved = {}
    original = report._save

    def capture(_plt, fig, path):
        saved[path.name] = fig
        fig.canvas.draw()                                        # lay out text as the PNG has it
        fig.savefig(path, dpi=60)
        return path

    monkeypatch.setattr(report, "_save", capture)
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 50, (2, 58, 64)).astype(float)   # [T, L, E], DeepSeek-V3's 58 MoE layers
    counts[:, :, 5] *= 400                                      # one expert far hotter than a GPU's share
    counts[:, 2] = 0                                            # a dense layer
    weights = counts.sum(axis=0)
    new = eplb.plan(weights, num_slots=64, num_gpus=16, num_nodes=4, method="greedy")
    old = eplb.plan(counts[0] + counts[1, ::-1], num_slots=64, num_gpus=16, num_nodes=4, method="greedy")
    data = CountsFile(counts, np.arange(58), "npy", tmp_path / "c.npy")
    wrap = lambda p: PlacementFile(p, np.arange(58), "eplb", tmp_path / "p.json")  # noqa: E731
    result = report.make_report(data, wrap(new), tmp_path, previous=wrap(old))
    assert original is not None and len(saved) == 5
    yield saved, result, new, weights
    import matplotlib.pyplot as plt

    plt.close("all")


def test_heatmap_scale_starts_at_zero_and_marks_nodes(figures):
    saved, _, placement, weights = figures
    ax = saved["gpu_loads.png"].axes[0]
    image = ax.images[0]
    assert image.norm.vmin >= 0.0 and image.norm.vmax > 2.0          # a GPU above twice the mean, none below 0
    boundaries = sorted(line.get_xdata()[0] for line in ax.lines)
    assert boundaries == [3.5, 7.5, 11.5]                             # 4 nodes of 4 GPUs
    assert np.ma.getmaskarray(image.get_array())[2].all()             # the dense layer is blank, not "balanced"


def test_hottest_experts_show_the_load_per_replica(figures):
    saved, _, placement, weights = figures
    fig = saved["hottest_experts.png"]
    assert len(fig.axes) == 2
    right = fig.axes[1]
    assert "per replica" in right.get_ylabel()
    points = right.lines[0].get_ydata()
    totals = weights.sum(axis=1)
    layer = int(np.argmax(np.divide(weights[:, 5], totals, out=np.zeros(len(totals)), where=totals > 0)))
    expected = weights[layer, 5] / placement.logcnt[layer, 5] / (weights[layer].sum() / placement.num_gpus)
    assert points[0] == pytest.approx(expected)


def _overlaps(labels) -> bool:
    boxes = [label.get_window_extent() for label in labels if label.get_text()]
    return any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))


def test_moves_tick_labels_do_not_overlap(figures):
    saved, *_ = figures
    fig = saved["moves.png"]
    for ax in fig.axes:
        assert not _overlaps(ax.get_xticklabels()), [t.get_text() for t in ax.get_xticklabels()]
        assert not _overlaps(ax.get_yticklabels())


def test_windows_ticks_are_whole_windows(figures):
    saved, *_ = figures
    ax = saved["windows.png"].axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks == [0.0, 1.0]


def test_means_leave_dense_layers_out(figures):
    saved, result, placement, weights = figures
    per_layer = placement.balancedness(weights)
    row = result.summary["balancedness (mean over layers)"]
    assert "57 MoE layers; 1 all-zero layers left out" in row
    assert f"plan {np.delete(per_layer, 2).mean():.4f}" in row
    line = saved["balancedness.png"].axes[0].lines[-1]
    assert np.isnan(line.get_ydata()[2])

"""``eplb report``: the HTML page and its PNG figures, checked as files and in a real headless browser."""

import base64
import re
import shutil
import subprocess

import numpy as np
import pytest

import eplb
from eplb.io.formats import read_counts, read_placement, write_placement
from eplb.model.topology import Topology

from test_cli import run

pytest.importorskip("matplotlib", reason="matplotlib is the optional 'report' extra")

PLAN_BLUE = (0x21, 0x66, 0xAC)       # the colour of "this plan" in the figures


def _png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    """A report made by the console script on drifting counts, with a previous placement."""
    from eplb.simulation.synthetic import drifting_counts

    if shutil.which("eplb") is None:
        pytest.skip("the eplb console script is not installed (pip install -e .)")
    folder = tmp_path_factory.mktemp("report")
    counts = drifting_counts(6, 10, 64, seed=4)                  # [T, L, E]
    np.savez(folder / "counts.npz", counts=counts, layer_ids=np.arange(3, 13))
    old = eplb.plan(counts[:2], num_slots=80, num_gpus=8, num_nodes=2, method="greedy")
    new = eplb.plan(counts, num_slots=80, num_gpus=8, num_nodes=2)
    write_placement(old, folder / "previous.yaml", layer_ids=np.arange(3, 13))
    write_placement(new, folder / "plan.json", layer_ids=np.arange(3, 13))
    out, _ = run("report", "counts.npz", "plan.json", "--previous", "previous.yaml", "-o", "out", cwd=folder)
    assert "index.html" in out
    return folder / "out"


def test_report_writes_a_self_contained_page_and_pngs(report_dir):
    names = ["balancedness.png", "gpu_loads.png", "hottest_experts.png", "windows.png", "moves.png"]
    page = (report_dir / "index.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == len(names)
    for name, data in zip(names, embedded):
        png = (report_dir / name).read_bytes()
        width, height = _png_size(png)
        assert width >= 400 and height >= 300
        assert base64.b64decode(data) == png                      # the page does not depend on the files
    assert "moves from previous" in page and "of 800 slots changed" in page
    assert "no rebalancing" in page and "greedy" in page
    assert "layer " in page                                         # worst layer named by its model index


def test_report_page_in_headless_chromium(report_dir, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium; CI installs it)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    url = (report_dir / "index.html").as_uri()
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert '<table id="summary">' in dom and dom.count("<img") == 5 and "eplb placement report" in dom
    shot = tmp_path / "page.png"
    subprocess.run([*flags, "--window-size=1200,1600", f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, check=True)
    import matplotlib.image

    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)
    blue = np.all(np.abs(pixels - np.array(PLAN_BLUE)) <= 8, axis=-1)
    assert blue.sum() > 200, "the figures did not render in the browser"


def test_report_on_one_window_and_uneven_slots(tmp_path):
    """No windows figure for a single window, no moves without a previous plan; greedy cannot place
    uneven slots, so the page says n/a instead of failing."""
    from eplb.io.report import make_report

    counts = np.random.default_rng(1).integers(0, 100, size=(3, 6))
    np.save(tmp_path / "counts.npy", counts)
    phy2log = np.tile([0, 1, 2, 3, 4, 5, 0, 1], (3, 1))
    write_placement(eplb.Placement(phy2log, 6, Topology(np.array([3, 2, 0, 3]), 2)), tmp_path / "plan.npz")
    result = make_report(read_counts(tmp_path / "counts.npy"), read_placement(tmp_path / "plan.npz"), tmp_path)
    assert [f.name for f in result.figures] == ["balancedness.png", "gpu_loads.png", "hottest_experts.png"]
    assert result.summary["balancedness (mean over layers)"].count("n/a") == 1
    assert result.html.read_text().count("data:image/png;base64,") == 3


def test_crossing_note_prices_the_tokens_off_the_rack():
    """The report's summary line: the tokens a capped plan serves off their rack, and their bytes and
    time on the network, priced with the model preset of as many routed experts (none: said so)."""
    from eplb.io.report import crossing_note
    from eplb.simulation.synthetic import skewed_counts

    counts = skewed_counts(3, 256, num_groups=8, seed=1).astype(float)
    capped = eplb.plan(counts, num_slots=288, num_gpus=36, num_nodes=2, num_groups=8, max_off_node=0.15)
    note = crossing_note(counts, capped)
    share = float((capped.off_node_fraction(counts) * counts.sum(axis=1)).sum() / counts.sum())
    assert note.startswith(f"{share:.1%} of the tokens") and "DeepSeek-V3" in note and "GB over the network" in note
    small = skewed_counts(3, 48, num_groups=8, seed=1).astype(float)
    home = eplb.plan(small, num_slots=64, num_gpus=8, num_nodes=2, num_groups=8, max_off_node=0.0)
    assert crossing_note(small, home).startswith("0.0% of the tokens")
    assert "no model preset has 48 routed experts" in crossing_note(small, home)

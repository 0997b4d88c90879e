"""Kernels shipped compiled: a wheel's build compiles the DeepSeek-V3 deployment's kernels and ships
Numba's cache files, so a fresh install's first call loads compiled code instead of compiling
(:mod:`eplb.kernels.plumbing._cache`, ``eplb/_build.py``, :func:`eplb.precompile.ship`).

The end-to-end checks build a real wheel from a copy of the source (about a minute: the build
compiles), install it into a folder of its own and run fresh interpreters on it with an empty
cache folder, counting Numba's compiles (no wall-clock assertion)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.kernels.plumbing import _cache
from eplb.simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts

pytestmark = pytest.mark.slow  # builds a wheel and compiles the shipped kernels

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}

# A fresh interpreter on the installed copy: the numba functions it compiled (not loaded) while
# planning the README's example, building a Balancer and answering its first decision, planning
# a small model, and planning (with the gap) and deciding at two and four slots a GPU.
CHILD = """
import json, numpy as np
from numba.core import event
compiled = []
class Compiles(event.Listener):
    def on_start(self, e): compiled.append(e.data["dispatcher"].py_func.__qualname__)
    def on_end(self, e): pass
event.register("numba:compile", Compiles())
import eplb
from eplb.simulation.synthetic import DEEPSEEK_V3 as c, deepseek_v3_counts, skewed_counts
counts = deepseek_v3_counts(0)
deploy = {k: c[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
placement = eplb.plan(counts, **deploy)
balancer = eplb.Balancer(counts.shape[0], eplb.Deployment.of(counts.shape[1], **deploy))
balancer.record(counts)
balancer.should_rebalance()
small = skewed_counts(4, 32, seed=2)  # a small model's paths (the searches of few experts)
eplb.plan(small, num_slots=40, num_gpus=4).gap
for slots, gpus in ((288, 144), (288, 72)):  # wide expert parallelism: two and four slots a GPU
    wide = eplb.Deployment.of(counts.shape[1], num_slots=slots, num_gpus=gpus)
    eplb.plan(counts, wide).gap
    rack = eplb.Balancer(counts.shape[0], wide)
    rack.record(counts)
    rack.should_rebalance()
print(json.dumps({"file": eplb.__file__, "compiled": compiled, "phy2log": placement.phy2log.tolist()}))
"""


def installed_env(site: Path, cache: Path) -> dict[str, str]:
    """The environment of an interpreter that imports eplb from ``site`` and caches in ``cache``."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(EPLB_CACHE_DIR=str(cache), PYTHONPATH=str(site))
    return env


def run_installed(site: Path, cache: Path, code: str = CHILD) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=installed_env(site, cache), cwd=site,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_wheel(source: Path, out: Path, **env_update) -> Path:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "EPLB_CACHE_DIR")}
    env.update(env_update)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
                           "-w", str(out)], env=env, cwd=source, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("eplb-*.whl")
    return wheel


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "eplb", source / "eplb", ignore=shutil.ignore_patterns("__pycache__", "_precompiled"))
    return source


@pytest.fixture(scope="module")
def installed(source_copy, tmp_path_factory) -> Path:
    """The package built into a wheel (compiling its kernels) and installed into a folder of its own."""
    wheel = build_wheel(source_copy, tmp_path_factory.mktemp("wheel"))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return site


def test_a_fresh_install_plans_and_decides_without_compiling(installed, tmp_path):
    out = run_installed(installed, tmp_path / "empty-cache")
    assert Path(out["file"]).is_relative_to(installed)
    assert out["compiled"] == [], f"compiled on a fresh install: {out['compiled']}"
    # shipped code plans what this process's own compile plans
    assert out["phy2log"] == eplb.plan(deepseek_v3_counts(0), **DEPLOY).phy2log.tolist()
    manifest = json.loads(next((installed / "eplb" / "_precompiled").glob("*/manifest.json")).read_text())
    assert manifest["numba"] == _cache.numba.__version__ and manifest["files"] > 0


def test_ranks_starting_together_on_one_empty_cache_all_load_and_agree(installed, tmp_path):
    """Every rank of an engine starts at once on the same empty cache folder: each copies the shipped
    entries it finds missing while the others do, and none compiles or plans differently."""
    env = installed_env(installed, tmp_path / "shared-cache")
    ranks = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=installed, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = []
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=900)
        assert rank.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [out["compiled"] for out in outs] == [[]] * 4
    assert all(out["phy2log"] == outs[0]["phy2log"] for out in outs)
    assert not list((tmp_path / "shared-cache").rglob("*.tmp")), "a copy's temporary file was left behind"


def test_an_edited_kernel_file_is_compiled_not_loaded_stale(installed, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    layout = site / "eplb" / "kernels" / "plumbing" / "layout.py"
    layout.write_text(layout.read_text() + "\n# edited after the build\n")
    out = run_installed(site, tmp_path / "empty-cache", """
        import json, numpy as np
        from eplb.kernels.plumbing.layout import replica_counts
        counts = replica_counts(np.array([[0, 1, 1, 2]], dtype=np.int64), 3)
        print(json.dumps({"counts": counts.tolist(), "misses": len(replica_counts.stats.cache_misses),
                          "hits": len(replica_counts.stats.cache_hits)}))
    """)
    assert out["counts"] == [[1, 2, 1]]
    assert out["misses"] == 1 and out["hits"] == 0


def test_a_build_told_not_to_compile_ships_no_kernels_not_even_an_earlier_builds(source_copy, installed, tmp_path):
    """``EPLB_PRECOMPILE=0`` skips the compile, and the build folder's kernels from the build before
    (the ``installed`` fixture's, same source folder) are not shipped either."""
    assert (source_copy / "build" / "lib" / "eplb" / "_precompiled").is_dir()
    wheel = build_wheel(source_copy, tmp_path, EPLB_PRECOMPILE="0")
    assert not [name for name in zipfile.ZipFile(wheel).namelist() if "_precompiled" in name]


def fake_shipped(root: Path, files: dict[str, bytes], manifest: str | None = '{"id": "0123456789abcdef0123"}') -> Path:
    """A shipped folder ``root/<tag>/kernels`` holding ``files``, with a manifest (or a broken one)."""
    folder = root / _cache.shipped_tag() / "kernels"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if manifest is not None:
        (folder.parent / _cache.MANIFEST).write_text(manifest)
    return folder


def test_seeding_copies_only_the_entries_a_cache_folder_lacks(tmp_path):
    shipped = fake_shipped(tmp_path / "shipped", {"a.nbi": b"A index", "a.1.nbc": b"A1", "a.2.nbc": b"A2",
                                                  "b.nbi": b"B index", "b.1.nbc": b"B1"})
    target = tmp_path / "cache"
    target.mkdir()
    (target / "b.nbi").write_bytes(b"the user's own B")  # compiled here before: kept, with its data
    assert _cache.seed_from_shipped(str(shipped), str(target)) == 1
    assert sorted(p.name for p in target.iterdir()) == ["a.1.nbc", "a.2.nbc", "a.nbi", "b.nbi"]
    assert (target / "a.2.nbc").read_bytes() == b"A2" and (target / "b.nbi").read_bytes() == b"the user's own B"


def test_the_cache_folder_carries_the_shipped_id_and_is_seeded(tmp_path, monkeypatch):
    fake_shipped(tmp_path / "shipped", {"k.nbi": b"K", "k.1.nbc": b"K1"})
    monkeypatch.setattr(_cache, "SHIPPED_ROOT", str(tmp_path / "shipped"))
    monkeypatch.setenv("EPLB_CACHE_DIR", str(tmp_path / "cache"))
    kernel_file = str(Path(_cache.__file__).with_name("layout.py"))
    folder = Path(_cache.cache_dir(kernel_file))
    assert folder.is_relative_to(tmp_path / "cache") and folder.name.endswith("_0123456789abcdef")
    assert sorted(p.name for p in folder.iterdir()) == ["k.1.nbc", "k.nbi"]


@pytest.mark.parametrize("manifest", [None, "not json", '{"no id": 1}'])
def test_without_a_readable_manifest_nothing_is_seeded(tmp_path, monkeypatch, manifest):
    fake_shipped(tmp_path / "shipped", {"k.nbi": b"K"}, manifest=manifest)
    monkeypatch.setattr(_cache, "SHIPPED_ROOT", str(tmp_path / "shipped"))
    monkeypatch.setenv("EPLB_CACHE_DIR", str(tmp_path / "cache"))
    folder = Path(_cache.cache_dir(str(Path(_cache.__file__).with_name("layout.py"))))
    kernels_init = str(Path(_cache.KERNELS_DIR) / "__init__.py")  # every kernel file's cache folder
    assert folder.name == _cache._CacheLocator.get_suitable_cache_subpath(kernels_init)
    assert not folder.exists() or not any(folder.iterdir())

"""eplb's SGLang placement file against SGLang's own loader (``sglang/srt/eplb/expert_location.py``).

``import sglang`` pulls psutil, transformers and the rest of the server (sglang 0.5.23: the wheel
is 39 MB, but its package ``__init__`` fails without those dependencies), so the loader module is
executed on its own from SGLang's files with its runtime context (``sglang.srt.runtime_context``:
the server's arguments and process groups) replaced by plain values. Files come from
``EPLB_SGLANG_SOURCES`` (a sglang wheel or an unpacked tree) or an installed sglang; without
either the tests skip with the reason.

Checked with sglang 0.5.23.
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="SGLang's loader uses torch; torch is not installed")

import eplb  # noqa: E402
from eplb.io.formats.sglang import write_sglang_placement  # noqa: E402
from eplb.simulation.synthetic import drifting_counts  # noqa: E402
from sglang_sources import LOADER, SKIP_REASON, load_expert_location, sglang_file  # noqa: E402



SOURCE = sglang_file(LOADER)
pytestmark = pytest.mark.skipif(SOURCE is None, reason=SKIP_REASON)


@pytest.fixture
def loader(monkeypatch):
    """SGLang's expert_location module with a server of ``ep_size=8`` on 2 nodes, static dispatch."""
    settings = SimpleNamespace(
        moe=SimpleNamespace(init_expert_location=None, ep_dispatch_algorithm="static", moe_a2a_backend="none",
                            ep_join_mode="none", ep_num_redundant_experts=16, eplb_algorithm="auto"),
    )
    parallel = SimpleNamespace(ep_size=8, nnodes=2, tp_size=8, elastic_ep_initial_size=None, ep_join_rank_offset=0)
    module = load_expert_location(monkeypatch, settings, parallel)
    module.settings = settings
    return module


def _placement():
    counts = drifting_counts(1, 3, 64, num_groups=8, seed=7)[0]
    return eplb.plan(counts, num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)


def test_sglang_accepts_the_file_eplb_writes(loader, tmp_path):
    placement = _placement()
    path = tmp_path / "init_expert_location.json"
    write_sglang_placement(placement, path)
    data = json.loads(path.read_text())  # compute_initial_expert_location_metadata reads .json this way
    assert "physical_to_logical_map" in data
    # ... and passes the dict as keyword arguments: every key must be a parameter of init_by_mapping
    inspect.signature(loader.ExpertLocationMetadata.init_by_mapping).bind(None, **data, moe_ep_rank=0)
    table = torch.tensor(data["physical_to_logical_map"])
    log2phy = loader._compute_logical_to_all_physical_map(table, num_logical_experts=64, ep_size=8,
                                                          moe_ep_rank=None)
    # SGLang's replica lists are eplb's log2phy (same slots, same order, padded with -1)
    np.testing.assert_array_equal(log2phy.numpy(), placement.log2phy)


def test_static_dispatch_picks_a_replica_of_each_expert_for_every_rank(loader):
    placement = _placement()
    log2phy = loader._compute_logical_to_all_physical_map(torch.tensor(placement.phy2log), 64, 8, None)
    for rank in range(8):
        table = loader.compute_logical_to_rank_dispatch_physical_map(log2phy, ep_size=8, num_physical_experts=80,
                                                                     ep_rank=rank)
        assert table.shape == (3, 64)
        chosen = np.take_along_axis(placement.phy2log, table.numpy(), axis=1)
        np.testing.assert_array_equal(chosen, np.broadcast_to(np.arange(64), (3, 64)))
        # a replica on the rank's own GPU wins when there is one
        gpu = table.numpy() // 10
        own = (placement.phy2log[:, rank * 10:(rank + 1) * 10][:, :, None] == np.arange(64)).any(axis=1)
        assert (gpu[own] == rank).all()

"""The shares engines realise (:mod:`eplb.analysis.engine_dispatch`): properties over random placements,
the rules of SGLang's near-replica choice, eplb's shares equal to the plain-Python reference
(``tests/sglang_reference.py``), and the strong check: SGLang 0.5.23's own code, run from its files,
builds the same per-rank static table as the reference from the file eplb writes.

SGLang's ``expert_location.py`` is executed on its own with its runtime context replaced by plain
values, as in ``tests/serving/test_adapters_sglang.py`` (files from ``EPLB_SGLANG_SOURCES``, a sglang wheel
or an unpacked tree, or an installed sglang; without them those tests skip with the reason).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.analysis.loads import gpu_loads
from eplb.analysis.engine_dispatch import ENGINES, engine_shares, with_engine_shares
from eplb.io.formats.sglang import write_sglang_placement
from eplb.analysis.metrics import balancedness
from eplb.analysis.placement import Placement, uniform_shares
from eplb.simulation.synthetic import deepseek_v3_counts, drifting_counts
from eplb.model.topology import Topology
from sglang_reference import reference_shares, sglang_static_table
from sglang_sources import LOADER, SKIP_REASON, load_expert_location, sglang_file
from strategies import configs

EVEN = ("uniform", "vllm", "tensorrt-llm", "sglang-dynamic-no-a2a")


def random_placement(config: dict, seed: int, num_layers: int = 2, stacked: bool = False) -> Placement:
    """Every expert once, the spare slots to random experts, slots shuffled (``stacked``: the spare
    slots all go to one hot expert, so it has several replicas on some GPUs)."""
    rng = np.random.default_rng(seed)
    experts, slots = config["num_experts"], config["num_slots"]
    rows = []
    for _ in range(num_layers):
        spare = np.zeros(slots - experts, np.int64) if stacked else rng.integers(0, experts, slots - experts)
        rows.append(rng.permutation(np.concatenate([np.arange(experts), spare])))
    topology = Topology.uniform(slots, config["num_gpus"], config["num_nodes"])
    return Placement(np.array(rows), experts, topology)


placements = st.builds(random_placement, configs(max_experts=24, max_gpus=8, max_slots_per_gpu=5),
                       st.integers(0, 2**32 - 1), st.integers(1, 3), st.booleans())


def expert_sums(placement: Placement, shares: np.ndarray) -> np.ndarray:
    """``[L, E]``: each expert's shares summed over its replicas."""
    sums = np.zeros((placement.num_layers, placement.num_experts))
    np.add.at(sums, (np.arange(placement.num_layers)[:, None], placement.phy2log), shares)
    return sums


# -------------------------------------------------------------------------------- properties

@given(placements, st.sampled_from(["sglang-static", "sglang-dynamic"]))
def test_shares_equal_the_reference(placement, engine):
    """The same ranks per slot and the same draws (summed in another order: to 1e-15)."""
    np.testing.assert_allclose(engine_shares(placement, engine), reference_shares(placement, engine), rtol=0,
                               atol=1e-15)


@given(placements, st.sampled_from(sorted(ENGINES)))
def test_shares_are_a_split_of_every_expert(placement, engine):
    shares = engine_shares(placement, engine)
    assert shares.shape == placement.phy2log.shape and shares.dtype == np.float64
    assert (shares >= 0).all()
    np.testing.assert_allclose(expert_sums(placement, shares), 1.0, atol=1e-12)
    np.testing.assert_array_equal(shares, engine_shares(placement, engine))  # deterministic


@given(placements)
def test_even_engines_split_evenly(placement):
    even = uniform_shares(placement.phy2log, placement.logcnt)
    for engine in EVEN:
        np.testing.assert_array_equal(engine_shares(placement, engine), even)


@given(placements)
def test_static_table_gives_each_rank_one_replica_and_shares_in_ranks(placement):
    table = sglang_static_table(placement)
    assert table.shape == (placement.num_gpus, placement.num_layers, placement.num_experts)
    chosen = np.take_along_axis(np.broadcast_to(placement.phy2log, table.shape[:2] + (placement.num_slots,)),
                                table, axis=2)
    np.testing.assert_array_equal(chosen, np.broadcast_to(np.arange(placement.num_experts), table.shape))
    ranks = engine_shares(placement, "sglang-static") * placement.num_gpus  # ranks choosing each slot
    np.testing.assert_allclose(ranks, np.round(ranks), atol=1e-9)


@given(placements)
def test_static_table_prefers_the_rank_gpu_then_its_node(placement):
    """``_find_nearest_expert``: the lowest replica on the rank's GPU; else the lowest on its node
    when the node holds some but not all replicas; else any replica (the fair choice)."""
    table = sglang_static_table(placement)
    topology = placement.topology
    gpu_of_slot = topology.gpu_of_slot
    node_of_slot = topology.node_of_gpu[gpu_of_slot]
    for rank in range(placement.num_gpus):
        node = topology.node_of_gpu[rank]
        for layer in range(placement.num_layers):
            for expert in range(placement.num_experts):
                slots = np.flatnonzero(placement.phy2log[layer] == expert)
                own = slots[gpu_of_slot[slots] == rank]
                near = slots[node_of_slot[slots] == node]
                pick = table[rank, layer, expert]
                if own.size:
                    assert pick == own[0]
                elif 0 < near.size < slots.size:
                    assert pick == near[0]


@settings(max_examples=30)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_a_replica_on_every_gpu_takes_one_share_per_gpu(num_nodes, gpus_per_node, extra_slots, seed):
    """Expert 0 on every GPU: every rank sends its tokens to its own copy, so each copy takes 1 / G."""
    num_gpus = num_nodes * gpus_per_node
    rng = np.random.default_rng(seed)
    num_experts = 1 + num_gpus * extra_slots  # expert 0 on every GPU, every other expert once
    others = rng.permutation(np.arange(1, num_experts)).reshape(num_gpus, extra_slots)
    row = np.concatenate([rng.permutation(np.concatenate([[0], block])) for block in others])
    topology = Topology.uniform(num_gpus * (1 + extra_slots), num_gpus, num_nodes)
    placement = Placement(row[None, :], num_experts, topology)
    for engine in ("sglang-static", "sglang-dynamic"):
        shares = engine_shares(placement, engine)
        np.testing.assert_allclose(shares[0, row == 0], 1.0 / num_gpus, atol=1e-15)


@given(placements)
def test_dynamic_is_static_in_expectation(placement):
    """Both give every rank its near replica; where no rank draws at random they agree exactly, and
    the random draw is uniform over the replicas up to SGLang's ``randint(0, 65536) % n`` bias."""
    static = engine_shares(placement, "sglang-static")
    dynamic = engine_shares(placement, "sglang-dynamic")
    table = sglang_static_table(placement)
    slots_of = [[np.flatnonzero(row == e) for e in range(placement.num_experts)] for row in placement.phy2log]
    for layer in range(placement.num_layers):
        for expert in range(placement.num_experts):
            slots = slots_of[layer][expert]
            picks = table[:, layer, expert]
            gpus = placement.topology.gpu_of_slot[slots]
            nodes = placement.topology.node_of_gpu[gpus]
            drawn = np.array([slots.size > 1 and rank not in gpus and not
                              (0 < (nodes == placement.topology.node_of_gpu[rank]).sum() < slots.size)
                              for rank in range(placement.num_gpus)])
            near = np.array([(picks[~drawn] == s).sum() for s in slots]) / placement.num_gpus
            expected = near + drawn.mean() / slots.size
            np.testing.assert_allclose(dynamic[layer, slots], expected, atol=slots.size / 65536)
            if not drawn.any():
                np.testing.assert_array_equal(dynamic[layer, slots], static[layer, slots])


def test_static_fair_choice_is_not_coordinated_across_ranks():
    """Each rank draws from its own stream of ``random.Random(42)``, so the ranks without a near
    replica need not spread evenly: on this DeepSeek-V3-sized plan some replica takes at least two
    ranks more than the even split would give it."""
    counts = deepseek_v3_counts(seed=0)
    placement = eplb.plan(counts, num_slots=288, num_gpus=32, num_nodes=4)
    static = engine_shares(placement, "sglang-static")
    dynamic = engine_shares(placement, "sglang-dynamic")
    assert np.abs(static - dynamic).max() * 32 >= 2
    # and it costs balance compared with the expectation
    served = with_engine_shares(placement, "sglang-static").balancedness(counts, dispatch="shares").mean()
    expected = with_engine_shares(placement, "sglang-dynamic").balancedness(counts, dispatch="shares").mean()
    assert served < expected


@given(placements)
def test_placement_with_engine_shares_measures_them(placement):
    counts = np.random.default_rng(placement.num_slots).integers(0, 100, (placement.num_layers,
                                                                          placement.num_experts))
    served = with_engine_shares(placement, "sglang-static")
    assert served == placement and served.info["engine_dispatch"] == "sglang-static"
    np.testing.assert_array_equal(served.shares, engine_shares(placement, "sglang-static"))
    loads = gpu_loads(counts, placement.phy2log, placement.topology, shares=served.shares)
    np.testing.assert_allclose(served.balancedness(counts, dispatch="shares"),
                               balancedness(loads, placement.topology))
    np.testing.assert_allclose(with_engine_shares(placement, "vllm").balancedness(counts, dispatch="shares"),
                               placement.balancedness(counts, dispatch="uniform"))


def test_hierarchical_plan_keeps_its_groups_and_home_nodes():
    counts = drifting_counts(1, 2, 64, num_groups=8, seed=1)[0]
    placement = eplb.plan(counts, num_slots=80, num_gpus=8, num_nodes=2, num_groups=8)
    served = with_engine_shares(placement, "sglang-dynamic")
    assert served.num_groups == 8
    np.testing.assert_array_equal(served.home_node, placement.home_node)
    # every replica of a group sits on its home node, so none of the engines sends tokens off it
    for engine in ENGINES:
        assert (with_engine_shares(placement, engine).off_node_fraction(counts) == 0).all()


def test_bad_input_names_the_argument_and_the_rule():
    placement = random_placement(dict(num_experts=8, num_slots=12, num_gpus=4, num_nodes=2), seed=0)
    with pytest.raises(ValueError, match="engine must be one of"):
        engine_shares(placement, "sglang")
    with pytest.raises(ValueError, match="engine must be one of"):
        engine_shares(placement, None)
    with pytest.raises(ValueError, match="dispatch='optimal'"):
        engine_shares(placement, "sglang-lp")
    with pytest.raises(ValueError, match="placement must be an eplb.Placement"):
        engine_shares(placement.phy2log, "uniform")
    uneven = Placement(np.arange(9)[None, :] % 8, 8, Topology.from_layout(9, 4, 2))
    for engine in ("sglang-static", "sglang-dynamic"):
        with pytest.raises(ValueError, match="same number of slots on every GPU"):
            engine_shares(uneven, engine)
    assert engine_shares(uneven, "vllm").shape == (1, 9)  # an even split needs no layout


# ---------------------------------------------------------------------- SGLang's own code



SOURCE = sglang_file(LOADER)
needs_sglang = pytest.mark.skipif(SOURCE is None, reason=SKIP_REASON)


def run_sglang(monkeypatch, placement: Placement, tmp_path: Path):
    """Per rank, SGLang's metadata built from the file eplb writes, the way a server of
    ``ep_size = G`` on ``nnodes = N`` with an all-to-all backend and static dispatch builds it
    (``compute_initial_expert_location_metadata(model_config, moe_ep_rank=r)``)."""
    torch = pytest.importorskip("torch", reason="SGLang's loader uses torch; torch is not installed")
    path = tmp_path / "init_expert_location.json"
    write_sglang_placement(placement, path)
    settings = SimpleNamespace(moe=SimpleNamespace(
        init_expert_location=str(path), ep_dispatch_algorithm="static", moe_a2a_backend="deepep",
        ep_join_mode="none", ep_num_redundant_experts=placement.num_slots - placement.num_experts))
    parallel = SimpleNamespace(ep_size=placement.num_gpus, nnodes=placement.num_nodes, tp_size=placement.num_gpus,
                               elastic_ep_initial_size=None, ep_join_rank_offset=0)
    module = load_expert_location(monkeypatch, settings, parallel)
    shape = module.ModelConfigForExpertLocation(num_layers=placement.num_layers,
                                                num_logical_experts=placement.num_experts)
    module.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda model_config: shape)
    with torch.no_grad():
        return [module.compute_initial_expert_location_metadata(None, moe_ep_rank=rank)
                for rank in range(placement.num_gpus)]


def _plan(num_experts, num_slots, num_gpus, num_nodes, num_groups=None, seed=0):
    counts = drifting_counts(1, 3, num_experts, num_groups=8, seed=seed)[0]
    return eplb.plan(counts, num_slots=num_slots, num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups)


SGLANG_CASES = {
    # global plans over several nodes: most replicated experts have no replica on some nodes
    "global 96/16 GPUs/4 nodes": lambda: _plan(64, 96, 16, 4),
    "global 80/8 GPUs/2 nodes": lambda: _plan(64, 80, 8, 2, seed=3),
    "global 80/8 GPUs/1 node": lambda: _plan(64, 80, 8, 1, seed=4),
    # hierarchical: every replica of a group on its home node
    "hierarchical 80/8 GPUs/2 nodes": lambda: _plan(64, 80, 8, 2, num_groups=8, seed=5),
    "hierarchical 128/16 GPUs/4 nodes": lambda: _plan(64, 128, 16, 4, num_groups=8, seed=6),
    # random: replicas stacked on one GPU, experts with many replicas, nodes with none of them
    "random 48/8 GPUs/4 nodes": lambda: random_placement(dict(num_experts=16, num_slots=48, num_gpus=8,
                                                              num_nodes=4), seed=7, num_layers=3),
    "stacked 40/8 GPUs/2 nodes": lambda: random_placement(dict(num_experts=16, num_slots=40, num_gpus=8,
                                                               num_nodes=2), seed=8, num_layers=2, stacked=True),
}


@needs_sglang
@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
def test_static_table_and_shares_match_sglang(monkeypatch, tmp_path, case):
    """Exact: the same slot for every (rank, layer, expert), hence the same fraction of ranks per
    slot (both count ranks and divide by G: bit-identical floats)."""
    placement = SGLANG_CASES[case]()
    metadata = run_sglang(monkeypatch, placement, tmp_path)
    theirs = np.stack([m.logical_to_rank_dispatch_physical_map.numpy() for m in metadata])
    np.testing.assert_array_equal(sglang_static_table(placement), theirs)
    fraction = np.zeros(placement.phy2log.shape)
    for table in theirs:
        for layer, row in enumerate(table):
            fraction[layer, row] += 1  # a rank sends each expert to one slot: no slot twice in a row
    np.testing.assert_allclose(engine_shares(placement, "sglang-static"), fraction / placement.num_gpus, rtol=0,
                               atol=1e-15)


@needs_sglang
@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
def test_dynamic_shares_match_sglang_candidate_lists(monkeypatch, tmp_path, case):
    """SGLang's ``dynamic`` dispatch draws ``randint(0, 65536) % num_valid`` from each rank's
    candidate list (``logical_to_all_physical_map``, collapsed to the near replica); the expected
    shares from SGLang's own lists agree with eplb's to rounding."""
    placement = SGLANG_CASES[case]()
    metadata = run_sglang(monkeypatch, placement, tmp_path)
    expected = np.zeros(placement.phy2log.shape)
    for m in metadata:
        lists = m.logical_to_all_physical_map.numpy()
        valid = m.logical_to_all_physical_map_num_valid.numpy()
        for layer in range(placement.num_layers):
            for expert in range(placement.num_experts):
                n = valid[layer, expert]
                draws = np.bincount(np.arange(65536) % n, minlength=n) / 65536
                expected[layer, lists[layer, expert, :n]] += draws / placement.num_gpus
    np.testing.assert_allclose(engine_shares(placement, "sglang-dynamic"), expected, rtol=0, atol=1e-12)


@needs_sglang
@settings(max_examples=15)
@given(placements)
def test_static_table_matches_sglang_on_random_placements(placement):
    with pytest.MonkeyPatch.context() as monkeypatch:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            metadata = run_sglang(monkeypatch, placement, Path(folder))
    theirs = np.stack([m.logical_to_rank_dispatch_physical_map.numpy() for m in metadata])
    np.testing.assert_array_equal(sglang_static_table(placement), theirs)

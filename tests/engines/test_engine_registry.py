"""The engine registry (:mod:`eplb.engines`): every entry keeps the contract, the names the layers
above hold for it exist there, and the rule vocabulary is derived from the entries."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

from eplb.engines import (DISPATCH_RULES, ENGINE_RULES, ENGINES, GENERAL_RULES, PLACEMENT_RULES, SCORING,
                          SHARE_RULES, engine, engine_of, rule_shares)
from eplb.engines.contract import DispatchRule, Engine, check_engine
from eplb.io.formats import FORMATS, PLACEMENT_FORMATS
from eplb.model.topology import Topology

ENTRY = ENGINES["sglang"]


def test_the_registry_lists_each_engine_once_by_its_name():
    assert list(ENGINES) == ["vllm", "tensorrt-llm", "sglang"]
    assert all(name == entry.name and check_engine(entry) is entry for name, entry in ENGINES.items())
    assert engine("tensorrt-llm") is ENGINES["tensorrt-llm"]


@pytest.mark.parametrize("name", [None, "SGLang", "sglang-static", "lmdeploy"])
def test_an_unknown_engine_is_refused_naming_the_accepted_ones(name):
    with pytest.raises(ValueError, match=re.escape("engine must be one of ('vllm', 'tensorrt-llm', 'sglang')")):
        engine(name)


def test_the_rules_are_the_general_ones_then_each_engine_s():
    """The vocabulary the package, the CLI and error messages use, in its published order."""
    assert list(DISPATCH_RULES) == ["uniform", "optimal", "vllm", "tensorrt-llm", "sglang-static", "sglang-dynamic",
                                    "sglang-dynamic-no-a2a"]
    assert SCORING == tuple(GENERAL_RULES) == ("uniform", "optimal")
    assert ENGINE_RULES == ("vllm", "tensorrt-llm", "sglang-static", "sglang-dynamic")
    assert SHARE_RULES == ("uniform",) + tuple(DISPATCH_RULES)[2:]
    assert PLACEMENT_RULES == ("sglang-static", "sglang-dynamic")
    assert {rule: engine_of(rule).name for rule in DISPATCH_RULES if engine_of(rule)} == {
        "vllm": "vllm", "tensorrt-llm": "tensorrt-llm", "sglang-static": "sglang", "sglang-dynamic": "sglang",
        "sglang-dynamic-no-a2a": "sglang"}
    assert engine_of("optimal") is None
    with pytest.raises(ValueError, match="rule must be one of"):
        engine_of("sglang-lp")


@pytest.mark.parametrize("name", list(ENGINES))
def test_each_engine_names_what_lives_in_the_layers_above(name):
    entry = ENGINES[name]
    assert set(entry.formats) <= {f.name for f in FORMATS}
    assert entry.loads is None or entry.loads in PLACEMENT_FORMATS
    if entry.adapter is not None:
        assert callable(importlib.import_module(entry.adapter).install)
    module = importlib.import_module(f"eplb.engines.{name.replace('-', '_')}")
    assert module.ENGINE is entry and entry.notes == module.__doc__
    assert "Checked against" in entry.notes and "docs/engines/" in entry.notes


def test_every_format_of_an_engine_is_claimed_once():
    claimed = [fmt for entry in ENGINES.values() for fmt in entry.formats]
    assert len(claimed) == len(set(claimed))


def test_an_entry_breaking_the_contract_is_refused_naming_it():
    with pytest.raises(ValueError, match="engine 'sglang': rule 'other' must be named 'sglang'"):
        check_engine(ENTRY._replace(rules={"other": DispatchRule("uniform", "x", "y")}))
    with pytest.raises(ValueError, match="layer_shares is given exactly when"):
        check_engine(ENTRY._replace(layer_shares=None))
    with pytest.raises(ValueError, match="options"):
        check_engine(ENTRY._replace(options=("sglang-lp",)))
    with pytest.raises(ValueError, match="loads 'trtllm' must be one of its formats"):
        check_engine(ENTRY._replace(loads="trtllm"))
    with pytest.raises(ValueError, match="dense_layers is given exactly when it loads a file"):
        check_engine(ENTRY._replace(dense_layers=None))
    with pytest.raises(ValueError, match="must be an eplb.engines.contract.Engine"):
        check_engine(tuple(ENTRY))
    assert isinstance(ENTRY, Engine)


def test_rule_shares_refuses_an_even_split_and_an_uneven_topology():
    with pytest.raises(ValueError, match=re.escape("rule must be one of ('sglang-static', 'sglang-dynamic')")):
        rule_shares([[0, 1]], 2, Topology.uniform(2, 1), "vllm")
    uneven = Topology(np.array([3, 1]))
    with pytest.raises(ValueError, match="needs the same number of slots on every GPU"):
        rule_shares([[0, 1, 0, 1]], 2, uneven, "sglang-static")

"""The wording of the figures the ``eplb`` commands print: one place for how a balancedness, a
rule, a held-out estimate, an engine's rows, dense layers and a copy's cost are said.
"""

from __future__ import annotations

import numpy as np

from ..engines import DISPATCH_RULES, ENGINES
from ..analysis.metrics import moe_layers, moe_mean
from ..io.report import moe_note
from ..io.formats import PLACEMENT_FORMATS


def engine_line(placement, weights, engine: str) -> str:
    """The summary line judging ``placement`` on ``weights [L, E]`` under ``engine``'s dispatch rule,
    saying that every figure of the summary is judged under it, and what an even split would give."""
    bal = placement.balancedness(weights, engine)
    moe = moe_layers(weights)
    line = (f"engine   balancedness under {DISPATCH_RULES[engine].label}: {moe_mean(bal, weights):.4f} "
            f"(mean over {moe_note(weights)}; worst layer {bal[moe].min() if moe.any() else bal.min():.4f}); "
            "every figure of this summary is judged under this rule")
    if DISPATCH_RULES[engine].kind != "uniform":
        line += f" (split evenly among replicas: {moe_mean(placement.balancedness(weights, 'shares'), weights):.4f})"
    return line


def _balance_line(before, after, placement, weights, num_windows: int, options: dict, engine) -> str:
    """The in-sample line of ``eplb plan``: balancedness without rebalancing and with the plan
    (``[L]`` each), and the rule it is judged under."""
    moe = moe_layers(weights)
    return (f"balance  {moe_mean(before, weights):.4f} without rebalancing -> {moe_mean(after, weights):.4f} with the "
            f"plan (mean over {moe_note(weights)}; worst layer {after[moe].min() if moe.any() else after.min():.4f})"
            + ("; on the summed windows, in sample" if num_windows > 1 else "")
            + f"; under {_rule_name(engine or 'shares', placement)}"
            + (f", {moe_mean(placement.balancedness(weights, 'optimal'), weights):.4f} with optimal "
               "dispatch" if options.get("dispatch") == "optimal" else ""))


def _rule_name(judge: str, placement=None) -> str:
    """What a figure judged under ``judge`` is judged under, for the line that prints it: a rule of
    :data:`eplb.engines.DISPATCH_RULES` by its label (``"SGLang static dispatch"``), or ``"shares"``,
    the plan's own split: ``"the plan's shares"`` when ``placement`` carries shares, else ``"an even split"``."""
    if judge == "shares":
        return "the plan's shares" if placement is not None and placement.shares is not None else \
            DISPATCH_RULES["uniform"].label
    return DISPATCH_RULES[judge].label


DEPLOYED_BETTER_BY = 5e-4
"""How much higher the deployed placement's balancedness must be than the new plan's on the same
counts for ``eplb plan --previous`` to warn that the deployed one serves them better (the fourth
decimal the summary prints)."""


def _regrouped_lines(placement, migration: dict) -> list[str]:
    """One summary line when the deployed placement spread expert groups over nodes and the plan
    gathered them again (``placement.info["regrouped"] [L]``), saying where it changed more slots
    than ``--max-moves`` allows."""
    regrouped = np.asarray(placement.info.get("regrouped", np.zeros(0, bool)), bool)
    if not regrouped.any():
        return []
    layers = np.flatnonzero(regrouped)
    changed = np.asarray(placement.info.get("slots_changed", np.zeros(len(regrouped))), np.int64)[layers]
    shown = ", ".join(str(int(i)) for i in layers[:6]) + (", ..." if layers.size > 6 else "")
    line = (f"regroup  the deployed placement spreads expert groups over nodes in {layers.size} layer"
            f"{'s' if layers.size > 1 else ''} ({shown}): the plan keeps every group on one node there, changing "
            f"{changed.min()}..{changed.max()} slots per layer")
    budget = migration.get("max_moves")
    if budget is not None and (changed > budget).any():
        line += f", more than --max-moves {budget} in {int((changed > budget).sum())} of them"
    return [line]


def _judge(options: dict) -> str:
    """How a plan made with ``options`` is split among replicas when judged: its own rule (an even
    split, or its shares, unless it was made for optimal dispatch or an engine's rule)."""
    rule = options.get("dispatch", "uniform")
    return rule if DISPATCH_RULES[rule].kind in ("optimal", "engine") else "shares"


def _left_out_note(held: dict) -> str:
    """``"; 1 block of windows carrying no load left out"`` for :func:`_held_out_estimates`' result (or ``""``)."""
    empty = held.get("empty", 0)
    return f"; {empty} block{'s' if empty > 1 else ''} of windows carrying no load left out" if empty else ""


def _held_out_lines(held: dict, placement) -> list[str]:
    """The summary lines of the held-out estimate (what windows the plan was not made from get:
    what the engine will see), with a recommendation only from held-out figures."""
    mine, summed = held["plan"], held["summed"]
    skipped = _left_out_note(held)
    under = f"under {_rule_name(held['judge'], placement)}"
    if mine.size == 0:
        return [f"held out n/a: every held-out block of windows carries no load; {under}"]
    lines = [f"held out {mine.mean():.4f} mean, {mine.min():.4f} worst window with this plan's options; "
             f"{summed.mean():.4f} / {summed.min():.4f} planned on the summed windows "
             f"(each of {held['folds']} blocks of windows served by the plan made from the others{skipped}); "
             f"{under}"]
    if mine.mean() < summed.mean() - 0.002:
        lines.append("note     held out, the summed plan serves unseen windows better here: consider --objective sum")
    return lines


def _copy_cost_line(old, new, expert_bytes, model_preset, hardware) -> str:
    """The bytes the copies from ``old`` to ``new`` move and their time on ``hardware``
    (:func:`eplb.transfer_plan`, :meth:`eplb.CostModel.transfer_time`: all layers at once, each GPU's
    slowest link)."""
    from ..model.cost import CostModel
    from ..serving.transfer import transfer_plan

    overrides = {} if expert_bytes is None else {"expert_bytes": expert_bytes}
    cost = CostModel.preset(hardware, model_preset or "deepseek-v3", **overrides)
    transfer = transfer_plan(old, new, expert_bytes=int(cost.expert_bytes))
    moved = transfer.bytes()
    between = moved["intra_node"] + moved["cross_node"]
    source = f"{int(cost.expert_bytes):,} bytes per expert" + (f" ({model_preset})" if expert_bytes is None else "")
    return (f"copies   {between / 2**30:.3g} GiB between GPUs ({moved['intra_node'] / 2**30:.3g} GiB over NVLink, "
            f"{moved['cross_node'] / 2**30:.3g} GiB across nodes) and {moved['intra_gpu'] / 2**30:.3g} GiB within GPUs, "
            f"{source}; {1e3 * cost.transfer_time(transfer):.3g} ms all at once on {hardware} "
            f"(the busiest GPU's slowest link)")


ENGINE_ROWS = tuple(name for name in PLACEMENT_FORMATS if name in {engine.loads for engine in ENGINES.values()})
"""The output formats an engine loads (:data:`eplb.engines.ENGINES`), whose rows ``eplb plan`` places by
model layer (``--num-layers``): ``("sglang", "trtllm")``."""


def _engine_rows_line(layer_ids, output_format: str, num_layers) -> str:
    """The summary line saying where the rows of an engine's file go: SGLang's map has a row per
    model layer (``layer_ids [L]`` from the counts, the others SGLang's trivial rows);
    TensorRT-LLM's YAML is keyed by the layer ids. ``""`` for other formats."""
    from ..io.formats.data import layer_ranges

    if output_format not in ENGINE_ROWS:
        return ""
    planned = layer_ranges(layer_ids)
    if output_format == "trtllm":
        return (f"layers   {planned}: the YAML's keys, the model's layer ids (TensorRT-LLM looks each MoE layer's "
                "row up by its layer index)")
    rows = int(num_layers) if num_layers is not None else int(np.max(layer_ids)) + 1
    rest = sorted(set(range(rows)) - {int(i) for i in layer_ids})
    return (f"layers   SGLang's map has {rows} rows, one per model layer (row l is layer l"
            + (", --num-layers" if num_layers is not None else "; the largest layer id + 1, else pass --num-layers")
            + f"): {planned} planned from the counts"
            + (f", {layer_ranges(rest)} (not in the counts) SGLang's trivial placement" if rest else ""))


def _served_without_shares(placement, weights, output_format: str) -> str:
    """The note for a plan with shares written where they cannot go: what the engine's own rule serves."""
    head = f"note     {output_format} files cannot carry the shares (eplb JSON does): "
    even = moe_mean(placement.balancedness(weights, "uniform"), weights)
    if output_format == "sglang":
        static = moe_mean(placement.balancedness(weights, "sglang-static"), weights)
        return (head + f"SGLang serves it by its own rule: balance {static:.4f} under {DISPATCH_RULES['sglang-static'].label} "
                f"(its default with an all-to-all backend such as DeepEP), {even:.4f} under dynamic dispatch with "
                "--moe-a2a-backend none (an even split)")
    if output_format == "trtllm":
        return head + f"TensorRT-LLM splits each expert's tokens evenly among its replicas: balance {even:.4f}"
    return head + f"an engine loading it splits by its own rule (an even split: balance {even:.4f})"


DENSE_LAYERS_IN = {engine.loads: engine.dense_layers for engine in ENGINES.values() if engine.loads is not None}
"""What each engine does with the placement rows of dense layers (all-zero counts), by the format
it loads (:attr:`eplb.engines.contract.Engine.dense_layers`)."""


def _dense_layers_note(weights: np.ndarray, layer_ids, output_format: str) -> str:
    """A summary line naming the dense layers (no tokens) and what the engine of ``output_format``
    does with their rows; ``""`` when there are none or the format is not an engine's."""
    dense = np.flatnonzero(~moe_layers(weights))
    if dense.size == 0 or output_format not in DENSE_LAYERS_IN:
        return ""
    ids = np.asarray(layer_ids)[dense] if layer_ids is not None else dense
    shown = ", ".join(str(int(i)) for i in ids[:8]) + (", ..." if ids.size > 8 else "")
    return (f"dense    layer{'s' if ids.size > 1 else ''} {shown} carr{'y' if ids.size > 1 else 'ies'} no tokens "
            f"(any placement serves them): {DENSE_LAYERS_IN[output_format]}")


def _groups_text(groups, nodes) -> str:
    if not groups:
        return ""
    return f", {groups} groups" + (" (ignored: global placement)" if groups % nodes else "")


def _shape_text(data) -> str:
    text = f"{data.num_layers} layers x {data.num_experts} experts"
    if data.num_windows > 1:
        text = f"{data.num_windows} windows x {text}"
        if data.metadata.get("passes_per_window"):
            text += f" (windows of {data.metadata['passes_per_window']} passes)"
    return text


def _seconds_text(seconds: float) -> str:
    """``0.0856`` -> ``"85.6 ms"``; ``12.3`` -> ``"12.3 s"``."""
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"

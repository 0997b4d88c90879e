"""Hierarchical plans held out: is the groups' node assignment what they lose to?

A hierarchical deployment (DeepSeek-V3 size: 256 experts in 8 groups, 288 slots on 32 GPUs in 4
nodes, every group and its replicas on one node) serves held-out windows worse than a global one
(``bench/robust_default.py``). One lever would be to choose which groups share a node from the
windows rather than from their sum. This script measures how much that lever could give: on the
DeepSeek-V3-sized prefill and decode workloads of ``robust_default`` (leave one workload out, plan
the others as a series with the default), per layer it scores the held-out window's **node**
balancedness (mean over max node load, groups summed per node) of

- the default plan's own assignment (the node holding each group's first expert),
- the best of every assignment (105 ways to pair 8 groups over 4 nodes) on the planning windows'
  mean node balancedness,
- the best on their sum,
- the best on the held-out window itself (an oracle no plan can reach),

beside the default's held-out **GPU** balancedness. Means over layers and held-out workloads.

Run: ``cd bench && python -m research.node_assignment [--quick]``.
"""

from __future__ import annotations

import numpy as np
from _common import markdown_table, run_alone, write_csv
from robust_default import DEEPSEEK, _phase_workloads, _sampled

import eplb

ROWS = ("default plan, GPU", "default plan's assignment, node", "best on the planning windows, node",
        "best on their sum, node", "oracle: best on the held-out window, node")


def pairings(items: list[int]) -> list[list[tuple[int, int]]]:
    """Every way to split ``items`` (even length) into unordered pairs."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    return [[(first, mate)] + tail for i, mate in enumerate(rest) for tail in pairings(rest[:i] + rest[i + 1:])]


def node_balancedness(group_loads: np.ndarray, node_of_group: np.ndarray, num_nodes: int) -> np.ndarray:
    """``group_loads [..., K]`` and ``node_of_group [A, K]`` -> ``[A, ...]`` mean / max node load."""
    one_hot = np.eye(num_nodes)[node_of_group]  # [A, K, N]
    loads = np.einsum("...k,akn->a...n", group_loads, one_hot)
    peak = loads.max(axis=-1)
    return np.divide(loads.mean(axis=-1), peak, out=np.ones_like(peak), where=peak > 0)


def held_out_rows(series: np.ndarray, deployment: eplb.Deployment) -> dict[str, list[float]]:
    """Leave each window of ``series [T, L, E]`` out: the five scores (module docstring) per window."""
    groups, nodes = deployment.num_groups, deployment.num_nodes
    assignments = np.array([[next(n for n, pair in enumerate(p) if k in pair) for k in range(groups)]
                            for p in pairings(list(range(groups)))])  # [A, K]
    slots_per_node = deployment.num_slots // nodes
    out = {name: [] for name in ROWS}
    for left_out in range(series.shape[0]):
        planning, served = np.delete(series, left_out, axis=0), series[left_out]
        placement = eplb.plan(planning, deployment)
        out[ROWS[0]].append(float(placement.balancedness(served).mean()))
        by_group = planning.reshape(planning.shape[:2] + (groups, -1)).sum(axis=-1)  # [T, L, K]
        served_groups = served.reshape(served.shape[0], groups, -1).sum(axis=-1)  # [L, K]
        first = np.argmax(placement.phy2log[:, :, None] == np.arange(0, deployment.num_experts,
                                                                      deployment.num_experts // groups), axis=1)
        node_load = np.zeros((served_groups.shape[0], nodes))  # [L, N] under the default's own assignment
        np.add.at(node_load, (np.arange(served_groups.shape[0])[:, None], first // slots_per_node), served_groups)
        peak = node_load.max(axis=1)
        out[ROWS[1]].append(float(np.divide(node_load.mean(axis=1), peak, out=np.ones_like(peak), where=peak > 0).mean()))
        served_all = node_balancedness(served_groups, assignments, nodes)  # [A, L]
        on_windows = node_balancedness(by_group, assignments, nodes).mean(axis=1)  # [A, L]
        on_sum = node_balancedness(by_group.sum(axis=0), assignments, nodes)  # [A, L]
        layers = np.arange(served_all.shape[1])
        out[ROWS[2]].append(float(served_all[on_windows.argmax(axis=0), layers].mean()))
        out[ROWS[3]].append(float(served_all[on_sum.argmax(axis=0), layers].mean()))
        out[ROWS[4]].append(float(served_all.max(axis=0).mean()))
    return out


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: the scores above, same phase and phases mixed."""
    size = dict(num_layers=8, num_experts=64, num_groups=8) if quick else DEEPSEEK
    deployment = (eplb.Deployment.of(64, num_slots=80, num_gpus=16, num_nodes=4, num_groups=8) if quick else
                  eplb.Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8))
    phases = _sampled(_phase_workloads(1, **size), seed=2)
    rows, table = [], []
    for family, series in (("same phase (6 workloads)", phases[:6]), ("phases mixed (12 workloads)", phases)):
        scores = held_out_rows(series, deployment)
        for name in ROWS:
            rows.append({"family": family, "score": name, "mean": round(float(np.mean(scores[name])), 4),
                         "worst": round(float(np.min(scores[name])), 4)})
            table.append((family, name, f"{np.mean(scores[name]):.4f}", f"{np.min(scores[name]):.4f}"))
    write_csv(results_dir / "node_assignment.csv", rows)
    size_text = "64 experts, 80 slots / 16 GPUs" if quick else "256 experts, 288 slots / 32 GPUs"
    return "\n".join([
        "## Node assignment (hierarchical, held out)", "",
        f"DeepSeek-V3-sized workloads ({size_text}, 4 nodes, 8 groups), leave one workload out; "
        "balancedness of the held-out window, mean and worst over the workloads left out.", "",
        markdown_table(("family", "score", "mean", "worst"), table)])


if __name__ == "__main__":
    run_alone(run, __doc__)

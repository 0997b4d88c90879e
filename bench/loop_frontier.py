"""Loop frontier: how close to the free re-plan limit a rebalancing policy gets for how many weight copies.

The loop targets ask the Balancer for two things at once on the held-out drifting series (the
Simulate section's DeepSeek-V3-sized synthetic one): MoE time lost within 1.05x (hierarchical) or
1.5x (global) of re-planning every block for free, with at most 0.25x the copies of the engines'
fewest-copying timer. This section measures the trade-off between the two along several policies,
all deciding every :data:`CHECK` passes (the Balancer's check interval):

- the Balancer with its defaults, with a lower or higher ``copy_cost`` (its hedged search charges
  each changed slot this much, in mean ``peak / mean``), with a budget of changed slots per layer
  (the budgets of ``bench/decision_rule.py``), or with no move limit at all;
- a *clairvoyant* planner that knows the next :data:`CHECK` passes exactly and plans for them
  (hedged over 10 sub-windows), near the placement in service with a move budget per layer, or
  from scratch. No online policy knows the future, so at a given budget these rows show what eplb's
  planner could reach with a perfect forecast: if even they miss a target, better forecasting or
  deciding cannot meet it, only a better planner near the placement in service.

Copies are priced as a stall (H100, DeepSeek-V3 weights) for the Balancer's decisions; "MoE time
lost" excludes the stalls (the targets' measure) and "with stalls" includes them.

Run: ``python bench/loop_frontier.py [--quick]`` (results in ``bench/results/loop_frontier.{csv,md}``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
from _common import load_note, markdown_table, read_csv, run_alone, write_csv, write_section
from simulate import BLOCK, DS, QUICK_BLOCKS, TARGETS, TOKENS, Cached, scenarios
from simulate import policies as simulate_policies

from eplb import Balancer, BalancerPolicy, Deployment, Policy, plan, simulate
from eplb.model.defaults import BALANCER_TOLERANCE

CHECK = 100  # passes between decisions (the Balancer's check interval in the Simulate section)
SUBWINDOWS = 10  # the clairvoyant plans hedge over the next CHECK passes in this many sub-windows
DEPLOYMENTS = {"global 288/32": Deployment.of(256, **DS), "hierarchical 4 nodes": Deployment.of(256, **DS, num_groups=8)}
# the Balancer's tolerance at 9 slots per GPU (its default follows the slots per GPU: "auto")
BALANCER_DEFAULTS = {"copy_cost": inspect.signature(Balancer).parameters["copy_cost"].default,
                     "tolerance": BALANCER_TOLERANCE}
BUDGETS = (2, 4, 8)  # slots per layer a near plan may change (the Balancer rows take 4 and 8)


class Clairvoyant(Policy):
    """Every ``every`` passes, plan for the next ``every`` passes of ``counts`` (known in advance),
    hedged over :data:`SUBWINDOWS` sub-windows: near the placement in service with ``plan``'s
    migration options (``near``), or from scratch (``near=None``)."""

    def __init__(self, counts: np.ndarray, every: int, near: dict | None, name: str):
        self.counts, self.every, self.near, self.name = counts, every, near, name

    def start(self, placement, deployment) -> None:
        self.deployment, self.current = deployment, placement

    def observe(self, step: int, counts: np.ndarray):
        if (step + 1) % self.every:
            return None
        future = self.counts[step + 1: step + 1 + self.every].astype(np.float64)
        if len(future) < self.every:
            return None
        parts = min(SUBWINDOWS, self.every)
        windows = np.add.reduceat(future, np.linspace(0, self.every, parts + 1).astype(int)[:-1], axis=0)
        options = {} if self.near is None else dict(self.near, previous=self.current)
        self.current = plan(windows, topology=self.deployment.topology, num_groups=self.deployment.num_groups,
                            **options)
        return self.current


def policies(counts: np.ndarray, every: int) -> list[tuple[str, str, object, bool]]:
    """``(key, family, policy, copies_free)`` in the order of the table."""
    balancer = lambda label, **options: BalancerPolicy(check_every=every, name=label, **options)  # noqa: E731
    # the limit and the engines' timers exactly as the Simulate section runs them
    families = {"reference": "limit", "vllm": "engine timer", "sglang": "engine timer"}
    out = [(key, families[key], policy, free) for key, policy, free in simulate_policies() if key in families]
    out += [
        ("balancer", "Balancer", balancer("defaults (copy_cost {copy_cost}, tolerance {tolerance})".format(**BALANCER_DEFAULTS)), False),
        ("balancer_copy_cost_0.002", "Balancer", balancer("copy_cost 0.002", copy_cost=0.002), False),
        ("balancer_copy_cost_0.0002", "Balancer", balancer("copy_cost 0.0002", copy_cost=0.0002), False),
        *[(f"balancer_budget_{b}", "Balancer", balancer(f"at most {b} slots per layer, tolerance 0", tolerance=0.0,
                                                         max_moves=b), False) for b in BUDGETS[1:]],
        ("balancer_unlimited", "Balancer", balancer("copy_cost 0, no move limit, min_gain 0", copy_cost=0.0,
                                                    tolerance=None, max_moves=DS["num_slots"], min_gain=0.0), False),
    ]
    out += [(f"clairvoyant_budget_{b}", "clairvoyant", Clairvoyant(counts, every, dict(tolerance=None, max_moves=b),
                                                                   f"near, at most {b} slots per layer"), False)
            for b in BUDGETS]
    out += [("clairvoyant_tolerance", "clairvoyant", Clairvoyant(
                counts, every, dict(tolerance=BALANCER_DEFAULTS["tolerance"]),
                f"near, tolerance {BALANCER_DEFAULTS['tolerance']} (the Balancer's)"), False),
            ("clairvoyant_scratch", "clairvoyant", Clairvoyant(counts, every, None, "from scratch"), False)]
    return out


def measure(blocks: int, every: int) -> list[dict]:
    scenario = scenarios(blocks)[0][0]  # the held-out DeepSeek-V3-sized synthetic series
    data = Cached(scenario["data"])
    rows = []
    for deployment_name, deployment in DEPLOYMENTS.items():
        for key, family, policy, free in policies(data.counts, every):
            cost = scenario["cost"].with_(copy_mode="free") if free else scenario["cost"]
            summary = simulate(data, deployment, policy=policy, cost_model=cost, initial_steps=BLOCK).summary()
            rows.append({"deployment": deployment_name, "key": key, "family": family, "policy": summary["policy"],
                         "lost_share": round(summary["lost_share"], 5),
                         "lost_with_stalls_share": round(summary["lost_with_stalls_share"], 5),
                         "rebalances": summary["rebalances"], "copies": summary["copies"]})
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with ``x_limit`` (time lost / the reference's) and ``x_fewest`` (copies / the engine
    timers' fewest), per deployment."""
    out = []
    for deployment in dict.fromkeys(r["deployment"] for r in rows):
        get = {r["key"]: r for r in rows if r["deployment"] == deployment}
        limit = float(get["reference"]["lost_share"])
        fewest = min(int(get["vllm"]["copies"]), int(get["sglang"]["copies"]))
        for r in get.values():
            out.append({**r, "x_limit": float(r["lost_share"]) / limit if limit > 0 else float("inf"),
                        "x_fewest": int(r["copies"]) / fewest if fewest else float("inf")})
    return out


def ratio(value: float) -> str:
    """A ratio for the table (``n/a`` when its denominator was zero: no copies, or no time lost)."""
    return f"{value:.2f}" if np.isfinite(value) else "n/a"


def candidates(rows: list[dict], deployment: str) -> list[dict]:
    """The rows of ``deployment`` that the targets judge: the Balancer's and the clairvoyant planner's."""
    return [r for r in rows if r["deployment"] == deployment and r["family"] in ("Balancer", "clairvoyant")]


def time_target(deployment: str) -> float:
    """The issue's bound on time lost, as a multiple of the limit's, for ``deployment``."""
    return TARGETS["reference_ratio_hierarchical" if "hierarchical" in deployment else "reference_ratio_global"]


def least_lost_within_copies(rows: list[dict]) -> dict | None:
    """The row of ``rows`` with the least time lost among those within the copy target."""
    cheap = [r for r in rows if r["x_fewest"] <= TARGETS["copies_ratio"]]
    return min(cheap, key=lambda r: r["x_limit"]) if cheap else None


def verdicts(rows: list[dict]) -> list[str]:
    """Per deployment: the fewest copies any measured policy needed to reach the time target, and
    the least time lost within the copy target."""
    lines = []
    for deployment in dict.fromkeys(r["deployment"] for r in rows):
        mine, target, copies = candidates(rows, deployment), time_target(deployment), TARGETS["copies_ratio"]
        if not any(np.isfinite(r["x_fewest"]) for r in mine):
            lines.append(f"- {deployment}: the engine timers made no copies (series shorter than their interval)")
            continue
        reach = [r for r in mine if r["x_limit"] <= target]
        fewest = min(reach, key=lambda r: r["x_fewest"]) if reach else None
        cheap = least_lost_within_copies(mine)
        both = [r for r in reach if r["x_fewest"] <= copies]
        lines.append("".join([
            f"- {deployment}: ",
            f"within {target}x the limit, the fewest copies: {fewest['x_fewest']:.2f}x the timers' fewest "
            f"({fewest['family']}, {fewest['policy']}); " if fewest else f"no measured policy within {target}x the limit; ",
            f"within {copies}x the copies, the least time lost: {cheap['x_limit']:.2f}x the limit "
            f"({cheap['family']}, {cheap['policy']}); " if cheap else f"no measured policy within {copies}x the copies; ",
            "both targets at once: " + ("met by " + ", ".join(f"{r['family']} {r['policy']}" for r in both)
                                        if both else "no measured policy, clairvoyant ones included"),
        ]))
    return lines


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline row: the hierarchical frontier against the joint target."""
    path = Path(results_dir) / "loop_frontier.csv"
    if not path.exists():
        return []
    rows = [{**r, "x_limit": float(r["x_limit"]), "x_fewest": float(r["x_fewest"])} for r in read_csv(path)]
    deployment = "hierarchical 4 nodes"
    best = least_lost_within_copies(candidates(rows, deployment))
    if best is None:
        return []
    target = time_target(deployment)
    return [("Loop frontier, hierarchical 4 nodes: least time lost within 0.25x the timers' copies, any policy "
             "(clairvoyant included)", f"{best['x_limit']:.2f}x the free re-plan limit ({best['family']}, {best['policy']})",
             f"<= {target}x at <= 0.25x copies: {'met' if best['x_limit'] <= target else 'not met'}")]


def run(quick: bool, results_dir: Path, *, blocks: int | None = None, every: int = CHECK) -> str:
    """The section's markdown; ``blocks`` and ``every`` override the sizes (tests)."""
    blocks = blocks or (QUICK_BLOCKS if quick else 900)
    rows = with_ratios(measure(blocks, every))
    write_csv(results_dir / "loop_frontier.csv", [{**r, "x_limit": round(r["x_limit"], 4),
                                                   "x_fewest": round(r["x_fewest"], 4)} for r in rows])
    table = markdown_table(
        ["deployment", "family", "policy", "MoE time lost", "x limit", "with stalls", "rebalances", "copies",
         "x timers' fewest"],
        [(r["deployment"], r["family"], r["policy"], f"{100 * r['lost_share']:.2f}%", ratio(r["x_limit"]),
          f"{100 * r['lost_with_stalls_share']:.2f}%", r["rebalances"], r["copies"], ratio(r["x_fewest"]))
         for r in rows])
    text = "\n".join([
        "## Loop frontier: time lost against copies, the Balancer and a clairvoyant planner",
        "",
        f"The Simulate section's held-out DeepSeek-V3-sized synthetic series ({blocks} blocks of {BLOCK} passes of "
        f"{TOKENS} tokens), every policy deciding every {every} passes from the greedy plan of the first block; the "
        f"clairvoyant rows plan for the next {every} passes exactly (hedged over {min(SUBWINDOWS, every)} "
        f"sub-windows). Limit: re-planning every block from the block before, copies free. {load_note()}.",
        "",
        table,
        "",
        "Targets (time lost <= 1.05x the limit hierarchical, <= 1.5x global; copies <= 0.25x the timers' fewest):",
        *verdicts(rows),
        "",
    ])
    return write_section(results_dir, "loop_frontier", text)


if __name__ == "__main__":
    run_alone(run, __doc__)

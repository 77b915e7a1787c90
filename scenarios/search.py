"""The planner's search: which candidates to simulate, at which loads, in rounds.

Target rate T (`plan.target.rate`). A candidate's answer is its smallest unit count n whose
unit, seeing 1/n of the cluster's stream, passes a steady-state probe (scenarios/probe.py); its
cost is n x GPUs per unit x price. Branch and bound over the candidates:

  1. bound: each candidate's capacity bound (scenarios/bounds.py) gives the fewest units it could
     need, n_lb = ceil(T / bound), and so a lower bound on its cost;
  2. rounds: candidates whose cost bound is within the best cost found so far propose one unit
     count each (the probes of a round run in parallel): with a best cost known, first the most
     units that would still not cost more (a fail there settles the candidate as dearer in one
     probe), then bisection down to the least passing n; with none known yet, n_lb and upward
     (a few candidates at a time, cheapest bound first);
  3. refine: the candidates shown (the best costs) get their capacity bracketed more finely, by
     probes of their n units at more than T (headroom = the highest passing total rate / T);
  4. confirm (scenarios/plan.py): a cluster simulation of the winner and the alternatives.

Fixed GPU budget G (`plan.target.gpus`): a candidate runs floor(G / GPUs per unit) units, and
its answer is the highest total rate those units pass, found by geometric bisection from its
bound down; rounds skip candidates whose bound cannot beat the best rate found.

Every decision depends only on the results of earlier rounds, so the search makes the same
probes whether they run inline, in local processes or on Ray.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from scenarios.probe import confirm, probe

PROBE = "scenarios.search:probe_task"
CONFIRM = "scenarios.search:confirm_task"


def probe_task(t: dict) -> dict:
    return probe(t["data"], t["base_dir"], t["total_rate"], t["units"], t["slo"], t["search"], t["out_len"])


def confirm_task(t: dict) -> dict:
    return confirm(t["data"], t["base_dir"], t["rate"], t["slo"], t["search"], t["out_len"])


@dataclass
class State:
    """The search's knowledge of one candidate."""

    key: int
    bound: float            # req/s per unit (upper bound)
    unit_cost: float        # $/h per unit
    max_units: int          # the search never goes past this many units
    fail_n: int = 0         # largest unit count known (or bounded) to fail
    pass_n: int | None = None
    step: int = 1           # galloping step while no pass is known
    probes: dict = field(default_factory=dict)   # (total_rate, units) -> probe result
    done: str | None = None  # why the search of this candidate ended
    lo: float | None = None  # refine / budget mode: highest passing total rate
    hi: float | None = None  # lowest failing (or bounded) total rate
    refined_n: int | None = None  # the unit count lo and hi were bracketed for

    @property
    def cost(self) -> float | None:
        return None if self.pass_n is None else self.pass_n * self.unit_cost

    @property
    def cost_lb(self) -> float:
        return (self.fail_n + 1) * self.unit_cost


def _record(s: State, total: float, units: int, res: dict) -> None:
    s.probes[(round(total, 9), units)] = res


def next_units(s: State, best: float) -> int | None:
    """The unit count to probe next, or None when the candidate is settled (sets s.done)."""
    if s.pass_n is not None and s.pass_n - s.fail_n <= 1:
        s.done = s.done or "exact"
        return None
    cap = math.floor(best / s.unit_cost + 1e-9) if math.isfinite(best) else s.max_units
    cap = min(cap, s.max_units)
    if cap <= s.fail_n:  # no unit count it has left to try costs less than the best
        s.done = "infeasible" if s.pass_n is None and s.fail_n >= s.max_units else "dearer"
        return None
    if s.pass_n is None:
        return cap if math.isfinite(best) else min(s.fail_n + s.step, cap)
    if cap < s.pass_n - 1:  # only counts up to cap could beat the best: try the largest first
        return cap
    return (s.fail_n + s.pass_n) // 2


def search_rate(states: list[State], target: float, run_probes, first_wave: int) -> None:
    """Rounds of probes until every candidate whose cost bound is within the best is settled.
    run_probes([(state, total_rate, units)]) -> results, in order."""
    order = sorted(states, key=lambda s: (s.cost_lb, -s.bound, s.key))
    best = math.inf
    while True:
        if math.isfinite(best):
            active = [s for s in order if s.done is None and s.cost_lb <= best + 1e-9]
        else:
            active = [s for s in order if s.done is None][:first_wave]
        for s in order:  # candidates that cannot beat the best any more
            if s.done is None and s not in active and math.isfinite(best) and s.cost_lb > best + 1e-9:
                s.done = "dearer"
        if not active:
            return
        asks = []
        for s in active:
            n = next_units(s, best)
            if n is not None:
                asks.append((s, target, n))
        if not asks:
            continue
        for (s, total, n), res in zip(asks, run_probes(asks)):
            _record(s, total, n, res)
            if res["ok"]:
                s.pass_n = n if s.pass_n is None else min(s.pass_n, n)
            else:
                s.fail_n = max(s.fail_n, n)
                s.step *= 2
        costs = [s.cost for s in states if s.cost is not None]
        best = min(costs) if costs else math.inf


def refine(states: list[State], target: float, run_probes, steps: int, rel_tol: float) -> None:
    """Bracket the total rate each state's pass_n units sustain: lo >= target (its own pass),
    hi from its failing unit count (or its bound), `steps` rounds of geometric bisection."""
    for s in states:
        s.refined_n = s.pass_n
        s.lo = target
        s.hi = (target * s.pass_n / s.fail_n if s.fail_n >= 1 and (round(target, 9), s.fail_n) in s.probes
                else s.bound * s.pass_n)
    for _ in range(steps):
        asks = [(s, math.sqrt(s.lo * s.hi), s.pass_n) for s in states if s.hi / s.lo > 1 + rel_tol]
        if not asks:
            return
        for (s, total, n), res in zip(asks, run_probes(asks)):
            _record(s, total, n, res)
            if res["ok"]:
                s.lo = total
            else:
                s.hi = total


def search_budget(states: list[State], units: dict[int, int], run_probes, rel_tol: float,
                  min_rate: float) -> None:
    """Fixed GPU budget: per state, the highest total rate its units[key] units pass (lo), with
    the lowest failing rate (hi); candidates whose bound cannot beat the best lo are skipped."""
    for s in states:
        s.hi = s.bound * units[s.key]
        s.lo = None
    order = sorted(states, key=lambda s: (-s.hi, s.key))
    while True:
        best = max((s.lo for s in states if s.lo is not None), default=0.0)
        asks = []
        for s in order:
            if s.done is not None:
                continue
            if best > 0 and s.hi <= best * (1 + rel_tol) and (s.lo is None or s.lo < best):
                s.done = "lower"   # cannot carry more than the best found
                continue
            if s.lo is not None and s.hi / s.lo <= 1 + rel_tol:
                s.done = "exact"
                continue
            if s.lo is None:
                r = s.hi / 2 if best <= 0 else min(best * (1 + rel_tol), s.hi / (1 + rel_tol / 2))
                if r < min_rate:
                    s.done = "infeasible"
                    continue
            else:
                r = math.sqrt(s.lo * s.hi)
            asks.append((s, r, units[s.key]))
        if not asks:
            return
        for (s, total, n), res in zip(asks, run_probes(asks)):
            _record(s, total, n, res)
            if res["ok"]:
                s.lo = total if s.lo is None else max(s.lo, total)
            else:
                s.hi = min(s.hi, total)


__all__ = ["State", "search_rate", "refine", "search_budget", "next_units", "probe_task", "confirm_task",
           "PROBE", "CONFIRM"]

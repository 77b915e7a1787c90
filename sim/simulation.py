"""A deployment under a workload, on SimPy's clock: arrivals, a router, replicas, results."""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from heapq import heappush
from operator import attrgetter
from pathlib import Path

import numpy as np
import simpy
from simpy.events import NORMAL, Event

from engine.core import SchedulerConfig
from engine.core.records import STEP_COLUMNS, RequestRecord
from sim.metrics import request_table, summarize, write_csv
from sim.replica import Replica, SimRequest

ROUTERS = ("round_robin", "random", "least_outstanding", "prefix_affinity")


class TimeoutAt(Event):
    """Like simpy's Timeout, but at an absolute time: k steady steps run back to back then end
    at exactly the float a chain of k single-step timeouts would reach (SimPy adds now + delay)."""

    def __init__(self, env: simpy.Environment, at: float) -> None:
        self.env = env
        self.callbacks = []
        self._value = None
        self._ok = True
        heappush(env._queue, (at, NORMAL, next(env._eid), self))  # simpy's own schedule(), absolute


@dataclass
class SimResult:
    """`requests` and `steps` are pandas DataFrames (built on first use from the column tables;
    the command line never needs pandas)."""

    request_table: dict
    step_table: dict
    summary: dict
    records: list[RequestRecord] = field(repr=False, default_factory=list)
    itl: tuple = field(repr=False, default=(np.empty(0), None))
    _frames: dict = field(repr=False, default_factory=dict)

    @property
    def requests(self):
        if "requests" not in self._frames:
            import pandas as pd
            self._frames["requests"] = pd.DataFrame(self.request_table)
        return self._frames["requests"]

    @property
    def steps(self):
        if "steps" not in self._frames:
            import pandas as pd
            self._frames["steps"] = pd.DataFrame(self.step_table)
        return self._frames["steps"]

    def save(self, out_dir: str | Path, plots: bool = True) -> Path:
        import json
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "summary.json", "w") as f:
            json.dump(self.summary, f, indent=1, default=float)
        write_csv(self.request_table, out / "requests.csv")
        write_csv(self.step_table, out / "steps.csv")
        if plots:
            from sim.plots import write_plots
            write_plots(self, out)
        return out


class Simulation:
    def __init__(self, workload, scheduler_config: SchedulerConfig, cost_model, num_replicas: int = 1,
                 router: str = "round_robin", seed: int = 0, use_steady: bool = True,
                 keep_token_times: bool = False, keep_steps: bool = True, progress: bool = False,
                 slo: dict | None = None, max_time_s: float | None = None) -> None:
        if router not in ROUTERS:
            raise ValueError(f"deployment.router={router!r}: expected one of {list(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"deployment.replicas={num_replicas!r}: must be >= 1")
        self.env = simpy.Environment()
        self.workload = workload
        self.closed_loop = getattr(workload, "closed_loop_concurrency", None)
        # Steady runs are exact when every outside event is known ahead: open-loop arrivals,
        # or a closed loop on one replica (its new arrivals come when its own requests finish,
        # which ends a steady run).
        # A run cut at max_time_s steps one by one: a steady run cannot stop in the middle.
        self.use_steady = (use_steady and (self.closed_loop is None or num_replicas == 1)
                           and max_time_s is None)
        self.keep_token_times = keep_token_times
        self.keep_steps = keep_steps
        self.slo = slo
        self.max_time_s = max_time_s
        self.router = router
        self.rng = np.random.default_rng(seed)
        self.next_arrival_s = math.inf
        self.records: list[RequestRecord] = []
        self.rejections: list[str] = []
        self._rr = 0
        self._done = 0
        self._issued = 0
        self._total = len(workload)
        self._iter = iter(workload)
        self._bar = None
        self._progress = progress
        self.replicas = [Replica(self, i, scheduler_config, cost_model) for i in range(num_replicas)]
        self._all_done = self.env.event()

    def timeout_at(self, at: float) -> Event:
        return TimeoutAt(self.env, at)

    # --------------------------------------------------------------- arrivals
    def _open_loop(self):
        env = self.env
        for spec in self._iter:
            self.next_arrival_s = spec.arrival_s
            if spec.arrival_s > env.now:
                yield self.timeout_at(spec.arrival_s)
            self._dispatch(spec, spec.arrival_s)
        self.next_arrival_s = math.inf

    def _dispatch(self, spec, arrival_s: float) -> None:
        rec = RequestRecord(spec.request_id, arrival_s, spec.prompt_len)
        self.records.append(rec)
        self._issued += 1
        replica = self._route(spec)
        rec.replica = replica.index
        replica.submit(SimRequest(spec, rec))

    def _route(self, spec) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.router == "round_robin":
            r = reps[self._rr]
            self._rr = (self._rr + 1) % len(reps)
            return r
        if self.router == "random":
            return reps[int(self.rng.integers(len(reps)))]
        if self.router == "least_outstanding":
            return min(reps, key=lambda r: (r.outstanding, r.index))
        # prefix_affinity: requests opening with the same content go to the same replica
        key = spec.segments[0][0] if spec.segments else hash(spec.request_id)
        return reps[hash(key) % len(reps)]

    def on_finish(self, replica: Replica, sreq: SimRequest, error: str | None) -> None:
        replica.outstanding -= 1
        self._done += 1
        if error is not None:
            self.rejections.append(f"{sreq.spec.request_id}: {error}")
        if self._bar is not None:
            self._bar.update(1)
        if self.closed_loop is not None:
            spec = next(self._iter, None)
            if spec is not None:
                self._dispatch(spec, self.env.now)
        if self._done >= self._total:
            if not self._all_done.triggered:
                self._all_done.succeed()

    # -------------------------------------------------------------------- run
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        if self._progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self._total, unit="req", desc="simulating", mininterval=0.5)
        if self.closed_loop is None:
            self.env.process(self._open_loop())
        else:
            for _ in range(min(self.closed_loop, self._total)):
                spec = next(self._iter, None)
                if spec is None:
                    break
                self._dispatch(spec, 0.0)
        until = self._all_done if self.max_time_s is None else simpy.AnyOf(
            self.env, [self._all_done, self.env.timeout(self.max_time_s)])
        if self._total:
            # The run allocates millions of short-lived objects and (almost) no cycles: the
            # cyclic collector would only walk the growing heap again and again.
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                self.env.run(until=until)
            finally:
                if gc_was_on:
                    gc.enable()
        if self._bar is not None:
            self._bar.close()
        return self.collect(time.perf_counter() - wall0)

    def collect(self, wall_s: float) -> SimResult:
        table = request_table(self.records)
        steps = [s for r in self.replicas for s in r.steps]
        # One C-level getter per record, transposed by zip: columns without a loop per cell.
        cols = list(zip(*map(attrgetter(*STEP_COLUMNS), steps))) if steps else [()] * len(STEP_COLUMNS)
        step_table = {c: np.array(v) for c, v in zip(STEP_COLUMNS, cols)}
        vals, weights = [], []
        for r in self.replicas:
            v, w = r.itl_sample()
            vals.append(v)
            weights.append(w)
        itl = (np.concatenate(vals), np.concatenate(weights))
        preemptions = sum(r.scheduler.num_preemptions for r in self.replicas)
        cut = self.max_time_s is not None and not self._all_done.triggered
        summary = summarize(table, itl[0], itl[1], self.slo, preemptions,
                            end_s=float(self.env.now) if cut else None)
        summary["simulated_s"] = float(self.env.now)
        summary["wall_s"] = wall_s
        summary["num_steps"] = int(sum(r.step_idx for r in self.replicas))
        if steps:
            kv = step_table["kv_usage"]
            span = step_table["end_s"] - step_table["start_s"]
            summary["kv_usage"] = {"mean": float(np.average(kv, weights=span + 1e-15)), "max": float(kv.max())}
        return SimResult(table, step_table, summary, self.records, itl)

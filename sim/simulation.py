"""A deployment under a workload, on SimPy's clock: clients, a router, replicas, results.

Clients (sim/clients.py): a request is sent when its arrival is due and, with a concurrency cap
(closed loop, or a benchmark's max concurrency), when a slot is free, after the client's
turnaround; it reaches the engine after the API server's HTTP handling and tokenization (one
request at a time, in send order), and every token reaches the client `output_s` after its step
ends. Record times are the client's: arrival_s is the send, token and finish times are when the
client has them (collect() adds output_s). With the ENGINE_DIRECT client all of these are zero
and requests go straight into the engine.

Warm-up (workload.num_warmup > 0, vllm bench serve --num-warmups / aiperf and genai-perf
--warmup-request-count): the first requests run as a separate phase under the same client, the
measured requests start only when every warm-up response has been read, and warm-up requests
are left out of every metric (their steps stay in steps.csv).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from heapq import heappop, heappush
from operator import attrgetter
from pathlib import Path

import numpy as np
import simpy
from simpy.events import NORMAL, Event

from engine.core import SchedulerConfig
from engine.core import compiled as _compiled
from engine.core.records import STEP_COLUMNS, RequestRecord
from sim.clients import ENGINE_DIRECT, ClientModel, vllm_bench_result
from sim.metrics import itl_from_token_times, request_table, summarize, write_csv
from sim.replica import DataParallelGroup, Replica, SimRequest

ROUTERS = ("round_robin", "random", "least_outstanding", "prefix_affinity")


class Clock(simpy.Environment):
    """SimPy's Environment with timeout_at(at): an event at an absolute time. A fast-forward run of
    k steps must end at exactly the float a chain of k single-step timeouts reaches (the same
    additions, done by the scheduler), or a later arrival and a step end could swap places.
    timeout(at - now) does that almost always (rounded, at - now sums back to at); where the
    difference cannot (now < at / 2 and a rounding tie: no float d has now + d == at), the event
    is scheduled at `at` itself, as Environment.schedule does for now + delay (the one place this
    extension uses SimPy's internals, as its own RealtimeEnvironment does)."""

    def timeout_at(self, at: float) -> Event:
        now = self.now
        if at < now:
            raise ValueError(f"an event at {at!r} s is before the clock ({now!r} s)")
        d = at - now
        if now + d == at:
            return self.timeout(d)
        ev = Event(self)
        ev._ok = True
        ev._value = None
        heappush(self._queue, (at, NORMAL, next(self._eid), ev))
        return ev


def _no_cancellation(workload) -> bool:
    """Whether no request of the workload is cancelled (by a deadline or a disconnect)."""
    after_s = getattr(workload, "cancel_after_s", None)
    after_tokens = getattr(workload, "cancel_after_tokens", None)
    if after_s is None or after_tokens is None:
        return False
    return bool(np.isnan(np.asarray(after_s, dtype=float)).all() and (np.asarray(after_tokens) < 0).all())


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
                 slo: dict | None = None, max_time_s: float | None = None,
                 client: ClientModel | None = None, data_parallel: int = 1, api_servers: int = 1) -> None:
        """`data_parallel` > 1: each replica is that many data-parallel attention ranks stepping
        together (sim.replica.DataParallelGroup); the router spreads requests over all ranks.
        `api_servers`: the API server processes (each with its own tokenizer) of each replica."""
        if router not in ROUTERS:
            raise ValueError(f"deployment.router={router!r}: expected one of {list(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"deployment.replicas={num_replicas!r}: must be >= 1")
        if data_parallel < 1:
            raise ValueError(f"deployment.data_parallel={data_parallel!r}: must be >= 1")
        if api_servers < 1:
            raise ValueError(f"deployment.api_server_count={api_servers!r}: must be >= 1")
        if data_parallel > 1:  # ranks, each its own engine, in lock-step groups: plain steps
            num_replicas *= data_parallel
            use_steady = False
        self.env = Clock()
        self.workload = workload
        self.closed_loop = getattr(workload, "closed_loop_concurrency", None)
        self.client = client or getattr(workload, "client", None) or ENGINE_DIRECT
        self.num_warmup = int(getattr(workload, "num_warmup", 0) or 0)
        # The client's turnaround is the time between reading a response and sending the next
        # request: a closed loop's. An open loop's arrival times are its sends.
        self._think = self.client.think_s > 0 and self.closed_loop is not None
        # Steady runs are exact when every outside event is known ahead: open-loop arrivals,
        # or a closed loop on one replica (its new arrivals come when its own requests finish,
        # which ends a steady run).
        # A run cut at max_time_s steps one by one: a steady run cannot stop in the middle.
        self.use_steady = (use_steady and (self.closed_loop is None or num_replicas == 1)
                           and max_time_s is None)
        # With warm-up, ITL comes from the measured requests' own token times.
        self.keep_token_times = keep_token_times or self.num_warmup > 0
        self.keep_steps = keep_steps
        self.slo = slo
        self.max_time_s = max_time_s
        self.router = router
        self.rng = np.random.default_rng(seed)
        self._path_rng = np.random.default_rng([seed, 10])  # the client's request-path times
        self.records: list[RequestRecord] = []      # measured requests, in send order
        self.warmup_records: list[RequestRecord] = []
        self.rejections: list[str] = []
        self._rr = 0
        self._done = 0
        self._issued = 0
        self._total = len(workload)
        self._iter = iter(workload)
        # Client side: pending outside events, the next unsent request, slots in use, phase.
        self._timers: list[float] = []   # heap: times at which a send or an engine arrival is due
        self._next = None
        self._exhausted = False
        self._pump_at = None
        self._in_flight = 0
        self._warm_left = self.num_warmup
        self._phase_start = 0.0
        # Each engine's API servers (one tokenizer each, first come first served; a data-parallel
        # group's ranks share their engine's): when each is next free.
        self._ranks_per_engine = data_parallel
        self._frontend_free = [[0.0] * api_servers for _ in range(max(1, num_replicas // data_parallel))]
        self._bar = None
        self._progress = progress
        # Whether a finish can bring an outside event: with an open loop, no warm-up and a router
        # that does not count outstanding requests it cannot (on_finish then only counts), and
        # the replicas' fast steps run on through finishes, reporting them when the run ends.
        self.quiet_finishes = (self.closed_loop is None and self.num_warmup == 0
                               and (num_replicas == 1 or router != "least_outstanding"))
        # Direct feed: with fast steps, one replica with one API server, an open loop and no
        # cancellation, every arrival at the engine is known ahead, in send order (a request's
        # send, then its request path and its turn at the API server's tokenizer), so the
        # replica takes its requests from the workload itself (feed_next_s / feed_take) at its
        # step boundaries, and a fast run goes on through arrivals (FastForwardScheduler.advance's
        # `arrive`) instead of one SimPy event and one run per arrival. Plain steps
        # (steady_decode: false) keep the client path as SimPy events, the reference.
        self.direct_feed = (self.use_steady and self.quiet_finishes and num_replicas == 1
                            and api_servers == 1
                            and not self._think and _no_cancellation(workload))
        self._feed_t = 0.0  # send time of the last request fed (sends keep workload order)
        self._fed_next = None  # (send time, engine arrival time) of the peeked request, once drawn
        self.replicas = [Replica(self, i, scheduler_config, cost_model, start=data_parallel == 1)
                         for i in range(num_replicas)]
        self.groups = [DataParallelGroup(self, self.replicas[i:i + data_parallel], cost_model)
                       for i in range(0, num_replicas, data_parallel)] if data_parallel > 1 else []
        self._all_done = self.env.event()

    def timeout_at(self, at: float) -> Event:
        return self.env.timeout_at(at)

    # ---------------------------------------------------------------- clients
    @property
    def next_arrival_s(self) -> float:
        """The earliest pending outside event (a send or an engine arrival): steady runs stop there."""
        return self._timers[0] if self._timers else math.inf

    def _at(self, t: float, fn) -> None:
        """Call fn() at time t, and count t as a pending outside event until then."""
        heappush(self._timers, t)
        ev = self.timeout_at(t)
        ev.callbacks.append(lambda _e: (heappop(self._timers), fn()))

    def _peek(self):
        if self._next is None and not self._exhausted:
            self._next = next(self._iter, None)
            self._exhausted = self._next is None
        return self._next

    def _fed_times(self, spec) -> tuple[float, float]:
        """Direct feed: (send time, time it reaches the engine) of the peeked request, as _pump
        and _send make them: sent when due and after every request before it; then its request
        path (drawn once, in send order, from the same stream) and its turn at the tokenizer."""
        if self._fed_next is None:
            t = spec.arrival_s
            if t < self._feed_t:
                t = self._feed_t
            self._fed_next = (t, self._reaches_engine(t, spec, 0))
        return self._fed_next

    def feed_next_s(self) -> float:
        """Direct feed: when the next request reaches the engine (math.inf: none left)."""
        spec = self._peek()
        if spec is None:
            return math.inf
        return self._fed_times(spec)[1]

    def feed_take(self, cutoff: float) -> list:
        """Direct feed: the requests that reached the engine at or before `cutoff`, in workload
        order, each with its record (opened at its send time, as _send opens it)."""
        out = []
        while True:
            spec = self._peek()
            if spec is None:
                return out
            t, t_in = self._fed_times(spec)
            if t_in > cutoff:
                return out
            self._take()
            self._feed_t = t
            self._fed_next = None
            self.replicas[0].outstanding += 1  # as _send counts a request it forwards
            out.append(SimRequest(spec, self._open_record(spec, t, False)))

    def _pump(self) -> None:
        """Send every request that is due and has a free slot (in workload order)."""
        if self.direct_feed:
            return  # the replica takes them itself
        now = self.env.now
        while self.closed_loop is None or self._in_flight < self.closed_loop:
            spec = self._peek()
            if spec is None:
                return
            warm = self._issued < self.num_warmup
            if not warm and self._warm_left > 0:
                return  # measured requests start when every warm-up response is in
            t = spec.arrival_s + self._phase_start if self._phase_start else spec.arrival_s
            if t > now:
                if self._pump_at != t:
                    self._pump_at = t
                    self._at(t, self._pump)
                return
            self._take()
            d = spec.client_delay_s if self._think else 0.0
            if d > 0:
                self._at(now + d, lambda spec=spec, warm=warm: self._send(spec, warm))
            else:
                self._send(spec, warm)

    def _take(self) -> None:
        """The peeked request leaves the workload: sent, and in flight until it finishes."""
        self._next = None
        self._in_flight += 1
        self._issued += 1

    def _open_record(self, spec, sent_s: float, warm: bool) -> RequestRecord:
        """The record of a request sent at sent_s (its arrival time in the metrics)."""
        rec = RequestRecord(spec.request_id, sent_s, spec.prompt_len)
        (self.warmup_records if warm else self.records).append(rec)
        return rec

    def _send(self, spec, warm: bool) -> None:
        """A request leaves the client: the router forwards it to an engine's API server as it is
        sent (its load counts from then), which hands it to the engine after its request path and
        its turn at that server's tokenizer."""
        now = self.env.now
        rec = self._open_record(spec, now, warm)
        replica = self._route(spec)
        rec.replica = replica.index
        replica.outstanding += 1
        if self.client.delays_requests:
            t_in = self._reaches_engine(now, spec, replica.index // self._ranks_per_engine)
            self._at(t_in, lambda: replica.submit(SimRequest(spec, rec), routed=True))
        else:
            replica.submit(SimRequest(spec, rec), routed=True)

    def _reaches_engine(self, sent_s: float, spec, engine: int) -> float:
        """When a request sent at sent_s reaches its engine: after its request path (drawn here,
        in send order) and its turn at a tokenizer of that engine's API servers, first come first
        served, at the server free first."""
        c = self.client
        if not c.delays_requests:
            return sent_s
        free = self._frontend_free[engine]
        i = free.index(min(free))
        start = max(sent_s + c.request_path(self._path_rng), free[i])
        free[i] = t_in = start + c.tokenize_s_per_token * spec.prompt_len
        return t_in

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
        out = self.client.output_s
        # Only a closed loop's sends, and the end of a warm-up, wait for the client to read a
        # response; an open loop's do not, so its reads need no event of their own.
        if out > 0 and (self.closed_loop is not None or self._warm_left > 0):
            self._at(self.env.now + out, self._response_read)
        else:
            self._response_read()
        if self._done >= self._total:
            if not self._all_done.triggered:
                self._all_done.succeed()

    def _response_read(self) -> None:
        """The client has read a response to its end: its slot frees (and the warm-up may end)."""
        self._in_flight -= 1
        if self._warm_left > 0:
            self._warm_left -= 1
            if self._warm_left == 0:
                self._phase_start = self.env.now
        self._pump()

    # -------------------------------------------------------------------- run
    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        if self._progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self._total, unit="req", desc="simulating", mininterval=0.5)
        self._pump()
        until = self._all_done if self.max_time_s is None else simpy.AnyOf(
            self.env, [self._all_done, self.env.timeout(self.max_time_s)])
        # The run and its summary allocate millions of short-lived objects and (almost) no
        # cycles: the cyclic collector would only walk the growing heap again and again.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            if self._total:
                self.env.run(until=until)
            if self._bar is not None:
                self._bar.close()
            return self.collect(time.perf_counter() - wall0)
        finally:
            if gc_was_on:
                gc.enable()

    def _client_times(self) -> None:
        """Token and finish times as the client reads them: output_s after the engine's."""
        d = self.client.output_s
        if d <= 0:
            return
        for rec in self.records:
            if rec.first_token_s is not None:
                rec.first_token_s += d
                rec.last_token_s += d
            if rec.finish_s is not None:
                rec.finish_s += d
            if rec.token_times_s:
                rec.token_times_s = [t + d for t in rec.token_times_s]

    def _client_summary(self, summary: dict) -> None:
        c = self.client
        # http_s and output_s are latencies, not work on a shared process: only tokenization is
        # queued (first come, first served), so only its load is a load
        # The busiest engine's API servers', per server (a request takes the server free first,
        # so they share the work).
        busy = [0.0] * len(self._frontend_free)
        for r in self.records:
            busy[r.replica // self._ranks_per_engine] += c.tokenize_s_per_token * r.num_prompt_tokens
        per_server = max(b / len(f) for b, f in zip(busy, self._frontend_free))
        summary["client"] = {**c.describe(), "turnaround_applied": self._think,
                             "warmup_requests": len(self.warmup_records),
                             "api_servers_per_engine": len(self._frontend_free[0]),
                             "tokenizer_busy_fraction": per_server / summary["duration_s"]}

    def _all_replicas(self) -> list[Replica]:
        """Every replica whose steps, ITL and preemptions the results count."""
        return self.replicas

    def _extra_itl(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Inter-token gaps outside any one replica's books (values, weights), or None."""
        return None

    def collect(self, wall_s: float) -> SimResult:
        self._client_times()
        table = request_table(self.records)
        reps = self._all_replicas()
        steps = [s for r in reps for s in r.steps]
        # One C-level getter per record, transposed by zip: columns without a loop per cell.
        cols = list(zip(*map(attrgetter(*STEP_COLUMNS), steps))) if steps else [()] * len(STEP_COLUMNS)
        step_table = {c: np.array(v) for c, v in zip(STEP_COLUMNS, cols)}
        extra = self._extra_itl()
        vals, weights = ([extra[0]], [extra[1]]) if extra is not None else ([], [])
        for r in reps:
            v, w = r.itl_sample()
            vals.append(v)
            weights.append(w)
        itl = (np.concatenate(vals), np.concatenate(weights))
        if self.warmup_records:
            itl = itl_from_token_times(self.records)
        preemptions = sum(r.scheduler.num_preemptions for r in reps)
        cut = self.max_time_s is not None and not self._all_done.triggered
        summary = summarize(table, itl[0], itl[1], self.slo, preemptions,
                            end_s=float(self.env.now) if cut else None)
        self._client_summary(summary)
        if getattr(self.workload, "benchmark", None) is not None:
            summary["vllm_bench"] = vllm_bench_result(table, itl[0], itl[1], summary)
        summary["simulated_s"] = float(self.env.now)
        summary["wall_s"] = wall_s
        summary["engine_core_build"] = _compiled.build_name()
        summary["num_steps"] = int(sum(r.step_idx for r in reps))
        if steps:
            kv = step_table["kv_usage"]
            span = step_table["end_s"] - step_table["start_s"]
            summary["kv_usage"] = {"mean": float(np.average(kv, weights=span + 1e-15)), "max": float(kv.max())}
        return SimResult(table, step_table, summary, self.records, itl)

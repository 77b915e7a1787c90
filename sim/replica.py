"""One simulated engine replica: the step loop of architecture.md on SimPy's clock.

    loop:  take arrivals and aborts  ->  schedule()  ->  wait cost_model.step_time(features)
           ->  every request that finished its prompt samples a synthetic token  ->  update

Requests end by their workload output length (ignore_eos) or by cancellation.

Speed: the replica asks the scheduler to `advance()` up to the next outside event (an arrival or
a deadline): it takes the steps in which every running request decodes in O(events) per step
instead of O(running requests), with the code of its plain steps, and the replica waits once on
SimPy's clock for all of them. It stops early after a step in which a client hangs up, or in
which a request finished when a finish can bring an outside event (Simulation.quiet_finishes is
false: a closed loop, a warm-up, a load-aware router); otherwise the finishes of a run are
recorded at their steps' ends and reported to the simulation (on_finish) when the run ends.
Timestamps are identical to stepping one by one with schedule() (tests/test_sim.py,
tests/test_sim_fuzz.py check it).

Direct feed (Simulation.direct_feed: fast steps, one replica, an open loop, no cancellation; a
request reaches the engine after its send, its request path and its turn at the API server's
tokenizer, Simulation._fed_times): every arrival is known ahead, so the replica
takes its requests from the workload itself at its step boundaries (with the same cutoff as
the inbox: under async admission, those that came before the start of the step that just
ended), and a fast run goes on through arrivals through advance()'s `arrive` hook; a run then
ends after FEED_RUN_S of simulated time, at a step fast steps cannot take, or when the engine
runs dry. The records equal those of the client path (tests/test_sim.py).

steps.csv: a plain step is one row; the steps of one advance() call are one row with num_steps
> 1 (one row per finish it went on through, and one for the steps after the last) whose feature
columns (num_reqs ... num_preempted) and forward_s are sums over those steps, and num_running,
num_waiting and kv_usage are as after its last step. A row covers the steps between two outside
events, finishes or (direct feed) run ends, so memory is bounded by those, not by the steps;
where rows end depends on the path, and every row is the sum of the plain rows it covers.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Protocol

from engine.core import FastForwardScheduler, Request, RequestStatus, SamplingParams, SchedulerConfig
from engine.core.bookkeeping import Book, Entry
from engine.core.records import RequestRecord, StepRecord



class ReplicaOwner(Protocol):
    """What a replica needs from the simulation that owns it (sim.simulation.Simulation, or the
    P/D simulation): its clock and settings, the direct feed of arrivals, and where finished
    requests go."""

    env: object
    use_steady: bool
    keep_token_times: bool
    keep_steps: bool
    direct_feed: bool
    quiet_finishes: bool
    next_arrival_s: float

    def feed_take(self, until_s: float) -> list: ...

    def feed_next_s(self) -> float: ...

    def timeout_at(self, at_s: float): ...

    def on_finish(self, replica: "Replica", sreq: "SimRequest", error: str | None) -> None: ...

FEED_RUN_S = 1.0  # direct feed: the simulated seconds a fast run covers at most
TOKEN = 1  # the synthetic token every request samples (never an EOS or stop id in the simulator)
_TOKENS = [TOKEN]  # shared, never mutated
_SHARED_SP = SamplingParams(max_tokens=None, ignore_eos=True)


class SimRequest(Entry):
    """Simulator-side state of one request: its workload spec and its bookkeeping entry."""

    __slots__ = ("spec",)

    def __init__(self, spec, record: RequestRecord) -> None:
        super().__init__(record)
        self.spec = spec


def _disconnect_point(r: Request) -> int | None:
    """num_tokens at which a request's client hangs up (steady runs stop there to abort it)."""
    m = r.driver_state.cancel_tokens
    return None if m is None else r.num_prompt_tokens + m


class Replica:
    # The simulator never reads block ids: its KV pools count blocks while no prefix hit is
    # possible (SchedulerConfig.track_block_ids; tests set this True to compare).
    track_block_ids = False

    def __init__(self, sim: ReplicaOwner, index: int, config: SchedulerConfig, cost_model,
                 start: bool = True) -> None:
        """`start=False`: no step loop of its own (a DataParallelGroup steps it with its peers)."""
        self.sim = sim
        self.env = sim.env
        self.index = index
        self.scheduler = FastForwardScheduler(dataclasses.replace(config, track_block_ids=self.track_block_ids))
        self.cost = cost_model
        # A decode-only step's time without building its features, where the cost model has it.
        self._decode_time = cost_model.decode_step_time
        self.use_steady = sim.use_steady
        # Whether a finish can cause an outside event (a closed loop's next send, a warm-up phase
        # ending, a load-aware router's choice); if not, fast steps run on through finishes.
        self._stop_at_finish = not getattr(sim, "quiet_finishes", False)
        self.book = Book(sim.keep_token_times)
        self.inbox: list[SimRequest] = []
        self.inbox_s: list[float] = []  # when each inbox request reached the engine
        # vLLM's async scheduling schedules step n+1 while step n runs: a request that reaches
        # the engine during step n first runs in step n+2. Arrivals are admitted at a boundary
        # only if they came before the start of the step that just ended (the moment the next
        # step was scheduled); an idle engine takes them at once.
        self.async_admission = bool(cost_model.async_scheduling)
        self._last_start: float | None = None  # start of the step that ended at this boundary
        self.aborts: list[str] = []
        self.deadlines: list[tuple[float, str]] = []  # heap of (abandon time, request id)
        self.live: dict[str, SimRequest] = {}
        self._wake = None
        self._plain_next = False
        self._late: list[SimRequest] | None = None  # went lazy after a step without a token
        self.steps: list[StepRecord] = []
        self.outstanding = 0  # requests routed here and not finished (router load signal)
        self.group: DataParallelGroup | None = None
        # (reached the engine at, event) of requests whose KV another engine sends (remote_kv_start)
        self.kv_waiters: list[tuple[float, object]] = []
        self.process = self.env.process(self.run()) if start else None

    @property
    def step_idx(self) -> int:
        """Steps taken so far."""
        return self.book.num_steps

    # ------------------------------------------------------------ from outside
    def submit(self, sreq: SimRequest, routed: bool = False) -> None:
        """A request reaches this engine now. `routed`: the router already counted it in
        `outstanding` when it forwarded the request (Simulation._send)."""
        self.inbox.append(sreq)
        self.inbox_s.append(self.env.now)
        if not routed:
            self.outstanding += 1
        self._poke()

    def remote_kv_start(self):
        """A SimPy event: when a request that reaches this engine now, with its KV on another
        engine, starts loading it. vLLM's KV connectors (NixlConnector) start the load in the
        worker when the step that first schedules the request runs (the scheduler allocates its
        blocks and puts the load in that step's connector metadata), so it starts as any arrival
        is admitted: at once when the engine (every rank of its DataParallelGroup) is idle, else
        at the boundary that would admit an arrival made now (_admissible). Plain steps only: a
        fast-forward run (use_steady) visits no boundary inside it, so the P/D pools that use
        this never fast-forward."""
        if self.use_steady:
            raise RuntimeError("remote_kv_start: a replica that fast-forwards (use_steady) would start the load late")
        ev = self.env.event()
        ranks = self.group.ranks if self.group is not None else [self]
        if not any(r.scheduler.has_unfinished_requests() for r in ranks):
            ev.succeed()
        else:
            self.kv_waiters.append((self.env.now, ev))
        return ev

    def _release_kv_waiters(self, cutoff: float | None) -> None:
        """Start the loads of the waiting requests this boundary's step schedules (those that
        reached the engine by `cutoff`, or all of them where admission takes every arrival)."""
        keep = []
        for t, ev in self.kv_waiters:
            if cutoff is None or t <= cutoff:
                ev.succeed()
            else:
                keep.append((t, ev))
        self.kv_waiters = keep

    def _poke(self) -> None:
        if self.group is not None:
            self.group.poke()
            return
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # --------------------------------------------------------- step boundary
    def _cutoff(self) -> float | None:
        """The latest arrival the step about to be scheduled can see: the start of the step that
        just ended under async admission, or None (every arrival so far) when admission is
        synchronous or the engine is idle."""
        if not self.async_admission or not self.scheduler.has_unfinished_requests():
            return None
        return self._last_start

    def _admissible(self) -> list[SimRequest]:
        """Take the inbox requests the step about to be scheduled can see (all of them, unless
        async admission holds back those that came while the last step ran)."""
        cutoff = self._cutoff()
        if cutoff is None:
            ready = self.inbox
            self.inbox, self.inbox_s = [], []
            return ready
        ready, keep, keep_s = [], [], []
        for sreq, t in zip(self.inbox, self.inbox_s):
            if t <= cutoff:
                ready.append(sreq)
            else:
                keep.append(sreq)
                keep_s.append(t)
        self.inbox, self.inbox_s = keep, keep_s
        return ready

    def _admit_arrivals(self, now: float) -> None:
        self._add(self._admissible(), now)

    def _feed(self, now: float) -> None:
        """Direct feed (Simulation.direct_feed): take the requests that reached the engine by the
        cutoff _admissible applies (all by now when the engine is idle or admission is
        synchronous, else those that came before the start of the step that just ended)."""
        cutoff = self._cutoff()
        self._add(self.sim.feed_take(now if cutoff is None else cutoff), now)

    def _arrive(self, last_start: float, now: float) -> float:
        """FastForwardScheduler.advance's `arrive` hook under the direct feed: the boundary at
        `now` after a step that started at `last_start` takes what _feed would take there."""
        self._add(self.sim.feed_take(last_start if self.async_admission else now), now)
        return self.sim.feed_next_s()

    def _add(self, sreqs: list[SimRequest], now: float) -> None:
        """Open the records of requests that reached the engine and queue them in the scheduler."""
        sched = self.scheduler
        book = self.book
        for sreq in sreqs:
            spec, rec = sreq.spec, sreq.record
            book.open(rec, spec.output_len)
            req = Request(spec.request_id, spec.token_sequence(), _SHARED_SP, arrival_time=rec.arrival_s,
                          priority=spec.priority)
            req.max_tokens = spec.output_len
            req.unique_from = spec.unique_from
            if spec.cancel_after_tokens is not None and spec.cancel_after_tokens < spec.output_len:
                # The client disconnects after receiving that many tokens; the server notices
                # at the next step boundary and aborts the request (the scheduler's abort path).
                sreq.cancel_tokens = max(1, spec.cancel_after_tokens)
            try:
                sched.add_request(req)
            except ValueError as e:
                book.finish(rec, "rejected", now)
                self.sim.on_finish(self, sreq, str(e))
                continue
            self.live[spec.request_id] = sreq
            req.driver_state = sreq
            if spec.cancel_after_s is not None:
                heapq.heappush(self.deadlines, (rec.arrival_s + spec.cancel_after_s, spec.request_id))

    def _apply_aborts(self, now: float) -> None:
        dl = self.deadlines
        while dl and dl[0][0] <= now:
            _, rid = heapq.heappop(dl)
            if rid in self.live:
                self.aborts.append(rid)
        if not self.aborts:
            return
        # A request can be asked to abort twice at one boundary (deadline and disconnect).
        ids = [rid for rid in dict.fromkeys(self.aborts) if rid in self.live]
        self.aborts.clear()
        if not ids:
            return
        sched = self.scheduler
        reqs = [r for r in map(sched.requests.get, ids) if r is not None]
        sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._sync_lazy_records(reqs)  # those decoding lazily: their tokens through the last step
        for rid in ids:
            sreq = self.live.pop(rid)
            self.book.finish(sreq.record, "abort", now)
            self.sim.on_finish(self, sreq, None)

    # ------------------------------------------------------------------ loop
    def run(self):
        env = self.env
        sched = self.scheduler
        feed = self.sim.direct_feed
        while True:
            now = env.now
            self._boundary(now, feed)
            if not sched.has_unfinished_requests():
                if self.inbox or self.kv_waiters:  # held back by async admission, and the engine ran dry: take them now
                    self._last_start = None
                    continue
                sched.sync()  # nothing is lazy any more: leave fast mode
                self._late = None
                self._last_start = None
                if feed:  # idle until the next request reaches the engine
                    nxt = self.sim.feed_next_s()
                    if nxt == math.inf:
                        return
                    yield self.sim.timeout_at(nxt)
                    continue
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            if self.use_steady and not self._plain_next:
                if feed:
                    # Arrivals join the run (_arrive); a run ends by FEED_RUN_S of simulated
                    # time, so that its steps' results stay few.
                    adv = sched.advance(TOKEN, self.cost.step_time, now, now + FEED_RUN_S,
                                        decode_time=self._decode_time, stop_at_finish=False,
                                        arrive=self._arrive, arrive_at=self.sim.feed_next_s())
                else:
                    until = self.sim.next_arrival_s
                    # Async: an arrival during step n waits for step n+1 too, so the run goes on
                    # through it; not with deadlines pending (one could fall due before step n+1).
                    then = 1 if self.async_admission and not self.deadlines else 0
                    if self.deadlines and self.deadlines[0][0] < until:
                        until = self.deadlines[0][0]
                    if self.inbox:  # held back: one step, then they are admitted
                        until, then = min(until, math.nextafter(now, math.inf)), 0
                    adv = sched.advance(TOKEN, self.cost.step_time, now, until, watch=_disconnect_point,
                                        then=then, decode_time=self._decode_time,
                                        stop_at_finish=self._stop_at_finish)
                if adv is not None:
                    yield from self._fast_steps(now, adv)
                    continue
            self._plain_next = False
            yield from self._plain_step(now)

    def _boundary(self, now: float, feed: bool = False) -> None:
        """What a step boundary takes in: arrivals (the direct feed's or the inbox's), aborts, and
        the KV loads its step starts (remote_kv_start)."""
        if self.kv_waiters:
            self._release_kv_waiters(self._cutoff())
        if feed:
            self._feed(now)
        elif self.inbox:
            self._admit_arrivals(now)
        if self.aborts or (self.deadlines and self.deadlines[0][0] <= now):
            self._apply_aborts(now)
            n = -1
            while self.inbox and len(self.inbox) != n:  # closed loop: the aborted requests' replacements
                n = len(self.inbox)
                self._admit_arrivals(now)

    def _plain_step(self, now: float):
        out = self._begin_plain(now)
        yield self.env.timeout(self.cost.step_time(out.features))
        self._end_plain(out, now, self.env.now)

    def _begin_plain(self, now: float):
        """Schedule one plain step starting at `now` (the scheduler's output)."""
        live = self.live
        book = self.book
        out = self.scheduler.schedule()
        for d in out.scheduled_new_reqs:
            book.scheduled(live[d.req_id].record, now, d.num_computed_tokens)
        self._last_start = now
        return out

    def _end_plain(self, out, now: float, end: float) -> None:
        """The step `out` that ran from `now` to `end`: its tokens, finishes and record."""
        sched = self.scheduler
        live = self.live
        book = self.book
        f = out.features
        step = book.num_steps
        for rid in out.preempted_req_ids:
            book.preempted(live[rid].record)
        outputs = sched.update_from_output(out, dict.fromkeys(out.sampling_req_ids, _TOKENS))
        finished = []
        for o in outputs:
            sreq = live[o.request_id]
            hangs_up = book.token(sreq, step, end)
            if o.finish_reason is not None:
                book.finish(sreq.record, o.finish_reason, end)
                del live[o.request_id]
                finished.append(sreq)
            elif hangs_up:
                self.aborts.append(o.request_id)
        book.end_step(end)
        self._record_step(step, now, end, 1, f)
        for sreq in finished:
            self.sim.on_finish(self, sreq, None)

    # ---------------------------------------------------------------- fast
    def _sync_lazy_records(self, reqs) -> None:
        """Requests the scheduler wrote back from fast mode: bring the records of those that
        decoded lazily up to date (one token per step from lazy_from through the last step)."""
        book = self.book
        last = book.num_steps - 1
        for r in reqs:
            book.lazy_sync(r.driver_state, last, len(r.output_token_ids))

    def _fast_steps(self, now: float, adv):
        """Bookkeeping of the steps one scheduler.advance() took, then wait for their end."""
        live = self.live
        book = self.book
        step0 = book.num_steps
        if adv.entered:
            # ITL: a request left out of the previous step has an explicit gap at its first lazy token.
            self._late = book.lazy_enter([r.driver_state for r in adv.entered], step0)
        k = len(adv.ends)
        book.lazy_steps(adv.ends, adv.num_decodes)
        if k and self._late is not None:
            book.lazy_late([e for e in self._late if e.lazy_from == step0], step0)
            self._late = None
        finished: list[SimRequest] = []
        for ev in adv.events:
            step = step0 + ev.index
            end = adv.ends[ev.index]
            for r, num_hit, _n, was_new in ev.admitted:
                if was_new:
                    book.scheduled(r.driver_state.record, adv.ends[ev.index - 1] if ev.index else adv.start,
                                   num_hit)
            for r in ev.first_tokens:
                book.lazy_first_token(r.driver_state, step, len(r.output_token_ids))
            for r in ev.watched:  # its client hangs up now: aborted at the boundary
                self.aborts.append(r.request_id)
            for r, reason in ev.finished:
                sreq = r.driver_state
                book.lazy_sync(sreq, step, len(r.output_token_ids))
                book.finish(sreq.record, reason, end)
                del live[r.request_id]
                finished.append(sreq)
        t = adv.ends[-1] if k else now
        if k:
            self._last_start = adv.ends[-2] if k > 1 else now
            prev, start = 0, now
            for cut in adv.cuts:  # finishes the run went on through: a row ends at each
                end = adv.ends[cut.num_steps - 1]
                self._record_step(step0 + prev, start, end, cut.num_steps - prev, cut.features,
                                  (cut.num_running, cut.num_waiting, cut.num_free_blocks))
                prev, start = cut.num_steps, end
            if k > prev:
                self._record_step(step0 + prev, start, t, k - prev, adv.features)
        if adv.left is not None:
            self._sync_lazy_records(adv.left)
            self._late = None
            self._plain_next = True  # the step fast mode refused goes to schedule()
        if t > now or adv.left is None:
            # Steps were taken (advance the clock to their end), or an outside event is due
            # now: let it happen before going on.
            yield self.sim.timeout_at(t)
        for sreq in finished:
            self.sim.on_finish(self, sreq, None)

    # --------------------------------------------------------------- records
    def _record_step(self, step: int, start: float, end: float, num_steps: int, f, state=None) -> None:
        """A row of steps.csv; `state`: (running, waiting, free blocks) after its last step, when
        that is not the scheduler's state now."""
        if not self.sim.keep_steps:
            return
        sched = self.scheduler
        kvm = sched.kv_cache_manager
        running, waiting, free = state if state is not None else (
            len(sched.running), len(sched.waiting), kvm.num_free_blocks)
        self.steps.append(StepRecord(
            step=step, start_s=start, end_s=end, num_steps=num_steps, num_reqs=f.num_reqs,
            num_prefill_reqs=f.num_prefill_reqs, num_prefill_tokens=f.num_prefill_tokens,
            prefill_context_tokens=f.prefill_context_tokens, prefill_attn_pairs=f.prefill_attn_pairs,
            num_decode_reqs=f.num_decode_reqs, decode_context_tokens=f.decode_context_tokens,
            num_tokens=f.num_prefill_tokens + f.num_decode_reqs, num_preempted=f.num_preempted,
            num_running=running, num_waiting=waiting, kv_usage=1.0 - free / kvm.num_usable_blocks,
            forward_s=end - start, replica=self.index))

    # ------------------------------------------------------------------ ITL
    def itl_sample(self):
        """(values, weights) of every inter-token gap on this replica."""
        return self.book.itl_sample()


class DataParallelGroup:
    """vLLM's data-parallel attention (`--data-parallel-size`): `ranks` engine ranks, each with its
    own scheduler, KV pool and requests (Replica objects without a loop of their own), stepping
    together because every MoE layer is one collective over all of them: while any rank has work,
    every rank's step starts at the same boundary (vLLM runs a dummy batch on an idle rank; its
    own time is not counted here), the MoE layers process the tokens of all ranks, each padded
    to the largest rank's count when the step runs in CUDA graphs (CostModel.group_step_time),
    and the step ends when the slowest rank's attention and dense layers are done. So one rank's
    long prefill stalls the others' decodes. Plain steps only (no fast-forward)."""

    def __init__(self, sim: ReplicaOwner, ranks: list[Replica], cost_model) -> None:
        self.env = sim.env
        self.ranks = ranks
        self.cost = cost_model
        self._wake = None
        for r in ranks:
            r.group = self
        self.process = self.env.process(self.run())

    def poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def run(self):
        env = self.env
        ranks = self.ranks
        while True:
            now = env.now
            for r in ranks:
                r._boundary(now)
            busy = [r for r in ranks if r.scheduler.has_unfinished_requests()]
            if not busy:
                held = [r for r in ranks if r.inbox or r.kv_waiters]
                if held:  # held back by async admission, and the group ran dry: take them now
                    for r in held:
                        r._last_start = None
                    continue
                for r in ranks:
                    r._last_start = None
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            outs = [r._begin_plain(now) for r in busy]
            feats = [o.features for o in outs]
            yield env.timeout(self.cost.group_step_time(feats, len(ranks)))
            end = env.now
            for r, o in zip(busy, outs):
                r._end_plain(o, now, end)

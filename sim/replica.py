"""One simulated engine replica: the step loop of architecture.md on SimPy's clock.

    loop:  take arrivals and aborts  ->  schedule()  ->  wait cost_model.step_time(features)
           ->  every request that finished its prompt samples a synthetic token  ->  update

Requests end by their workload output length (ignore_eos) or by cancellation.

Speed: the replica asks the scheduler to `advance()` up to the next outside event (an arrival or
a deadline): it takes the steps in which every running request decodes in O(events) per step
instead of O(running requests), with the code of its plain steps, and the replica waits once on
SimPy's clock for all of them. It stops early after a step in which a request finished or a
client hangs up. Timestamps are identical to stepping one by one with schedule()
(tests/test_sim.py, tests/test_sim_fuzz.py check it).

steps.csv: a plain step is one row; the steps of one advance() call are one row with num_steps
> 1 whose feature columns (num_reqs ... num_preempted) and forward_s are sums over those steps,
and num_running, num_waiting and kv_usage are as after its last step. Rows stay one per outside
event at most, so memory is bounded by the events, not by the steps.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from engine.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from engine.core.records import RequestRecord, StepRecord

if TYPE_CHECKING:
    from sim.simulation import Simulation

TOKEN = 1  # the synthetic token every request samples (never an EOS or stop id in the simulator)
_TOKENS = [TOKEN]  # shared, never mutated
_SHARED_SP = SamplingParams(max_tokens=None, ignore_eos=True)


class SimRequest:
    """Simulator-side state of one request: its record and ITL bookkeeping."""

    __slots__ = ("spec", "record", "last_step", "cancel_tokens", "steady_from")

    def __init__(self, spec, record: RequestRecord) -> None:
        self.spec = spec
        self.record = record
        self.last_step = -2         # step index of its latest token
        self.cancel_tokens = None   # the client disconnects after this many output tokens
        self.steady_from = -1       # first step it decodes lazily in the scheduler's fast mode; -1: not lazy


def _disconnect_point(r: Request) -> int | None:
    """num_tokens at which a request's client hangs up (steady runs stop there to abort it)."""
    m = r.driver_state.cancel_tokens
    return None if m is None else r.num_prompt_tokens + m


class Replica:
    def __init__(self, sim: "Simulation", index: int, config: SchedulerConfig, cost_model) -> None:
        self.sim = sim
        self.env = sim.env
        self.index = index
        self.scheduler = Scheduler(config)
        self.cost = cost_model
        self.use_steady = sim.use_steady
        self.keep_token_times = sim.keep_token_times
        self.inbox: list[SimRequest] = []
        self.aborts: list[str] = []
        self.deadlines: list[tuple[float, str]] = []  # heap of (abandon time, request id)
        self.live: dict[str, SimRequest] = {}
        self._wake = None
        self._plain_next = False
        self._late: list[SimRequest] | None = None  # went lazy after a step without a token
        self.step_idx = 0
        self.steps: list[StepRecord] = []
        # ITL bookkeeping: a token whose predecessor came in the previous step has gap
        # step_ends[s] - step_ends[s - 1]; count those per step, keep other gaps explicitly.
        self.step_ends: list[float] = []
        self.step_cont: list[int] = []
        self.other_gaps: list[float] = []
        self.outstanding = 0  # requests routed here and not finished (router load signal)
        self.process = self.env.process(self.run())

    # ------------------------------------------------------------ from outside
    def submit(self, sreq: SimRequest) -> None:
        self.inbox.append(sreq)
        self.outstanding += 1
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # --------------------------------------------------------- step boundary
    def _admit_arrivals(self, now: float) -> None:
        sched = self.scheduler
        for sreq in self.inbox:
            spec, rec = sreq.spec, sreq.record
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
                rec.finish_reason = "rejected"
                rec.finish_s = now
                self.sim.on_finish(self, sreq, str(e))
                continue
            self.live[spec.request_id] = sreq
            req.driver_state = sreq
            if spec.cancel_after_s is not None:
                heapq.heappush(self.deadlines, (rec.arrival_s + spec.cancel_after_s, spec.request_id))
        self.inbox.clear()

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
            sreq.record.finish_reason = "abort"
            sreq.record.finish_s = now
            self.sim.on_finish(self, sreq, None)

    # ------------------------------------------------------------------ loop
    def run(self):
        env = self.env
        sched = self.scheduler
        while True:
            now = env.now
            if self.inbox:
                self._admit_arrivals(now)
            if self.aborts or (self.deadlines and self.deadlines[0][0] <= now):
                self._apply_aborts(now)
                while self.inbox:  # closed loop: the aborted requests' replacements
                    self._admit_arrivals(now)
            if not sched.has_unfinished_requests():
                sched.sync()  # nothing is lazy any more: leave fast mode
                self._late = None
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            if self.use_steady and not self._plain_next:
                until = self.sim.next_arrival_s
                if self.deadlines and self.deadlines[0][0] < until:
                    until = self.deadlines[0][0]
                adv = sched.advance(TOKEN, self.cost.step_time, now, until, watch=_disconnect_point)
                if adv is not None:
                    yield from self._fast_steps(now, adv)
                    continue
            self._plain_next = False
            yield from self._plain_step(now)

    def _plain_step(self, now: float):
        sched = self.scheduler
        live = self.live
        out = sched.schedule()
        f = out.features
        step = self.step_idx
        for d in out.scheduled_new_reqs:
            rec = live[d.req_id].record
            rec.first_scheduled_s = now
            rec.num_cached_tokens = d.num_computed_tokens
        yield self.env.timeout(self.cost.step_time(f))
        end = self.env.now
        for rid in out.preempted_req_ids:
            live[rid].record.num_preemptions += 1
        outputs = sched.update_from_output(out, dict.fromkeys(out.sampling_req_ids, _TOKENS))
        cont = 0
        gaps = self.other_gaps
        keep = self.keep_token_times
        finished = []
        for o in outputs:
            sreq = live[o.request_id]
            rec = sreq.record
            if rec.first_token_s is None:
                rec.first_token_s = end
                if keep:
                    rec.token_times_s = [end]
            else:
                if sreq.last_step == step - 1:
                    cont += 1
                else:
                    gaps.append(end - rec.last_token_s)
                if keep:
                    rec.token_times_s.append(end)
            sreq.last_step = step
            rec.last_token_s = end
            rec.num_output_tokens += 1
            if o.finish_reason is not None:
                rec.finish_reason = o.finish_reason
                rec.finish_s = end
                del live[o.request_id]
                finished.append(sreq)
            elif sreq.cancel_tokens is not None and rec.num_output_tokens >= sreq.cancel_tokens:
                self.aborts.append(o.request_id)
        self.step_ends.append(end)
        self.step_cont.append(cont)
        self.step_idx = step + 1
        self._record_step(step, now, end, 1, f)
        for sreq in finished:
            self.sim.on_finish(self, sreq, None)

    # ---------------------------------------------------------------- fast
    def _sync_lazy_records(self, reqs) -> None:
        """Requests the scheduler wrote back from fast mode: bring the records of those that
        decoded lazily up to date (one token per step from steady_from through the last step)."""
        last = self.step_idx - 1
        keep = self.keep_token_times
        for r in reqs:
            sreq = r.driver_state
            if sreq.steady_from < 0:
                continue
            if sreq.steady_from <= last:
                rec = sreq.record
                if keep:
                    rec.token_times_s.extend(self.step_ends[sreq.steady_from:last + 1])
                rec.num_output_tokens = len(r.output_token_ids)
                rec.last_token_s = self.step_ends[last]
                sreq.last_step = last
            sreq.steady_from = -1

    def _fast_steps(self, now: float, adv):
        """Bookkeeping of the steps one scheduler.advance() took, then wait for their end."""
        live = self.live
        ends, cont, gaps = self.step_ends, self.step_cont, self.other_gaps
        keep = self.keep_token_times
        step0 = self.step_idx
        if adv.entered:
            for r in adv.entered:
                r.driver_state.steady_from = step0
            # ITL: a request left out of the previous step has an explicit gap at its first lazy token.
            self._late = [r.driver_state for r in adv.entered if r.driver_state.last_step != step0 - 1]
        k = len(adv.ends)
        ends.extend(adv.ends)
        cont.extend(adv.num_decodes)
        if k and self._late is not None:
            late = [sreq for sreq in self._late if sreq.steady_from == step0]
            self._late = None
            end = adv.ends[0]
            for sreq in late:
                rec = sreq.record
                if rec.first_token_s is None:
                    # A prompt whose last chunk was one token: this is its first token
                    # (its time joins token_times_s through the lazy slice).
                    rec.first_token_s = end
                    if keep:
                        rec.token_times_s = []
                else:
                    gaps.append(end - rec.last_token_s)
            cont[step0] -= len(late)
        finished: list[SimRequest] = []
        for ev in adv.events:
            step = step0 + ev.index
            end = adv.ends[ev.index]
            for r, num_hit, _n, was_new in ev.admitted:
                if was_new:
                    rec = r.driver_state.record
                    rec.first_scheduled_s = adv.ends[ev.index - 1] if ev.index else adv.start
                    rec.num_cached_tokens = num_hit
            for r in ev.first_tokens:
                sreq = r.driver_state
                rec = sreq.record
                if rec.first_token_s is None:
                    rec.first_token_s = end
                    if keep:
                        rec.token_times_s = [end]
                else:  # a resumed request: its first token after a preemption
                    gaps.append(end - rec.last_token_s)
                    if keep:
                        rec.token_times_s.append(end)
                rec.last_token_s = end
                rec.num_output_tokens = len(r.output_token_ids)
                sreq.last_step = step
                sreq.steady_from = step + 1
            for r in ev.watched:  # its client hangs up now: aborted at the boundary
                self.aborts.append(r.request_id)
            for r, reason in ev.finished:
                sreq = r.driver_state
                rec = sreq.record
                if keep:
                    rec.token_times_s.extend(ends[sreq.steady_from:step + 1])
                sreq.steady_from = -1
                rec.num_output_tokens = len(r.output_token_ids)
                rec.last_token_s = end
                sreq.last_step = step
                rec.finish_reason = reason
                rec.finish_s = end
                del live[r.request_id]
                finished.append(sreq)
        self.step_idx = step0 + k
        t = adv.ends[-1] if k else now
        if k:
            self._record_step(step0, now, t, k, adv.features)
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
    def _record_step(self, step: int, start: float, end: float, num_steps: int, f) -> None:
        if not self.sim.keep_steps:
            return
        sched = self.scheduler
        kvm = sched.kv_cache_manager
        self.steps.append(StepRecord(
            step=step, start_s=start, end_s=end, num_steps=num_steps, num_reqs=f.num_reqs,
            num_prefill_reqs=f.num_prefill_reqs, num_prefill_tokens=f.num_prefill_tokens,
            prefill_context_tokens=f.prefill_context_tokens, prefill_attn_pairs=f.prefill_attn_pairs,
            num_decode_reqs=f.num_decode_reqs, decode_context_tokens=f.decode_context_tokens,
            num_tokens=f.num_prefill_tokens + f.num_decode_reqs, num_preempted=f.num_preempted,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_usage=1.0 - kvm.num_free_blocks / kvm.num_usable_blocks,
            forward_s=end - start, replica=self.index))

    # ------------------------------------------------------------------ ITL
    def itl_sample(self):
        """(values, weights) of every inter-token gap on this replica."""
        import numpy as np
        ends = np.asarray(self.step_ends)
        w = np.asarray(self.step_cont[1:], dtype=np.int64)
        vals = np.diff(ends) if len(ends) > 1 else np.empty(0)
        keep = w > 0
        other = np.asarray(self.other_gaps)
        return (np.concatenate([vals[keep], other]),
                np.concatenate([w[keep], np.ones(len(other), dtype=np.int64)]))

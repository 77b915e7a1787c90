"""One simulated engine replica: the step loop of architecture.md on SimPy's clock.

    loop:  take arrivals and aborts  ->  schedule()  ->  wait cost_model.step_time(features)
           ->  every request that finished its prompt samples a synthetic token  ->  update

Requests end by their workload output length (ignore_eos) or by cancellation. When every running
request is decoding and nothing can change (no arrival, deadline, finish, admission or
preemption), the scheduler's decode window advances k steps at once; timestamps are identical to
stepping one by one (tests/test_sim.py checks it).
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from engine.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from engine.core.records import RequestRecord, StepRecord

if TYPE_CHECKING:
    from sim.simulation import Simulation

TOKEN = 1  # the synthetic token every request samples (never an EOS or stop id in the simulator)
_TOKENS = [TOKEN]  # shared, never mutated
_SHARED_SP = SamplingParams(max_tokens=None, ignore_eos=True)
_INF = math.inf


class SimRequest:
    """Simulator-side state of one request: its record and ITL bookkeeping."""

    __slots__ = ("spec", "record", "last_step", "cancel_tokens")

    def __init__(self, spec, record: RequestRecord) -> None:
        self.spec = spec
        self.record = record
        self.last_step = -2        # step index of its latest token
        self.cancel_tokens = False  # its max_tokens is the client's disconnect point


class Replica:
    def __init__(self, sim: "Simulation", index: int, config: SchedulerConfig, cost_model) -> None:
        self.sim = sim
        self.env = sim.env
        self.index = index
        self.scheduler = Scheduler(config)
        self.cost = cost_model
        self.use_windows = sim.use_windows
        self.keep_token_times = sim.keep_token_times
        self.inbox: list[SimRequest] = []
        self.aborts: list[str] = []
        self.deadlines: list[tuple[float, str]] = []  # heap of (abandon time, request id)
        self.live: dict[str, SimRequest] = {}
        self._wake = None
        self.step_idx = 0
        self.steps: list[StepRecord] = []
        # ITL bookkeeping: a token whose predecessor came in the previous step has gap
        # step_end[s] - step_end[s - 1]; count those per step, keep other gaps explicitly.
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

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # ------------------------------------------------------------------ loop
    def _admit_arrivals(self, now: float) -> None:
        sched = self.scheduler
        for sreq in self.inbox:
            spec, rec = sreq.spec, sreq.record
            req = Request(spec.request_id, spec.token_ids(), _SHARED_SP, arrival_time=rec.arrival_s,
                          priority=spec.priority)
            max_tokens = spec.output_len
            if spec.cancel_after_tokens is not None and spec.cancel_after_tokens < max_tokens:
                # A client that disconnects after m tokens: the request ends at that step, as an
                # abort, exactly when the server would notice at the next step boundary.
                max_tokens = max(1, spec.cancel_after_tokens)
                sreq.cancel_tokens = True
            req.max_tokens = max_tokens
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
        ids = [rid for rid in self.aborts if rid in self.live]
        self.aborts.clear()
        if ids:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for rid in ids:
                sreq = self.live.pop(rid)
                sreq.record.finish_reason = "abort"
                sreq.record.finish_s = now
                self.sim.on_finish(self, sreq, None)

    def run(self):
        env = self.env
        sched = self.scheduler
        live = self.live
        cost = self.cost
        while True:
            now = env.now
            if self.inbox:
                self._admit_arrivals(now)
            if self.aborts or (self.deadlines and self.deadlines[0][0] <= now):
                self._apply_aborts(now)
            if not sched.has_unfinished_requests():
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue

            if self.use_windows and sched.running:
                horizon = self.sim.next_arrival_s
                if self.deadlines and self.deadlines[0][0] < horizon:
                    horizon = self.deadlines[0][0]
                k = sched.decode_window(4096, TOKEN)
                if k:
                    ends = self._window_ends(now, k, horizon)
                    if len(ends) >= 2:
                        yield self.sim.timeout_at(ends[-1])
                        self._finish_window(now, ends)
                        continue

            out = sched.schedule()
            f = out.features
            dt = cost.step_time(f)
            step = self.step_idx
            if out.scheduled_new_reqs or out.scheduled_resumed_reqs:
                for d in out.scheduled_new_reqs:
                    rec = live[d.req_id].record
                    rec.first_scheduled_s = now
                    rec.num_cached_tokens = d.num_computed_tokens
            yield env.timeout(dt)
            end = env.now
            sampled = dict.fromkeys(out.sampling_req_ids, _TOKENS)
            if out.preempted_req_ids:
                for rid in out.preempted_req_ids:
                    live[rid].record.num_preemptions += 1
            outputs = sched.update_from_output(out, sampled)
            cont = 0
            gaps = self.other_gaps
            keep = self.keep_token_times
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
                    rec.finish_reason = "abort" if sreq.cancel_tokens else o.finish_reason
                    rec.finish_s = end
                    del live[o.request_id]
                    self.sim.on_finish(self, sreq, None)
            self.step_ends.append(end)
            self.step_cont.append(cont)
            self.step_idx = step + 1
            self._record_step(step, now, end, 1, f)

    # --------------------------------------------------------------- windows
    def _window_ends(self, now: float, k: int, horizon: float) -> list[float]:
        """End times of the window's steps that start before the next outside event."""
        running = self.scheduler.running
        n = len(running)
        ctx = n
        for r in running:
            ctx += r.num_computed_tokens
        ends = []
        t = now
        for dt in self.cost.decode_times(n, ctx, k):
            if t >= horizon:
                break
            t = t + dt  # the same addition SimPy does for a single step's timeout
            ends.append(t)
        return ends

    def _finish_window(self, start: float, ends: list[float]) -> None:
        sched = self.scheduler
        live = self.live
        k = len(ends)
        step0 = self.step_idx
        running = sched.running
        n = len(running)
        f_first = _decode_features(running)
        end = ends[-1]
        cont_first = 0
        gaps = self.other_gaps
        keep = self.keep_token_times
        for r in running:
            sreq = r.driver_state
            rec = sreq.record
            if sreq.last_step == step0 - 1:
                cont_first += 1
            else:
                gaps.append(ends[0] - rec.last_token_s)
            if keep:
                rec.token_times_s.extend(ends)
            sreq.last_step = step0 + k - 1
            rec.last_token_s = end
            rec.num_output_tokens += k
        finished = sched.advance_decode_window(k, TOKEN)
        for o in finished:
            sreq = live.pop(o.request_id)
            rec = sreq.record
            rec.finish_reason = "abort" if sreq.cancel_tokens else o.finish_reason
            rec.finish_s = end
            self.sim.on_finish(self, sreq, None)
        self.step_ends.extend(ends)
        self.step_cont.append(cont_first)
        self.step_cont.extend([n] * (k - 1))
        self.step_idx = step0 + k
        self._record_step(step0, start, end, k, f_first)

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
            forward_s=(end - start) / num_steps, replica=self.index))

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


def _decode_features(running):
    from engine.core.features import BatchFeatures
    n = len(running)
    ctx = n
    for r in running:
        ctx += r.num_computed_tokens
    return BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=ctx)

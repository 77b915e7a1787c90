"""One simulated engine replica: the step loop of architecture.md on SimPy's clock.

    loop:  take arrivals and aborts  ->  schedule()  ->  wait cost_model.step_time(features)
           ->  every request that finished its prompt samples a synthetic token  ->  update

Requests end by their workload output length (ignore_eos) or by cancellation.

Speed: while every running request is decoding, the scheduler's SteadyDecoder takes the steps
(same decisions, O(events) per step instead of O(running requests)), and the replica runs them
back to back without a SimPy event until something outside can happen (the next arrival or
deadline) or a request finishes. Timestamps are identical to stepping one by one with
schedule() (tests/test_sim.py checks it).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from engine.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from engine.core.records import RequestRecord, StepRecord
from engine.core.steady import SteadyDecoder

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
        self.steady_from = -1       # first step it decoded lazily in the current steady run


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
        self.steady: SteadyDecoder | None = None
        self._plain_next = False
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
            req = Request(spec.request_id, spec.token_ids(), _SHARED_SP, arrival_time=rec.arrival_s,
                          priority=spec.priority)
            req.max_tokens = spec.output_len
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
        if self.steady is not None:
            reqs = [sched.requests.get(rid) for rid in ids]
            lazy = [r for r in reqs if r is not None and r.request_id in self.steady.lazy]
            self.steady.abort(ids)
            for r in lazy:  # they decoded through the last step: write their counts back
                self._sync_lazy_record(r)
        else:
            sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
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
                if self.steady is not None:
                    self._leave_steady()
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            if self.use_steady and not self._plain_next:
                if self.steady is None and SteadyDecoder.can_enter(sched, TOKEN):
                    self._enter_steady()
                if self.steady is not None:
                    yield from self._run_steady(now)
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

    # ---------------------------------------------------------------- steady
    def _enter_steady(self) -> None:
        self.steady = SteadyDecoder(self.scheduler, TOKEN, watch=_disconnect_point)
        step = self.step_idx
        for r in self.scheduler.running:
            r.driver_state.steady_from = step

    def _sync_lazy_record(self, r: Request) -> None:
        """A request that decoded lazily through the last step: write its record back."""
        sreq = r.driver_state
        rec = sreq.record
        last = self.step_idx - 1
        if self.keep_token_times and sreq.steady_from <= last:
            rec.token_times_s.extend(self.step_ends[sreq.steady_from:last + 1])
        rec.num_output_tokens = len(r.output_token_ids)
        rec.last_token_s = self.step_ends[last]
        sreq.last_step = last

    def _leave_steady(self) -> None:
        steady = self.steady
        lazy = [self.scheduler.requests[rid] for rid in steady.lazy]
        took_steps = steady.t > 0
        steady.leave()
        self.steady = None
        if took_steps:  # then every lazy request decoded in the last step
            for r in lazy:
                self._sync_lazy_record(r)

    def _run_steady(self, now: float):
        """Steady steps back to back until an outside event is due, a request finishes, or the
        decoder hands the step back to schedule()."""
        steady = self.steady
        sim = self.sim
        live = self.live
        cost = self.cost
        cost_time = cost._time
        ends, cont, gaps = self.step_ends, self.step_cont, self.other_gaps
        keep = self.keep_token_times
        horizon = sim.next_arrival_s
        if self.deadlines and self.deadlines[0][0] < horizon:
            horizon = self.deadlines[0][0]
        t = now
        # One steps.csv row per steady run (its first step's features, num_steps steps).
        seg_start, seg_step, seg_feat = now, self.step_idx, None
        finished: list[SimRequest] = []
        leave = False
        while t < horizon:
            step = self.step_idx
            # ITL: every lazy decode had a token in the previous step, except possibly at the
            # first step of a steady run (a request the previous schedule() left out).
            late = None
            if steady.t == 0:
                late = [live[rid] for rid in steady.lazy if live[rid].last_step != step - 1]
            res = steady.try_step()
            if res is None:
                leave = True
                break
            if res.admitted:
                f = res.features
                dt = cost.step_time(f)
            else:  # the same arithmetic as step_time(features) of a pure decode step
                f = None
                n = res.num_decodes
                dt = cost_time(n, n, 0, 0, 0, res.decode_context_tokens)
            if seg_feat is None:
                seg_feat = f if f is not None else res.features
            end = t + dt  # the same addition SimPy does for a single step
            ends.append(end)
            if late:
                for sreq in late:
                    rec = sreq.record
                    if rec.first_token_s is None:
                        # A prompt whose last chunk was one token: this is its first token
                        # (its time joins token_times_s through the steady slice).
                        rec.first_token_s = end
                        if keep:
                            rec.token_times_s = []
                    else:
                        gaps.append(end - rec.last_token_s)
                cont.append(res.num_decodes - len(late))
            else:
                cont.append(res.num_decodes)
            for r, num_hit, _n, was_new in res.admitted:
                if was_new:
                    rec = r.driver_state.record
                    rec.first_scheduled_s = t
                    rec.num_cached_tokens = num_hit
            for r in res.first_tokens:
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
                if sreq.cancel_tokens is not None and rec.num_output_tokens >= sreq.cancel_tokens:
                    self.aborts.append(r.request_id)
            for r in res.watched:  # its client hangs up now: aborted at the boundary
                self.aborts.append(r.request_id)
            for r, reason in res.finished:
                sreq = r.driver_state
                rec = sreq.record
                if keep:
                    rec.token_times_s.extend(ends[sreq.steady_from:step + 1])
                rec.num_output_tokens = len(r.output_token_ids)
                rec.last_token_s = end
                sreq.last_step = step
                rec.finish_reason = reason
                rec.finish_s = end
                del live[r.request_id]
                finished.append(sreq)
            self.step_idx = step + 1
            t = end
            if res.leave:
                leave = True
                break
            if finished or self.aborts:
                break
        if seg_feat is not None:
            self._record_step(seg_step, seg_start, t, self.step_idx - seg_step, seg_feat)
        if leave:
            self._leave_steady()
            self._plain_next = True  # the step the decoder refused goes to schedule()
        if t > now or not leave:
            # Steps were taken (advance the clock to their end), or an outside event is due
            # now: let it happen before going on.
            yield self.sim.timeout_at(t)
        for sreq in finished:
            sim.on_finish(self, sreq, None)

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

"""Disaggregated prefill/decode pools on one SimPy clock, composed from Simulation and Replica.

    arrival -> router -> prefill replica: the prompt with max_tokens 1 (prefill + one token)
            -> transfer queue (FIFO) -> the decode replica with room and fewest requests
            -> the decode replica's next scheduling step starts pulling the KV (vLLM's KV
               connectors load in the step that first schedules the request: at once on an idle
               engine, else at the boundary that would admit any arrival then)
            -> KV transfer: prompt tokens x KV bytes per token / link bandwidth + link latency
            -> decode replica: every output token the client sees (`first_token: decode`, the
               default), or the remaining output_len - 1 after the prefill's (`first_token: prefill`)

Which engine streams the first token: in vLLM's disaggregated serving (its P/D proxy examples and
NVIDIA Dynamo's workers for vLLM, SGLang and TensorRT-LLM) the prefill request runs with
max_tokens 1 and its token is not sent; the decode engine streams every token, computing the
first in its first step for the request (vLLM recomputes the prompt's last token over the arrived
KV). So the client's TTFT holds the prefill, the wait for decode room, the wait for the decode
engine's step that starts the load, the transfer, the wait for the step that admits the request
once its KV is in, and that step; TPOT the decode steps alone.
`first_token: prefill` is a server that streams the prefill engine's token at once (the hand-off
gap then falls between the first two tokens).

Every replica, prefill or decode, is a plain `Replica` with its own shared-scheduler instance.

Room on a decode replica: fewer than max_num_seqs of its requests outstanding (in transfer,
waiting or running), and its free KV blocks, less those promised to transfers it has not
scheduled yet, cover the prompt plus one token. Until a decode replica has room the transfer
waits and its KV stays on the prefill replica (this model does not hold those blocks there);
nothing is dropped. Room grows only when a decode replica finishes a request, so the queue is
retried then. A prompt larger than every decode replica's whole pool is rejected.

Arrived KV on a decode replica: its scheduler admits the request as a prompt whose KV is about
to be computed; two choices make that step what a KV-receiving engine does:
  - the decode pool's token budget is raised to max_model_len + max_num_seqs, so an arrived
    prompt is admitted in one step, never chunked;
  - `KVArrivedCost` prices a prompt row as one decode token reading that prompt's KV (the row
    computes the client's first output token from the arrived KV, or the second with
    `first_token: prefill`; no prefill FLOPs).
A request preempted on a decode replica is priced the same way when it resumes (an engine would
recompute it), so preemption-heavy decode pools are optimistic.

Transfers do not contend: each takes bytes / bandwidth + latency whatever else is in flight.
Steady decoding is off: a decode replica cannot know ahead when the next KV will land.
Cancellation is not supported with pools.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np

from engine.core.features import BatchFeatures
from engine.core.records import RequestRecord
from sim.cost_model import CostModel
from sim.metrics import stats
from sim.replica import DataParallelGroup, Replica, SimRequest
from sim.simulation import SimResult, Simulation


class KVArrivedCost(CostModel):
    """A decode pool's step time: prompt rows are arrived KV, priced as decodes of their context."""

    kind = "kv-arrived"

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self.metadata = {"decode_pool_of": base.describe()}
        # The pool's timing composition (CPU work, async scheduling) is the base's own.
        self.async_scheduling = base.async_scheduling

    @staticmethod
    def _as_decodes(f) -> BatchFeatures:
        n = f.num_decode_reqs + f.num_prefill_reqs
        ctx = f.decode_context_tokens + f.prefill_context_tokens + f.num_prefill_tokens
        return BatchFeatures(num_reqs=f.num_reqs, num_decode_reqs=n, decode_context_tokens=ctx)

    def step_time(self, f) -> float:
        return self.base.step_time(self._as_decodes(f))

    def group_step_time(self, features, ranks=None) -> float:
        """A decode engine's data-parallel ranks: each rank's arrived prompts as decodes, and the
        MoE layers over the ranks' decode tokens (the base's group step)."""
        return self.base.group_step_time([self._as_decodes(f) for f in features], ranks)


class _PrefillView:
    """The workload as the prefill pool sees it: every request stops after its first token."""

    def __init__(self, workload) -> None:
        self.workload = workload
        # what the client side of the simulation reads from a workload: the loop, the warm-up
        # requests (the measured phase starts when their responses are in), the client model
        for key in ("closed_loop_concurrency", "num_warmup", "client"):
            setattr(self, key, getattr(workload, key, None))
        self.output_len: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.workload)

    def __iter__(self):
        for spec in self.workload:
            self.output_len[spec.request_id] = spec.output_len
            yield replace(spec, output_len=1)


class _Handoff:
    __slots__ = ("sreq", "output_len", "need", "ready_s", "decoder", "dsreq")

    def __init__(self, sreq, output_len, need, ready_s) -> None:
        self.sreq, self.output_len, self.need, self.ready_s = sreq, output_len, need, ready_s
        self.decoder = None
        self.dsreq = None


class DisaggSimulation(Simulation):
    """`pd`: {prefill_replicas, decode_replicas, link_bandwidth_gb_s, link_latency_s,
    kv_bytes_per_token, prefill: (SchedulerConfig, CostModel), decode: (SchedulerConfig, CostModel)}
    (sim.scenario builds it from `deployment.pd`). `router` routes arrivals to prefill replicas."""

    def __init__(self, workload, pd: dict, router: str = "round_robin", seed: int = 0,
                 keep_token_times: bool = False, keep_steps: bool = True, progress: bool = False,
                 slo: dict | None = None, max_time_s: float | None = None) -> None:
        if len(workload) and (np.any(~np.isnan(getattr(workload, "cancel_after_s", np.empty(0))))
                              or np.any(getattr(workload, "cancel_after_tokens", np.empty(0)) >= 0)):
            raise ValueError("workload.cancellation: not supported with deployment.pd (disaggregated pools)")
        pcfg, pcost = pd["prefill"]
        dcfg, dcost = pd["decode"]
        self.view = _PrefillView(workload)
        pdp, ddp = pd.get("prefill_data_parallel", 1), pd.get("decode_data_parallel", 1)
        super().__init__(self.view, pcfg, pcost, num_replicas=pd["prefill_replicas"], router=router,
                         seed=seed, use_steady=False, keep_token_times=keep_token_times,
                         keep_steps=keep_steps, progress=progress, slo=slo, max_time_s=max_time_s,
                         data_parallel=pdp)
        self.workload = workload
        self.num_prefill = pd["prefill_replicas"] * pdp  # ranks: each its own scheduler and pool
        self.decode_config = replace(
            dcfg, max_num_batched_tokens=max(dcfg.max_num_batched_tokens, dcfg.max_model_len + dcfg.max_num_seqs))
        arrived = KVArrivedCost(dcost)
        self.decoders = [Replica(self, self.num_prefill + i, self.decode_config, arrived, start=ddp == 1)
                         for i in range(pd["decode_replicas"] * ddp)]
        # A decode engine of ddp data-parallel ranks steps them together (DataParallelGroup).
        self.decode_groups = [DataParallelGroup(self, self.decoders[i:i + ddp], arrived)
                              for i in range(0, len(self.decoders), ddp)] if ddp > 1 else []
        self.bytes_per_token = pd["kv_bytes_per_token"]
        self.bandwidth = pd["link_bandwidth_gb_s"] * 1e9
        self.latency = pd["link_latency_s"]
        self.pd = {k: v for k, v in pd.items() if k not in ("prefill", "decode")}
        self.first_from_decode = pd.get("first_token", "decode") == "decode"
        self.queue: deque[_Handoff] = deque()
        self.in_flight = [0] * len(self.decoders)
        self.promised: list[list[_Handoff]] = [[] for _ in self.decoders]
        self.decoding: dict[str, _Handoff] = {}
        self.transfer_s: list[float] = []
        self.load_wait_s: list[float] = []  # from a decode replica's choice to its load's start
        self.wait_s: list[float] = []
        self.handoff_gaps: list[float] = []

    def transfer_time(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.bytes_per_token / self.bandwidth + self.latency

    # ------------------------------------------------------------ hand-off
    def on_finish(self, replica: Replica, sreq: SimRequest, error: str | None) -> None:
        if replica.index >= self.num_prefill:
            self._decode_done(replica, sreq, error)
            return
        out_len = self.view.output_len.pop(sreq.spec.request_id)
        rec = sreq.record
        if (error is not None or rec.finish_reason not in ("stop", "length")
                or (out_len <= 1 and not self.first_from_decode)):
            super().on_finish(replica, sreq, error)
            return
        replica.outstanding -= 1
        rec.finish_reason = rec.finish_s = None  # in transit: not finished yet
        rec.num_requested_output_tokens = out_len  # what the client asked (the prefill ran with 1)
        if self.first_from_decode:  # the prefill's token is never sent: the client has none yet
            rec.first_token_s = rec.last_token_s = None
            rec.num_output_tokens = 0
            if rec.token_times_s is not None:
                rec.token_times_s.clear()
        need = -(-(sreq.spec.prompt_len + 1) // self.decode_config.block_size)
        # a sliding-window model's window while the decode replica takes the prompt in
        need += self.decoders[0].scheduler.kv_cache_manager.window_reserve(
            min(sreq.spec.prompt_len + 1, self.decode_config.max_num_batched_tokens))
        self.queue.append(_Handoff(sreq, out_len, need, self.env.now))
        self._start_transfers()

    def _room(self, i: int, h: _Handoff) -> bool:
        d = self.decoders[i]
        if d.outstanding + self.in_flight[i] >= self.decode_config.max_num_seqs:
            return False
        # Promises to requests the decode scheduler has since admitted are in its own usage now.
        self.promised[i] = p = [x for x in self.promised[i] if x.dsreq is None or x.dsreq.record.first_scheduled_s is None]
        return d.scheduler.kv_cache_manager.num_free_blocks - sum(x.need for x in p) >= h.need

    def _start_transfers(self) -> None:
        while self.queue:
            h = self.queue[0]
            fits = [i for i in range(len(self.decoders)) if self._room(i, h)]
            if not fits:
                if all(h.need > d.scheduler.kv_cache_manager.num_usable_blocks for d in self.decoders):
                    self.queue.popleft()
                    self._reject(h)
                    continue
                return  # first come, first served: the head waits for room
            self.queue.popleft()
            i = min(fits, key=lambda j: (self.decoders[j].outstanding + self.in_flight[j], j))
            h.decoder = i
            self.in_flight[i] += 1
            self.promised[i].append(h)
            self.wait_s.append(self.env.now - h.ready_s)
            # Asked now, before the chosen engine takes its boundary: room freed by a request it
            # finished at this instant goes to this one in the step it schedules next, as vLLM's
            # scheduler hands the freed blocks to a waiting request.
            self.env.process(self._transfer(h, self.decoders[i].remote_kv_start()))

    def _transfer(self, h: _Handoff, start):
        # The decode engine starts pulling the KV in the step that first schedules the request
        # (Replica.remote_kv_start), then admits it when the load is done, as any arrival.
        asked = self.env.now
        yield start
        self.load_wait_s.append(self.env.now - asked)
        dt = self.transfer_time(h.sreq.spec.prompt_len)
        self.transfer_s.append(dt)
        yield self.env.timeout(dt)
        i = h.decoder
        self.in_flight[i] -= 1
        spec = h.sreq.spec
        now = self.env.now
        dspec = replace(spec, arrival_s=now, output_len=h.output_len - (0 if self.first_from_decode else 1))
        drec = RequestRecord(spec.request_id, now, spec.prompt_len)
        d = self.decoders[i]
        drec.replica = d.index
        h.dsreq = SimRequest(dspec, drec)
        self.decoding[spec.request_id] = h
        d.submit(h.dsreq)

    def _reject(self, h: _Handoff) -> None:
        rec = h.sreq.record
        rec.finish_reason = "rejected"
        rec.finish_s = self.env.now
        msg = (f"prompt of {h.sreq.spec.prompt_len} tokens needs {h.need} KV blocks; no decode replica "
               f"has that many")
        # Counted as finished through the base class, on a prefill replica's books.
        rep = self.replicas[rec.replica]
        rep.outstanding += 1
        super().on_finish(rep, h.sreq, msg)

    def _decode_done(self, replica: Replica, dsreq: SimRequest, error: str | None) -> None:
        h = self.decoding.pop(dsreq.spec.request_id)
        rec, drec = h.sreq.record, dsreq.record
        rec.finish_reason, rec.finish_s = drec.finish_reason, drec.finish_s
        rec.num_preemptions += drec.num_preemptions
        if self.first_from_decode:  # the client's tokens are the decode engine's (none if it refused)
            rec.first_token_s, rec.last_token_s = drec.first_token_s, drec.last_token_s
            rec.num_output_tokens = drec.num_output_tokens
            if rec.token_times_s is not None:
                rec.token_times_s[:] = drec.token_times_s or []
        elif drec.first_token_s is not None:
            self.handoff_gaps.append(drec.first_token_s - rec.first_token_s)
            rec.last_token_s = drec.last_token_s
            rec.num_output_tokens += drec.num_output_tokens
            if rec.token_times_s is not None and drec.token_times_s:
                rec.token_times_s.extend(drec.token_times_s)
        super().on_finish(replica, dsreq, error)  # the base class counts it; it reads only the id
        self._start_transfers()

    # ------------------------------------------------------------- results
    def _all_replicas(self) -> list[Replica]:
        return self.replicas + self.decoders

    def _extra_itl(self):
        """The hand-off gaps between the prefill's token and the decode engine's first (a server
        that streams the prefill's token; none otherwise). Prefill replicas count no gaps: each
        of their requests stops at its first token."""
        return np.asarray(self.handoff_gaps), np.ones(len(self.handoff_gaps), np.int64)

    def collect(self, wall_s: float) -> SimResult:
        result = super().collect(wall_s)
        result.summary["pd"] = {**self.pd, "kv_transfer_s": _stats(self.transfer_s),
                                "wait_for_room_s": _stats(self.wait_s),
                                "wait_for_load_start_s": _stats(self.load_wait_s),
                                "never_transferred": len(self.queue) + sum(self.in_flight)}
        return result


def _stats(xs: list[float]) -> dict:
    return {**stats(xs), "max": max(xs) if xs else None}


__all__ = ["DisaggSimulation", "KVArrivedCost"]

"""The shared scheduler: vLLM V1 (0.33) continuous batching, chunked prefill, prefix caching,
preemption by recompute. Pure Python; the engine and the simulator both drive it:

    out = scheduler.schedule()                         # decide this step
    sampled = runner.execute(out)  |  env.timeout(cost(out))
    outputs = scheduler.update_from_output(out, sampled)

There are no prefill/decode phases: each request has `num_computed_tokens` and `num_tokens`, and a
step decides only how many tokens each request advances (`num_scheduled_tokens`).

This module is the plain scheduler. A driver that samples one fixed token for every request (the
simulator) may use engine.core.fast_forward.FastForwardScheduler instead, which extends this
class, as vLLM's AsyncScheduler extends Scheduler, and can take every step up to the next outside
event at once through the public hooks below (`admit_waiting`, `before_finish`).
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core.admission import AdmissionError, admit
from engine.core.config import SchedulerConfig
from engine.core.features import BatchFeatures
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output import (CachedRequestData, EngineCoreOutput, NewRequestData,
                                SchedulerOutput)
from engine.core.policy import make_queue
from engine.core.request import Request, RequestStatus

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISH_REASON = {s: RequestStatus.finish_reason(s) for s in (
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)}


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            unhashed_first=config.unhashed_blocks_first,
            track_block_ids=config.track_block_ids,
            sliding_window=config.sliding_window,
            sliding_kv_bytes=config.sliding_kv_bytes,
            kv_bytes=config.kv_bytes,
        )
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); reported once so the runner can drop state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # cumulative, for metrics

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for requests that could never run."""
        rid = request.request_id
        n = request.num_prompt_tokens
        if rid in self.requests:
            raise AdmissionError("request_id", f"request {rid!r}: request_id is already in use")
        try:  # the one admission rule (engine.core.admission): the engine core truncates
            request.max_tokens = admit(n, request.max_tokens, self.max_model_len, refuse_overflow=False)
        except AdmissionError as e:
            raise AdmissionError(e.field, f"request {rid!r}: {e}") from None
        problem = self.fit_problem(n, request.max_tokens)
        if problem is not None:
            raise ValueError(f"request {rid!r}: {problem}")
        sp = request.sampling_params
        stop = set(sp.stop_token_ids)
        if request.eos_token_id is not None and not sp.ignore_eos:
            stop.add(request.eos_token_id)
        request.stop_ids = frozenset(stop) if stop else None
        request.token_limit = min(self.max_model_len, n + request.max_tokens)
        self.requests[rid] = request
        request.status = _WAITING
        self.waiting.add_request(request)

    def fit_problem(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size could never finish in this pool, or None.

        A sequence whose KV cannot fit in the whole pool would wait (or preempt itself) for ever
        and block every request queued behind it. Its last sampled token is never computed, so
        it needs slots for at most min(prompt + max_tokens - 1, max_model_len) tokens, and with
        a sliding-window charge the window of its largest prefill chunk.
        """
        tokens = min(num_prompt_tokens + max_tokens - 1, self.max_model_len)
        need = -(-tokens // self.block_size)
        # and a sliding-window model's window while it prefills (KVCacheManager.window_reserve)
        # (a preempted request comes back with its outputs in its prompt: as many as `tokens`)
        need += self.kv_cache_manager.window_reserve(min(tokens, self.max_num_batched_tokens))
        usable = self.kv_cache_manager.num_usable_blocks
        if need > usable:
            return (f"prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} needs {need} KV "
                    f"blocks of {self.block_size} tokens but the pool has only {usable} "
                    f"(num_gpu_blocks={self.config.num_gpu_blocks})")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish (usually abort) requests; unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status={finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        found = []
        for rid in dict.fromkeys(request_ids):
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                found.append(req)
        if not found:
            return
        self.before_finish(found)
        running_drop = {id(r) for r in found if r.status == _RUNNING}
        if running_drop:
            self.running = [r for r in self.running if id(r) not in running_drop]
        waiting_drop = [r for r in found if r.status != _RUNNING]
        if waiting_drop:
            self.waiting.remove_requests(waiting_drop)
        for req in found:
            req.status = finished_status
            self._free_request(req)

    def before_finish(self, requests: list[Request]) -> None:
        """Hook: called by finish_requests with the live requests it is about to finish, before it
        touches them (a subclass brings state it keeps aside up to date). Does nothing here."""

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, keep the outputs, go back to the front."""
        self.kv_cache_manager.free(req, resumable=True)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        running = self.running
        waiting = self.waiting
        kvm = self.kv_cache_manager
        req_to_blocks = kvm.req_to_blocks
        bs = self.block_size
        caching = kvm.enable_caching
        max_model_len = self.max_model_len
        thr = self.config.long_prefill_token_threshold
        if thr and len(running) + len(waiting) <= 1:
            thr = 0  # a lone request is never held back by the long-prefill cap
        victim_key = waiting.victim_key
        window = kvm.sliding_window

        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        # The runner's diff for requests that stay running, filled as they are scheduled.
        cached = CachedRequestData()
        c_ids, c_blocks, c_computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        no_blocks: list[int] = []
        # Requests that sample a token this step (decodes and final prefill chunks), and the
        # batch features the cost models use, gathered on the way (see engine/core/features.py).
        sampling: list[str] = []
        feats = BatchFeatures()
        d_n = d_ctx = 0

        # 1. Running requests, in order. A request's num_computed_tokens is advanced as soon as
        #    it is scheduled (optimistically, before the model runs); c_computed keeps the value
        #    before the step for the runner.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            rid = req.request_id
            computed = req.num_computed_tokens
            n = req.num_tokens - computed
            if n == 1:
                # A pure counter increment: the slot exists and the token completes no block, so
                # append_slots would allocate and cache nothing (a fast-forward step skips exactly
                # these requests too).
                if computed < len(req_to_blocks[rid]) * bs and (not caching or (computed + 1) % bs) \
                        and not (window and computed >= window and (computed - window + 1) % bs == 0):
                    # (nor a token at which a sliding window drops its oldest block)
                    num_scheduled[rid] = 1
                    c_ids.append(rid)
                    c_blocks.append(no_blocks)
                    c_computed.append(computed)
                    sampling.append(rid)
                    d_n += 1
                    d_ctx += computed + 1
                    req.num_computed_tokens = computed + 1
                    budget -= 1
                    i += 1
                    continue
            else:
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
                room = max_model_len - 1 - computed  # keep a position for the sampled token
                if room <= 0:
                    # Only a prompt of max_model_len tokens gets here: its last prompt token still
                    # has a position (it then samples one token and is length-capped). Capping it
                    # to 0 would leave it waiting for ever.
                    room = req.num_tokens - computed
                if n > room:
                    n = room
                if n <= 0:
                    # Nothing to do for this one; `continue`, not `break`, so later requests run.
                    i += 1
                    continue
            while True:
                # One new token: the call a fast-forward step makes for decodes at a block boundary.
                blocks = kvm.append_slots([req]) if n == 1 else kvm.allocate_slots(req, n)
                if blocks is not None:
                    break
                if victim_key is None:
                    victim = running.pop()  # FCFS: the last admitted
                else:
                    victim = max(running, key=victim_key)
                    running.remove(victim)
                    vid = victim.request_id
                    if vid in num_scheduled:
                        # Already scheduled this step: un-schedule it and refund its tokens.
                        vn = num_scheduled.pop(vid)
                        budget += vn
                        j = c_ids.index(vid)
                        vc = c_computed[j]
                        if self.config.uncache_unscheduled_victims:
                            # Its chunk will not run: blocks entered in the prefix cache for it
                            # must not be hits for anyone (their KV is never written).
                            kvm.uncache_blocks(victim, vc)
                        del c_ids[j], c_blocks[j], c_computed[j]
                        if vid in sampling:
                            sampling.remove(vid)
                        feats.add(vn, vc, -1)
                        i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:
                # The request preempted itself. FCFS stops here; under a victim-key policy the
                # next running request (now at index i) may still fit.
                if victim_key is None:
                    break
                continue
            num_scheduled[rid] = n
            c_ids.append(rid)
            c_blocks.append([b.block_id for b in blocks] if blocks else no_blocks)
            c_computed.append(computed)
            feats.add(n, computed)
            if computed + n == req.num_tokens:
                sampling.append(rid)
            req.num_computed_tokens = computed + n
            budget -= n
            i += 1

        # 2. Waiting requests, only when nobody was preempted in this step.
        new_data: list[NewRequestData] = []
        resumed_data: list[NewRequestData] = []
        if not preempted and waiting:
            admitted, budget = self.admit_waiting(budget, thr)
            for req, num_hit, n, was_new in admitted:
                rid = req.request_id
                (new_data if was_new else resumed_data).append(NewRequestData(
                    rid, req.prompt_token_ids, [] if was_new else list(req.output_token_ids),
                    req.sampling_params, kvm.get_block_ids(rid), num_hit, req.eos_token_id))
                num_scheduled[rid] = n
                feats.add(n, num_hit)
                if num_hit + n == req.num_tokens:
                    sampling.append(rid)

        feats.num_decode_reqs += d_n  # the decode fast path's counts, kept in locals
        feats.decode_context_tokens += d_ctx
        feats.num_reqs = len(num_scheduled)
        feats.num_preempted = len(preempted)
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_resumed_reqs=resumed_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_req_ids={r.request_id for r in preempted} if preempted else set(),
            finished_req_ids=self.finished_req_ids,
            sampling_req_ids=sampling,
            features=feats,
        )
        self.finished_req_ids = set()
        return out

    def admit_waiting(self, budget: int, thr: int) -> tuple[list[tuple[Request, int, int, bool]], int]:
        """Hook (also for subclasses' steps): the waiting part of a step: admit from the head of the queue while the token budget,
        max_num_seqs and the KV pool allow (head-of-line: the first refusal ends it).

        Returns [(request, prefix-hit tokens, tokens scheduled, was new)] and the budget left.
        The admitted requests are RUNNING with num_computed_tokens already advanced.
        """
        waiting, running, kvm = self.waiting, self.running, self.kv_cache_manager
        chunked = self.config.enable_chunked_prefill
        reserve = self.config.reserve_full_prompt
        watermark = self.config.watermark_blocks
        max_num_seqs = self.max_num_seqs
        admitted = []
        while waiting and budget > 0:
            if len(running) >= max_num_seqs:
                break
            req = waiting.peek_request()
            # Preempted requests were reset to 0 computed tokens: they look up the prefix
            # cache too and may hit their own freed blocks.
            hits, num_hit = kvm.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if 0 < thr < n:
                n = thr
            if not chunked and n > budget:
                break
            if n > budget:
                n = budget
            blocks = kvm.allocate_slots(
                req, n, num_hit, hits,
                num_reserve_tokens=req.num_tokens if reserve else 0,
                num_watermark_blocks=watermark if running else 0,
            )
            if blocks is None:
                break  # head-of-line: no skipping ahead
            waiting.pop_request()
            running.append(req)
            admitted.append((req, num_hit, n, req.status == _WAITING))
            req.status = _RUNNING
            req.num_computed_tokens = num_hit + n
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            kvm.num_queried_tokens += req.num_tokens
            kvm.num_hit_tokens += num_hit
            budget -= n
        return admitted, budget

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests.

        `sampled_token_ids[req_id]` is empty (or absent) for a non-final prefill chunk; tokens
        given for a request that did not sample this step (out.sampling_req_ids) are ignored. Stop
        checks follow vLLM 0.33's order: EOS, stop token ids, then length (max_tokens or
        max_model_len); EOS and stop ids only count once min_tokens outputs exist.
        """
        requests = self.requests
        outputs: list[EngineCoreOutput] = []
        append = outputs.append
        stopped: list[Request] = []
        get_sampled = sampled_token_ids.get
        rows = scheduler_output.sampling_req_ids
        for rid in (rows if rows is not None else scheduler_output.num_scheduled_tokens):
            toks = get_sampled(rid)
            if not toks:
                continue
            req = requests.get(rid)
            if req is None or req.status != _RUNNING:
                continue  # aborted (or preempted) while the step ran
            status = None
            out_ids = req.output_token_ids
            n0 = len(out_ids)
            for tok in toks:
                out_ids.append(tok)
                req.all_token_ids.append(tok)
                req.num_tokens += 1
                stop_ids = req.stop_ids
                if stop_ids is not None and tok in stop_ids and (
                        len(out_ids) >= req.sampling_params.min_tokens):
                    status = _STOPPED
                    if tok != req.eos_token_id or req.sampling_params.ignore_eos:
                        req.stop_reason = tok
                    break
                if req.num_tokens >= req.token_limit:
                    status = _LENGTH
                    break
            if status is not None and len(out_ids) - n0 < len(toks):
                toks = toks[:len(out_ids) - n0]  # tokens after the stop are dropped
            if status is None:
                append(EngineCoreOutput(rid, toks))
            else:
                req.status = status
                stopped.append(req)
                self._free_request(req)
                append(EngineCoreOutput(rid, toks, _FINISH_REASON[status], req.stop_reason))
        if len(stopped) == 1:
            self.running.remove(stopped[0])  # identity compare, in C
        elif stopped:
            drop = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in drop]
        return outputs

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Cross-checks used by tests and debug runs (mini-sglang's check_integrity)."""
        self.kv_cache_manager.check_integrity()
        assert len(self.running) <= self.max_num_seqs, "running exceeds max_num_seqs"
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "requests dict out of sync with queues"
        for r in self.running:
            assert r.status == _RUNNING
        for r in self.waiting:
            assert r.status in (_WAITING, _PREEMPTED)
            assert r.request_id not in self.kv_cache_manager.req_to_blocks

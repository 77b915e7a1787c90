"""The shared scheduler: vLLM V1 (0.33) continuous batching, chunked prefill, prefix caching,
preemption by recompute. Pure Python; the engine and the simulator both drive it:

    out = scheduler.schedule()                         # decide this step
    sampled = runner.execute(out)  |  env.timeout(cost(out))
    outputs = scheduler.update_from_output(out, sampled)

There are no prefill/decode phases: each request has `num_computed_tokens` and `num_tokens`, and a
step decides only how many tokens each request advances (`num_scheduled_tokens`).

A driver that samples one fixed token for every request (the simulator) may instead call
`advance()`, which takes every step up to the next outside event at once (see there).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from engine.core.admission import AdmissionError, admit
from engine.core.config import SchedulerConfig
from engine.core.features import BatchFeatures
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output import (CachedRequestData, EngineCoreOutput, NewRequestData,
                                SchedulerOutput)
from engine.core.policy import make_queue
from engine.core.request import Request, RequestStatus
from engine.core.steady import LazyDecodes

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISH_REASON = {s: RequestStatus.finish_reason(s) for s in (
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)}


# Plain classes with their own __init__, not dataclasses: a step builds several, and mypyc
# compiles an explicit __init__ natively, while a dataclass with default factories keeps the
# generated Python __init__ (py-spy showed it among the compiled build's hottest frames).
class FastStep:
    """A step of Scheduler.advance() in which more happened than decodes."""

    __slots__ = ("index", "admitted", "first_tokens", "finished", "watched", "leave", "features")

    def __init__(self, admitted: list | None = None) -> None:
        self.index = 0                   # its position in Advance.ends
        self.admitted: list = admitted if admitted is not None else []  # (request, prefix-hit tokens, tokens, was new)
        self.first_tokens: list = []     # admitted requests that sampled a token
        self.finished: list = []         # (request, finish reason)
        self.watched: list = []          # requests that reached their watch point
        self.leave = False               # plain steps must follow
        self.features = BatchFeatures()


def _add_decodes(f: BatchFeatures, n: int, ctx: int) -> None:
    """Count n decodes reading ctx KV tokens, summed over featureless fast steps, into f."""
    f.num_reqs += n
    f.num_decode_reqs += n
    f.decode_context_tokens += ctx


class Cut:
    """Where a driver's step table closes a row inside one Scheduler.advance() run (after a step in
    which a request finished, when the run goes on through finishes): the steps before it, their
    summed features, and the scheduler's state after them."""

    __slots__ = ("num_steps", "features", "num_running", "num_waiting", "num_free_blocks")

    def __init__(self, num_steps: int, features: BatchFeatures, num_running: int, num_waiting: int,
                 num_free_blocks: int) -> None:
        self.num_steps = num_steps       # steps of the run up to and including the step it follows
        self.features = features         # summed over the steps since the previous cut
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.num_free_blocks = num_free_blocks


class Advance:
    """The steps one Scheduler.advance() call took."""

    __slots__ = ("start", "ends", "num_decodes", "events", "features", "cuts", "entered", "left")

    def __init__(self, start: float, entered: list[Request] | None = None) -> None:
        self.start = start
        self.ends: list[float] = []          # each step's end time
        self.num_decodes: list[int] = []     # each step's lazy decodes (one token each)
        self.events: list[FastStep] = []     # the steps with more than decodes
        self.features = BatchFeatures()      # summed over the steps after the last cut
        self.cuts: list[Cut] = []            # finishes the run went on through (stop_at_finish=False)
        self.entered: list[Request] = entered if entered is not None else []  # went lazy at the start
        self.left: list[Request] | None = None  # fast mode ended: sync()'s result; plain steps next

    @property
    def num_steps(self) -> int:
        return len(self.ends)


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
        )
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); reported once so the runner can drop state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # cumulative, for metrics
        # Fast mode (advance()): the running requests decoding lazily, or None.
        self._lazy: LazyDecodes | None = None

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
        it needs slots for at most min(prompt + max_tokens - 1, max_model_len) tokens.
        """
        tokens = min(num_prompt_tokens + max_tokens - 1, self.max_model_len)
        need = -(-tokens // self.block_size)
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
        lazy = self._lazy
        if lazy is not None:
            for req in found:
                seq = lazy.index.get(req.request_id)
                if seq is not None:  # its counters, tokens and cached blocks as of the last step
                    self.kv_cache_manager.cache_full_blocks(lazy.drop(seq))
        running_drop = {id(r) for r in found if r.status == _RUNNING}
        if running_drop:
            self.running = [r for r in self.running if id(r) not in running_drop]
        waiting_drop = [r for r in found if r.status != _RUNNING]
        if waiting_drop:
            self.waiting.remove_requests(waiting_drop)
        for req in found:
            req.status = finished_status
            self._free_request(req)

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
        if self._lazy is not None:
            self.sync()
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
                # append_slots would allocate and cache nothing (the fast steps of advance() skip
                # exactly these requests too).
                if computed < len(req_to_blocks[rid]) * bs and (not caching or (computed + 1) % bs):
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
                # One new token: the call a fast step makes for the decodes at a block boundary.
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
            admitted, budget = self._admit_waiting(budget, thr)
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

    def _admit_waiting(self, budget: int, thr: int) -> tuple[list[tuple[Request, int, int, bool]], int]:
        """The waiting part of a step: admit from the head of the queue while the token budget,
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

    # ------------------------------------------------------------ fast steps
    def advance(self, token_id: int, step_time: Callable[[BatchFeatures], float], start: float,
                until: float, watch: Callable[[Request], int | None] | None = None,
                then: int = 0, decode_time: Callable[[int, int], float] | None = None,
                stop_at_finish: bool = True, arrive: Callable[[float, float], float] | None = None,
                arrive_at: float = math.inf) -> Advance | None:
        """Steps back to back, for a driver that samples `token_id` for every request (the
        simulator): the steps schedule() + update_from_output(out, {id: [token_id] for each
        sampling request}) would take, while the clock, which starts at `start` and advances
        by `step_time(features)` per step, is before `until` (the next outside event).

        Only steps in which every running request decodes are taken here ("fast steps"); the
        per-request work of such a step is done only for the requests whose step is more than a
        counter increment (engine/core/steady.py), with the code schedule() runs for them:
        KVCacheManager.append_slots at block boundaries, _admit_waiting for the waiting queue,
        update_from_output for finishes and first tokens. Running requests stay *lazy* (their
        counters stale) between calls, until sync(), schedule() or finish_requests() writes
        them back.

        Returns None when no fast step can be taken now (take a plain step). Otherwise the
        steps taken (maybe none, when `until` <= `start`); the run also stops after a step in
        which a request finished (unless `stop_at_finish` is False: a driver to which a finish
        brings no outside event; each such finish is then a `Cut` in the result, where the driver's
        step table can close a row) or reached its `watch(request)` num_tokens, and before a step
        fast steps cannot take (a preemption, a partial prefill chunk, more decodes than the
        token budget): then `left` is set and the next step must be a plain one.
        With `then` > 0, that many more steps are taken once the clock has reached `until`
        (unless the run stops earlier for a reason above): a driver whose next outside event
        cannot change the step after it (async scheduling: an arrival during step n first runs
        in step n+2) lets the run go on through that step.
        The features passed to step_time are valid during the call only. `decode_time(n, ctx)`,
        if given, is step_time of a step of n decodes reading ctx KV tokens and nothing else (it
        must equal step_time on those features); such steps then build no features.
        `arrive(last_start, now)`, if given, is the driver's own arrival handling, for a driver
        whose arrivals are known ahead (an open loop): it is called at each boundary of the run
        after its first step whose time `now` has reached `arrive_at`, with the start of the step
        that just ended; it may add_request() the requests that have arrived, and returns the
        time at which it wants to be called again (math.inf: never). Arrivals then join the run
        instead of ending it: the next step admits them as any step admits waiting requests.
        """
        lazy = self._lazy
        entered: list[Request] = []
        if lazy is None:
            if not self._can_go_lazy(token_id):
                return None
            lazy = self._lazy = LazyDecodes(self.block_size, self.kv_cache_manager.enable_caching,
                                            token_id)
            for r in self.running:
                lazy.join(r, 0, watch(r) if watch is not None else None)
            entered = list(self.running)
        elif lazy.token_id != token_id:
            raise ValueError(f"advance(token_id={token_id}) while fast steps run with {lazy.token_id}")
        res = Advance(start, entered=entered)
        ends, decodes, events = res.ends, res.num_decodes, res.events
        total = res.features
        n_sum = ctx_sum = 0
        decode_f = BatchFeatures()  # reused for pure decode steps
        t = start
        more = then
        while True:
            if t >= until:
                if more <= 0:
                    break
                more -= 1
            arrived = False
            if t >= arrive_at and ends and arrive is not None:
                state = (len(self.running), len(self.waiting), self.kv_cache_manager.num_free_blocks)
                arrive_at = arrive(ends[-2] if len(ends) > 1 else start, t)
                arrived = True
            step = self._fast_step(lazy, watch)
            if step is None:
                # The steps since the last cut end as they were before the arrivals: a cut there.
                if arrived and not (res.cuts and res.cuts[-1].num_steps == len(ends)):
                    _add_decodes(total, n_sum, ctx_sum)
                    n_sum = ctx_sum = 0
                    res.cuts.append(Cut(len(ends), total, state[0], state[1], state[2]))
                    total = BatchFeatures()
                res.left = self.sync()
                break
            n, ctx, f = step
            if f is None:
                if decode_time is not None:
                    t += decode_time(n, ctx)
                else:
                    decode_f.num_reqs = decode_f.num_decode_reqs = n
                    decode_f.decode_context_tokens = ctx
                    t += step_time(decode_f)
                n_sum += n
                ctx_sum += ctx
            else:
                t += step_time(f.features)
                f.index = len(ends)
                events.append(f)
                total.merge(f.features)
            ends.append(t)
            decodes.append(n)
            if f is not None:
                if f.leave:
                    res.left = self.sync()
                    break
                if f.watched:
                    break
                if f.finished:
                    if stop_at_finish:
                        break
                    _add_decodes(total, n_sum, ctx_sum)
                    n_sum = ctx_sum = 0
                    res.cuts.append(Cut(len(ends), total, len(self.running), len(self.waiting),
                                        self.kv_cache_manager.num_free_blocks))
                    total = BatchFeatures()
        _add_decodes(total, n_sum, ctx_sum)
        res.features = total
        return res

    def sync(self) -> list[Request]:
        """Leave fast mode: write every lazy request's counters and tokens back. Returns those
        requests (a driver brings its records up to date)."""
        lazy = self._lazy
        if lazy is None:
            return []
        self._lazy = None
        written = lazy.drop_all()
        for r in written:
            self.kv_cache_manager.cache_full_blocks(r)
        return written

    def _can_go_lazy(self, token_id: int) -> bool:
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1:
                return False
            if r.stop_ids is not None and token_id in r.stop_ids:
                return False  # the fixed token could stop it: every token must be checked
        return True

    def _fast_step(self, lazy: LazyDecodes, watch) -> tuple[int, int, FastStep | None] | None:
        """One step with every running request lazy, or None (nothing changed) when schedule()
        must take it. Returns (decodes, their KV tokens read, what else happened or None)."""
        n_dec = len(lazy)
        running = self.running
        if n_dec == 0 or n_dec != len(running) or n_dec > self.max_num_batched_tokens:
            return None
        members = lazy.members
        kvm = self.kv_cache_manager

        # 1. Running part: the requests at a block boundary get append_slots, in running order;
        #    the step is refused whole if the pool cannot give every block (a preemption).
        seqs, need = lazy.block_events()
        if seqs:
            if need > kvm.num_free_blocks:
                return None
            c0s, s0s, t = lazy.c0, lazy.s0, lazy.t
            tok = lazy.token_id
            hashing = lazy.caching
            at_boundary = []
            for seq in seqs:
                # lazy.materialize(r, computed before step t), inlined: this loop is hot. The
                # tokens are only needed where append_slots may hash them (written back later).
                r = members[seq]
                p = c0s[seq] + t - s0s[seq]
                r.num_computed_tokens = p
                r.num_tokens = p + 1
                if hashing and r.unique_from is None:
                    missing = p + 1 - len(r.all_token_ids)
                    if missing > 0:
                        tail = [tok] * missing
                        r.all_token_ids += tail
                        r.output_token_ids += tail
                at_boundary.append(r)
            kvm.append_slots(at_boundary)  # cannot fail: need <= free
        ctx = lazy.ctx_base + n_dec * lazy.t  # lazy.decode_context_tokens()

        # 2. Waiting part: the admission code of schedule().
        admitted: list = []
        if self.waiting and n_dec < self.max_num_seqs and n_dec < self.max_num_batched_tokens:
            admitted, _ = self._admit_waiting(self.max_num_batched_tokens - n_dec,
                                              self.config.long_prefill_token_threshold)

        # 3. Update: members at their length limit, then admitted requests that computed their
        #    whole prompt, sample through update_from_output (in running order, as a plain step).
        limit, watched = lazy.pop_limit_events()
        t = lazy.t
        if not admitted and not limit and not watched:
            lazy.t = t + 1
            return n_dec, ctx, None
        step = FastStep(admitted=list(admitted) if admitted else [])
        step.watched = [members[seq] for seq in watched]
        sampling = []
        for seq in limit:
            r = lazy.drop(seq)  # as before step t; then as schedule() leaves it: c + 1 computed
            r.num_computed_tokens += 1
            kvm.cache_full_blocks(r)
            sampling.append(r)
        lazy.t = t + 1
        done = [a[0] for a in admitted if a[1] + a[2] == a[0].num_tokens]
        step.leave = len(done) < len(admitted)  # a partial chunk runs: plain steps next
        sampling += done
        if sampling:
            ids = [r.request_id for r in sampling]
            out = SchedulerOutput([], [], None, {}, 0, set(), set(), sampling_req_ids=ids)
            outs = self.update_from_output(out, dict.fromkeys(ids, lazy.tok_list))
            tok = lazy.token_id
            first = len(limit)
            for k, (r, o) in enumerate(zip(sampling, outs)):
                if k >= first:
                    step.first_tokens.append(r)
                if o.finish_reason is not None:
                    step.finished.append((r, o.finish_reason))
                    continue
                w = watch(r) if watch is not None else None
                if w is not None and r.num_tokens >= w:
                    step.watched.append(r)  # its first token already reaches the watch point
                if r.stop_ids is not None and tok in r.stop_ids:
                    step.leave = True  # the fixed token could stop it later (min_tokens)
                    continue
                lazy.join(r, t + 1, w)
        f = step.features
        f.num_decode_reqs = n_dec
        f.decode_context_tokens = ctx
        for _r, num_hit, n, _new in admitted:
            f.add(n, num_hit)
        f.num_reqs = n_dec + len(admitted)
        return n_dec, ctx, step

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

"""Steady decoding: the scheduler's steps in O(events) instead of O(running requests).

When every running request is decoding, a step (schedule() + update_from_output() with every
sampling request given the same token) changes each running request in the same way: one more
computed token and one more output token. `SteadyDecoder` keeps those requests *lazy*: each
remembers the computed count c0 it had at steady step S0, and at steady step t it stands at
c0 + (t - S0). Only what a step can actually change is done per step, in the order schedule()
does it:

    running part   a request whose next token position starts a block gets one (block events,
                   popped from a heap in running order); a request whose block fills caches it
    waiting part   Scheduler._admit_waiting, the very code schedule() runs
    update         requests reaching their length limit finish (finish heap, running order); new
                   requests that computed their whole prompt sample their first token through
                   update_from_output and join the lazy set

A step it cannot do this way (a decode would need a block the pool does not have, i.e. a
preemption; more running requests than the token budget) is refused before anything changes
(`try_step` returns None); a step that admits a partial prefill chunk is done, then the decoder
asks to be left (`StepResult.leave`). `leave()` writes every lazy request's real counters and
tokens back. Every decision is the general scheduler's: tests/test_steady.py checks the whole
state against plain steps after every step.

Only drivers that sample one fixed token for everybody (the simulator) can use it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.core.features import BatchFeatures
from engine.core.output import EngineCoreOutput, SchedulerOutput
from engine.core.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_ALLOC, _CACHE = 0, 1


@dataclass(slots=True)
class StepResult:
    features: BatchFeatures
    num_decodes: int                                   # lazy decodes that got a token
    admitted: list[tuple[Request, int, int, bool]]     # (request, prefix hits, tokens, was new)
    first_tokens: list[Request] = field(default_factory=list)   # admitted, sampled a token
    finished: list[tuple[Request, str]] = field(default_factory=list)  # (request, reason)
    leave: bool = False                                 # a partial prefill joined running


class SteadyDecoder:
    def __init__(self, scheduler, token_id: int) -> None:
        s = self.s = scheduler
        self.tok = token_id
        self.tok_list = [token_id]
        self.bs = s.block_size
        self.caching = s.kv_cache_manager.enable_caching
        self.t = 0                      # steady steps done
        self.lazy: dict[str, tuple[int, int, int]] = {}   # request id -> (c0, S0, seq)
        self.ctx_base = 0               # sum over lazy of (c0 - S0 + 1): KV read at step t = base + N t
        self.events: list[tuple[int, int, int, str]] = []  # (step, seq, kind, request id)
        self.finishes: list[tuple[int, int, str]] = []     # (step, seq, request id)
        self.seq = 0
        self.active = True
        for r in s.running:
            self._join(r, 0)

    @staticmethod
    def can_enter(scheduler, token_id: int) -> bool:
        running = scheduler.running
        if not running or len(running) > scheduler.max_num_batched_tokens:
            return False
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1:
                return False
            if r.stop_ids is not None and token_id in r.stop_ids:
                return False
        return True

    # --------------------------------------------------------------- members
    def _join(self, r: Request, s0: int) -> None:
        """r is decode-ready before steady step s0: it computes position c0 at step s0."""
        c0 = r.num_computed_tokens
        seq = self.seq
        self.seq += 1
        self.lazy[r.request_id] = (c0, s0, seq)
        self.ctx_base += c0 - s0 + 1
        bs = self.bs
        rid = r.request_id
        ev = self.events
        heapq.heappush(ev, (s0 + (-c0) % bs, seq, _ALLOC, rid))          # position c0 + k starts a block
        if self.caching:
            heapq.heappush(ev, (s0 + (-(c0 + 1)) % bs, seq, _CACHE, rid))  # position c0 + k fills one
        heapq.heappush(self.finishes, (s0 + r.token_limit - c0 - 2, seq, rid))

    def _sync(self, r: Request, c0: int, s0: int, computed: int, num_tokens: int) -> None:
        """Write a lazy request's counters and tokens for a given point."""
        r.num_computed_tokens = computed
        missing = num_tokens - len(r.all_token_ids)
        if missing > 0:
            tail = [self.tok] * missing
            r.all_token_ids.extend(tail)
            r.output_token_ids.extend(tail)
        r.num_tokens = num_tokens

    def _drop(self, rid: str) -> tuple[int, int, int]:
        c0, s0, seq = self.lazy.pop(rid)
        self.ctx_base -= c0 - s0 + 1
        return c0, s0, seq

    def leave(self) -> None:
        """Write back every lazy request (between steps) and stop."""
        t = self.t
        reqs = self.s.requests
        for rid, (c0, s0, _) in self.lazy.items():
            computed = c0 + t - s0
            self._sync(reqs[rid], c0, s0, computed, computed + 1)
        self.lazy.clear()
        self.events.clear()
        self.finishes.clear()
        self.ctx_base = 0
        self.active = False

    def abort(self, request_ids) -> None:
        """Abort requests between steps (they may be lazy, waiting or unknown)."""
        t = self.t
        reqs = self.s.requests
        for rid in request_ids:
            if rid in self.lazy:
                c0, s0, _ = self._drop(rid)
                computed = c0 + t - s0
                self._sync(reqs[rid], c0, s0, computed, computed + 1)
        self.s.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def position(self, rid: str) -> tuple[int, int]:
        """(num_computed_tokens, num_tokens) of a request between steps, lazy or not."""
        if rid in self.lazy:
            c0, s0, _ = self.lazy[rid]
            c = c0 + self.t - s0
            return c, c + 1
        r = self.s.requests[rid]
        return r.num_computed_tokens, r.num_tokens

    # ------------------------------------------------------------------ step
    def try_step(self) -> StepResult | None:
        s = self.s
        lazy = self.lazy
        n_dec = len(lazy)
        if not self.active or n_dec == 0 or n_dec != len(s.running) or n_dec > s.max_num_batched_tokens:
            return None
        t = self.t
        kvm = s.kv_cache_manager
        pool = kvm.block_pool
        reqs = s.requests

        # 1. Running part: block events of this step, refused if the pool cannot cover them.
        ev = self.events
        todo = []
        while ev and ev[0][0] == t:
            e = heapq.heappop(ev)
            if e[3] in lazy and lazy[e[3]][2] == e[1]:
                todo.append(e)
        need = sum(1 for e in todo if e[2] == _ALLOC)
        if need > kvm.num_free_blocks:
            for e in todo:
                heapq.heappush(ev, e)
            return None  # a preemption: the general path decides it
        bs = self.bs
        for e in todo:
            rid = e[3]
            r = reqs[rid]
            blocks = kvm.req_to_blocks[rid]
            if e[2] == _ALLOC:
                blocks.extend(pool.get_new_blocks(1))
            else:
                c0, s0, _ = lazy[rid]
                # The block holding position p = c0 + t - s0 fills: its tokens are all known.
                p = c0 + t - s0
                self._sync(r, c0, s0, r.num_computed_tokens, p + 1)
                kvm._cache_full_blocks(r, blocks, (p + 1) // bs)
            heapq.heappush(ev, (t + bs, e[1], e[2], rid))

        # 2. Waiting part: the scheduler's own admission code.
        budget = s.max_num_batched_tokens - n_dec
        admitted: list = []
        if s.waiting and budget > 0 and n_dec < s.max_num_seqs:
            admitted, budget = s._admit_waiting(budget, s.config.long_prefill_token_threshold)

        f = BatchFeatures(num_decode_reqs=n_dec, decode_context_tokens=self.ctx_base + n_dec * t)
        for r, num_hit, n, _ in admitted:
            if n == 1:
                f.num_decode_reqs += 1
                f.decode_context_tokens += num_hit + 1
            else:
                f.add_chunk(n, num_hit)
        f.num_reqs = n_dec + len(admitted)
        result = StepResult(f, n_dec, admitted)

        # 3. Update: lazy requests at their length limit finish, in running order.
        fin = self.finishes
        while fin and fin[0][0] == t:
            _, seq, rid = heapq.heappop(fin)
            if rid not in lazy or lazy[rid][2] != seq:
                continue
            c0, s0, _ = self._drop(rid)
            r = reqs[rid]
            computed = c0 + t - s0 + 1
            self._sync(r, c0, s0, computed, computed + 1)
            r.status = _LENGTH
            s._free_request(r)
            s.running.remove(r)
            result.finished.append((r, "length"))
        # ... then admitted requests that computed their whole prompt sample their first token.
        sampling = [r.request_id for r, num_hit, n, _ in admitted if num_hit + n == r.num_tokens]
        if len(sampling) < len(admitted):
            result.leave = True  # a partial prefill chunk is running: general steps from here
        if sampling:
            out = SchedulerOutput([], [], None, {}, 0, set(), set(), sampling_req_ids=sampling)
            outs: list[EngineCoreOutput] = s.update_from_output(out, dict.fromkeys(sampling, self.tok_list))
            for o in outs:
                r = reqs.get(o.request_id)
                if o.finish_reason is not None:
                    # freed by update_from_output; find the object among the admitted
                    r = next(a[0] for a in admitted if a[0].request_id == o.request_id)
                    result.first_tokens.append(r)
                    result.finished.append((r, o.finish_reason))
                else:
                    result.first_tokens.append(r)
                    self._join(r, t + 1)
        self.t = t + 1
        return result

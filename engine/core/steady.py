"""Steady decoding: the scheduler's steps in O(events) instead of O(running requests).

When every running request is decoding, a step (schedule() + update_from_output() with every
sampling request given the same token) changes each running request in the same way: one more
computed token and one more output token. `SteadyDecoder` keeps those requests *lazy*: each
remembers the computed count c0 it had at steady step s0, and at steady step t it stands at
c0 + (t - s0). Only what a step can actually change is done per step, in the order schedule()
does it:

    running part   a request whose next token position starts a block gets one, a request
                   whose block fills caches it (block events, from a heap, in running order)
    waiting part   Scheduler._admit_waiting, the very code schedule() runs
    update         requests reaching their length limit finish (finish heap, running order); new
                   requests that computed their whole prompt sample their first token through
                   update_from_output and join the lazy set

A step it cannot do this way (a decode would need a block the pool does not have, i.e. a
preemption; more running requests than the token budget) is refused before anything changes
(`try_step` returns None); after a step that admitted a partial prefill chunk the decoder asks
to be left (`StepResult.leave`). `leave()` writes every lazy request's real counters and tokens
back. Every decision is the general scheduler's: tests/test_steady.py checks the whole state
against plain steps after every step.

Only drivers that sample one fixed token for everybody (the simulator) can use it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from engine.core.features import BatchFeatures
from engine.core.output import SchedulerOutput
from engine.core.request import Request, RequestStatus

_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_SHIFT = 32            # event key = step << 32 | seq << 1 | kind (ints compare fastest in a heap)
_SEQ_MASK = (1 << 31) - 1
_ALLOC, _CACHE = 0, 1


@dataclass(slots=True)
class StepResult:
    # The lists are empty tuples unless something happened (a step is usually just decodes).
    num_decodes: int                 # lazy decodes that got a token
    decode_context_tokens: int       # KV tokens they read
    admitted: list | tuple = ()      # (request, prefix hits, tokens, was new)
    first_tokens: list | tuple = ()  # admitted requests that sampled a token
    finished: list | tuple = ()      # (request, finish reason)
    watched: list | tuple = ()       # requests that reached their watch point
    leave: bool = False              # a partial prefill joined running

    @property
    def features(self) -> BatchFeatures:
        f = BatchFeatures(num_decode_reqs=self.num_decodes,
                          decode_context_tokens=self.decode_context_tokens)
        for _r, num_hit, n, _new in self.admitted:
            f.add(n, num_hit)
        f.num_reqs = self.num_decodes + len(self.admitted)
        return f


class SteadyDecoder:
    """`watch(request)` may return a num_tokens at which the driver wants to hear about a lazy
    request (e.g. a client that disconnects after so many tokens): the step at whose end the
    request reaches it lists it in StepResult.watched."""

    def __init__(self, scheduler, token_id: int, watch=None) -> None:
        s = self.s = scheduler
        self.watch = watch
        self.tok = token_id
        self.tok_list = [token_id]
        self.bs = s.block_size
        self.caching = s.kv_cache_manager.enable_caching
        self.t = 0                       # steady steps done
        self.lazy: dict[str, int] = {}   # request id -> seq (its rank in running order)
        self.members: list[Request | None] = []   # by seq; None once it left the lazy set
        self.c0: list[int] = []          # by seq: computed tokens when it joined ...
        self.s0: list[int] = []          # ... at this steady step
        self.ctx_base = 0                # sum over lazy of (c0 - s0 + 1): KV read at step t = base + N t
        self.events: list[int] = []      # block events, keys as above
        self.finishes: list[int] = []    # step << 32 | seq << 1 | watch (0: length limit)
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
        seq = len(self.members)
        self.members.append(r)
        self.c0.append(c0)
        self.s0.append(s0)
        self.lazy[r.request_id] = seq
        self.ctx_base += c0 - s0 + 1
        bs = self.bs
        ev = self.events
        # Position c0 + k starts a block at step s0 + k for k = (-c0) mod bs, then every bs.
        heapq.heappush(ev, ((s0 + (-c0) % bs) << _SHIFT) | (seq << 1) | _ALLOC)
        if self.caching:  # ... and fills one at k = (-(c0 + 1)) mod bs
            heapq.heappush(ev, ((s0 + (-(c0 + 1)) % bs) << _SHIFT) | (seq << 1) | _CACHE)
        # After step t its num_tokens is c0 + (t - s0) + 2: the length limit is reached at
        heapq.heappush(self.finishes, ((s0 + r.token_limit - c0 - 2) << _SHIFT) | (seq << 1))
        if self.watch is not None:
            w = self.watch(r)
            if w is not None and c0 + 1 < w < r.token_limit:
                heapq.heappush(self.finishes, ((s0 + w - c0 - 2) << _SHIFT) | (seq << 1) | 1)

    def _fill(self, r: Request, num_tokens: int) -> None:
        missing = num_tokens - len(r.all_token_ids)
        if missing > 0:
            tail = [self.tok] * missing
            r.all_token_ids.extend(tail)
            r.output_token_ids.extend(tail)

    def _write_back(self, r: Request, computed: int) -> Request:
        r.num_computed_tokens = computed
        self._fill(r, computed + 1)
        r.num_tokens = computed + 1
        return r

    def _drop(self, seq: int) -> int:
        """Take a request out of the lazy set; returns its computed count before step t."""
        r = self.members[seq]
        self.members[seq] = None
        del self.lazy[r.request_id]
        c0, s0 = self.c0[seq], self.s0[seq]
        self.ctx_base -= c0 - s0 + 1
        return c0 + self.t - s0

    def leave(self) -> None:
        """Write back every lazy request (between steps) and stop."""
        t = self.t
        for seq in self.lazy.values():
            self._write_back(self.members[seq], self.c0[seq] + t - self.s0[seq])
        self.lazy.clear()
        self.members.clear()
        self.events.clear()
        self.finishes.clear()
        self.ctx_base = 0
        self.active = False

    def abort(self, request_ids) -> None:
        """Abort requests between steps (they may be lazy, waiting or unknown)."""
        for rid in request_ids:
            seq = self.lazy.get(rid)
            if seq is not None:
                r = self.members[seq]
                self._write_back(r, self._drop(seq))
        self.s.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ step
    def try_step(self) -> StepResult | None:
        s = self.s
        lazy = self.lazy
        n_dec = len(lazy)
        if not self.active or n_dec == 0 or n_dec != len(s.running) or n_dec > s.max_num_batched_tokens:
            return None
        t = self.t
        kvm = s.kv_cache_manager
        members = self.members

        # 1. Running part: the block events of this step, refused whole if the pool cannot
        #    cover the allocations (a preemption, which schedule() must decide).
        ev = self.events
        if ev and ev[0] >> _SHIFT == t:
            todo = []
            need = 0
            while ev and ev[0] >> _SHIFT == t:
                key = heapq.heappop(ev)
                if members[(key >> 1) & _SEQ_MASK] is not None:
                    todo.append(key)
                    need += 1 - (key & 1)
            if need > kvm.num_free_blocks:
                for key in todo:
                    heapq.heappush(ev, key)
                return None
            self._block_events(todo, t, need)

        # 2. Waiting part: the scheduler's own admission code.
        res = StepResult(n_dec, self.ctx_base + n_dec * t)
        if s.waiting and n_dec < s.max_num_seqs and n_dec < s.max_num_batched_tokens:
            res.admitted, _ = s._admit_waiting(s.max_num_batched_tokens - n_dec,
                                               s.config.long_prefill_token_threshold)

        # 3. Update: lazy requests at their length limit finish, in running order ...
        fin = self.finishes
        if fin and fin[0] >> _SHIFT == t:
            res.finished, res.watched = [], []
            while fin and fin[0] >> _SHIFT == t:
                key = heapq.heappop(fin)
                seq = (key >> 1) & _SEQ_MASK
                r = members[seq]
                if r is None:
                    continue
                if key & 1:
                    res.watched.append(r)
                    continue
                self._write_back(r, self._drop(seq) + 1)
                r.status = _LENGTH
                s._free_request(r)
                s.running.remove(r)
                res.finished.append((r, "length"))
        # ... then admitted requests that computed their whole prompt sample their first token.
        if res.admitted:
            done = [a[0] for a in res.admitted if a[1] + a[2] == a[0].num_tokens]
            res.leave = len(done) < len(res.admitted)  # a partial chunk runs: plain steps next
            if done:
                res.first_tokens = []
                if not res.finished:
                    res.finished = []
                ids = [r.request_id for r in done]
                out = SchedulerOutput([], [], None, {}, 0, set(), set(), sampling_req_ids=ids)
                outs = s.update_from_output(out, dict.fromkeys(ids, self.tok_list))
                for r, o in zip(done, outs):
                    res.first_tokens.append(r)
                    if o.finish_reason is not None:
                        res.finished.append((r, o.finish_reason))
                    elif r.stop_ids is not None and self.tok in r.stop_ids:
                        # The fixed token could stop it later (min_tokens): plain steps must
                        # check every token, so it never decodes lazily.
                        res.leave = True
                    else:
                        self._join(r, t + 1)
        self.t = t + 1
        return res

    def _block_events(self, keys: list[int], t: int, need: int) -> None:
        """Allocate and cache blocks as allocate_slots would for these decodes.

        The step's new blocks are popped from the free queue at once, in the order the requests
        ask for them. Caching a filled block in between touches no free block, so the blocks
        each request gets are the ones step-by-step allocation would give it.
        """
        kvm = self.s.kv_cache_manager
        pool = kvm.block_pool
        cached = pool.cached
        req_to_blocks = kvm.req_to_blocks
        num_cached = kvm.num_cached_block
        members, c0s, s0s = self.members, self.c0, self.s0
        bs = self.bs
        ev = self.events
        step_ahead = bs << _SHIFT
        new_blocks = iter(pool.get_new_blocks(need)) if need else None
        salted_or_first = kvm._ensure_block_hashes
        for key in keys:
            seq = (key >> 1) & _SEQ_MASK
            r = members[seq]
            rid = r.request_id
            blocks = req_to_blocks[rid]
            if key & 1 == _ALLOC:
                blocks.append(next(new_blocks))
            else:
                # Position p = c0 + t - s0 fills block j: its tokens are all known by now.
                p = c0s[seq] + t - s0s[seq]
                j = (p + 1) // bs - 1
                self._fill(r, p + 1)
                if num_cached[rid] != j:
                    kvm._cache_full_blocks(r, blocks, j + 1)
                else:
                    hashes = r.block_hashes
                    if len(hashes) == j and j > 0:  # the usual case: one more block, inlined
                        hashes.append(hash((hashes[-1], tuple(r.all_token_ids[j * bs:(j + 1) * bs]))))
                    elif len(hashes) <= j:
                        salted_or_first(r, j + 1)
                    b = blocks[j]
                    if b.block_hash is None:
                        h = b.block_hash = hashes[j]
                        if cached.setdefault(h, b) is not b:  # h already cached: keep both
                            pool.cache_block(b, h)
                    num_cached[rid] = j + 1
            heapq.heappush(ev, key + step_ahead)

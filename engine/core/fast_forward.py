"""Fast-forward: the scheduler's steps taken in O(events) instead of O(running requests), for a
driver that samples one fixed token for every request (the simulator).

FastForwardScheduler extends the plain Scheduler (engine/core/scheduler.py), as vLLM's
AsyncScheduler extends Scheduler, through its public hooks: `admit_waiting` (the waiting part of a
step), `before_finish` (aborts), `update_from_output` and the KV cache manager's `append_slots`.
Every decision is the plain scheduler's code; this module adds only the bookkeeping that lets a
step skip the requests for which it is a counter increment. `advance()` takes the steps up to the
next outside event; `sync()`, `schedule()` and `finish_requests()` write the stale requests back,
so a driver can mix fast-forward runs and plain steps freely (tests/test_steady.py checks that
both leave the scheduler in the same state).

Lazy decodes (LazyDecodes), the bookkeeping. It holds arithmetic only; every decision is taken
by scheduler code.

While every running request decodes and every sampled token is the same fixed id (the simulator),
a step moves each running request by one token. A member of the lazy set remembers the computed
count c0 it had at fast step s0; at fast step t it stands at c0 + (t - s0) computed tokens, one
token short of num_tokens. Its Request object is stale until `materialize` writes the counters
and the missing tokens back.

What a step can change for a member comes from two kinds of events:

    block events   its next position starts a block (ALLOC), or its last token fills one (CACHE):
                   the scheduler materializes it and calls KVCacheManager.append_slots, the
                   call schedule() makes for such a decode. CACHE events exist only with prefix
                   caching on (without it a filled block needs nothing), and not for a request
                   whose blocks nobody else can hit (Request.unique_from): its filled blocks are
                   marked when it is written back (KVCacheManager.cache_full_blocks), which no
                   one can tell apart, since no lookup can hit them and nothing frees them
                   before.
    limit events   it reaches its length limit (it finishes through update_from_output), or a
                   num_tokens the driver asked to watch.

A member's block events of one kind recur every block_size steps, so they are kept by phase:
bucket k of a kind lists (in running order) the members whose events of that kind fall on the
steps t with t % block_size == k, from their first one on (no member is in a bucket before it
joined, and the first event comes within block_size steps of joining). A step reads its two
buckets; nothing is popped or pushed again. Limit events happen once per member: a heap of int
keys, step << 32 | seq << 1 | kind (ints compare fastest in a heap). seq is the member's rank in
running order, so the events of one step come out in running order.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from engine.core.config import SchedulerConfig
from engine.core.features import BatchFeatures
from engine.core.output import SchedulerOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler

SHIFT = 32
SEQ_MASK = (1 << 31) - 1
LIMIT, WATCH = 0, 1          # limit event kinds


class LazyDecodes:
    __slots__ = ("block_size", "caching", "token_id", "tok_list", "t", "index", "members", "c0",
                 "s0", "ctx_base", "alloc_at", "cache_at", "limit_events")

    def __init__(self, block_size: int, caching: bool, token_id: int) -> None:
        self.block_size = block_size
        self.caching = caching
        self.token_id = token_id
        self.tok_list = [token_id]         # shared, never mutated
        self.t = 0                         # fast steps taken
        self.index: dict[str, int] = {}    # request id -> seq
        self.members: list[Request | None] = []   # by seq; None once it left
        self.c0: list[int] = []            # by seq: computed tokens when it joined ...
        self.s0: list[int] = []            # ... before this step
        self.ctx_base = 0                  # sum over members of (c0 - s0 + 1)
        self.alloc_at: list[list[int]] = [[] for _ in range(block_size)]  # by phase: member seqs
        self.cache_at: list[list[int]] = [[] for _ in range(block_size)]
        self.limit_events: list[int] = []

    def __len__(self) -> int:
        return len(self.index)

    def join(self, r: Request, s0: int, watch_at: int | None = None) -> None:
        """r (num_tokens == num_computed_tokens + 1) decodes from step s0 on; `watch_at`: a
        num_tokens the driver wants to hear about (a limit event at the step that reaches it)."""
        c0 = r.num_computed_tokens
        seq = len(self.members)
        self.members.append(r)
        self.c0.append(c0)
        self.s0.append(s0)
        self.index[r.request_id] = seq
        self.ctx_base += c0 - s0 + 1
        bs = self.block_size
        # Position c0 + k starts a block at step s0 + k for k = (-c0) mod bs, then every bs steps ...
        self.alloc_at[(s0 + (-c0) % bs) % bs].append(seq)
        if self.caching and r.unique_from is None:  # ... and fills one at k = (-(c0 + 1)) mod bs.
            self.cache_at[(s0 + (-(c0 + 1)) % bs) % bs].append(seq)
        # After step s0 + k its num_tokens is c0 + k + 2.
        lim = self.limit_events
        heapq.heappush(lim, ((s0 + r.token_limit - c0 - 2) << SHIFT) | (seq << 1) | LIMIT)
        if watch_at is not None and c0 + 1 < watch_at < r.token_limit:
            heapq.heappush(lim, ((s0 + watch_at - c0 - 2) << SHIFT) | (seq << 1) | WATCH)

    def materialize(self, r: Request, computed: int) -> Request:
        """Write the counters (num_tokens = computed + 1) and the fixed tokens back."""
        r.num_computed_tokens = computed
        missing = computed + 1 - len(r.all_token_ids)
        if missing > 0:
            tail = [self.token_id] * missing
            r.all_token_ids.extend(tail)
            r.output_token_ids.extend(tail)
        r.num_tokens = computed + 1
        return r

    def drop(self, seq: int) -> Request:
        """Take member seq out of the set, its Request written back as of before step t."""
        r = self.members[seq]
        self.members[seq] = None
        del self.index[r.request_id]
        c0, s0 = self.c0[seq], self.s0[seq]
        self.ctx_base -= c0 - s0 + 1
        return self.materialize(r, c0 + self.t - s0)

    def drop_all(self) -> list[Request]:
        """Write every member back and empty the set; returns the members."""
        t = self.t
        out = []
        for seq in self.index.values():
            r = self.members[seq]
            out.append(self.materialize(r, self.c0[seq] + t - self.s0[seq]))
        self.index.clear()
        self.members.clear()
        self.c0.clear()
        self.s0.clear()
        for b in self.alloc_at:
            b.clear()
        for b in self.cache_at:
            b.clear()
        self.limit_events.clear()
        self.ctx_base = 0
        return out

    def block_events(self) -> tuple[list[int], int]:
        """The members (seqs, in running order, each once) with a block event at step t, and how
        many new blocks they need (their ALLOC events). Reading them consumes nothing: the same
        members come again bs steps later. The list is the scheduler's to read, not to keep."""
        k = self.t % self.block_size
        alloc = self._live_bucket(self.alloc_at, k)
        if not self.cache_at[k]:
            return alloc, len(alloc)
        cache = self._live_bucket(self.cache_at, k)
        if not alloc:
            return cache, 0
        return sorted(set(alloc).union(cache)), len(alloc)

    def _live_bucket(self, buckets: list[list[int]], k: int) -> list[int]:
        """buckets[k] without the members that left (dropped from it here, when any)."""
        bucket = buckets[k]
        members = self.members
        for seq in bucket:
            if members[seq] is None:
                bucket = buckets[k] = [q for q in bucket if members[q] is not None]
                break
        return bucket

    def pop_limit_events(self) -> tuple[list[int], list[int]]:
        """Members reaching their length limit at step t, and members reaching their watch
        point (seqs, in running order)."""
        lim = self.limit_events
        t = self.t
        limit: list[int] = []
        watch: list[int] = []
        members = self.members
        while lim and lim[0] >> SHIFT == t:
            key = heapq.heappop(lim)
            seq = (key >> 1) & SEQ_MASK
            if members[seq] is not None:
                (watch if key & 1 else limit).append(seq)
        return limit, watch


# Plain classes with their own __init__, not dataclasses: a step builds several, and mypyc
# compiles an explicit __init__ natively, while a dataclass with default factories keeps the
# generated Python __init__ (py-spy showed it among the compiled build's hottest frames).
class FastStep:
    """A step of FastForwardScheduler.advance() in which more happened than decodes."""

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
    """Where a driver's step table closes a row inside one FastForwardScheduler.advance() run (after a step in
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
    """The steps one FastForwardScheduler.advance() call took."""

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


class FastForwardScheduler(Scheduler):
    """The plain Scheduler plus advance(): fast-forward runs of steps (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        # The running requests decoding lazily while a fast-forward run is open, or None.
        self._lazy: LazyDecodes | None = None

    def schedule(self) -> SchedulerOutput:
        if self._lazy is not None:
            self.sync()
        return super().schedule()

    def before_finish(self, requests: list[Request]) -> None:
        lazy = self._lazy
        if lazy is not None:
            for req in requests:
                seq = lazy.index.get(req.request_id)
                if seq is not None:  # its counters, tokens and cached blocks as of the last step
                    self.kv_cache_manager.cache_full_blocks(lazy.drop(seq))

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
        counter increment (LazyDecodes above), with the code schedule() runs for them:
        KVCacheManager.append_slots at block boundaries, admit_waiting for the waiting queue,
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
        if self.kv_cache_manager.sliding_window:  # a window's blocks change off the block boundaries
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
        ctx = lazy.ctx_base + n_dec * lazy.t  # KV tokens the members read: sum of (c0 + t - s0 + 1)

        # 2. Waiting part: the admission code of schedule().
        admitted: list = []
        if self.waiting and n_dec < self.max_num_seqs and n_dec < self.max_num_batched_tokens:
            admitted, _ = self.admit_waiting(self.max_num_batched_tokens - n_dec,
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

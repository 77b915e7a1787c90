"""Lazy decodes: the bookkeeping that lets Scheduler.advance() take a step in O(events) instead of
O(running requests). It holds arithmetic only; every decision is taken by scheduler code.

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

from engine.core.request import Request

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

    def decode_context_tokens(self) -> int:
        """KV tokens the members read in step t: sum of (c0 + t - s0 + 1)."""
        return self.ctx_base + len(self.index) * self.t

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

    def computed(self, seq: int) -> int:
        """Member seq's computed tokens before step t."""
        return self.c0[seq] + self.t - self.s0[seq]

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
        alloc = self._live(self.alloc_at, k)
        if not self.cache_at[k]:
            return alloc, len(alloc)
        cache = self._live(self.cache_at, k)
        if not alloc:
            return cache, 0
        return sorted(set(alloc).union(cache)), len(alloc)

    def _live(self, buckets: list[list[int]], k: int) -> list[int]:
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

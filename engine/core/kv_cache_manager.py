"""Per-request KV block bookkeeping: prefix-cache lookup, slot allocation, caching, free.

This folds vLLM's KVCacheManager, coordinator and single-type (full attention) manager into one
class: one KV cache group, full attention, which is what the engine and simulator model.
"""
from __future__ import annotations

from engine.core.block_pool import ANONYMOUS, UNIQUE, BlockPool, KVCacheBlock
from engine.core.request import Request

_NO_BLOCKS: list = []  # shared, never mutated

# Seed of the hash chain; any fixed value works, it only has to be the same for every request.
NONE_HASH = hash(("servetwin-prefix-cache", 0))


def block_hashes(request: Request, num_full_blocks: int, block_size: int) -> list[int]:
    """The block hash, the only place it is computed: extend the request's chain
    (request.block_hashes) to `num_full_blocks` full blocks and return it.

        hashes[i] = hash((hashes[i - 1], tuple(tokens of block i)))     hashes[-1] = NONE_HASH

    Block 0 also mixes in the request's cache_salt (vLLM's) when it has one. Equal hashes mean
    equal token prefixes (up to 64-bit collisions). A block past request.unique_from (content
    no other request has) is keyed by the request id instead of its tokens, hashes[i] =
    hash((hashes[i - 1], request_id)): no other request can have it either, so its tokens need
    not exist (the simulator does not build them).
    """
    hashes = request.block_hashes
    n = len(hashes)
    if n >= num_full_blocks:
        return hashes
    bs = block_size
    toks = request.all_token_ids
    by_content = num_full_blocks
    if request.unique_from is not None:
        by_content = min(num_full_blocks, request.unique_from // bs)
    parent = hashes[-1] if n else NONE_HASH
    if n == 0 and request.cache_salt is not None:
        key = tuple(toks[:bs]) if by_content > 0 else request.request_id
        parent = hash((parent, key, request.cache_salt))
        hashes.append(parent)
        n = 1
    for i in range(n, by_content):
        parent = hash((parent, tuple(toks[i * bs:(i + 1) * bs])))
        hashes.append(parent)
    rid = request.request_id
    for _ in range(max(n, by_content), num_full_blocks):
        parent = hash((parent, rid))
        hashes.append(parent)
    return hashes


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        unhashed_first: bool = True,
        track_block_ids: bool = True,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, unhashed_first, track_block_ids)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already entered in the prefix-cache map.
        self.num_cached_block: dict[str, int] = {}
        # Prefix-cache statistics, counted by the scheduler once per admission.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ views
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, cached-but-unreferenced ones included (as vLLM counts)."""
        return self.block_pool.free_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    @property
    def usage(self) -> float:
        return self.block_pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids (-1 for each block while the pool is in counting mode)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def counting(self) -> bool:
        """Whether the pool counts blocks instead of tracking which (see the module docstring)."""
        return self.block_pool.counting

    def _materialize(self) -> None:
        """Leave counting mode: real blocks for every placeholder, marked as the request's cached
        blocks would be (UNIQUE up to num_cached_block: every request so far had unique_from 0)."""
        pool = self.block_pool
        held = list(self.req_to_blocks.items())
        pool.materialize([blocks for _rid, blocks in held])
        if self.enable_caching:
            for rid, blocks in held:
                for i in range(self.num_cached_block[rid]):
                    blocks[i].block_hash = UNIQUE

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ---------------------------------------------------------------- hashing
    def _ensure_block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        return block_hashes(request, num_full_blocks, self.block_size)

    # ---------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks from the start of the request.

        At most (num_tokens - 1) // block_size blocks: the last token is always recomputed so
        the step produces logits for it.
        """
        if not self.enable_caching:
            return [], 0
        if self.block_pool.counting and (request.unique_from != 0 or request.num_preemptions):
            self._materialize()  # its prompt may hit, or be hit by, a hashed block
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.unique_from is not None and request.num_preemptions == 0:
            # Blocks past unique_from are nobody else's; it has none of its own yet.
            max_blocks = min(max_blocks, request.unique_from // self.block_size)
            if max_blocks == 0:
                return [], 0
        hashes = self._ensure_block_hashes(request, max_blocks)
        get = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            b = get(hashes[i])
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    # ------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_reserve_tokens: int = 0,
        num_watermark_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None if the pool cannot.

        `num_reserve_tokens` (admission with reserve_full_prompt): the check requires blocks for
        that many tokens, though only the chunk's blocks are allocated now.
        Returns the newly allocated blocks (possibly empty).
        """
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_need_slot = num_computed + num_new_tokens
        if num_need_slot > self.max_model_len:
            num_need_slot = self.max_model_len
        num_required = -(-num_need_slot // bs)
        pool = self.block_pool
        free = pool.free_queue.num_free_blocks

        if new_computed_blocks:
            num_hits = len(new_computed_blocks)
            # A hit on a free cached block takes it out of the free queue, so it costs a block.
            num_evictable = 0
            for b in new_computed_blocks:
                if b.ref_cnt == 0:
                    num_evictable += 1
        else:
            num_hits = num_evictable = 0

        num_check = num_required
        if num_reserve_tokens:
            n = min(num_reserve_tokens, self.max_model_len)
            num_check = max(num_required, -(-n // bs))
        if num_check - num_held - num_hits + num_evictable + num_watermark_blocks > free:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_block[request.request_id] = 0
        if num_hits:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            num_held += num_hits
            # Hits are already in the map: they count as cached blocks of this request.
            self.num_cached_block[request.request_id] = num_hits
        num_new_blocks = num_required - num_held
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // bs
            if num_full > self.num_cached_block[request.request_id]:
                self._cache_full_blocks(request, req_blocks, num_full)
        return new_blocks

    def append_slots(self, requests: list[Request]) -> list[KVCacheBlock] | None:
        """allocate_slots(r, 1) for each of these running requests, in order, or for none of them
        (None) if the pool lacks the blocks. Each holds its blocks and schedules one new token
        (a decode, or a one-token chunk): it gets a block when the token's position starts one,
        and the block the token fills enters the prefix cache. Returns the new blocks in order.

        The one implementation of a one-token step: schedule() calls it for a single request,
        the fast steps of Scheduler.advance() for all the requests at a block boundary at once.
        """
        bs = self.block_size
        req_to_blocks = self.req_to_blocks
        need = 0
        for r in requests:
            if r.num_computed_tokens >= len(req_to_blocks[r.request_id]) * bs:
                need += 1
        pool = self.block_pool
        if need > pool.free_queue.num_free_blocks:
            return None
        new = pool.get_new_blocks(need) if need else _NO_BLOCKS
        k = 0
        caching = self.enable_caching
        for r in requests:
            p = r.num_computed_tokens
            blocks = req_to_blocks[r.request_id]
            if p >= len(blocks) * bs:
                blocks.append(new[k])
                k += 1
            # Only a token that fills its block can cache one (the blocks before are cached).
            if caching and (p + 1) % bs == 0 and (p + 1) // bs > self.num_cached_block[r.request_id]:
                self._cache_full_blocks(r, blocks, (p + 1) // bs)
        return new

    def cache_full_blocks(self, request: Request) -> None:
        """Enter the request's full computed blocks in the prefix cache, if some are not yet (as
        allocate_slots does for the blocks a step fills). Scheduler.advance() defers it for the
        UNIQUE blocks of a request decoding lazily: nobody can hit them, nothing frees them."""
        if self.enable_caching:
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            if num_full > self.num_cached_block.get(request.request_id, num_full):
                self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_full)

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_full: int) -> None:
        """Enter blocks [num_cached, num_full) of a request in the prefix-cache map (blocks past
        request.unique_from are marked UNIQUE instead: cached, but hashed only on preemption)."""
        start = self.num_cached_block[request.request_id]
        self.num_cached_block[request.request_id] = num_full
        if self.block_pool.counting:
            return  # unique_from is 0 (get_computed_blocks saw it): UNIQUE marks, made on leaving
        num_hashed = num_full
        if request.unique_from is not None:
            num_hashed = min(num_full, request.unique_from // self.block_size)
            for i in range(max(start, num_hashed), num_full):
                b = req_blocks[i]
                if b.block_hash is None:
                    b.block_hash = UNIQUE
            if start >= num_hashed:
                return
        hashes = block_hashes(request, num_hashed, self.block_size)
        cached = self.block_pool.cached
        for i in range(start, num_hashed):
            b = req_blocks[i]
            if b.block_hash is None:
                h = b.block_hash = hashes[i]
                if cached.setdefault(h, b) is not b:  # h already cached: keep both
                    self.block_pool.cache_block(b, h)

    def _hash_unique_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Give a request's UNIQUE blocks their real hashes and enter them in the map, as they
        would have been all along (a preempted request may hit them when it resumes)."""
        num = self.num_cached_block.get(request.request_id, 0)
        first = None
        for i in range(num):
            if blocks[i].block_hash is UNIQUE:
                first = i
                break
        if first is None:
            return
        hashes = block_hashes(request, num, self.block_size)
        cached = self.block_pool.cached
        for i in range(first, num):
            b = blocks[i]
            if b.block_hash is UNIQUE:
                h = b.block_hash = hashes[i]
                if cached.setdefault(h, b) is not b:
                    self.block_pool.cache_block(b, h)

    def uncache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Take the blocks past `num_computed_tokens` out of the prefix-cache map: they were
        entered when this step's chunk was allocated, and that chunk will not be computed."""
        blocks = self.req_to_blocks.get(request.request_id)
        first = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if not blocks or num_cached <= first:
            return
        for b in blocks[first:num_cached]:
            if b.block_hash is not None:
                self.block_pool.evict(b)
        self.num_cached_block[request.request_id] = first

    def free(self, request: Request, resumable: bool = False) -> None:
        """Release a request's blocks, last block first (so tails are evicted before prefixes).
        `resumable`: the request is preempted and will look its own blocks up again."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and resumable and self.block_pool.counting and self.enable_caching:
            self._materialize()  # it may hit its own blocks when it resumes
        if blocks and resumable and request.unique_from is not None:
            self._hash_unique_blocks(request, blocks)
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            if self.block_pool.counting:
                self.block_pool.release(len(blocks))
            else:
                self.block_pool.free_blocks(reversed(blocks))

    def check_integrity(self) -> None:
        """Invariants (mini-sglang style): ref counts equal holders; free queue consistent."""
        pool = self.block_pool
        if pool.counting:
            held = sum(len(blocks) for blocks in self.req_to_blocks.values())
            assert held + pool.free_queue.num_free_blocks == pool.num_blocks - 1, "block count drift"
            assert all(b is ANONYMOUS for blocks in self.req_to_blocks.values() for b in blocks), \
                "a tracked block in counting mode"
            assert not pool.cached, "a hashed block in counting mode"
            return
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        in_queue = {b.block_id for b in self.block_pool.free_queue}
        assert len(in_queue) == self.block_pool.free_queue.num_free_blocks, "free queue count drift"
        for b in self.block_pool.blocks[1:]:
            want = holders.get(b.block_id, 0)
            assert b.ref_cnt == want, f"block {b.block_id}: ref_cnt {b.ref_cnt} != holders {want}"
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"block {b.block_id} queue state"
        assert 0 not in in_queue, "null block in free queue"
        for h in self.block_pool.cached:
            for b in self.block_pool.cached_blocks(h):
                assert b.block_hash == h, f"block {b.block_id} hash map mismatch"

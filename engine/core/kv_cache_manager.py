"""Per-request KV block bookkeeping: prefix-cache lookup, slot allocation, caching, free.

This folds vLLM's KVCacheManager, coordinator and single-type (full attention) manager into one
class: one KV cache group, full attention, which is what the engine models. For a model whose
sliding-window layers keep their window in the same pool (vLLM's hybrid KV cache manager gives
each sliding-window group blocks for the tokens in its window only), the simulator also charges
each request its window: `sliding_window` tokens of `sliding_kv_bytes` per token, counted in
blocks of the pool, whose block holds block_size tokens of `kv_bytes` per token (the full-attention
layers'). A request holds, beside its own blocks, the pool blocks its window's blocks weigh: those
covering its last sliding_window - 1 computed tokens and the ones it schedules (all of a prefill
chunk, as vLLM allocates them before it frees what fell out of the window), rounded up.
"""
from __future__ import annotations

from engine.core.block_pool import NONE_HASH, UNIQUE, BlockPool, CountingBlockPool, KVCacheBlock, block_hashes
from engine.core.request import Request

_NO_BLOCKS: list = []  # shared, never mutated


def window_reserve_blocks(num_new_tokens: int, block_size: int, sliding_window: int, sliding_kv_bytes: int,
                          kv_bytes: int) -> int:
    """The most pool blocks a request's sliding-window layers hold in a step that schedules
    num_new_tokens: their blocks for the last sliding_window - 1 tokens and the new ones, at the
    worst alignment (one block more), each weighing sliding_kv_bytes / kv_bytes pool blocks."""
    sw = -(-(num_new_tokens + sliding_window - 1) // block_size) + 1
    return -(-(sw * sliding_kv_bytes) // kv_bytes)

class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        unhashed_first: bool = True,
        track_block_ids: bool = True,
        sliding_window: int = 0,
        sliding_kv_bytes: int = 0,
        kv_bytes: int = 0,
    ) -> None:
        self.block_size = block_size
        # The sliding-window charge (module docstring; 0: none) and each request's window blocks
        self.sliding_window = sliding_window if sliding_kv_bytes > 0 and kv_bytes > 0 else 0
        self.sliding_kv_bytes = sliding_kv_bytes
        self.kv_bytes = kv_bytes
        self.req_to_window: dict[str, list[KVCacheBlock]] = {}
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # The pool strategy (engine/core/block_pool.py): tracking, or counting until a lookup needs ids.
        self.block_pool: BlockPool = (BlockPool if track_block_ids else CountingBlockPool)(
            num_gpu_blocks, enable_caching, unhashed_first)
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

    def window_blocks(self, num_computed: int, num_need_slot: int) -> int:
        """Pool blocks a request's sliding-window layers hold once it has num_need_slot tokens' slots
        of which num_computed were computed before this step (0 without a sliding-window charge)."""
        w = self.sliding_window
        if not w:
            return 0
        bs = self.block_size
        first = num_computed - w + 1
        first = first // bs if first > 0 else 0
        sw = -(-num_need_slot // bs) - first
        return -(-(sw * self.sliding_kv_bytes) // self.kv_bytes)

    def window_reserve(self, num_new_tokens: int) -> int:
        """Pool blocks a request's window holds at most in a step that schedules num_new_tokens
        (window_reserve_blocks; 0 without a sliding-window charge)."""
        if not self.sliding_window:
            return 0
        return window_reserve_blocks(num_new_tokens, self.block_size, self.sliding_window,
                                     self.sliding_kv_bytes, self.kv_bytes)

    @property
    def counting(self) -> bool:
        """Whether the pool counts blocks instead of tracking which (engine/core/block_pool.py)."""
        return isinstance(self.block_pool, CountingBlockPool)

    def _track_blocks(self) -> None:
        """Swap the counting pool for the tracking one it stands for: real blocks for every
        placeholder, marked as the request's cached blocks would be (UNIQUE up to
        num_cached_block: every request so far had unique_from 0)."""
        pool = self.block_pool
        assert isinstance(pool, CountingBlockPool)
        held = list(self.req_to_blocks.items())
        self.block_pool = pool.tracked([blocks for _rid, blocks in held] + list(self.req_to_window.values()))
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
        the step produces logits for it. No hits for a request that wants its prompt's logprobs
        (vLLM's rule: its whole prompt is computed, so every position has logits).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        if self.block_pool.needs_ids(request, False):
            self._track_blocks()  # its prompt may hit, or be hit by, a hashed block
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
        window = 0
        if self.sliding_window:  # the window's blocks (module docstring): more, or fewer, than held
            rid = request.request_id
            want = self.window_blocks(num_computed, num_need_slot)
            held_w = len(self.req_to_window.get(rid, ()))
            window = want - held_w
            if window < 0:  # blocks that left the window go back first (vLLM's remove_skipped_blocks)
                self._resize_window(rid, window)
                window, held_w = 0, want
                free = pool.free_queue.num_free_blocks
            # admission (reserve_full_prompt): room for the window of a chunk this size at any offset
            num_check += max(want, self.window_reserve(num_new_tokens)) - held_w if num_reserve_tokens else window
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
        if window:  # (after the hits left the free queue: a window block is never one of them)
            self._resize_window(request.request_id, window)
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
        the fast steps of FastForwardScheduler.advance() for all the requests at a block boundary at once.
        """
        bs = self.block_size
        req_to_blocks = self.req_to_blocks
        need = 0
        for r in requests:
            if r.num_computed_tokens >= len(req_to_blocks[r.request_id]) * bs:
                need += 1
        pool = self.block_pool
        if self.sliding_window:
            grow = []
            for r in requests:
                d = self.window_blocks(r.num_computed_tokens, r.num_computed_tokens + 1) \
                    - len(self.req_to_window.get(r.request_id, ()))
                if d < 0:  # out of the window: back first, as in allocate_slots
                    self._resize_window(r.request_id, d)
                elif d:
                    grow.append((r.request_id, d))
            if need + sum(d for _rid, d in grow) > pool.free_queue.num_free_blocks:
                return None
            for rid, d in grow:
                self._resize_window(rid, d)
        elif need > pool.free_queue.num_free_blocks:
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

    def _resize_window(self, request_id: str, delta: int) -> None:
        """Give a request delta more window blocks (fewer when negative: the last ones go back)."""
        held = self.req_to_window.get(request_id)
        if held is None:
            held = self.req_to_window[request_id] = []
        if delta > 0:
            held.extend(self.block_pool.get_new_blocks(delta))
        else:
            self.block_pool.free_request_blocks(held[delta:])
            del held[delta:]

    def cache_full_blocks(self, request: Request) -> None:
        """Enter the request's full computed blocks in the prefix cache, if some are not yet (as
        allocate_slots does for the blocks a step fills). FastForwardScheduler.advance() defers it for the
        UNIQUE blocks of a request decoding lazily: nobody can hit them, nothing frees them."""
        if self.enable_caching:
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            if num_full > self.num_cached_block.get(request.request_id, num_full):
                self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_full)

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_full: int) -> None:
        """Enter blocks [num_cached, num_full) of a request in the prefix cache (the pool's
        cache_full_blocks: hashed, or UNIQUE past request.unique_from)."""
        start = self.num_cached_block[request.request_id]
        self.num_cached_block[request.request_id] = num_full
        self.block_pool.cache_full_blocks(request, req_blocks, start, num_full, self.block_size)

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
        if blocks and resumable and self.enable_caching and self.block_pool.needs_ids(request, True):
            self._track_blocks()  # it may hit its own blocks when it resumes
        if blocks and resumable and request.unique_from is not None:
            self._hash_unique_blocks(request, blocks)
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_request_blocks(blocks)
        window = self.req_to_window.pop(request.request_id, None)
        if window:
            self.block_pool.free_request_blocks(window)

    def check_integrity(self) -> None:
        """Invariants (mini-sglang style): the pool's own (ref counts equal holders, free queue
        consistent; or, counting, held + free = usable), and the manager's books."""
        held = self.req_to_blocks
        if self.req_to_window:
            held = {**held, **{"window " + rid: w for rid, w in self.req_to_window.items()}}
        self.block_pool.check_integrity(held)
        for rid, n in self.num_cached_block.items():
            assert n <= len(self.req_to_blocks.get(rid, ())), f"request {rid}: {n} cached blocks > held"

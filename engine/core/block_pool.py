"""KV cache blocks, the O(1) free queue and the block pool (prefix-cache map, lazy eviction).

Layout of the free queue (a doubly linked list threaded through the blocks themselves, so moving
a block allocates nothing):

    head <-> b7 <-> b3 <-> b9 <-> ... <-> tail
    ^ allocation pops here                ^ freed hashed blocks go here (LRU among cached)

A freed block keeps its prefix hash: it is still a cache hit until allocation pops it from the
head, at which point its hash is dropped from the map (lazy eviction). A hit on a free cached
block takes it out of the middle of the queue (`touch`).

Two pool classes with one interface, chosen by KVCacheManager:

    BlockPool          tracks which block each request holds (the engine, and vLLM);
    CountingBlockPool  counts them (the simulator, SchedulerConfig.track_block_ids=False). While
                       no block can ever be a prefix-cache hit, which block a request holds
                       cannot change any decision, only how many. get_new_blocks hands out the
                       shared placeholder ANONYMOUS (block_id -1), nothing moves in a free
                       queue, and cache marks are deferred. Before the first block hash that
                       someone could hit exists (`needs_ids`), the manager swaps it for the
                       BlockPool that `tracked()` builds, for good.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request

# block_hash of a block that is cached (it goes to the tail when freed, like any hashed block)
# but whose content is unique to its request (Request.unique_from), so no other request can hit
# it: its real hash is computed only if the request is preempted and may hit it on resumption.
# Never a key of the hash map.
UNIQUE = type("UniqueContent", (), {"__repr__": lambda self: "UNIQUE", "__slots__": ()})()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: object = None  # an int, UNIQUE, or None (no hash)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


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


# The block a counting pool hands out: every allocated slot holds this one object.
ANONYMOUS = KVCacheBlock(-1)


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1) per block."""

    __slots__ = ("head", "tail", "num_free_blocks")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = len(blocks)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail:
            raise ValueError("no free blocks left")
        self.remove(b)
        return b

    def remove(self, b: KVCacheBlock) -> None:
        p, n = b.prev_free, b.next_free
        p.next_free = n
        n.prev_free = p
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free_blocks += 1

    def appendleft(self, b: KVCacheBlock) -> None:
        first = self.head.next_free
        self.head.next_free = b
        b.prev_free = self.head
        b.next_free = first
        first.prev_free = b
        self.num_free_blocks += 1

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All KV blocks of one replica. Block 0 is the null block and is never handed out.

    `unhashed_first` (vLLM 0.33): blocks freed without a prefix hash go to the head of the free
    queue so they are reused before cached blocks; older V1 appended every freed block at the tail.

    The hash map holds, per hash, either one block or (when several requests computed the same
    content concurrently) a dict {block_id: block} in insertion order; a hit returns the first.
    The hot loops below inline the queue operations: they run for every block of every request.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, unhashed_first: bool = True) -> None:
        _check_num_blocks(num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.unhashed_first = unhashed_first
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.cached: dict = {}  # hash -> KVCacheBlock | {block_id: KVCacheBlock}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        v = self.cached.get(block_hash)
        if v is None or v.__class__ is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head of the free queue, evicting their stale hashes."""
        q = self.free_queue
        if n > q.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {q.num_free_blocks} free")
        out = []
        cached = self.cached if self.enable_caching else None
        head = q.head
        b = head.next_free
        for _ in range(n):
            h = b.block_hash
            if h is not None:  # lazy eviction (self.evict, inlined)
                if h is not UNIQUE and cached is not None:
                    v = cached.pop(h, None)
                    if v is not b and v is not None:  # several blocks hold h: put them back
                        cached[h] = v
                        self.evict(b)
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
            b = b.next_free  # (an allocated block's links are stale; nothing reads them)
        head.next_free = b
        b.prev_free = head
        q.num_free_blocks -= n
        return out

    def needs_ids(self, request: Request, resumable: bool) -> bool:
        """Whether the manager must swap this pool for a tracking one before looking `request` up
        (or freeing it, `resumable`) with prefix caching on. A tracking pool: never."""
        return False

    def free_request_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Release a request's blocks, last block first (so tails are evicted before prefixes)."""
        self.free_blocks(reversed(blocks))

    def evict(self, b: KVCacheBlock) -> None:
        """Take a block's hash out of the prefix-cache map (the block stays where it is)."""
        h = b.block_hash
        v = self.cached.get(h)
        if v is b:
            del self.cached[h]
        elif v is not None and v.__class__ is not KVCacheBlock:
            v.pop(b.block_id, None)
            if not v:
                del self.cached[h]
        b.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free queue."""
        q = self.free_queue
        for b in blocks:
            if b.ref_cnt == 0:
                q.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (eviction order).

        Blocks going to the tail are chained among themselves and spliced in once; blocks going
        to the head (unhashed, 0.33) likewise, each one ahead of the previous.
        """
        q = self.free_queue
        unhashed_first = self.unhashed_first
        t_first = t_last = h_first = h_last = None
        freed = 0
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed += 1
                if unhashed_first and b.block_hash is None:
                    if h_first is None:
                        h_first = h_last = b
                    else:  # b goes in front of the previous head-bound block
                        b.next_free = h_first
                        h_first.prev_free = b
                        h_first = b
                else:
                    if t_first is None:
                        t_first = t_last = b
                    else:
                        t_last.next_free = b
                        b.prev_free = t_last
                        t_last = b
        if t_first is not None:
            tail = q.tail
            last = tail.prev_free
            last.next_free = t_first
            t_first.prev_free = last
            t_last.next_free = tail
            tail.prev_free = t_last
        if h_first is not None:
            head = q.head
            first = head.next_free
            head.next_free = h_first
            h_first.prev_free = head
            h_last.next_free = first
            first.prev_free = h_last
        q.num_free_blocks += freed

    def cache_block(self, b: KVCacheBlock, block_hash: int) -> None:
        b.block_hash = block_hash
        v = self.cached.get(block_hash)
        if v is None:
            self.cached[block_hash] = b
        elif v.__class__ is KVCacheBlock:
            self.cached[block_hash] = {v.block_id: v, b.block_id: b}
        else:
            v[b.block_id] = b

    def cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], start: int, num_full: int,
                          block_size: int) -> None:
        """Enter blocks [start, num_full) of a request in the prefix-cache map (vLLM's
        BlockPool.cache_full_blocks); blocks past request.unique_from are marked UNIQUE instead:
        cached, but hashed only on preemption (KVCacheManager._hash_unique_blocks)."""
        num_hashed = num_full
        if request.unique_from is not None:
            num_hashed = min(num_full, request.unique_from // block_size)
            for i in range(max(start, num_hashed), num_full):
                b = req_blocks[i]
                if b.block_hash is None:
                    b.block_hash = UNIQUE
            if start >= num_hashed:
                return
        hashes = block_hashes(request, num_hashed, block_size)
        cached = self.cached
        for i in range(start, num_hashed):
            b = req_blocks[i]
            if b.block_hash is None:
                h = b.block_hash = hashes[i]
                if cached.setdefault(h, b) is not b:  # h already cached: keep both
                    self.cache_block(b, h)

    def check_integrity(self, req_to_blocks: dict[str, list[KVCacheBlock]]) -> None:
        """Invariants (mini-sglang style): ref counts equal holders; free queue consistent."""
        holders: dict[int, int] = {}
        for blocks in req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.num_free_blocks, "free queue count drift"
        for b in self.blocks[1:]:
            want = holders.get(b.block_id, 0)
            assert b.ref_cnt == want, f"block {b.block_id}: ref_cnt {b.ref_cnt} != holders {want}"
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"block {b.block_id} queue state"
        assert 0 not in in_queue, "null block in free queue"
        for h in self.cached:
            for b in self.cached_blocks(h):
                assert b.block_hash == h, f"block {b.block_id} hash map mismatch"

    def cached_blocks(self, block_hash: int) -> list[KVCacheBlock]:
        v = self.cached.get(block_hash)
        if v is None:
            return []
        return [v] if v.__class__ is KVCacheBlock else list(v.values())

    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks


class CountingBlockPool(BlockPool):
    """A pool that counts blocks instead of tracking them (see the module docstring). It holds no
    KVCacheBlock of its own: the blocks exist once `tracked()` builds the tracking pool."""

    def __init__(self, num_blocks: int, enable_caching: bool, unhashed_first: bool = True) -> None:
        _check_num_blocks(num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.unhashed_first = unhashed_first
        self.blocks = []
        self.free_queue = FreeBlockQueue([])
        self.free_queue.num_free_blocks = num_blocks - 1
        self.null_block = KVCacheBlock(0)
        self.cached = {}  # stays empty: no block carries a hash in this pool

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        q = self.free_queue
        if n > q.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {q.num_free_blocks} free")
        q.num_free_blocks -= n
        return [ANONYMOUS] * n

    def free_request_blocks(self, blocks: list[KVCacheBlock]) -> None:
        self.free_queue.num_free_blocks += len(blocks)

    def needs_ids(self, request: Request, resumable: bool) -> bool:
        """A lookup can hit, or be hit by, a hashed block: the request is preempted and may hit its
        own blocks when it resumes, or its prompt is not unique from its first token."""
        return resumable or request.unique_from != 0 or request.num_preemptions > 0

    def cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], start: int, num_full: int,
                          block_size: int) -> None:
        """Deferred: every request so far had unique_from 0 (needs_ids saw it), so its full blocks
        are UNIQUE marks, which the manager makes when it swaps in the tracking pool."""

    def tracked(self, held: list[list[KVCacheBlock]]) -> BlockPool:
        """The tracking pool this one stands for: every placeholder in `held` (the requests' block
        lists, each placeholder a block with one reference) gets a block of its own, in place, and
        the rest are free in id order, without hashes. No block here carries a hash anyone can
        hit, so the result differs from a tracking pool's state only in block numbering, the order
        of free blocks and UNIQUE marks on free blocks, none of which a lookup or a later
        allocation can tell apart (UNIQUE is never a key of the hash map; every such free block
        is evicted with no effect when allocation reaches it)."""
        pool = BlockPool(self.num_blocks, self.enable_caching, self.unhashed_first)
        blocks = pool.blocks
        k = 1  # block 0 is the null block
        for lst in held:
            for i in range(len(lst)):
                b = blocks[k]
                b.ref_cnt = 1
                lst[i] = b
                k += 1
        num_free = self.free_queue.num_free_blocks
        if k - 1 + num_free != self.num_blocks - 1:
            raise RuntimeError(f"block pool: {k - 1} held + {num_free} free != {self.num_blocks - 1} usable")
        pool.free_queue = FreeBlockQueue(blocks[k:])
        return pool

    def check_integrity(self, req_to_blocks: dict[str, list[KVCacheBlock]]) -> None:
        held = sum(len(blocks) for blocks in req_to_blocks.values())
        assert held + self.free_queue.num_free_blocks == self.num_blocks - 1, "block count drift"
        assert all(b is ANONYMOUS for blocks in req_to_blocks.values() for b in blocks), \
            "a tracked block in a counting pool"
        assert not self.cached, "a hashed block in a counting pool"


def _check_num_blocks(num_blocks: int) -> None:
    if num_blocks < 2:
        raise ValueError(f"num_gpu_blocks={num_blocks}: need at least 2 (block 0 is the null block)")

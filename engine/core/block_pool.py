"""KV cache blocks, the O(1) free queue and the block pool (prefix-cache map, lazy eviction).

Layout of the free queue (a doubly linked list threaded through the blocks themselves, so moving
a block allocates nothing):

    head <-> b7 <-> b3 <-> b9 <-> ... <-> tail
    ^ allocation pops here                ^ freed hashed blocks go here (LRU among cached)

A freed block keeps its prefix hash: it is still a cache hit until allocation pops it from the
head, at which point its hash is dropped from the map (lazy eviction). A hit on a free cached
block takes it out of the middle of the queue (`touch`).

Counting mode (a pool made with track_ids=False, for the simulator): while no block can ever be
a prefix-cache hit, which block a request holds cannot change any decision, only how many. The
pool then counts: get_new_blocks hands out the shared placeholder ANONYMOUS (block_id -1) and
nothing moves in the free queue. `materialize` leaves the mode for good (KVCacheManager calls it
before the first block hash that someone could hit exists).
"""
from __future__ import annotations

from collections.abc import Iterable

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


# The block a pool in counting mode hands out: every allocated slot holds this one object.
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

    def __init__(self, num_blocks: int, enable_caching: bool, unhashed_first: bool = True,
                 track_ids: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.unhashed_first = unhashed_first
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.cached: dict = {}  # hash -> KVCacheBlock | {block_id: KVCacheBlock}
        self.counting = not track_ids  # counting mode (see the module docstring)

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
        if self.counting:
            q.num_free_blocks -= n
            return [ANONYMOUS] * n
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

    def release(self, n: int) -> None:
        """free_blocks in counting mode: n placeholders come back (no block moves)."""
        self.free_queue.num_free_blocks += n

    def materialize(self, held: list[list[KVCacheBlock]]) -> None:
        """Leave counting mode: give every placeholder in `held` (the requests' block lists, each
        placeholder a block with one reference) a block of its own, and free the rest in id
        order, without hashes. In counting mode no block carries a hash anyone can hit, so the
        result differs from the tracked pool's state only in block numbering, the order of free
        blocks and UNIQUE marks on free blocks, none of which a lookup or a later allocation can
        tell apart (UNIQUE is never a key of the hash map; every such free block is evicted with
        no effect when allocation reaches it)."""
        if not self.counting:
            return
        blocks = self.blocks
        k = 1  # block 0 is the null block
        for lst in held:
            for i in range(len(lst)):
                b = blocks[k]
                b.ref_cnt = 1
                b.block_hash = None
                lst[i] = b
                k += 1
        num_free = self.free_queue.num_free_blocks
        if k - 1 + num_free != self.num_blocks - 1:
            raise RuntimeError(f"block pool: {k - 1} held + {num_free} free != {self.num_blocks - 1} usable")
        rest = blocks[k:]
        for b in rest:
            b.ref_cnt = 0
            b.block_hash = None
        self.free_queue = FreeBlockQueue(rest)
        self.cached.clear()
        self.counting = False

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

    def cached_blocks(self, block_hash: int) -> list[KVCacheBlock]:
        v = self.cached.get(block_hash)
        if v is None:
            return []
        return [v] if v.__class__ is KVCacheBlock else list(v.values())

    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

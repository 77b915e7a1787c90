"""Scheduler configuration, validated on construction (errors name the field and the value)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.policy import POLICIES, WaitingQueue


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of the shared scheduler. Defaults are vLLM 0.33's class defaults.

    `num_gpu_blocks` counts the null block, as in vLLM: 11 blocks give 10 usable.
    Pre-0.33 behaviours, for policy studies:
      reserve_full_prompt=False   admit a request when only its first chunk fits (older V1)
      unhashed_blocks_first=False append every freed block at the tail of the free queue (older V1)
    And one correction vLLM 0.33 does not make:
      uncache_unscheduled_victims=True   a PRIORITY victim un-scheduled in the step that allocated
          its chunk takes that chunk's blocks out of the prefix cache. vLLM leaves them cached,
          so a later hit can read KV that was never computed; a real engine must set this (the
          simulator keeps vLLM's decisions).
    And one for drivers that never read block ids:
      track_block_ids=False   the KV pool counts blocks while no prefix-cache hit is possible
          (engine/core/kv_cache_manager.py); while it counts, the block ids in the scheduler's
          outputs are -1. Same decisions; the simulator sets it, an engine must not.
    And one for the simulator of a model with sliding-window layers (vLLM's hybrid KV cache
    manager keeps their windows in the same pool):
      sliding_window, sliding_kv_bytes, kv_bytes   each running request also holds the pool blocks
          its window weighs: sliding_window tokens of sliding_kv_bytes per token (every
          sliding-window layer's), in blocks of block_size tokens of kv_bytes (the layers the
          pool is sized by). 0: no charge (engine/core/kv_cache_manager.py).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    policy: str | type[WaitingQueue] = "fcfs"
    reserve_full_prompt: bool = True
    unhashed_blocks_first: bool = True
    watermark: float = 0.0
    uncache_unscheduled_victims: bool = False
    track_block_ids: bool = True
    sliding_window: int = 0
    sliding_kv_bytes: int = 0
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "must be a positive integer")
        v = self.num_gpu_blocks
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:
            bad("num_gpu_blocks", "must be an integer >= 2 (it counts the null block, so 2 give 1 usable)")
        for name in ("sliding_window", "sliding_kv_bytes", "kv_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "must be an integer >= 0")
        if self.sliding_window and not (self.sliding_kv_bytes and self.kv_bytes):
            bad("sliding_window", "needs sliding_kv_bytes and kv_bytes > 0 (what a window token weighs in the pool)")
        v = self.long_prefill_token_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            bad("long_prefill_token_threshold", "must be an integer >= 0 (0 disables it)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.block_size:
            bad("max_num_batched_tokens",
                f"is below block_size={self.block_size} with enable_chunked_prefill=False: "
                "no prompt of a full block could ever be scheduled")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's rule: without chunking a sequence must fit in one step, or it (and every
            # request queued behind it) would wait for ever.
            bad("max_num_batched_tokens",
                f"is below max_model_len={self.max_model_len} with enable_chunked_prefill=False: "
                "raise max_num_batched_tokens, lower max_model_len or enable chunked prefill")
        if not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            bad("watermark", "must be in [0, 1)")
        if isinstance(self.policy, str) and self.policy not in POLICIES:
            bad("policy", f"unknown policy; known: {sorted(POLICIES)}")
        if not isinstance(self.policy, str) and not (
                isinstance(self.policy, type) and issubclass(self.policy, WaitingQueue)):
            bad("policy", "must be a policy name or a WaitingQueue subclass")

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_usable_blocks)

"""The shared scheduler: pure Python, no torch. The engine and the simulator both run it.

Its hot modules load from an optional compiled build when one matches the sources
(engine/core/compiled.py; SERVETWIN_PURE_PYTHON=1 runs the Python reference).
"""
from engine.core import compiled as _compiled

_compiled.activate(__path__)

from engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine.core.config import SchedulerConfig
from engine.core.fast_forward import FastForwardScheduler
from engine.core.features import BatchFeatures
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output import (CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput,
                               batch_features)
from engine.core.policy import (FCFSQueue, HeapQueue, PriorityQueue, ShortestPromptFirstQueue,
                                WaitingQueue, register_policy)
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

__all__ = [
    "BatchFeatures", "BlockPool", "CachedRequestData", "EngineCoreOutput", "FastForwardScheduler", "FCFSQueue",
    "FreeBlockQueue", "HeapQueue", "KVCacheBlock", "KVCacheManager", "NewRequestData",
    "PriorityQueue", "Request", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "ShortestPromptFirstQueue", "WaitingQueue", "batch_features",
    "register_policy",
]

"""LLMEngine (add_request / abort_request / step) and LLM (generate / chat), vLLM-style.

The engine only drives the shared scheduler; every scheduling decision is `Scheduler.schedule()`:

    out = scheduler.schedule()
    sampled = runner.execute(out)                    # forward + sampling (engine/runner/)
    outputs = scheduler.update_from_output(out, sampled)
    detokenize; a stop string finishes the request via scheduler.finish_requests(...)

Each step appends a StepRecord (engine.core.records) to `step_log`: wall start/end on the engine
clock (seconds since the engine started), schedule_s (schedule() + update_from_output()),
prepare_s, forward_s (forward + logits; CUDA events on GPU), sample_s (sampling + detokenize),
the batch features of `engine.core.batch_features`, queue sizes and KV usage after the step, and
extra["num_prefix_hit_tokens"] (prefix-cache hits of requests admitted for the first time).
Steps that schedule no token (nothing runnable) are not logged. `request_records[id]` holds each
request's RequestRecord (arrival, first scheduled, every token time, finish, preemptions, cached
tokens, finish reason); a token's time is the end of the step that produced it.

KV pool size when num_gpu_blocks is None: on CUDA, gpu_memory_utilization x total memory minus
the peak of a profiling forward of max_num_batched_tokens tokens (weights included) and non-torch
memory; on CPU a byte budget, kv_cache_memory_bytes (default min(1 GiB, 25% of RAM)); divided by
kv_cache_bytes_per_block. The outcome is logged and kept in `memory_profile`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention import kv_cache_bytes_per_block
from engine.core import RequestStatus, SamplingParams, Scheduler, SchedulerConfig, batch_features
from engine.core.admission import admit
from engine.core.bookkeeping import Book, Entry
from engine.core.records import RequestRecord, StepRecord
from engine.core.request import Request
from engine.detokenizer import IncrementalDetokenizer
from engine.model.loader import load_model
from engine.prompt_embeds import PLACEHOLDER_ID, PromptEmbeds, salted
from engine.runner import ModelRunner

logger = logging.getLogger("servetwin.engine")

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(slots=True)
class Logprob:
    """One sampled token's log-probability with its text, its rank (1 = most likely), and the
    requested number of most likely alternatives as (token id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[tuple[int, str, float]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None    # None, "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprob] | None = None  # one per token id, when SamplingParams.logprobs is set

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Cumulative output of one request so far (vLLM's default output kind)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestRecord | None = None
    num_cached_tokens: int | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it); complete in every output (they come after the prompt is processed); shared
    # between a request's outputs, never changed once handed out
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(slots=True)
class _Live:
    """Engine-side state of an unfinished request."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    entry: Entry                     # its bookkeeping (engine.core.bookkeeping), with its record
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def record(self) -> RequestRecord:
        return self.entry.record


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def _tune_cpu_malloc() -> None:
    """Keep freed memory in glibc's heap instead of returning it to the OS.

    A CPU forward allocates many tens-of-MB temporaries per layer; with glibc's defaults each one
    is a fresh mmap whose pages fault in on first touch, which made CPU decode steps several times
    slower. (vLLM's CPU backend preloads tcmalloc for the same reason.) Process-wide;
    SERVETWIN_NO_MALLOPT=1 disables it.
    """
    if os.environ.get("SERVETWIN_NO_MALLOPT") == "1":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: allocations up to 1 GiB come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: do not give the heap back eagerly
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 * GiB


class LLMEngine:
    def __init__(
        self,
        model: str = "default",
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        seed: int = 0,
        load_format: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(dtype, self.device)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]")
        # Check the scheduler knobs before the (slow) model load; the pool-dependent ones come later.
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        block_size=block_size, enable_chunked_prefill=enable_chunked_prefill,
                        long_prefill_token_threshold=long_prefill_token_threshold, policy=policy)
        if self.device.type == "cpu":
            _tune_cpu_malloc()
        t_load = time.perf_counter()
        self.model, self.tokenizer, self.hf_config = load_model(model, self.device, self.dtype,
                                                                load_format=load_format)
        self.model.pack_linears()  # oneDNN-prepacked GEMMs on the CPU (fp32); a no-op elsewhere
        self.model_name = model
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.eos_token_id, self.extra_eos_ids = _eos_ids(self.tokenizer, self.hf_config, model)
        self.runner = ModelRunner(self.model, block_size, self.device, seed=seed)
        self.block_size = block_size
        self.kv_bytes_per_block = kv_cache_bytes_per_block(
            cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.memory_profile = self._size_kv_pool(num_gpu_blocks, kv_cache_memory_bytes,
                                                 gpu_memory_utilization, max_num_batched_tokens,
                                                 max_num_seqs)
        self.num_gpu_blocks = self.memory_profile["num_gpu_blocks"]
        capacity = (self.num_gpu_blocks - 1) * block_size
        max_pos = cfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(max_pos, capacity)
            if not enable_chunked_prefill:
                max_model_len = min(max_model_len, max_num_batched_tokens)
        elif max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        elif max_model_len > capacity:
            raise ValueError(f"max_model_len={max_model_len} exceeds what the KV pool holds: "
                             f"{self.num_gpu_blocks - 1} usable blocks x {block_size} = {capacity} tokens")
        elif not enable_chunked_prefill and max_model_len > max_num_batched_tokens:
            raise ValueError(f"max_model_len={max_model_len} > max_num_batched_tokens="
                             f"{max_num_batched_tokens} with enable_chunked_prefill=False: long prompts "
                             "could never be scheduled")
        self.max_model_len = max_model_len
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=self.num_gpu_blocks,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching, policy=policy,
            uncache_unscheduled_victims=True)  # this engine reads the KV the cache points at
        self.scheduler = Scheduler(self.scheduler_config)
        self.runner.initialize_kv_cache(self.num_gpu_blocks)
        self.memory_profile["max_model_len"] = max_model_len
        logger.info(
            "engine ready in %.1fs: model=%s device=%s dtype=%s attention=%s | KV pool %d blocks x %d "
            "tokens (%.2f MiB/block, %.2f GiB, %s) | max_model_len=%d",
            time.perf_counter() - t_load, model, self.device, self.dtype,
            getattr(self.model.attn_backend, "name", "auto"), self.num_gpu_blocks, block_size,
            self.kv_bytes_per_block / 2**20, self.num_gpu_blocks * self.kv_bytes_per_block / GiB,
            self.memory_profile["source"], max_model_len)

        self.step_log: list[StepRecord] = []
        self.request_records: dict[str, RequestRecord] = {}
        self.book = Book(keep_token_times=True)  # records, token times, ITL (engine.core.bookkeeping)
        self._live: dict[str, _Live] = {}
        self._t0 = time.perf_counter()
        self._step_index = 0
        self._step_req_ids: dict[str, int] = {}  # the current step's {request id: tokens}

    # ------------------------------------------------------------------ memory
    def _size_kv_pool(self, num_gpu_blocks, kv_bytes, utilization, max_tokens, max_seqs) -> dict[str, Any]:
        per_block = self.kv_bytes_per_block
        prof: dict[str, Any] = {"kv_bytes_per_block": per_block, "block_size": self.block_size,
                                "device": str(self.device), "dtype": str(self.dtype).replace("torch.", "")}
        if num_gpu_blocks is not None:
            if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 2:
                raise ValueError(f"num_gpu_blocks={num_gpu_blocks!r}: must be an integer >= 2 "
                                 "(it counts the reserved null block)")
            prof.update(source="num_gpu_blocks", num_gpu_blocks=num_gpu_blocks)
            return prof
        if kv_bytes is not None:
            prof.update(source="kv_cache_memory_bytes", kv_cache_bytes=int(kv_bytes))
        elif self.device.type == "cuda":
            prof.update(self._profile_cuda(utilization, max_tokens, max_seqs))
        else:
            ram = _physical_memory_bytes()
            prof.update(source="cpu byte budget min(1 GiB, 25% RAM)", ram_bytes=ram,
                        kv_cache_bytes=min(GiB, ram // 4))
        blocks = int(prof["kv_cache_bytes"] // per_block)
        if blocks < 2:
            raise ValueError(f"KV budget of {prof['kv_cache_bytes']} bytes holds {blocks} blocks of "
                             f"{per_block} bytes; need at least 2 (raise gpu_memory_utilization or "
                             "kv_cache_memory_bytes)")
        prof["num_gpu_blocks"] = blocks
        return prof

    def _profile_cuda(self, utilization: float, max_tokens: int, max_seqs: int) -> dict[str, Any]:
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
        t = time.perf_counter()
        self.runner.profile_forward(max_tokens, max_seqs)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        budget = int(total * utilization) - peak - non_torch
        return {"source": f"cuda profile (gpu_memory_utilization={utilization})",
                "total_bytes": total, "weights_bytes": weights, "peak_bytes": peak,
                "activation_peak_bytes": peak - weights, "non_torch_bytes": non_torch,
                "profile_s": time.perf_counter() - t, "kv_cache_bytes": budget}

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        """Seconds since the engine started (the clock of every record)."""
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: model {self.model_name!r} has no tokenizer; pass token ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """ValueError (naming the field and value) for a request that must not be queued."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params={sampling_params!r}: expected a SamplingParams")
        sampling_params.validate()
        # The engine core's rule (engine.core.admission): too long is refused, prompt + max_tokens
        # past max_model_len is truncated by the scheduler.
        admit(len(prompt_token_ids), sampling_params.max_tokens, self.max_model_len, refuse_overflow=False)
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        for t in sampling_params.logit_bias or {}:
            if t >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {t} is not in [0, {self.vocab_size})")
        for t in sampling_params.allowed_token_ids or ():
            if t >= self.vocab_size:
                raise ValueError(f"allowed_token_ids: token id {t} is out of vocabulary (not in "
                                 f"[0, {self.vocab_size}))")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"stop={sampling_params.stop!r}: stop strings need a tokenizer")

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        """Queue a request. Raises ValueError before queuing anything if it is invalid.

        `arrival_time` is on the engine clock (`now()`); default: now.
        """
        sp = sampling_params if sampling_params is not None else SamplingParams()
        text, ids = self.encode(prompt)
        self.validate(ids, sp)
        self._add(str(request_id), text, ids, sp, arrival_time, priority)

    def add_tokenized_request(self, request_id: str, prompt_token_ids: list[int],
                              sampling_params: SamplingParams, prompt_text: str | None = None,
                              arrival_time: float | None = None, priority: int = 0,
                              cache_salt: str | None = None,
                              prompt_embeds: PromptEmbeds | None = None) -> None:
        """add_request for a prompt tokenized elsewhere (the server), keeping its text.
        `cache_salt` (vLLM's): its prefix-cache blocks match only requests with the same salt.
        `prompt_embeds`: vectors given for some prompt positions (engine.prompt_embeds); the ids
        at those positions are ignored (PLACEHOLDER_ID is kept in their place)."""
        ids = list(prompt_token_ids)
        if prompt_embeds is not None:
            ids = self._embed_positions(ids, prompt_embeds, sampling_params)
        self.validate(ids, sampling_params)
        self._add(str(request_id), prompt_text, ids, sampling_params, arrival_time, priority,
                  cache_salt, prompt_embeds)

    def _embed_positions(self, ids: list[int], pe: PromptEmbeds, sp: SamplingParams) -> list[int]:
        """The prompt's ids with PLACEHOLDER_ID at the embedded positions, or a ValueError naming
        what does not fit."""
        hidden = self.model.config.hidden_size
        if pe.values.dim() != 2 or pe.values.shape[1] != hidden or pe.values.shape[0] != len(pe):
            raise ValueError(f"prompt_embeds: shape {tuple(pe.values.shape)} for {len(pe)} positions; "
                             f"expected ({len(pe)}, {hidden}) (the model's hidden_size)")
        if len(pe) and not (0 <= int(pe.positions.min()) and int(pe.positions.max()) < len(ids)):
            raise ValueError(f"prompt_embeds: positions outside the prompt's {len(ids)} tokens")
        if sp.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not with prompt_embeds (an embedded position has no token)")
        out = list(ids)
        for p in pe.positions.tolist():
            out[p] = PLACEHOLDER_ID
        return out

    def partial_output(self, request_id: str) -> RequestOutput | None:
        """What an unfinished request produced so far (None if it is not live), as if it had
        been aborted now."""
        live = self._live.get(request_id)
        if live is None:
            return None
        return RequestOutput(request_id, live.prompt, live.prompt_token_ids,
                             [CompletionOutput(0, live.detok.get_text(True), list(live.output_token_ids),
                                               "abort", None, _copy(live.logprobs))],
                             True, live.record, live.record.num_cached_tokens, live.prompt_logprobs)

    def _add(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
             arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
             prompt_embeds: PromptEmbeds | None = None) -> None:
        """Queue an already validated request; one with `prompt_embeds` gets their digest in its
        cache salt (engine.prompt_embeds.salted)."""
        if request_id in self._live:
            raise ValueError(f"request_id={request_id!r} is already in use")
        if self.extra_eos_ids and not sp.ignore_eos:
            extra = [t for t in self.extra_eos_ids if t not in sp.stop_token_ids]
            if extra:
                sp = dataclasses.replace(sp, stop_token_ids=list(sp.stop_token_ids) + extra)
        arrival = self.now() if arrival_time is None else float(arrival_time)
        req = Request(request_id, ids, sp, arrival_time=arrival, priority=priority,
                      eos_token_id=self.eos_token_id, cache_salt=salted(cache_salt, prompt_embeds))
        self.scheduler.add_request(req)  # may raise (e.g. pool too small): nothing is kept then
        record = self.book.open(RequestRecord(request_id, arrival, len(ids)), sp.max_tokens)
        self.request_records[request_id] = record
        context = ids
        if prompt_embeds is not None:  # the runner drops them when the scheduler finishes the request
            self.runner.add_prompt_embeds(request_id, prompt_embeds, len(ids))
            embedded = set(prompt_embeds.positions.tolist())
            context = [t for i, t in enumerate(ids) if i not in embedded]  # the detokenizer's text context
        self._live[request_id] = _Live(text, ids, sp, IncrementalDetokenizer(self.tokenizer, context, sp), Entry(record),
                                       logprobs=[] if sp.logprobs is not None else None,
                                       prompt_logprobs=[None] * len(ids) if sp.prompt_logprobs is not None else None)

    def abort_request(self, request_ids: str | Sequence[str], reason: str = "abort") -> None:
        """Finish requests now (their KV blocks are freed); `reason` goes to their records."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = [str(r) for r in request_ids]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        t = self.now()
        for rid in ids:
            live = self._live.pop(rid, None)
            if live is not None:
                self.book.finish(live.record, reason, t)

    def reconfigure(self, **knobs: Any) -> SchedulerConfig:
        """Serve with other scheduler knobs (any SchedulerConfig field: max_num_batched_tokens,
        max_num_seqs, max_model_len, policy, enable_prefix_caching, ...) from now on, over a
        KV pool of `num_gpu_blocks` (default: the current one; another count allocates a new
        pool). max_model_len stays as it was unless given (or the pool is too small for it). Only
        while idle; the new scheduler starts with an empty prefix cache. Returns the new config. This engine keeps `uncache_unscheduled_victims` on (it reads the KV its cache
        points at); asking for it off is refused."""
        if self.has_unfinished_requests():
            raise RuntimeError("reconfigure: requests are still running")
        if knobs.get("uncache_unscheduled_victims") is False:
            raise ValueError("uncache_unscheduled_victims=False: this engine reads the KV its prefix cache "
                             "points at, so preempted victims' unwritten blocks must leave the cache")
        if knobs.get("block_size", self.block_size) != self.block_size:
            raise ValueError(f"block_size={knobs['block_size']}: the engine's KV pool was built with "
                             f"block_size={self.block_size}; load a new engine for another")
        blocks = knobs.pop("num_gpu_blocks", None) or self.num_gpu_blocks
        capacity = (blocks - 1) * self.block_size
        knobs.setdefault("max_model_len", min(self.max_model_len, capacity))
        if knobs["max_model_len"] > capacity:
            raise ValueError(f"max_model_len={knobs['max_model_len']} exceeds what the KV pool holds: "
                             f"{blocks - 1} usable blocks x {self.block_size} = {capacity} tokens")
        cfg = dataclasses.replace(self.scheduler_config, **knobs, num_gpu_blocks=blocks,
                                  uncache_unscheduled_victims=True)
        if blocks != self.num_gpu_blocks:
            self.runner.initialize_kv_cache(blocks)
            self.num_gpu_blocks = blocks
            self.memory_profile["num_gpu_blocks"] = blocks
        self.scheduler_config = cfg
        self.scheduler = Scheduler(cfg)
        self.max_model_len = cfg.max_model_len
        self.memory_profile["max_model_len"] = cfg.max_model_len
        return cfg

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (vLLM's /reset_prefix_cache). Refused (False) while
        any request holds blocks, as in vLLM."""
        kvm = self.scheduler.kv_cache_manager
        if kvm.num_free_blocks != kvm.num_usable_blocks:
            return False
        pool = kvm.block_pool
        for b in pool.blocks:
            if b.block_hash is not None:
                pool.evict(b)
        return True

    def fail_step(self) -> list[str]:
        """After step() raised: abort the requests that step scheduled (finish reason "error") and
        take the blocks it was computing out of the prefix cache, since their KV may never have
        been written. Returns the failed request ids; the engine can step again."""
        sched = self.scheduler
        ids = [rid for rid in self._step_req_ids if rid in self._live]
        for rid, n in self._step_req_ids.items():
            req = sched.requests.get(rid)
            if req is not None:
                sched.kv_cache_manager.uncache_blocks(req, max(0, req.num_computed_tokens - n))
        self.abort_request(ids, reason="error")
        self._step_req_ids = {}
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    has_unfinished = has_unfinished_requests

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ------------------------------------------------------------------ step
    def _token_text(self, token_id: int) -> str:
        tok = self.tokenizer
        return "" if tok is None else tok.decode([token_id], skip_special_tokens=False)

    def _logprob_entry(self, lp) -> Logprob:
        text = self._token_text
        return Logprob(lp.token_id, text(lp.token_id), lp.logprob, lp.rank,
                       [(t, text(t), v) for t, v in lp.top])

    def step(self) -> list[RequestOutput]:
        """One scheduler step + forward; outputs of every request that got tokens (or finished)."""
        sched = self.scheduler
        perf = time.perf_counter
        t_start = perf()
        self._step_req_ids = {}
        out = sched.schedule()
        t_sched = perf()
        self._step_req_ids = out.num_scheduled_tokens
        scheduled = bool(out.num_scheduled_tokens)
        start_s = t_start - self._t0
        feats = batch_features(out, sched.requests) if scheduled else None
        records = self.request_records
        book = self.book
        hit_tokens = 0
        for d in out.scheduled_new_reqs:
            book.scheduled(records[d.req_id], start_s, d.num_computed_tokens)
            hit_tokens += d.num_computed_tokens
        resumed_hits = sum(d.num_computed_tokens for d in out.scheduled_resumed_reqs)
        for rid in out.preempted_req_ids:
            book.preempted(records[rid])

        sampled = self.runner.execute(out)
        t_exec = perf()
        core_outputs = sched.update_from_output(out, sampled)
        t_update = perf()

        outputs: list[RequestOutput] = []
        got_tokens: list[tuple[Entry, int]] = []
        finished: list[RequestRecord] = []
        live_map = self._live
        step_logprobs = self.runner.logprobs
        prompt_failed: set[str] = set()
        for rid, (p0, entries) in self.runner.prompt_logprobs.items():
            live = live_map.get(rid)
            if live is not None and live.prompt_logprobs is not None:
                try:  # a new list (outputs already handed out keep theirs): no copy per output
                    updated = list(live.prompt_logprobs)
                    updated[p0:p0 + len(entries)] = [self._logprob_entry(e) for e in entries]
                    live.prompt_logprobs = updated
                except Exception:  # finished with 'error' with its other outputs below
                    logger.exception("request %s: prompt logprobs failed", rid)
                    prompt_failed.add(rid)
        for co in core_outputs:
            live = live_map.get(co.request_id)
            if live is None:
                continue
            toks = co.new_token_ids
            live.output_token_ids.extend(toks)
            finish, stop_reason = co.finish_reason, co.stop_reason
            try:  # one request's text or logprobs failing must not fail its batch mates
                if co.request_id in prompt_failed:
                    raise RuntimeError("its prompt logprobs failed")
                stop_str = live.detok.update(toks, stop_terminated=finish == "stop")
                if live.params.min_characters and len(live.detok.output_text) >= live.params.min_characters:
                    self.runner.text_reached(co.request_id)
                if live.logprobs is not None and toks:
                    live.logprobs.append(self._logprob_entry(step_logprobs[co.request_id]))
                text = live.detok.get_text(finish is not None or stop_str is not None)
            except Exception:
                logger.exception("request %s failed after its step: finished with 'error'", co.request_id)
                if finish is None:
                    sched.finish_requests([co.request_id], RequestStatus.FINISHED_ABORTED)
                stop_str, finish, stop_reason, text = None, "error", None, ""
            if stop_str is not None:
                if finish is None:
                    sched.finish_requests([co.request_id], RequestStatus.FINISHED_STOPPED)
                finish, stop_reason = "stop", stop_str
            got_tokens.append((live.entry, len(toks)))
            if finish is not None:
                live.record.finish_reason = finish
                finished.append(live.record)
                del live_map[co.request_id]
            outputs.append(RequestOutput(
                co.request_id, live.prompt, live.prompt_token_ids,
                [CompletionOutput(0, text, list(live.output_token_ids), finish, stop_reason,
                                  _copy(live.logprobs))],
                finish is not None, live.record, live.record.num_cached_tokens,
                live.prompt_logprobs))
        t_end = perf()
        end_s = t_end - self._t0
        step = book.num_steps
        for entry, n in got_tokens:
            book.token(entry, step, end_s, n)
        for rec in finished:
            book.finish(rec, rec.finish_reason, end_s)
        if scheduled:
            book.end_step(end_s)
            times = self.runner.times
            f = feats
            self.step_log.append(StepRecord(
                step=self._step_index, start_s=start_s, end_s=end_s,
                num_reqs=f.num_reqs, num_prefill_reqs=f.num_prefill_reqs,
                num_prefill_tokens=f.num_prefill_tokens, prefill_context_tokens=f.prefill_context_tokens,
                prefill_attn_pairs=f.prefill_attn_pairs, num_decode_reqs=f.num_decode_reqs,
                decode_context_tokens=f.decode_context_tokens, num_tokens=f.num_tokens,
                num_preempted=f.num_preempted, num_running=len(sched.running),
                num_waiting=len(sched.waiting), kv_usage=sched.kv_cache_manager.usage,
                schedule_s=(t_sched - t_start) + (t_update - t_exec), prepare_s=times.prepare_s,
                forward_s=times.forward_s, sample_s=times.sample_s + (t_end - t_update),
                extra={"num_prefix_hit_tokens": hit_tokens, "num_resumed_hit_tokens": resumed_hits}))
            self._step_index += 1
        return outputs


def _copy(xs: list | None) -> list | None:
    return None if xs is None else list(xs)


def _eos_ids(tokenizer, hf_config, model: str) -> tuple[int | None, list[int]]:
    """(main EOS id, extra EOS ids): tokenizer's EOS first, then the config / generation config's."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    cands: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        from engine.model.loader import resolve_model

        path = resolve_model(model)
        if (path / "generation_config.json").is_file():
            cands.append(GenerationConfig.from_pretrained(str(path), local_files_only=True).eos_token_id)
    except (OSError, ValueError):
        pass
    for c in cands:
        for t in ([c] if isinstance(c, int) else list(c or [])):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return (ids[0] if ids else None), ids[1:]


class LLM:
    """Offline batch generation on one LLMEngine (keyword arguments go to LLMEngine)."""

    def __init__(self, model: str = "default", device: str | torch.device = "cpu", **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model=model, device=device, **engine_kwargs)
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _next_id(self) -> str:
        rid = f"gen-{self._counter}"
        self._counter += 1
        return rid

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`.

        Every prompt is validated before any is queued (ValueError names the field).
        """
        items = _normalise_prompts(prompts)
        return self._run([(p, None) for p in items], sampling_params, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the
        tokenizer's chat template."""
        tok = self.llm_engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"model {self.llm_engine.model_name!r} has no chat template")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        items = []
        for conv in messages:
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **(chat_template_kwargs or {}))
            items.append((text, list(tok(text, add_special_tokens=False).input_ids)))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[Any, list[int] | None]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        prepared = []
        for (prompt, ids), sp in zip(items, params):
            pe = None
            if isinstance(prompt, PromptEmbeds):  # a prompt given as vectors: placeholders for the scheduler
                pe, text = prompt, None
                ids = eng._embed_positions([PLACEHOLDER_ID] * len(pe), pe, sp)
            elif ids is None:
                text, ids = eng.encode(prompt)
            else:
                text = prompt
            eng.validate(ids, sp)  # all checked before anything is queued
            prepared.append((text, ids, sp, pe))
        req_ids: list[str] = []
        try:
            for text, ids, sp, pe in prepared:
                rid = self._next_id()
                eng._add(rid, text, ids, sp, prompt_embeds=pe)
                req_ids.append(rid)
        except Exception:
            eng.abort_request(req_ids)
            raise
        pending = set(req_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="generate")
        while pending:
            if not eng.has_unfinished_requests():
                raise RuntimeError(f"engine has no unfinished requests but {len(pending)} are pending")
            for o in eng.step():
                if o.finished and o.request_id in pending:
                    pending.discard(o.request_id)
                    done[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in req_ids]


def _normalise_prompts(prompts) -> list[Any]:
    """str | list[int] | list[str | list[int] | {"prompt"|"prompt_token_ids"|"prompt_embeds": ...}]
    -> list; a {"prompt_embeds": [num_tokens, hidden_size] tensor} prompt is given as vectors."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    out = []
    for p in prompts:
        if isinstance(p, dict) and "prompt_embeds" in p:
            t = p["prompt_embeds"]
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"prompt_embeds: a (num_tokens, hidden_size) tensor, got {type(t).__name__}")
            out.append(PromptEmbeds.from_spans([(0, t)]))
            continue
        if isinstance(p, dict):
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        if not isinstance(p, str):
            p = list(p)
        out.append(p)
    return out

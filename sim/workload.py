"""Simulator workloads: synthetic arrivals and lengths, or trace replay, built from the YAML
`workload:` mapping.

Everything is generated up front as numpy arrays (100k requests build in milliseconds); the
RequestSpec objects are made lazily while iterating.

Prompt content. A prompt is a tuple of (segment_key, length) pieces, and piece (k, n) stands for the
token ids k, k+1, ..., k+n-1: the key is the segment's first token id. Keys are allocated so the id
ranges of different keys never overlap (shared system prompts and trace hash blocks first, then one
fresh range per request for its unique content), so
  - the same key gives the same ids: shared prefixes and Mooncake hash blocks produce real hits in
    the scheduler's prefix cache (chained hashes of full 16-token blocks),
  - different keys give disjoint ids: no false hits, and unique content never collides.
Ids are dense (about one id per distinct prompt token), so they stay small ints.
They are not valid ids for any real vocabulary; replaying a workload through the real engine needs
its own mapping.

Choices where the spec leaves room:
  - Open-loop arrivals start at t=0 (first request), like trace replay and vLLM's benchmark.
  - shared_prefix picks exactly round(fraction * n) requests; a picked request whose prompt_len is
    <= length is lengthened to length + 1 (the prefix plus at least one own token).
  - cancellation.fraction picks exactly round(fraction * n) requests; each disconnects after
    max(1, floor(output_len * at_output_fraction)) tokens.
  - With a trace, num_requests and trace.max_requests both set the count (the smaller wins); a
    count beyond the trace tiles it, copy t shifted by t * (span + mean gap). Tiled copies of a
    Mooncake trace get fresh hash ids (new conversations), so a copy does not hit the cache
    entries of the previous one.
  - A trace gives arrivals and lengths; `arrival:` (including closed loop) or `prompt_len:` /
    `output_len:` given alongside replace the trace's (not Mooncake prompt lengths: its hash
    blocks fix them).

Random streams. Each concern draws from its own PCG64 stream derived from (seed, stream id), so
changing, say, the output-length distribution leaves arrivals, prompts and prefixes unchanged.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from sim.clients import ENGINE_DIRECT, FIELDS as CLIENT_FIELDS, HTTP_DEFAULTS, ClientModel
from sim.specmap import MISSING, SpecError, SpecMap
from sim.traces import FORMATS, MOONCAKE_BLOCK, TraceFormatError, read_trace
from sim.sampling import SAMPLING_MODES


class WorkloadError(SpecError):
    """Invalid workload spec; the message names the key path and the offending value."""


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    arrival_s: float  # open loop: absolute arrival time; closed loop: 0.0 (the driver sets it)
    prompt_len: int
    output_len: int  # tokens to generate (the simulator runs with ignore_eos)
    segments: tuple[tuple[int, int], ...]  # (segment_key, length) pieces; lengths sum to prompt_len
    priority: int = 0
    cancel_after_s: float | None = None  # abandon if not finished this long after arrival
    cancel_after_tokens: int | None = None  # disconnect after receiving this many output tokens
    # Position of its first token whose id no other request has (see Workload.unique_from);
    # the scheduler's KV manager then never hashes the blocks past it. None: not known.
    unique_from: int | None = None
    # The client's turnaround before it sends this request (sim/clients.py); 0: sent when due.
    client_delay_s: float = 0.0

    def token_sequence(self) -> list[int] | range:
        """The prompt as the scheduler needs it: token_ids(), except that from unique_from on
        (ids no other request has) it is a filler of zeros, since the scheduler keys those
        blocks by the request and never reads their tokens (Request.unique_from). A range when
        it is one segment of real ids (the Request copies it into its own list)."""
        u = self.unique_from
        if u is None:
            if len(self.segments) == 1:
                k, n = self.segments[0]
                return range(k, k + n)
            return self.token_ids()
        filler = [0] * (self.prompt_len - u)
        if u == 0:
            return filler  # the whole prompt is its own (most trace requests): one list, not two
        head: list[int] = []
        for k, n in self.segments:
            if len(head) >= u:
                break
            head += range(k, k + n)
        return head + filler

    def token_ids(self) -> list[int]:
        """Synthetic prompt token ids (len == prompt_len); segment (k, n) is ids k .. k+n-1."""
        segs = self.segments
        if len(segs) == 1:
            k, n = segs[0]
            return list(range(k, k + n))
        ids: list[int] = []
        for k, n in segs:
            ids += range(k, k + n)
        return ids


class Workload:
    """A fixed list of requests, stored column-wise. Segments are in CSR form: request i owns
    seg_keys[seg_off[i]:seg_off[i+1]] (and the matching seg_lens)."""

    # Hand RequestSpec.unique_from to the scheduler (False: never; tests compare both).
    unique_hints = True

    def __init__(self, *, arrival_s, prompt_len, output_len, seg_off, seg_keys, seg_lens,
                 priority=None, cancel_after_s=None, cancel_after_tokens=None,
                 closed_loop_concurrency: int | None = None, source: str = "",
                 request_ids: list[str] | None = None, client_delay_s=None,
                 client: ClientModel | None = None, num_warmup: int = 0,
                 benchmark: dict | None = None) -> None:
        n = len(prompt_len)
        self.num_requests = n
        # At most this many requests in flight. arrival_s is when each request is due (all 0:
        # a plain closed loop; otherwise a rate-limited benchmark with a concurrency cap).
        self.closed_loop_concurrency = closed_loop_concurrency
        self.client = client          # None: the simulator sends straight to the engine
        self.num_warmup = num_warmup  # the first num_warmup requests are a warm-up phase
        self.benchmark = benchmark    # the benchmark protocol this workload reproduces, if any
        self.client_delay_s = (np.zeros(n) if client_delay_s is None
                               else np.asarray(client_delay_s, dtype=np.float64))
        self.source = source
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.prompt_len = np.asarray(prompt_len, dtype=np.int64)
        self.output_len = np.asarray(output_len, dtype=np.int64)
        self.seg_off = np.asarray(seg_off, dtype=np.int64)
        self.seg_keys = np.asarray(seg_keys, dtype=np.int64)
        self.seg_lens = np.asarray(seg_lens, dtype=np.int64)
        self.priority = (np.zeros(n, np.int64) if priority is None
                         else np.asarray(priority, dtype=np.int64))
        # NaN / -1 mean "no cancellation" (None on the RequestSpec).
        self.cancel_after_s = (np.full(n, np.nan) if cancel_after_s is None
                               else np.asarray(cancel_after_s, dtype=np.float64))
        self.cancel_after_tokens = (np.full(n, -1, np.int64) if cancel_after_tokens is None
                                    else np.asarray(cancel_after_tokens, dtype=np.int64))
        self._ids = request_ids  # None: "req-<index>"
        self._unique = None
        # Load stages (arrival type `stages`): [{rate, duration_s, requests, start_s, end_s}], else None.
        self.stages: list[dict] | None = None
        self._check()

    def _id(self, i: int) -> str:
        return f"req-{i}" if self._ids is None else self._ids[i]

    def _check(self) -> None:
        n = self.num_requests
        for name in ("arrival_s", "output_len", "priority", "cancel_after_s",
                     "cancel_after_tokens", "client_delay_s"):
            assert len(getattr(self, name)) == n, name
        assert self._ids is None or len(self._ids) == n
        assert len(self.seg_off) == n + 1 and self.seg_off[0] == 0
        assert self.seg_off[-1] == len(self.seg_keys) == len(self.seg_lens)
        assert (self.prompt_len >= 1).all() and (self.output_len >= 1).all()
        csum = np.concatenate([[0], np.cumsum(self.seg_lens)])
        assert (csum[self.seg_off[1:]] - csum[self.seg_off[:-1]] == self.prompt_len).all()
        if self.closed_loop_concurrency is None:
            assert (np.diff(self.arrival_s) >= 0).all(), "open-loop arrivals must be sorted"
        assert 0 <= self.num_warmup <= n

    @classmethod
    def from_requests(cls, requests: list[RequestSpec],
                      closed_loop_concurrency: int | None = None,
                      source: str = "requests") -> Workload:
        """A workload from hand-made RequestSpecs (tests, custom drivers)."""
        counts = [len(r.segments) for r in requests]
        return cls(
            arrival_s=[r.arrival_s for r in requests],
            prompt_len=[r.prompt_len for r in requests],
            output_len=[r.output_len for r in requests],
            seg_off=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]),
            seg_keys=[k for r in requests for k, _ in r.segments],
            seg_lens=[n for r in requests for _, n in r.segments],
            priority=[r.priority for r in requests],
            cancel_after_s=[np.nan if r.cancel_after_s is None else r.cancel_after_s
                            for r in requests],
            cancel_after_tokens=[-1 if r.cancel_after_tokens is None else r.cancel_after_tokens
                                 for r in requests],
            closed_loop_concurrency=closed_loop_concurrency, source=source,
            request_ids=[r.request_id for r in requests],
            client_delay_s=[r.client_delay_s for r in requests])

    def __len__(self) -> int:
        return self.num_requests

    def unique_from(self) -> np.ndarray:
        """Per request, the position of its first token that no other request has, or -1.

        A segment (k, n) stands for ids k .. k+n-1; one whose id range overlaps no other
        segment of the workload (its own request's included) holds ids nobody else has, so a
        prompt's token list agrees with no other request's past the start of its first such
        segment. Built-in workloads give each request a fresh range for its unique tail.
        """
        if self._unique is None:
            keys, lens, off = self.seg_keys, self.seg_lens, self.seg_off
            order = np.argsort(keys, kind="stable")
            ks, es = keys[order], keys[order] + lens[order]
            overlap = np.zeros(len(ks), bool)
            if len(ks) > 1:
                prev_end = np.maximum.accumulate(es)[:-1]
                overlap[1:] |= prev_end > ks[1:]    # starts inside an earlier range
                overlap[:-1] |= ks[1:] < es[:-1]    # a later range starts inside it
            exclusive = np.empty(len(ks), bool)
            exclusive[order] = ~overlap
            if self.num_requests == 0:
                self._unique = np.empty(0, np.int64)
                return self._unique
            # Index of each request's first exclusive segment (len(keys) if none) ...
            idx = np.where(exclusive, np.arange(len(keys)), len(keys))
            first = np.minimum(np.minimum.reduceat(idx, off[:-1]), off[1:])
            # ... and the tokens before it.
            tok = np.concatenate([[0], np.cumsum(lens)])
            self._unique = np.where(first < off[1:], tok[first] - tok[off[:-1]], -1)
        return self._unique

    def __iter__(self) -> Iterator[RequestSpec]:
        # Plain lists once, then cheap per-request indexing (numpy scalars are slow to unbox).
        arrival, prompt, output, prio, dl, ct, off, keys, lens, delay = (a.tolist() for a in (
            self.arrival_s, self.prompt_len, self.output_len, self.priority, self.cancel_after_s,
            self.cancel_after_tokens, self.seg_off, self.seg_keys, self.seg_lens,
            self.client_delay_s))
        uniq = self.unique_from().tolist() if self.unique_hints else [-1] * self.num_requests
        for i in range(self.num_requests):
            s, e = off[i], off[i + 1]
            yield RequestSpec(
                self._id(i), arrival[i], prompt[i], output[i], tuple(zip(keys[s:e], lens[s:e])),
                prio[i], None if dl[i] != dl[i] else dl[i], None if ct[i] < 0 else ct[i],
                None if uniq[i] < 0 else uniq[i], delay[i])

    def __getitem__(self, i: int) -> RequestSpec:
        if not -self.num_requests <= i < self.num_requests:
            raise IndexError(i)
        i %= self.num_requests
        s, e = int(self.seg_off[i]), int(self.seg_off[i + 1])
        dl, ct = float(self.cancel_after_s[i]), int(self.cancel_after_tokens[i])
        return RequestSpec(
            self._id(i), float(self.arrival_s[i]), int(self.prompt_len[i]),
            int(self.output_len[i]),
            tuple(zip(self.seg_keys[s:e].tolist(), self.seg_lens[s:e].tolist())),
            int(self.priority[i]), None if math.isnan(dl) else dl, None if ct < 0 else ct,
            int(self.unique_from()[i]) if self.unique_hints and self.unique_from()[i] >= 0 else None,
            float(self.client_delay_s[i]))

    def describe(self) -> dict:
        n = self.num_requests
        out: dict = {"source": self.source, "num_requests": n,
                     "closed_loop_concurrency": self.closed_loop_concurrency}
        if self.benchmark is not None:
            out["benchmark"] = dict(self.benchmark)
        if self.client is not None:
            out["client"] = self.client.describe()
        if self.closed_loop_concurrency is None and n:
            span = float(self.arrival_s[-1] - self.arrival_s[0])
            out["duration_s"] = span
            out["mean_rate_rps"] = (n - 1) / span if span > 0 else None
        for name, arr in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            out[name] = _summary(arr)
        out["total_prompt_tokens"] = int(self.prompt_len.sum())
        out["total_output_tokens"] = int(self.output_len.sum())
        out.update(self._sharing())
        out["priority_levels"] = np.unique(self.priority).tolist()
        out["deadline_fraction"] = float(np.mean(~np.isnan(self.cancel_after_s))) if n else 0.0
        out["mid_stream_cancel_fraction"] = (float(np.mean(self.cancel_after_tokens >= 0))
                                             if n else 0.0)
        return out

    def _sharing(self) -> dict:
        """shared_prefix_fraction: requests whose first segment also starts another request.
        ideal_prefix_hit_fraction: prompt tokens in leading segments already seen by an earlier
        request, i.e. the prefix-cache hit rate with unlimited KV capacity (segment granularity)."""
        n = self.num_requests
        if n == 0:
            return {"shared_prefix_fraction": 0.0, "ideal_prefix_hit_fraction": 0.0}
        first = self.seg_keys[self.seg_off[:-1]]
        _, inv, cnt = np.unique(first, return_inverse=True, return_counts=True)
        shared = float(np.mean(cnt[inv] > 1))
        # A segment is "seen" if its key occurred at an earlier position (CSR is in arrival order).
        keys = self.seg_keys
        _, first_pos = np.unique(keys, return_index=True)
        unseen = np.zeros(len(keys), np.int64)
        unseen[first_pos] = 1
        # Hits are the leading run of seen segments in each request: running unseen count == 0.
        csum = np.cumsum(unseen)
        starts = self.seg_off[:-1]
        before = np.repeat(csum[starts] - unseen[starts], np.diff(self.seg_off))
        hit_tokens = int(self.seg_lens[(csum - before) == 0].sum())
        return {"shared_prefix_fraction": shared,
                "ideal_prefix_hit_fraction": hit_tokens / int(self.prompt_len.sum())}


def _summary(a: np.ndarray) -> dict:
    if len(a) == 0:
        return {}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": int(a.min()), "max": int(a.max())}


# ----------------------------------------------------------------------------- spec validation

_MISSING = MISSING


class _Map(SpecMap):
    error = WorkloadError


_TOP_KEYS = ("num_requests", "arrival", "prompt_len", "output_len", "shared_prefix", "prompt_pool", "priority",
             "cancellation", "trace", "client", "benchmark", "sampling")
# One independent random stream per concern (see the module docstring).
_STREAMS = {"arrival": 1, "prompt_len": 2, "output_len": 3, "shared_prefix": 4, "priority": 5,
            "cancel": 6, "client": 7, "lengths": 8, "prompt_pool": 9}


def _rng(seed: int, stream: str) -> np.random.Generator:
    seq = np.random.SeedSequence(seed, spawn_key=(_STREAMS[stream],))
    return np.random.Generator(np.random.PCG64(seq))


@dataclass(slots=True)
class _Trace:
    """Trace rows after start/cap/tiling, one per request."""
    arrival: np.ndarray | None  # None when the file has no timestamps
    prompt: np.ndarray
    output: np.ndarray
    hash_off: np.ndarray | None  # CSR over dense hash indices (Mooncake) or None
    hash_idx: np.ndarray | None
    num_hash: int  # distinct hash indices (after tiling)


def build_workload(spec: dict, seed: int, base_dir: Path | None = None) -> Workload:
    """Build a Workload from the YAML `workload:` mapping. Raises WorkloadError on a bad spec."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise WorkloadError(f"seed={seed!r}: must be a non-negative integer")
    root = _Map(spec, "workload")
    root.done(allowed=_TOP_KEYS)  # a misspelt key fails first, not after reading a trace
    # The requests' sampling parameters: they price the GPU sampler (sim.sampling), not the requests
    root.text("sampling", "model_default", choices=SAMPLING_MODES)
    if root.has("benchmark"):
        return _benchmark(root, seed)
    reader = _Reader(base_dir)
    num_requests = root.integer("num_requests", None, ge=1)
    arrival_m = root.sub("arrival")
    if arrival_m is not None and arrival_m.d.get("type") == "stages":
        staged = _stage_count(arrival_m)
        if num_requests is not None and num_requests != staged:
            raise WorkloadError(f"workload.num_requests={num_requests}: the stages send {staged} requests "
                                "(rate x duration_s each); leave num_requests out")
        num_requests = staged
    trace_m = root.sub("trace")
    trace = (_load_trace(trace_m, num_requests, arrival_m is not None, reader)
             if trace_m is not None else None)
    if trace is None and num_requests is None:
        raise WorkloadError("workload.num_requests: required (no trace gives the count)")
    n = len(trace.prompt) if trace is not None else num_requests

    # Arrivals.
    concurrency = None
    stage_bounds = None
    if arrival_m is not None and arrival_m.d.get("type") == "stages":
        arrival, stage_bounds = _stage_arrivals(arrival_m, _rng(seed, "arrival"))
    elif arrival_m is not None:
        arrival, concurrency = _arrivals(arrival_m, n, _rng(seed, "arrival"))
    elif trace is not None and trace.arrival is not None:
        arrival = trace.arrival
    else:
        raise WorkloadError("workload.arrival: required (the trace has no timestamps)" if trace
                            else "workload.arrival: required")

    # Lengths: a distribution if given, else the trace's column.
    lengths = {}
    for key in ("prompt_len", "output_len"):
        m = root.sub(key)
        if m is not None:
            if key == "prompt_len" and trace is not None and trace.hash_off is not None:
                raise WorkloadError("workload.prompt_len: cannot override the prompt lengths of a "
                                    "trace with hash_ids (its prefix blocks fix them)")
            lengths[key] = _lengths(m, key, n, _rng(seed, key), reader)
        elif trace is not None:
            lengths[key] = getattr(trace, "prompt" if key == "prompt_len" else "output")
        else:
            raise WorkloadError(f"workload.{key}: required (no trace)")
    prompt, output = lengths["prompt_len"].copy(), lengths["output_len"]

    # Prompt segments: head pieces (shared prefix or trace hash blocks), then a unique tail.
    sp_m = root.sub("shared_prefix")
    pool_m = root.sub("prompt_pool")
    if sp_m is not None and trace is not None and trace.hash_off is not None:
        raise WorkloadError("workload.shared_prefix: cannot combine with a trace that has hash_ids "
                            "(its hash blocks already define the shared prefixes)")
    if pool_m is not None and (sp_m is not None or trace is not None):
        raise WorkloadError("workload.prompt_pool: cannot combine with shared_prefix or a trace (the pool "
                            "defines every prompt)")
    if pool_m is not None:
        head = _prompt_pool(pool_m, prompt, _rng(seed, "prompt_pool"))
    elif sp_m is not None:
        head = _shared_prefix(sp_m, prompt, _rng(seed, "shared_prefix"))
    elif trace is not None and trace.hash_off is not None:
        head = _hash_blocks(trace, prompt)
    else:
        head = np.zeros(n + 1, np.int64), _EMPTY, _EMPTY, 0
    seg_off, seg_keys, seg_lens = _segments(prompt, *head)

    priority = _priority(root.sub("priority"), n, _rng(seed, "priority"))
    cancel_s, cancel_tokens = _cancellation(root.sub("cancellation"), output, _rng(seed, "cancel"))
    source = "trace" if trace is not None else "synthetic"
    client = _client(root.sub("client"))
    wl = Workload(arrival_s=arrival, prompt_len=prompt, output_len=output, seg_off=seg_off,
                  seg_keys=seg_keys, seg_lens=seg_lens, priority=priority,
                  cancel_after_s=cancel_s, cancel_after_tokens=cancel_tokens,
                  closed_loop_concurrency=concurrency, source=source, client=client,
                  client_delay_s=_turnarounds(client, n, seed))
    wl.stages = stage_bounds
    return wl


def _client(m: _Map | None) -> ClientModel:
    """`workload.client`: overrides of the default client, HTTP_DEFAULTS (a vLLM server's request
    path) for every workload; `type: engine_direct` sends requests straight into the engine."""
    if m is None:
        return HTTP_DEFAULTS
    base = HTTP_DEFAULTS
    if m.d.get("type") is not None:
        kind = m.text("type", choices=("http", "engine_direct"))
        base = HTTP_DEFAULTS if kind == "http" else ENGINE_DIRECT
    vals = {k: m.number(k, getattr(base, k), ge=0) for k in CLIENT_FIELDS}
    m.done()
    return ClientModel(**vals)


def _turnarounds(client: ClientModel | None, n: int, seed: int) -> np.ndarray:
    return np.zeros(n) if client is None else client.turnarounds(n, _rng(seed, "client"))


def _benchmark(root: _Map, seed: int) -> Workload:
    """`workload.benchmark`: vllm bench serve's random dataset with --random-range-ratio 0 and
    --ignore-eos: num_prompts requests of exactly isl prompt and osl output tokens (unique random
    prompts: no prefix-cache hits), sent by a client with at most `concurrency` in flight
    (--max-concurrency; none: unlimited) at `request_rate` per second (Poisson, or gamma with
    `burstiness` as vLLM's --burstiness; default inf: all due at once), after `warmup` warm-up
    requests of the same shape (--num-warmups) that run first and are not measured. `prefix_len`
    (--random-prefix-len) puts one shared prefix of that many tokens before every prompt.

    Lengths: `range_ratio` r draws prompt and output lengths as vllm bench serve (>= 0.10) does,
    uniform integers in [L(1-r), L(1+r)]; `min_ratio` r draws them as the older
    benchmarks/benchmark_serving.py and sglang.bench_serving do with --random-range-ratio r
    (and InferenceMAX runs them, r = 0.8): uniform integers in [int(L r), L]. Give one of the two."""
    for key in root.d:
        if key not in ("benchmark", "client", "sampling"):
            raise WorkloadError(f"workload.{key}={root.d[key]!r}: not allowed with workload.benchmark "
                                "(it fixes the requests); give only benchmark, client and sampling")
    m = root.sub("benchmark")
    conc = m.integer("concurrency", None, ge=1)
    isl = m.integer("isl", ge=1)
    osl = m.integer("osl", ge=1)
    num = m.integer("num_prompts", ge=1)
    warm = m.integer("warmup", 0, ge=0)
    rate_v = m.raw("request_rate", "inf")
    if rate_v in ("inf", float("inf")):
        rate = math.inf
    else:
        rate = m.number("request_rate", gt=0)
    burst = m.number("burstiness", 1.0, gt=0)
    prefix = m.integer("prefix_len", 0, ge=0)
    ratio = m.number("range_ratio", 0.0, ge=0)
    low = m.number("min_ratio", 1.0, gt=0, le=1)
    m.done()
    if ratio >= 1:
        raise WorkloadError(f"workload.benchmark.range_ratio={ratio!r}: must be in [0, 1) "
                            "(lengths are drawn from [len * (1 - r), len * (1 + r)])")
    if ratio > 0 and low < 1:
        raise WorkloadError(f"workload.benchmark: range_ratio={ratio!r} and min_ratio={low!r} are two "
                            "conventions for one option; give one")
    if conc is None and rate == math.inf:
        raise WorkloadError("workload.benchmark: give concurrency, request_rate or both "
                            "(with neither every request would be sent at t=0 at once)")
    client = _client(root.sub("client"))
    root.done()
    n = warm + num
    # Measured requests are due from the start of their phase (after the warm-up): rate-limited
    # offsets as vLLM draws them (gamma, shape burstiness, mean gap 1/rate; first at 0).
    due = np.zeros(n)
    if rate != math.inf:
        gaps = _rng(seed, "arrival").gamma(burst, 1.0 / (rate * burst), num)
        due[warm:] = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    if ratio > 0:  # vllm bench serve --random-range-ratio: uniform integers in [L(1-r), L(1+r)]
        rng = _rng(seed, "lengths")
        own = rng.integers(max(1, int(isl * (1 - ratio))), int(isl * (1 + ratio)) + 1, n)
        out = rng.integers(max(1, int(osl * (1 - ratio))), int(osl * (1 + ratio)) + 1, n)
    elif low < 1:  # benchmark_serving.py / sglang --random-range-ratio: uniform integers in [int(L r), L]
        rng = _rng(seed, "lengths")
        own = rng.integers(max(1, int(isl * low)), isl + 1, n)
        out = rng.integers(max(1, int(osl * low)), osl + 1, n)
    else:
        own, out = np.full(n, isl, np.int64), np.full(n, osl, np.int64)
    own, out = own.astype(np.int64), out.astype(np.int64)
    prompt = prefix + own
    step = int(own.max())  # each request's own tokens get their own key range (unique prompts)
    if prefix:  # key 0 is the shared prefix; each request's own tokens follow
        seg_off = np.arange(0, 2 * n + 1, 2, dtype=np.int64)
        seg_keys = np.empty(2 * n, np.int64)
        seg_keys[0::2], seg_keys[1::2] = 0, prefix + np.arange(n, dtype=np.int64) * step
        seg_lens = np.empty(2 * n, np.int64)
        seg_lens[0::2], seg_lens[1::2] = prefix, own
    else:
        seg_off = np.arange(n + 1, dtype=np.int64)
        seg_keys = np.arange(n, dtype=np.int64) * step
        seg_lens = own.copy()
    ids = [f"warmup-{i}" for i in range(warm)] + [f"req-{i}" for i in range(num)]
    info = {"concurrency": conc, "isl": isl, "osl": osl, "num_prompts": num, "warmup": warm,
            "request_rate": rate if rate != math.inf else "inf", "burstiness": burst,
            "prefix_len": prefix, "range_ratio": ratio, "min_ratio": low,
            "protocol": (f"benchmark_serving.py --dataset-name random --random-range-ratio {low:g} --ignore-eos"
                         if low < 1 else
                         f"vllm bench serve --dataset-name random --random-range-ratio {ratio:g} --ignore-eos")}
    return Workload(arrival_s=due, prompt_len=prompt, output_len=out,
                    seg_off=seg_off, seg_keys=seg_keys, seg_lens=seg_lens,
                    closed_loop_concurrency=conc, source="benchmark", request_ids=ids,
                    client=client, num_warmup=warm, benchmark=info,
                    client_delay_s=_turnarounds(client, n, seed))


_EMPTY = np.zeros(0, np.int64)


class _Reader:
    """Reads each trace file once per build (prompt and output may name the same file)."""

    def __init__(self, base_dir: Path | None) -> None:
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.cache: dict = {}

    def read(self, m: _Map, path_key: str, fmt: str):
        raw = m.text(path_key)
        path = Path(raw).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        if (path, fmt) not in self.cache:
            try:
                self.cache[path, fmt] = read_trace(path, fmt)
            except FileNotFoundError as e:
                raise WorkloadError(f"{m.path}.{path_key}={raw!r}: no such file ({path})") from e
            except TraceFormatError as e:
                raise WorkloadError(f"{m.path}.{path_key}={raw!r}: {e}") from e
        return self.cache[path, fmt]


def _load_trace(m: _Map, num_requests, has_arrival: bool, reader: _Reader) -> _Trace:
    fmt = m.text("format", "auto", choices=("auto",) + FORMATS)
    df = reader.read(m, "path", fmt)
    time_scale = m.number("time_scale", None, gt=0)
    rate = m.number("rate", None, gt=0)
    max_requests = m.integer("max_requests", None, ge=1)
    start = m.integer("start", 0, ge=0)
    m.done()
    if time_scale is not None and rate is not None:
        raise WorkloadError(f"workload.trace.time_scale={m.d['time_scale']!r}, "
                            f"workload.trace.rate={m.d['rate']!r}: "
                            "mutually exclusive, give one")
    if start >= len(df):
        raise WorkloadError(f"workload.trace.start={start}: the trace has only {len(df)} rows")
    df = df.take(slice(start, None))
    caps = [c for c in (num_requests, max_requests) if c is not None]
    n = min(caps) if caps else len(df)
    base = df.take(slice(0, n))  # fewer rows than n: all of them, tiled below
    m_rows = len(base)

    arrival = None
    if base.timed and not has_arrival:
        a = base.arrival_s
        order = np.argsort(a, kind="stable")
        if (order != np.arange(m_rows)).any():  # replay in arrival order
            base, a = base.take(order), a[order]
        a = a - a[0]
        span = float(a[-1])
        if time_scale is not None:
            a, span = a * time_scale, span * time_scale
        elif rate is not None:
            if span <= 0:
                raise WorkloadError(f"workload.trace.rate={m.d['rate']!r}: the trace's arrivals "
                                    "span 0 s, cannot rescale to a rate")
            scale = (m_rows - 1) / rate / span
            a, span = a * scale, span * scale
        gap = span / (m_rows - 1) if m_rows > 1 else 0.0
        arrival = a
    else:
        for key in ("time_scale", "rate"):
            if m.has(key):
                why = ("workload.arrival sets the arrivals" if has_arrival
                       else "the trace has no timestamps")
                raise WorkloadError(f"workload.trace.{key}={m.d[key]!r}: only rescales trace "
                                    f"timestamps, but {why}")

    # Tile to n requests: copy t is offset by t * (span + mean gap), so arrivals stay monotone.
    idx = np.arange(n) % m_rows
    tile = np.arange(n) // m_rows
    if arrival is not None:
        arrival = arrival[idx] + tile * (span + gap)
    prompt = base.prompt_len[idx]
    output = base.output_len[idx]

    hash_off = hash_idx = None
    num_hash = 0
    hashes = base.hash_ids
    if any(h is not None for h in hashes):
        # Keep the blocks the prompt covers, renumber hash ids densely (0..K-1), then tile.
        need = -(-base.prompt_len // MOONCAKE_BLOCK)
        kept = [(h or [])[:k] for h, k in zip(hashes, need.tolist())]
        counts = np.fromiter((len(h) for h in kept), np.int64, m_rows)
        flat = np.fromiter((x for h in kept for x in h), np.int64, int(counts.sum()))
        uniq, dense = np.unique(flat, return_inverse=True)
        k_base = len(uniq)
        base_off = np.concatenate([[0], np.cumsum(counts)])
        counts_n = counts[idx]
        hash_off = np.concatenate([[0], np.cumsum(counts_n)])
        # Each tiled copy is new conversations: its hash ids are shifted past the previous copy's.
        src = np.repeat(base_off[:-1][idx] - hash_off[:-1], counts_n) + np.arange(hash_off[-1])
        hash_idx = dense[src] + np.repeat(tile * k_base, counts_n)
        num_hash = k_base * (int(tile[-1]) + 1)
    return _Trace(arrival, prompt, output, hash_off, hash_idx, num_hash)


def _arrivals(m: _Map, n: int, rng: np.random.Generator):
    kind = m.text("type", choices=("poisson", "gamma", "constant", "concurrency"))
    if kind == "concurrency":
        c = m.integer("concurrency", ge=1)
        m.done()
        return np.zeros(n), c
    rate = m.number("rate", gt=0)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif kind == "gamma":  # vLLM benchmark: shape = burstiness, mean gap 1/rate, CV = 1/sqrt(shape)
        b = m.number("burstiness", 1.0, gt=0)
        gaps = rng.gamma(b, 1.0 / (rate * b), n)
    else:
        gaps = np.full(n, 1.0 / rate)
    m.done()
    # The first request arrives at t=0, like trace replay (arrivals from 0) and vLLM's benchmark.
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]), None


def _stage_list(m: _Map) -> list[dict]:
    stages = m.raw("stages")
    if not isinstance(stages, list) or not stages:
        raise WorkloadError(f"workload.arrival.stages={stages!r}: a list of {{rate, duration_s}}")
    out = []
    for i, st in enumerate(stages):
        sm = _Map(st, f"workload.arrival.stages[{i}]")
        rate, dur = sm.number("rate", gt=0), sm.number("duration_s", gt=0)
        sm.done()
        if int(rate * dur) < 1:
            raise WorkloadError(f"workload.arrival.stages[{i}]: rate x duration_s = {rate * dur:g} sends no request")
        out.append({"rate": rate, "duration_s": dur, "requests": int(rate * dur)})
    return out


def _stage_count(m: _Map) -> int:
    return sum(st["requests"] for st in _stage_list(_Map(m.d, m.path)))


def _stage_arrivals(m: _Map, rng: np.random.Generator):
    """inference-perf's `constant` load: each stage sends exactly int(rate x duration_s) requests
    whose exponential gaps are rescaled to sum to the stage's duration (its last request at its
    end); stages run back to back, the next starting `gap_s` after the last arrival."""
    m.text("type")
    stages = _stage_list(m)
    gap = m.number("gap_s", 1.0, ge=0)
    m.done()
    out, bounds, t0 = [], [], 0.0
    for st in stages:
        gaps = rng.exponential(1.0 / st["rate"], st["requests"])
        t = t0 + np.cumsum(gaps) * (st["duration_s"] / gaps.sum())
        out.append(t)
        bounds.append({"rate": st["rate"], "duration_s": st["duration_s"], "requests": st["requests"],
                       "start_s": float(t[0]), "end_s": float(t[-1])})
        t0 = float(t[-1]) + gap
    arrival = np.concatenate(out)
    a0 = float(arrival[0])  # the first request at 0, as every open-loop workload here
    return arrival - a0, [dict(b, start_s=b["start_s"] - a0, end_s=b["end_s"] - a0) for b in bounds]


def _prompt_pool(m: _Map, prompt: np.ndarray, rng: np.random.Generator):
    """A shuffled pool of num_prompts distinct prompts, reused in turn (request i sends pool
    prompt i mod num_prompts, so the same whole prompt comes back and the prefix cache can serve
    it): num_prefixes system prompts of prefix_len tokens, each opening num_prompts /
    num_prefixes prompts, then the prompt's own question. A pool prompt's length is the
    prompt_len drawn for its first use; later uses repeat it. Edits `prompt` in place."""
    k = m.integer("num_prompts", ge=1)
    groups = m.integer("num_prefixes", 1, ge=1)
    plen = m.integer("prefix_len", 0, ge=0)
    m.done()
    if groups > k:
        raise WorkloadError(f"workload.prompt_pool.num_prefixes={groups}: more than num_prompts={k}")
    n = len(prompt)
    order = rng.permutation(k)            # the pool, shuffled: position -> pool prompt
    first = np.minimum(np.arange(k), n - 1) if n else np.zeros(0, np.int64)
    own = np.maximum(prompt[first] - plen, 1) if n else np.zeros(k, np.int64)  # question tokens per position
    pos = np.arange(n) % k
    prompt[:] = plen + own[pos]
    which = order[pos] % groups          # its system prompt
    q_key = groups * plen + np.concatenate([[0], np.cumsum(own)[:-1]])
    has_sys = plen > 0
    per = 2 if has_sys else 1
    head_off = np.arange(n + 1, dtype=np.int64) * per
    keys = np.empty(n * per, np.int64)
    lens = np.empty(n * per, np.int64)
    if has_sys:
        keys[0::2], lens[0::2] = which * plen, plen
        keys[1::2], lens[1::2] = q_key[pos], own[pos]
    else:
        keys[:], lens[:] = q_key[pos], own[pos]
    return head_off, keys, lens, groups * plen + int(own.sum())


def _lengths(m: _Map, key: str, n: int, rng: np.random.Generator, reader: _Reader) -> np.ndarray:
    kind = m.text("type", choices=("fixed", "uniform", "lognormal", "trace"))
    if kind == "fixed":
        out = np.full(n, m.integer("value", ge=1), np.int64)
    elif kind == "uniform":
        lo = m.integer("min", ge=1)
        hi = m.integer("max", ge=lo)
        out = rng.integers(lo, hi + 1, n, dtype=np.int64)
    elif kind == "lognormal":  # `mean` is the distribution's mean (not its median) before clamping
        mean = m.number("mean", gt=0)
        sigma = m.number("sigma", ge=0)
        lo = m.integer("min", 1, ge=1)
        hi = m.integer("max", None, ge=lo)
        x = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)
        out = np.clip(np.rint(x), lo, hi if hi is not None else np.inf).astype(np.int64)
    else:  # resample (with replacement) a trace column
        fmt = m.text("format", "auto", choices=("auto",) + FORMATS)
        df = reader.read(m, "path", fmt)
        col = m.text("column", key, choices=("prompt_len", "output_len"))
        out = rng.choice(df[col], n)
    m.done()
    return out


def _shared_prefix(m: _Map, prompt: np.ndarray, rng: np.random.Generator):
    """Pick round(fraction * n) requests to start with one of num_prefixes system prompts (chosen
    uniformly); their prompt_len is raised to length + 1 if shorter. Edits `prompt` in place."""
    num = m.integer("num_prefixes", ge=1)
    length = m.integer("length", ge=1)
    fraction = m.number("fraction", 1.0, ge=0, le=1)
    m.done()
    n = len(prompt)
    k = int(math.floor(fraction * n + 0.5))
    chosen = np.sort(rng.choice(n, k, replace=False))
    which = rng.integers(0, num, k)
    prompt[chosen] = np.maximum(prompt[chosen], length + 1)
    has = np.zeros(n, np.int64)
    has[chosen] = 1
    head_off = np.concatenate([[0], np.cumsum(has)])
    return head_off, which * length, np.full(k, length, np.int64), num * length


def _hash_blocks(trace: _Trace, prompt: np.ndarray):
    """Mooncake: block j of a prompt is hash block hash_ids[j] (512 tokens, the last one cut so the
    blocks cover input_length); tokens past the listed blocks go to the unique tail."""
    counts = np.diff(trace.hash_off)
    keys = trace.hash_idx * MOONCAKE_BLOCK
    lens = np.full(len(keys), MOONCAKE_BLOCK, np.int64)
    has = counts > 0
    last = trace.hash_off[1:][has] - 1
    lens[last] = np.minimum(prompt[has] - MOONCAKE_BLOCK * (counts[has] - 1), MOONCAKE_BLOCK)
    return trace.hash_off, keys, lens, trace.num_hash * MOONCAKE_BLOCK


def _segments(prompt, head_off, head_keys, head_lens, next_key):
    """Merge per-request head pieces with a unique tail (the rest of the prompt, if any) whose id
    ranges are allocated consecutively from next_key."""
    head_counts = np.diff(head_off)
    csum = np.concatenate([[0], np.cumsum(head_lens, dtype=np.int64)])
    head_total = csum[head_off[1:]] - csum[head_off[:-1]]
    tail = prompt - head_total
    assert (tail >= 0).all()
    has_tail = tail > 0
    tail_key = next_key + np.concatenate([[0], np.cumsum(tail)[:-1]])
    counts = head_counts + has_tail
    seg_off = np.concatenate([[0], np.cumsum(counts)])
    seg_keys = np.empty(seg_off[-1], np.int64)
    seg_lens = np.empty(seg_off[-1], np.int64)
    pos = np.repeat(seg_off[:-1] - head_off[:-1], head_counts) + np.arange(len(head_keys))
    seg_keys[pos], seg_lens[pos] = head_keys, head_lens
    tpos = (seg_off[:-1] + head_counts)[has_tail]
    seg_keys[tpos], seg_lens[tpos] = tail_key[has_tail], tail[has_tail]
    return seg_off, seg_keys, seg_lens


def _priority(m: _Map | None, n: int, rng: np.random.Generator) -> np.ndarray:
    if m is None:
        return np.zeros(n, np.int64)
    kind = m.text("type", choices=("uniform_int", "fixed"))
    if kind == "fixed":
        out = np.full(n, m.integer("value"), np.int64)
    else:
        lo = m.integer("min")
        hi = m.integer("max", ge=lo)
        out = rng.integers(lo, hi + 1, n, dtype=np.int64)
    m.done()
    return out


def _cancellation(m: _Map | None, output: np.ndarray, rng: np.random.Generator):
    n = len(output)
    cancel_s = np.full(n, np.nan)
    tokens = np.full(n, -1, np.int64)
    if m is None:
        return cancel_s, tokens
    deadline = m.number("deadline_s", None, gt=0)
    fraction = m.number("fraction", 0.0, ge=0, le=1)
    at = m.number("at_output_fraction", _MISSING if fraction > 0 else None, gt=0, le=1)
    m.done()
    if deadline is not None:
        cancel_s[:] = deadline
    k = int(math.floor(fraction * n + 0.5))
    if k:
        chosen = rng.choice(n, k, replace=False)
        tokens[chosen] = np.maximum(np.floor(output[chosen] * at).astype(np.int64), 1)
    return cancel_s, tokens

"""Prometheus metrics of the server (one registry per app, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """Definitions as in sim/metrics.py: TTFT = first token - arrival, TPOT = (last - first) /
    (tokens - 1), ITL = every gap between tokens, E2E = finish - arrival, queue = first scheduled -
    arrival; all in seconds on the engine clock."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "servetwin_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "TTFT", registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "TPOT per request", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "every gap between consecutive tokens",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram(p + "request_queue_time_seconds", "arrival to first scheduled", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.running = Gauge(p + "num_requests_running", "requests running", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "requests waiting", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "fraction of KV blocks in use", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "prefix-cache hit tokens / queried tokens",
                                     registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries_tokens", "tokens looked up", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits_tokens", "tokens found", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "preemptions", registry=r)
        self.aborted = Counter(p + "aborted_requests", "requests aborted (disconnect, timeout)", registry=r)
        self.finished = Counter(p + "request_success", "finished requests by reason", ["finished_reason"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens", registry=r)
        self.rejected = Counter(p + "rejected_requests", "requests refused (validation or admission)",
                                ["reason"], registry=r)
        self._queried = self._hits = 0
        self._seen: dict[str, int] = {}  # tokens already observed per live request

    def on_step(self, engine, outputs, new_preemptions: int) -> None:
        sched = engine.scheduler
        kvm = sched.kv_cache_manager
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(kvm.usage)
        if kvm.num_queried_tokens != self._queried:
            self.prefix_queries.inc(kvm.num_queried_tokens - self._queried)
            self.prefix_hits.inc(kvm.num_hit_tokens - self._hits)
            self._queried, self._hits = kvm.num_queried_tokens, kvm.num_hit_tokens
            self.prefix_hit_rate.set(kvm.prefix_cache_hit_rate)
        if new_preemptions:
            self.preemptions.inc(new_preemptions)
        for o in outputs:
            rec = o.metrics
            if rec is None or not rec.token_times_s:
                continue
            times = rec.token_times_s
            seen = self._seen.get(o.request_id, 0)
            for i in range(max(1, seen), len(times)):
                self.itl.observe(times[i] - times[i - 1])
            self.generation_tokens.inc(len(times) - seen)
            if seen == 0 and rec.first_scheduled_s is not None:
                self.prompt_tokens.inc(rec.num_prompt_tokens)
                self.queue.observe(rec.first_scheduled_s - rec.arrival_s)
            self._seen[o.request_id] = len(times)
            if o.finished:
                self._seen.pop(o.request_id, None)
                reason = o.outputs[0].finish_reason or "stop"
                self.finished.labels(reason).inc()
                if rec.first_token_s is not None:
                    self.ttft.observe(rec.first_token_s - rec.arrival_s)
                    if rec.num_output_tokens > 1:
                        self.tpot.observe((rec.last_token_s - rec.first_token_s) / (rec.num_output_tokens - 1))
                if rec.finish_s is not None:
                    self.e2e.observe(rec.finish_s - rec.arrival_s)

    def on_abort(self, request_id: str | None = None) -> None:
        self.aborted.inc()
        if request_id is not None:
            self._seen.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)

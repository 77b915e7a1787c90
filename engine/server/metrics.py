"""Prometheus metrics of the server under vLLM's names and labels, so dashboards and alerts built
for vLLM work unchanged (one registry per app, so tests can run several).

Every metric carries the label `model_name`. Definitions as in sim/metrics.py, in seconds on the
engine clock, where arrival is the moment the HTTP request was received:
TTFT = first token - arrival; TPOT = (last token - first token) / (output tokens - 1); ITL = every
gap between consecutive tokens; E2E = finish - arrival; queue = first scheduled - arrival;
prefill = first token - first scheduled; decode = finish - first token; inference = finish -
first scheduled. `vllm:kv_cache_usage_perc` is a fraction in [0, 1], as in vLLM.

Only `servetwin_rejected_requests_total` (requests refused at the HTTP boundary, by reason) has no
vLLM equivalent and keeps the project's prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, model_name: str = "default", hidden: bool = False) -> None:
        """`hidden`: also the metrics vLLM deprecated and serves only with
        --show-hidden-metrics-for-version (the same values under their old names)."""
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, registry=r, buckets=buckets).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        v = "vllm:"
        self.ttft = hist(v + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist(v + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS)
        self.tpot = hist(v + "request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = hist(v + "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_BUCKETS)
        self.queue = hist(v + "request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS)
        self.prefill = hist(v + "request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS)
        self.decode = hist(v + "request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS)
        self.inference = hist(v + "request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = hist(v + "request_prompt_tokens",
                                          "Number of prefill tokens processed.", _TOKEN_BUCKETS)
        self.request_generation_tokens = hist(v + "request_generation_tokens",
                                              "Number of generation tokens processed.", _TOKEN_BUCKETS)
        self.running = gauge(v + "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge(v + "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge(v + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(v + "prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter(v + "prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter(v + "num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter(v + "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(v + "generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = hist(v + "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION_BUCKETS)
        self.params_n = hist(v + "request_params_n", "Histogram of the n request parameter.",
                             (1, 2, 5, 10, 20))
        self.params_max_tokens = hist(v + "request_params_max_tokens", "Histogram of the max_tokens request "
                                      "parameter.", _TOKEN_BUCKETS)
        self.max_generation_tokens = hist(v + "request_max_num_generation_tokens", "Histogram of maximum "
                                          "number of requested generation tokens.", _TOKEN_BUCKETS)
        self.cache_config = Gauge(v + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                  ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
                                  registry=r)
        self._success = Counter(v + "request_success", "Count of successfully processed requests.",
                                lab + ["finished_reason"], registry=r)
        self._rejected = Counter("servetwin_rejected_requests", "Requests refused at the HTTP boundary.",
                                 lab + ["reason"], registry=r)
        self.hidden = None
        if hidden:
            self.hidden = (gauge(v + "gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage "
                                 "(deprecated: vllm:kv_cache_usage_perc)."),
                           counter(v + "gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of "
                                   "number of queried tokens (deprecated: vllm:prefix_cache_queries)."),
                           counter(v + "gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number "
                                   "of cached tokens (deprecated: vllm:prefix_cache_hits)."),
                           hist(v + "time_per_output_token_seconds", "Histogram of time per output token in "
                                "seconds (deprecated: vllm:inter_token_latency_seconds).", _ITL_BUCKETS))
        self._queried = self._hits = 0
        self._seen: dict[str, int] = {}  # tokens already observed per live request

    def finished(self, reason: str):
        return self._success.labels(self.model_name, reason)

    def rejected(self, reason: str):
        return self._rejected.labels(self.model_name, reason)

    def refresh(self, engine) -> None:
        """Gauges and prefix-cache counters from the engine's state now (engine thread)."""
        sched = engine.scheduler
        kvm = sched.kv_cache_manager
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(kvm.usage)
        if self.hidden:
            self.hidden[0].set(kvm.usage)
        if kvm.num_queried_tokens != self._queried:
            self.prefix_queries.inc(kvm.num_queried_tokens - self._queried)
            self.prefix_hits.inc(kvm.num_hit_tokens - self._hits)
            if self.hidden:
                self.hidden[1].inc(kvm.num_queried_tokens - self._queried)
                self.hidden[2].inc(kvm.num_hit_tokens - self._hits)
            self._queried, self._hits = kvm.num_queried_tokens, kvm.num_hit_tokens

    def describe_cache(self, engine) -> None:
        """vllm:cache_config_info: the KV cache's settings as labels of a gauge set to 1."""
        cfg = engine.scheduler_config
        self.cache_config.labels(str(cfg.block_size), str(cfg.num_gpu_blocks),
                                 str(cfg.enable_prefix_caching), str(engine.dtype).removeprefix("torch.")).set(1)

    def on_submit(self, n: int, max_tokens: list[int]) -> None:
        """One HTTP request's parameters: n, and each prompt's max_tokens (server thread)."""
        for mt in max_tokens:
            self.params_n.observe(n)
            self.params_max_tokens.observe(mt)

    def on_step(self, engine, outputs, new_preemptions: int) -> None:
        self.refresh(engine)
        # vLLM's iteration tokens: the tokens generated this step, plus the whole prompt of each
        # request whose first token this is
        iteration = 0
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
                if self.hidden:
                    self.hidden[3].observe(times[i] - times[i - 1])
            self.generation_tokens.inc(len(times) - seen)
            iteration += len(times) - seen
            if seen == 0 and rec.first_scheduled_s is not None:
                iteration += rec.num_prompt_tokens
                self.prompt_tokens.inc(rec.num_prompt_tokens)
                self.queue.observe(rec.first_scheduled_s - rec.arrival_s)
            self._seen[o.request_id] = len(times)
            if o.finished:
                self._seen.pop(o.request_id, None)
                self.finished(o.outputs[0].finish_reason or "stop").inc()
                self.request_prompt_tokens.observe(rec.num_prompt_tokens)
                self.request_generation_tokens.observe(rec.num_output_tokens)
                self.max_generation_tokens.observe(rec.num_output_tokens)
                if rec.first_token_s is not None:
                    self.ttft.observe(rec.first_token_s - rec.arrival_s)
                    if rec.first_scheduled_s is not None:
                        self.prefill.observe(rec.first_token_s - rec.first_scheduled_s)
                    if rec.num_output_tokens > 1:
                        self.tpot.observe((rec.last_token_s - rec.first_token_s) / (rec.num_output_tokens - 1))
                if rec.finish_s is not None:
                    self.e2e.observe(rec.finish_s - rec.arrival_s)
                    if rec.first_token_s is not None:
                        self.decode.observe(rec.finish_s - rec.first_token_s)
                    if rec.first_scheduled_s is not None:
                        self.inference.observe(rec.finish_s - rec.first_scheduled_s)
        if iteration:
            self.iteration_tokens.observe(iteration)

    def on_abort(self, request_id: str, engine=None, reason: str = "abort") -> None:
        """A request aborted (disconnect, timeout) or failed ("error"); gauges refreshed at once."""
        self.finished(reason).inc()
        self._seen.pop(request_id, None)
        if engine is not None:
            self.refresh(engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)

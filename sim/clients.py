"""The request path outside the engine: the benchmark client and the API server.

A real measurement (vllm bench serve, aiperf, genai-perf) times a request on the client:

    slot free (or arrival due) -> client turnaround (asyncio wake-up, building the POST)
      -> SEND (the request's arrival_s: the client starts its timer, vllm bench serve's `st`)
      -> HTTP to the API server, request validation, hand-off to the engine    (http_s)
      -> tokenization, one request at a time in each API server process        (tokenize)
      -> the engine's waiting queue: scheduled at a step boundary ... a step ends with a token
      -> engine -> front end -> detokenize -> SSE chunk -> client parses it       (output_s)

so TTFT = queueing + prefill + the CPU work of both ends, and a closed-loop client sends its next
request a turnaround after it has read the last chunk of the previous one. The turnaround is
random (gamma, mean think_s, coefficient of variation think_cv, drawn per request from the
workload's seeded "client" stream), and tokenization is first-come-first-served in each of the
engine's API server processes (default_api_servers), so waves of equal requests do not stay in
lock-step as they would with zero overheads. The request path's time varies from request to
request too (http_cv: gamma, exponential by default: nothing measured says more than its mean),
from the simulation's own seeded stream; a wave of a
closed loop then reaches the engine spread over a few steps, as real clients drift out of phase,
instead of being prefilled in one step every time.

`output_s` is the same for every token, so it shifts a request's token times: TTFT and E2E grow
by it, TPOT and ITL do not change. The batch effect (the front end handles a step's outputs one
request after another) is not modelled; `summary["client"]["tokenizer_busy_fraction"]` says how
loaded the API servers' tokenization was, the one front-end stage queued here (near 1 it, not the
GPU, limits the run).

Defaults (HTTP_DEFAULTS): vllm bench serve against vllm serve on one host, from public component
costs, not fitted to any serving benchmark: FastAPI/uvicorn + pydantic request handling and ZMQ
hand-off ~1 ms; HF fast (Rust) BPE tokenizers run ~0.5-1 M tokens/s on one core, ~1.5 us/token
on vllm bench serve's random-token text; the output path (msgspec IPC, incremental detokenizer,
SSE JSON, aiohttp chunk parse) ~0.3-0.5 ms; an asyncio semaphore hand-off plus request build in
the client ~0.5 ms, exponential. What these leave out is fitted on published runs
(REQUEST_PATH_FITTED_S, added to http_s). Every workload read from a scenario's `workload:`
mapping (build_workload) defaults to HTTP_DEFAULTS: latencies are those a deployed server's
clients see (a Workload made in code without a client goes straight into the engine). An open
loop's arrival times are its sends (the turnaround is a closed loop's only).
`workload.client: {type: engine_direct}` sends requests straight into the engine, as `servetwin
validate` does (it drives its engine without an API server).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from sim.specs import vllm_version_tuple


@dataclass(frozen=True)
class ClientModel:
    think_s: float = 0.0              # client turnaround before each send, mean
    think_cv: float = 1.0             # its coefficient of variation (gamma; 1 = exponential)
    http_s: float = 0.0               # send -> the API server hands the request on, mean
    http_cv: float = 0.0              # its coefficient of variation per request (gamma; 0 = fixed)
    tokenize_s_per_token: float = 0.0  # API-server tokenization, FIFO in one process
    output_s: float = 0.0             # per streamed token: engine step end -> client has it

    @property
    def delays_requests(self) -> bool:
        return self.http_s > 0 or self.tokenize_s_per_token > 0

    def request_path(self, rng: np.random.Generator) -> float:
        """One request's time from send to the API server's hand-off: http_s, or a gamma draw
        with that mean and coefficient of variation http_cv."""
        if self.http_cv <= 0 or self.http_s <= 0:
            return self.http_s
        shape = 1.0 / (self.http_cv * self.http_cv)
        return float(rng.gamma(shape, self.http_s / shape))

    def turnarounds(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n client turnaround delays (seconds), gamma with mean think_s and CV think_cv."""
        if self.think_s <= 0 or n == 0:
            return np.zeros(n)
        if self.think_cv <= 0:
            return np.full(n, self.think_s)
        shape = 1.0 / (self.think_cv * self.think_cv)
        return rng.gamma(shape, self.think_s / shape, n)

    def describe(self) -> dict:
        return asdict(self)


def vllm_bench_result(table: dict, itl: np.ndarray, itl_weights, summary: dict) -> dict:
    """The metrics under the keys `vllm bench serve --save-result` writes (ms; percentiles numpy
    'linear'; std is numpy's population std as vLLM computes it), for side-by-side comparison."""
    from sim.metrics import weighted_percentiles

    done = np.asarray([fr in ("stop", "length") for fr in table["finish_reason"]])
    th = summary["throughput"]
    out = {"completed": int(done.sum()), "duration": summary["duration_s"],
           "total_input_tokens": int(np.asarray(table["num_prompt_tokens"])[done].sum()),
           "total_output_tokens": int(np.asarray(table["num_output_tokens"])[done].sum()),
           "request_throughput": th["requests_per_s"], "output_throughput": th["output_tokens_per_s"],
           "total_token_throughput": th["total_tokens_per_s"]}
    w = None if itl_weights is None else np.asarray(itl_weights)
    for key, col in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", None), ("e2el", "e2e_s")):
        if col is None:
            v = np.asarray(itl, dtype=float)
        else:
            v = np.asarray(table[col], dtype=float)[done]
            v = v[~np.isnan(v)]
        ww = w if col is None else None
        if v.size == 0:
            continue
        mean = float(np.average(v, weights=ww)) * 1e3
        std = float(np.sqrt(np.average((v * 1e3 - mean) ** 2, weights=ww)))
        p50, p90, p99 = weighted_percentiles(v, ww, (50, 90, 99))
        out.update({f"mean_{key}_ms": mean, f"median_{key}_ms": p50 * 1e3, f"std_{key}_ms": std,
                    f"p90_{key}_ms": p90 * 1e3, f"p99_{key}_ms": p99 * 1e3})
    return out


ENGINE_DIRECT = ClientModel()
# The request path's time outside the engine that the component costs above leave out (the API
# server's pre- and post-processing, ZMQ hops, the client's own event loop), fitted as one shift
# of TTFT on the 11 published vLLM H100 runs of ../shared/gpu-runs (`python bench/gpu_runs.py
# --loro` refits it without each run): about 5 ms.
REQUEST_PATH_FITTED_S = 5.0e-3
HTTP_DEFAULTS = ClientModel(think_s=5e-4, think_cv=1.0, http_s=1e-3 + REQUEST_PATH_FITTED_S, http_cv=1.0,
                            tokenize_s_per_token=1.5e-6, output_s=4e-4)
FIELDS = tuple(asdict(ENGINE_DIRECT))
# API server processes per engine (`vllm serve --api-server-count`). From 0.15 on, vLLM starts one
# per data-parallel rank unless told otherwise (its internal load balancer; vllm PR #32525, January
# 2026: a 0.15.1 startup log prints "Defaulting api_server_count to data_parallel_size (4)"), one
# before. Each has its own tokenizer; an engine's servers share its requests (the one listening
# socket hands a request to whichever accepts first), so a request takes the one free first.
API_SERVER_PER_RANK_SINCE = (0, 15)


def default_api_servers(vllm_version: str | None, data_parallel: int) -> int:
    """vLLM's default API server count for an engine of `data_parallel` ranks on that release
    (None: sim.specs.DEFAULT_VLLM_VERSION)."""
    return data_parallel if vllm_version_tuple(vllm_version) >= API_SERVER_PER_RANK_SINCE else 1

__all__ = ["ClientModel", "ENGINE_DIRECT", "HTTP_DEFAULTS", "FIELDS", "API_SERVER_PER_RANK_SINCE",
           "default_api_servers", "vllm_bench_result"]

"""`servetwin serve`: start the OpenAI-compatible server (imports torch only when run)."""
from __future__ import annotations

import argparse
import logging


def add_serve_args(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), an HF dir or a .gguf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", default="fcfs", help="fcfs, priority (requests' `priority` field) or "
                   "shortest_prompt_first")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="abort requests running longer")
    p.add_argument("--request-log", default=None, help="CSV of finished requests (simulator record format)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get a 413")
    p.add_argument("--served-model-name", action="append", default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the engine (CPU only; default: one per core but one, "
                        "which is left to the HTTP side: event loop, tokenizer workers, SSE)")
    p.set_defaults(func=run_serve)


def build_app(a):
    import torch

    from engine.llm_engine import LLMEngine
    from engine.server.app import create_app

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # torch's CPU threads spin while they wait for each other: with a thread on every core,
        # the event loop (HTTP receipt, SSE writes) and the tokenizer workers wait behind a
        # forward pass, and clients see TTFT the server never logged.
        import os
        threads = a.threads or max(1, (os.cpu_count() or 1) - 1)
        torch.set_num_threads(threads)
        logging.getLogger(__name__).info("engine: %d torch CPU thread(s)", threads)
    engine = LLMEngine(model=a.model, device=device, dtype=a.dtype,
                       max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                       max_model_len=a.max_model_len, block_size=a.block_size,
                       num_gpu_blocks=a.num_gpu_blocks, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                       gpu_memory_utilization=a.gpu_memory_utilization,
                       enable_prefix_caching=not a.no_prefix_caching, policy=a.policy)
    return create_app(engine, model_name=a.model, max_waiting=a.max_waiting,
                      request_timeout_s=a.request_timeout_s, request_log=a.request_log,
                      served_model_names=a.served_model_name, max_body_bytes=a.max_body_bytes)


def run_serve(a: argparse.Namespace) -> int:
    import sys

    import uvicorn

    # The engine thread runs Python between its torch calls while holding the GIL; with the
    # default 5 ms switch interval the event loop (HTTP receipt, SSE writes) could wait that long
    # for it at every hand-off, which clients would see as TTFT the server never logged.
    sys.setswitchinterval(0.001)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(a)
    from engine.server.receipt import http_protocol

    # Arrival is stamped when the parser meets a request's first bytes, not when its handler runs.
    uvicorn.run(app, host=a.host, port=a.port, log_level="info", http=http_protocol())
    return 0

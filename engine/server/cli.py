"""`servetwin serve`: start the OpenAI-compatible server (imports torch only when run)."""
from __future__ import annotations

import argparse
import json
import logging

log = logging.getLogger(__name__)


class _YamlConfig(argparse.Action):
    """vLLM's --config FILE: a YAML mapping of flag names (dashes or underscores) to values, parsed
    by this same parser so types and choices are checked as on the command line. A flag the
    command line gives wins wherever it stands: before --config it has left its default, which
    the file then leaves alone; after --config it overwrites the file's value. (A flag given with
    its default value before --config cannot be told from an absent one: the file's value wins.)"""

    def __call__(self, parser, namespace, path, option_string=None):
        import yaml

        try:
            with open(path) as f:
                entries = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            parser.error(f"--config {path}: {e}")
        if not isinstance(entries, dict):
            parser.error(f"--config {path}: must be a mapping of flag names to values")
        argv, dests = [], []
        for key, value in entries.items():
            flag = "--" + str(key).replace("_", "-")
            action = parser._option_string_actions.get(flag)
            if action is None or action.dest == self.dest:
                parser.error(f"--config {path}: unknown flag {key!r}")
            if value is False and isinstance(action, argparse.BooleanOptionalAction):
                argv.append("--no-" + flag[2:])
            elif isinstance(value, bool):
                if value:
                    argv.append(flag)
            elif isinstance(action, argparse._AppendAction):  # a repeatable flag: once per value
                for v in value if isinstance(value, list) else [value]:
                    argv += [flag, str(v)]
            else:
                argv += [flag, *map(str, value if isinstance(value, list) else [value])]
            dests.append(action.dest)
        from_file = parser.parse_args(argv)
        for dest in dests:
            if getattr(namespace, dest, None) == parser.get_default(dest):
                setattr(namespace, dest, getattr(from_file, dest))


def add_serve_args(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as `vllm serve MODEL` takes it "
                   "(the same as --model)")
    p.add_argument("--model", default=None, help="'default' (SmolLM2-135M-Instruct), an HF dir or a .gguf")
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
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's spelling (--no-enable-prefix-caching turns it off)")
    p.add_argument("--policy", default="fcfs", help="fcfs, priority (requests' `priority` field) or "
                   "shortest_prompt_first")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="abort requests running longer")
    p.add_argument("--request-log", default=None, help="CSV of finished requests (simulator record format)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get a 413")
    p.add_argument("--served-model-name", nargs="+", action="extend", default=None,
                   help="the names clients use (as vLLM: the first is the default; the model's own "
                        "name is then not served)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes "
                   "(as vLLM; also read from VLLM_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed for requests without one")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (a file or the template "
                   "itself) instead of the tokenizer's")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help="the most logprobs a request may ask for (default 20, as vLLM; -1: no limit, "
                        "up to the whole vocabulary)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load answers the number of requests in flight (vLLM's)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in answers (vLLM's; off by default)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens written token_id:ID unless a request says otherwise (vLLM's)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="X-Request-Id on every response: the client's own, or a fresh one (vLLM's)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="usage in every chunk of every stream, as if each asked for stream_options "
                        "include_usage and continuous_usage_stats (vLLM's)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="GET /tokenizer_info answers the tokenizer's configuration (vLLM's)")
    p.add_argument("--root-path", default=None,
                   help="the path prefix of a proxy in front of the server: routes answer with it "
                        "and without it (vLLM's)")
    p.add_argument("--show-hidden-metrics-for-version", default=None,
                   help="also serve the Prometheus metrics vLLM deprecated in that version (vLLM's)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, stop accepting requests and wait this many seconds for the ones in "
                        "flight, then abort them (vLLM's; 0: abort at once; default: wait for them all)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="token ids in (vLLM's): text prompts, chat messages and /tokenize are refused "
                        "with a 400; the tokenizer still writes the output text")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted so vLLM command lines run; tools are not supported: a request with "
                        "`tools` is a 400")
    p.add_argument("--tool-call-parser", default=None, help="accepted with --enable-auto-tool-choice (see there)")
    p.add_argument("--chat-template-content-format", choices=("auto", "string", "openai"), default="auto",
                   help="vLLM's: how message content reaches the chat template: 'string', one string (text "
                        "parts joined); 'openai', a list of content parts ({type: text, text}: the text "
                        "parts joined into one); 'auto' (default), 'openai' for a template that loops over "
                        "a message's content, else 'string'")
    p.add_argument("--fingerprint-mode", choices=("full", "hash", "custom", "none"), default="full",
                   help="vLLM's: the system_fingerprint of non-streamed answers: 'full' and 'hash' "
                        "servetwin-VERSION-HASH8 (a hash of the model and engine settings; one device, so the "
                        "same), 'custom' --fingerprint-value, 'none' leaves the field out")
    p.add_argument("--fingerprint-value", default=None, help="the fingerprint of --fingerprint-mode custom")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 only (one device)")
    p.add_argument("--api-server-count", type=int, default=1, help="1 only (one API server process)")
    p.add_argument("--config", action=_YamlConfig, default=None,
                   help="a YAML file of flags (vLLM's: `port: 8001`, `enable-prefix-caching: true`); "
                        "flags given on the command line win, before or after it")
    p.add_argument("--middleware", action="append", default=[],
                   help="MODULE.NAME of an ASGI middleware class or an async `(request, call_next)` "
                        "function, added to the app (vLLM's; repeatable)")
    # LoRA adapters are not supported: the flags are accepted so a vLLM command line starts, the
    # adapters are not loaded, and a request naming one is a 404 like any unknown model
    p.add_argument("--enable-lora", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lora-modules", nargs="*", default=None, help=argparse.SUPPRESS)
    for flag in ("--max-lora-rank", "--max-loras", "--max-cpu-loras"):
        p.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    # vLLM flags that change nothing here: accepted so `vllm serve` command lines run unchanged
    for flag in ("--enforce-eager", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
                 "--disable-frontend-multiprocessing", "--disable-uvicorn-access-log"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    # prompts are always prefilled in chunks of --max-num-batched-tokens
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default="auto",
                   help="vLLM's: 'dummy' gives the model directory random weights (its config.json and "
                        "tokenizer, no weight files needed); 'auto' and 'safetensors' read its weights")
    for flag in ("--tokenizer-mode", "--uvicorn-log-level", "--swap-space"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host/--port "
                   "(vLLM's)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="vLLM's: with VLLM_SERVER_DEV_MODE=1, POST /sleep pauses the engine until POST "
                        "/wake_up (the prefix cache is emptied; the weights stay loaded)")
    # a Hugging Face hub revision: this server reads local files only (nothing is downloaded)
    for flag in ("--revision", "--tokenizer-revision", "--code-revision"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="vLLM's: prompts given as vectors are served (completions' prompt_embeds, chat's "
                        "prompt_embeds content parts: base64 of a torch.save'd (num_tokens, hidden_size) "
                        "tensor); without it, such requests get a 400")
    # steps are scheduled one after another here, as vLLM's --no-async-scheduling
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="vLLM's: a `metrics` object with the request's queue time, time to first token, "
                        "generation time, mean ITL and tokens per second (ms) on answers with one choice, "
                        "and on a stream's usage chunk")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="vLLM's: a request's own `chat_template` is used (without this flag it is refused)")
    p.add_argument("--reasoning-parser", default=None,
                   help="vLLM's: a reply's thinking between <think> and </think> goes to message.reasoning: "
                        "deepseek_r1 or qwen3 (engine/server/reasoning.py)")
    p.add_argument("--reasoning-config", default=None,
                   help="vLLM's: JSON {reasoning_start_str, reasoning_end_str}: other reasoning markers")
    # multimodal limits: this engine serves text-only models, for which vLLM ignores them too
    p.add_argument("--limit-mm-per-prompt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--runner", choices=("auto", "generate", "pooling", "draft"), default="auto",
                   help="vLLM's: 'auto' and 'generate' serve text generation; pooling and draft runners "
                        "are not supported")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the engine (CPU only; default: one per core but one, "
                        "which is left to the HTTP side: event loop, tokenizer workers, SSE)")
    p.set_defaults(func=run_serve)


def build_app(a):
    import os

    import torch

    from engine.llm_engine import LLMEngine
    from engine.server.app import create_app

    if a.model_tag and a.model and a.model_tag != a.model:
        raise SystemExit(f"serve: the model is given twice ({a.model_tag!r} and --model {a.model!r})")
    model = a.model_tag or a.model or "default"
    if a.tensor_parallel_size != 1:
        raise SystemExit(f"serve: --tensor-parallel-size={a.tensor_parallel_size}: this engine runs on one device")
    if a.api_server_count != 1:
        raise SystemExit(f"serve: --api-server-count={a.api_server_count}: this server runs one API server process")
    if a.max_logprobs is not None and a.max_logprobs < -1:
        raise SystemExit(f"serve: --max-logprobs={a.max_logprobs}: must be >= 0, or -1 for no limit")
    if a.fingerprint_mode == "custom" and not a.fingerprint_value:
        raise SystemExit("serve: --fingerprint-mode custom needs --fingerprint-value")
    prefix_caching = not a.no_prefix_caching if a.enable_prefix_caching is None else a.enable_prefix_caching
    if a.runner not in ("auto", "generate"):
        raise SystemExit(f"serve: --runner={a.runner}: this server runs text generation only (auto or generate)")
    reasoning_config = None
    if a.reasoning_config is not None:
        try:
            reasoning_config = json.loads(a.reasoning_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"serve: --reasoning-config={a.reasoning_config!r}: not JSON ({e})") from None
        if not isinstance(reasoning_config, dict):
            raise SystemExit(f"serve: --reasoning-config={a.reasoning_config!r}: must be a JSON object")
        if a.reasoning_parser is None:
            raise SystemExit("serve: --reasoning-config needs --reasoning-parser")

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # torch's CPU threads spin while they wait for each other: with a thread on every core,
        # the event loop (HTTP receipt, SSE writes) and the tokenizer workers wait behind a
        # forward pass, and clients see TTFT the server never logged.
        threads = a.threads or max(1, (os.cpu_count() or 1) - 1)
        torch.set_num_threads(threads)
        log.info("engine: %d torch CPU thread(s)", threads)
    engine = LLMEngine(model=model, device=device, dtype=a.dtype,
                       max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                       max_model_len=a.max_model_len, block_size=a.block_size,
                       num_gpu_blocks=a.num_gpu_blocks, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                       gpu_memory_utilization=a.gpu_memory_utilization,
                       enable_prefix_caching=prefix_caching, policy=a.policy, seed=a.seed,
                       load_format="dummy" if a.load_format == "dummy" else "auto")
    if a.chat_template is not None:
        if engine.tokenizer is None:
            raise SystemExit("serve: --chat-template: this model has no tokenizer")
        engine.tokenizer.chat_template = read_chat_template(a.chat_template)
    for flag, value in (("--revision", a.revision), ("--tokenizer-revision", a.tokenizer_revision),
                        ("--code-revision", a.code_revision)):
        if value is not None:
            log.warning("serve: %s %s ignored: the model is read from local files, "
                                                "as they are", flag, value)
    if a.enable_lora or a.lora_modules:
        log.warning("serve: LoRA adapters are not supported; %s not loaded "
                                            "(requests naming them get a 404)", a.lora_modules or "none")
    if a.limit_mm_per_prompt is not None:
        log.warning("serve: --limit-mm-per-prompt %s ignored: the model is text-only", a.limit_mm_per_prompt)
    reasoning = None
    if a.reasoning_parser is not None:
        from engine.server.reasoning import ReasoningParser
        try:
            reasoning = ReasoningParser.build(a.reasoning_parser, reasoning_config, engine.tokenizer)
        except ValueError as e:
            raise SystemExit(f"serve: {e}") from None
    served = a.served_model_name
    app = create_app(engine, model_name=served[0] if served else model, max_waiting=a.max_waiting,
                      request_timeout_s=a.request_timeout_s, request_log=a.request_log,
                      served_model_names=served, max_body_bytes=a.max_body_bytes,
                      api_key=a.api_key or os.environ.get("VLLM_API_KEY"), max_logprobs=a.max_logprobs,
                      load_tracking=a.enable_server_load_tracking,
                      request_id_headers=a.enable_request_id_headers,
                      prompt_tokens_details=a.enable_prompt_tokens_details,
                      return_tokens_as_token_ids=a.return_tokens_as_token_ids,
                      force_include_usage=a.enable_force_include_usage,
                      tokenizer_info=a.enable_tokenizer_info_endpoint,
                      hidden_metrics=a.show_hidden_metrics_for_version is not None,
                      root_path=a.root_path or "", token_ids_only=a.skip_tokenizer_init,
                      chat_template_content_format=a.chat_template_content_format,
                      fingerprint_mode=a.fingerprint_mode, fingerprint_value=a.fingerprint_value,
                      dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1", sleep_mode=a.enable_sleep_mode,
                      per_request_metrics=a.enable_per_request_metrics,
                      trust_request_chat_template=a.trust_request_chat_template, reasoning=reasoning,
                      enable_prompt_embeds=a.enable_prompt_embeds)
    for name in a.middleware:
        add_middleware(app, name)
    return app


def read_chat_template(given: str) -> str:
    """--chat-template: a file's contents, or the template itself. As vLLM, a value that cannot be
    opened and has none of a Jinja template's characters ('{', '}', a newline) is a mistyped
    path, refused, never served as a template that prints itself."""
    import os

    path = os.path.expanduser(given)
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        if not any(c in given for c in "{}\n"):
            raise SystemExit(f"serve: --chat-template {given!r} looks like a file path, but it cannot be "
                             f"opened ({e.strerror}); give a readable file or the template itself") from None
        return given


def add_middleware(app, name: str) -> None:
    """--middleware MODULE.NAME: an ASGI middleware class (app.add_middleware) or an async function
    of (request, call_next) (an HTTP middleware), as vLLM adds them."""
    import importlib
    import inspect

    module, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"serve: --middleware {name!r}: cannot be imported ({e})") from None
    if inspect.isclass(obj):
        app.add_middleware(obj)
    elif inspect.iscoroutinefunction(obj):
        app.middleware("http")(obj)
    else:
        raise SystemExit(f"serve: --middleware {name!r}: must name an ASGI middleware class or an async "
                         "function of (request, call_next)")


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
    if a.shutdown_timeout is not None and a.shutdown_timeout < 0:
        raise SystemExit(f"serve: --shutdown-timeout={a.shutdown_timeout}: must be >= 0")
    where = {"uds": a.uds} if a.uds else {"host": a.host, "port": a.port}
    uvicorn.run(app, **where, log_level="info", http=http_protocol(),
                timeout_graceful_shutdown=a.shutdown_timeout)
    return 0

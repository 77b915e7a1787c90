"""OpenAI-compatible HTTP server over the real engine (FastAPI + uvicorn), a drop-in for vLLM's.

Endpoints: POST /v1/completions, POST /v1/chat/completions (chat template), POST
/v1/chat/completions/batch (vLLM's: several conversations, one response), POST /invocations
(either, by the body), GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize, GET
/version, GET|POST /ping, GET /health, POST /reset_prefix_cache, GET /metrics (Prometheus, vLLM's
names), GET /openapi.json (OpenAPI 3.1: every request body and every response, errors and
streamed chunks included: engine/server/openapi.py, engine/server/responses.py). Errors, 404 and
405 included, are OpenAI-format JSON.

Completions take one prompt or several (text or token ids), `n` choices each, `echo`, `logprobs`
(with echo, the prompt's tokens lead; `max_tokens: 0` echoes only); chat takes `logprobs` /
`top_logprobs`, custom roles and `echo`; both take `logit_bias` and vLLM's `prompt_logprobs`,
`return_token_ids` and `return_tokens_as_token_ids`. Streaming is Server-Sent Events
(`stream: true`); `stream_options.include_usage` adds a last chunk with usage, and
`continuous_usage_stats` puts usage in every chunk. `usage.prompt_tokens_details.cached_tokens`
counts prefix-cache hits (unless `prompt_tokens_details` is off, as `servetwin serve` has it by
default, like vLLM).

A request's arrival is stamped when the HTTP request is received: under `servetwin serve`, when
uvicorn's parser meets its first bytes (engine/server/receipt.py); elsewhere, when its handler
starts. Either way before its body is read or tokenized, so TTFT, queue time and the request log
count everything the client waits for.
Tokenization and chat templating run on worker threads, never on the event loop, after a
body-size limit and a length check that needs no tokenizer. A client that disconnects, or a
request past the server's timeout, is aborted in the engine (its KV blocks are freed before the
next step). Past `max_waiting` queued requests the server answers 503 with Retry-After.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.server.context import RequestLog, ServerContext, TokenizerPool, _error
from engine.server.openapi import install_openapi
from engine.server.protocol import APIError
from engine.server.routes_misc import VERSION, add_misc_routes
from engine.server.routes_decisions import add_decision_routes
from engine.server.routes_openai import Shape, add_openai_routes

__all__ = ["RequestLog", "Shape", "TokenizerPool", "VERSION", "create_app"]
logger = logging.getLogger("servetwin.server")


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/invocations")


def _route_path(scope) -> str:
    """The path the routes see: without the --root-path prefix when the request has it (a proxy
    that forwards the prefix), as Starlette routes."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


class _RootPath:
    """ASGI middleware: vLLM's --root-path, the proxy's prefix as the request's root_path (the
    routes then answer with the prefix and without it, as Starlette routes)."""

    def __init__(self, app, root: str) -> None:
        self.app, self.root = app, root

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not scope.get("root_path"):
            scope = {**scope, "root_path": self.root}
        await self.app(scope, receive, send)


class _ApiKey:
    """ASGI middleware (not FastAPI's http middleware, which buffers streams): the /v1/ routes
    need `Authorization: Bearer KEY`, as vLLM's --api-key; health, metrics and the rest do not."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, ("Bearer " + key).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope).startswith("/v1/") and scope["method"] != "OPTIONS":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(auth, self.expected):
                err = APIError(401, "Unauthorized: a valid `Authorization: Bearer` API key is required", None,
                               type="authentication_error", code="invalid_api_key")
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _LoadCounter:
    """ASGI middleware: the generation requests in flight (from receipt to the stream's end), as
    vLLM's --enable-server-load-tracking counts them (GET /load)."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class _RequestIdHeader:
    """ASGI middleware: every response carries X-Request-Id, the client's own or a fresh one, as
    vLLM's --enable-request-id-headers (it replaces the generation routes' prefixed id)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _forget_endpoints() -> None:
    """Empty FastAPI's module-level memos of what kind of callable each endpoint is (LRU caches keyed
    by the callable, in fastapi.dependencies.models since 0.16x). They keep every stopped app's
    endpoints alive, and through their closures its engine, model weights and KV cache: a process
    that creates and stops apps (the test suite, an embedding program) would hold them all. The
    memos refill on the next request of any running app."""
    import fastapi.dependencies.models as memos
    for f in vars(memos).values():
        if callable(getattr(f, "cache_clear", None)):
            f.cache_clear()


FINGERPRINT_MODES = ("full", "hash", "custom", "none")


def system_fingerprint(engine, mode: str = "full", value: str | None = None) -> str | None:
    """vLLM's --fingerprint-mode: the system_fingerprint of non-streamed answers. "full" and "hash"
    (the same here: one device, no parallelism to name) are servetwin-VERSION-HASH8, HASH8 the
    first 8 hex digits of a hash of what changes the outputs (model, dtype, device, lengths, KV
    block size, scheduler policy); "custom" is `value`; "none", None (the field is left out)."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"fingerprint_mode={mode!r}: must be one of {', '.join(FINGERPRINT_MODES)}")
    if mode == "custom":
        if not value:
            raise ValueError("fingerprint_mode='custom' needs a fingerprint_value (--fingerprint-value)")
        return value
    if mode == "none":
        return None
    cfg = getattr(engine, "scheduler_config", None)
    parts = [getattr(engine, "model_name", None), str(getattr(engine, "dtype", None)),
             str(getattr(engine, "device", None)), getattr(engine, "max_model_len", None),
             getattr(engine, "block_size", None), getattr(cfg, "policy", None)]
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:8]
    return f"servetwin-{VERSION}-{digest}"


def create_app(engine, model_name: str = "default", max_waiting: int = 256,
               request_timeout_s: float = 600.0, request_log: str | Path | None = None,
               served_model_names: list[str] | None = None, max_body_bytes: int = 4 << 20,
               tokenizer_workers: int = 2, api_key: str | None = None, max_logprobs: int | None = None,
               load_tracking: bool = False, request_id_headers: bool = False,
               prompt_tokens_details: bool = True, return_tokens_as_token_ids: bool = False,
               force_include_usage: bool = False, tokenizer_info: bool = False,
               hidden_metrics: bool = False, root_path: str = "", token_ids_only: bool = False,
               chat_template_content_format: str = "auto", fingerprint_mode: str = "full",
               fingerprint_value: str | None = None, dev_mode: bool = False,
               sleep_mode: bool = False, per_request_metrics: bool = False,
               trust_request_chat_template: bool = False, reasoning=None,
               enable_prompt_embeds: bool = False) -> FastAPI:
    """`engine` is an LLMEngine; the app owns its loop thread (started with the app). The routes
    live in routes_openai.py and routes_misc.py, the state they share in context.py. vLLM's
    server options: `api_key` (the /v1/ routes need it), `max_logprobs` (the most a request may
    ask for), `load_tracking` (GET /load), `request_id_headers` (X-Request-Id on every response),
    `prompt_tokens_details` (usage.prompt_tokens_details.cached_tokens; `servetwin serve` leaves it
    off unless --enable-prompt-tokens-details, as vLLM), `return_tokens_as_token_ids` (the
    default of the request field), `force_include_usage` (usage in every chunk of every stream),
    `tokenizer_info` (GET /tokenizer_info), `hidden_metrics` (also the metrics vLLM deprecated),
    `root_path` (a proxy's path prefix: routes answer with it and without it, as vLLM's),
    `token_ids_only` (--skip-tokenizer-init: text prompts and messages get a 400),
    `chat_template_content_format` (how message content reaches the chat template: "string", one
    string; "openai", a list of content parts; "auto", read from the template as vLLM does),
    `fingerprint_mode` / `fingerprint_value` (the answers' system_fingerprint: system_fingerprint()),
    `dev_mode` (vLLM's VLLM_SERVER_DEV_MODE routes: /sleep, /wake_up, /is_sleeping),
    `sleep_mode` (--enable-sleep-mode: /sleep may pause the engine), `per_request_metrics`
    (--enable-per-request-metrics: a `metrics` object of the request's timings on a single
    answer, or on a stream's usage chunk), `trust_request_chat_template` (a request's own
    `chat_template` is used; without it, refused), `reasoning` (a reasoning parser,
    engine.server.reasoning: chat replies' thinking in message.reasoning) and
    `enable_prompt_embeds` (--enable-prompt-embeds: completions' prompt_embeds and chat's
    prompt_embeds content parts are served; without it, a 400)."""
    ctx = ServerContext(engine, model_name, max_waiting, request_timeout_s, request_log,
                        served_model_names, max_body_bytes, tokenizer_workers, max_logprobs,
                        prompt_tokens_details, return_tokens_as_token_ids, force_include_usage,
                        hidden_metrics, token_ids_only, chat_template_content_format,
                        system_fingerprint(engine, fingerprint_mode, fingerprint_value),
                        per_request_metrics, trust_request_chat_template, reasoning, enable_prompt_embeds)
    metrics = ctx.metrics

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        ctx.start()
        try:
            yield
        finally:
            ctx.stop()
            _forget_endpoints()

    app = FastAPI(title="ServeTwin", version=VERSION, lifespan=lifespan)
    app.state.async_engine = ctx.aeng
    app.state.metrics = metrics
    app.state.context = ctx

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        metrics.rejected("overloaded" if e.status == 503 else "invalid" if e.status < 500 else "error").inc()
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"{req.method} {req.url.path}: {e.detail}"
        return JSONResponse(APIError(e.status_code, msg, None, code=code).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):
        # A bug, not the client's fault: logged, and answered in OpenAI's format (never a plain
        # text 500 that closes the connection).
        logger.exception("internal error")
        metrics.rejected("error").inc()
        return _error(APIError(500, f"internal server error: {e!r}", None, type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ())) or "body"
        return _error(APIError(400, f"{field}: {first.get('msg', 'invalid')}", field))

    add_misc_routes(app, ctx, tokenizer_info=tokenizer_info, dev_mode=dev_mode, sleep_mode=sleep_mode)
    add_openai_routes(app, ctx)
    add_decision_routes(app, ctx)
    if load_tracking:
        app.state.server_load = 0
        app.add_middleware(_LoadCounter, state=app.state)

        @app.get("/load")
        async def load():
            return {"server_load": app.state.server_load}
    if api_key:
        app.add_middleware(_ApiKey, key=api_key)
    if request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if root_path.rstrip("/"):
        app.add_middleware(_RootPath, root=root_path.rstrip("/"))  # outermost: the others see it
    install_openapi(app)
    return app

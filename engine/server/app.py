"""OpenAI-compatible HTTP server over the real engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus). Streaming is Server-Sent Events (`stream: true`), with
`stream_options.include_usage` adding a last chunk that carries usage. A client that disconnects,
or a request past the server's timeout, is aborted in the engine (its KV blocks are freed before
the next step). Past `max_waiting` queued requests the server answers 503.
"""
from __future__ import annotations

import asyncio
import csv
import json
import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from engine.core.records import RequestRecord
from engine.server.async_engine import AsyncEngine, EngineDead
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, new_id,
                                    now_s, usage)

logger = logging.getLogger("servetwin.server")


class RequestLog:
    """Finished requests as CSV rows: the RequestRecord columns the simulator writes to
    requests.csv, plus every token's time (space-separated). sim.metrics.read_request_log
    derives the same latency columns from it."""

    COLUMNS = list(RequestRecord.COLUMNS) + ["token_times_s"]

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", newline="")
        self._w = csv.writer(self._f)
        self._w.writerow(self.COLUMNS)
        self._lock = threading.Lock()

    def write(self, rec: RequestRecord) -> None:
        row = [getattr(rec, c) for c in RequestRecord.COLUMNS]
        row.append(" ".join(f"{t:.6f}" for t in (rec.token_times_s or ())))
        with self._lock:
            self._w.writerow(["" if v is None else v for v in row])
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_message(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    field = ".".join(str(x) for x in first.get("loc", ()) if not isinstance(x, int)) or "body"
    value = first.get("input")
    return field, f"{field}={value!r}: {first.get('msg', 'invalid')}"


def create_app(engine, model_name: str = "default", max_waiting: int = 256,
               request_timeout_s: float = 600.0, request_log: str | Path | None = None,
               served_model_names: list[str] | None = None) -> FastAPI:
    """`engine` is an LLMEngine; the app owns its loop thread (started with the app)."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model

    metrics = ServerMetrics()
    log = RequestLog(request_log) if request_log else None
    aeng = AsyncEngine(engine, metrics, log, request_timeout_s)
    names = set(served_model_names or []) | {model_name}
    # The HTTP side tokenizes with its own tokenizer instance: the engine thread detokenizes
    # concurrently, and fast tokenizers are not safe to share across threads.
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model_name)), local_files_only=True) \
        if engine.tokenizer is not None else None
    max_model_len = engine.max_model_len

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        aeng.start()
        try:
            yield
        finally:
            aeng.stop()
            if log is not None:
                log.close()

    app = FastAPI(title="ServeTwin", version="0.1", lifespan=lifespan)
    app.state.async_engine = aeng
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        if e.status >= 400:
            metrics.rejected.labels("overloaded" if e.status == 503 else "invalid").inc()
        return _error(e)

    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse({"status": "error", "error": repr(aeng.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": now_s(), "owned_by": "servetwin",
             "max_model_len": max_model_len} for n in sorted(names)]}

    async def parse(request: Request, cls):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", "body") from None
        if not isinstance(body, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", "body")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            field, msg = _validation_message(e)
            raise APIError(400, msg, field) from None
        if req.model not in names:
            raise APIError(400, f"model={req.model!r}: unknown model; this server serves {sorted(names)}",
                           "model")
        return req

    def prepare(req, prompt_ids: list[int]):
        for name in ("logprobs", "echo"):  # accepted by OpenAI, not implemented here
            v = getattr(req, name, None)
            if v not in (None, False):
                raise APIError(400, f"{name}={v!r}: not supported by this server", name)
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "prompt: empty prompt (0 tokens)", "prompt")
        if n >= max_model_len:
            raise APIError(400, f"prompt: {n} tokens does not fit in max_model_len={max_model_len} "
                                "(it must leave room for at least one generated token)", "prompt")
        mt = req.requested_max_tokens
        if mt is None:
            mt = max_model_len - n  # what fits
        elif mt < 1:
            raise APIError(400, f"max_tokens={mt}: must be >= 1", "max_tokens")
        elif n + mt > max_model_len:
            raise APIError(400, f"max_tokens={mt}: prompt ({n} tokens) + max_tokens exceeds "
                                f"max_model_len={max_model_len}", "max_tokens")
        problem = engine.scheduler.fit_problem(n, mt)  # config only: safe from this thread
        if problem is not None:
            raise APIError(400, f"max_tokens={mt}: {problem}", "max_tokens")
        params = req.sampling_params(mt)
        if aeng.num_waiting() >= max_waiting:
            raise APIError(503, f"server overloaded: {aeng.num_waiting()} requests waiting "
                                f"(max_waiting={max_waiting}); retry later", None,
                           type="server_overloaded_error", code="overloaded")
        if not aeng.alive:
            raise APIError(503, f"engine is not running: {aeng.error!r}", None, type="server_error")
        return params

    def tokenize(text: str, special: bool = True) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
        return list(tokenizer(text, add_special_tokens=special).input_ids)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: {len(p)} prompts given; only one prompt per request "
                                    "is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            text, ids = p, tokenize(p)
        else:
            text, ids = None, list(p)
            if any((not isinstance(t, int)) or t < 0 or t >= engine.vocab_size for t in ids):
                raise APIError(400, f"prompt: token ids must be in [0, {engine.vocab_size})", "prompt")
        params = prepare(req, ids)
        return await respond(request, req, "cmpl", "text_completion", ids, text, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model={req.model!r} has no chat template", "model")
        msgs = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            msgs.append({"role": m.role, "content": content or ""})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tokenize(text, special=False)
        params = prepare(req, ids)
        return await respond(request, req, "chatcmpl", "chat.completion", ids, text, params, chat=True)

    async def respond(request: Request, req, prefix: str, obj: str, ids, text, params, chat: bool):
        rid = new_id(prefix)
        created = now_s()
        # Queued now, in the same event-loop turn as the admission check in prepare(), so
        # concurrent requests see each other in num_waiting().
        try:
            handle = aeng.submit(rid, ids, params, text, req.priority)
        except EngineDead as e:
            raise APIError(503, str(e), None, type="server_error") from None
        gen = aeng.outputs(rid, handle)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(gen, rid, created, req.model, obj + ".chunk" if chat else obj,
                                            len(ids), include_usage, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, gen, rid, created, req.model, obj, len(ids), chat)

    async def complete(request: Request, gen, rid, created, model, obj, n_prompt, chat):
        final = None

        async def consume():
            nonlocal final
            async for out in gen:
                final = out

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()  # the generator's cleanup aborts the request in the engine
                    await asyncio.gather(task, return_exceptions=True)
                    return Response(status_code=499)
            exc = task.exception()
            if exc is not None:
                raise exc
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        except EngineDead as e:
            raise APIError(503, str(e), None, type="server_error") from None
        c = final.outputs[0]
        choice = {"index": 0, "finish_reason": c.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        if c.stop_reason is not None:
            choice["stop_reason"] = c.stop_reason
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                "usage": usage(n_prompt, len(c.token_ids))}

    async def sse(gen, rid, created, model, obj, n_prompt, include_usage, chat):
        def chunk(delta_text: str | None, finish, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {} if delta_text is None else {"content": delta_text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        sent = ""
        n_tokens = 0
        try:
            if chat:
                yield chunk(None, None, role=True)
            async for out in gen:
                c = out.outputs[0]
                n_tokens = max(n_tokens, len(c.token_ids))
                delta = c.text[len(sent):] if c.text.startswith(sent) else ""
                sent = c.text if c.text.startswith(sent) else sent
                if delta or c.finish_reason is not None:
                    yield chunk(delta if delta or not chat else None, c.finish_reason)
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": usage(n_prompt, n_tokens)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        except (ValueError, EngineDead) as e:
            err = APIError(400 if isinstance(e, ValueError) else 503, str(e), None)
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            await gen.aclose()  # on disconnect: aborts the request in the engine

    return app

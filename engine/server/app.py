"""OpenAI-compatible HTTP server over the real engine (FastAPI + uvicorn), a drop-in for vLLM's.

Endpoints: POST /v1/completions, POST /v1/chat/completions (chat template), GET /v1/models and
/v1/models/{id}, POST /tokenize and /detokenize, GET /version, GET|POST /ping, GET /health,
POST /reset_prefix_cache, GET /metrics (Prometheus, vLLM's names). Errors, 404 and 405 included,
are OpenAI-format JSON.

Completions take one prompt or several (text or token ids), `n` choices each, `echo`, and
`logprobs`; chat takes `logprobs` / `top_logprobs`. Streaming is Server-Sent Events
(`stream: true`); `stream_options.include_usage` adds a last chunk with usage, and
`continuous_usage_stats` puts usage in every chunk. `usage.prompt_tokens_details.cached_tokens`
counts prefix-cache hits.

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

import asyncio
import copy
import csv
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.admission import AdmissionError, admit
from engine.core.records import RequestRecord
from engine.server.async_engine import AsyncEngine, Child, EngineDead, RequestFailed
from engine.server.receipt import received_elapsed_s
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest, check_json_values,
                                    check_unsupported, loads, new_id, now_s, usage, validate_model)

logger = logging.getLogger("servetwin.server")
VERSION = "0.1.0"
MASK64 = (1 << 64) - 1


class RequestLog:
    """Finished requests as CSV rows: the RequestRecord columns the simulator writes to
    requests.csv, plus every token's time (space-separated). sim.metrics.read_request_log
    derives the same latency columns from it. A request's id is the response's `id` (with
    `-k` appended for the k-th choice of a request with several)."""

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


class TokenizerPool:
    """Tokenizer work on worker threads, each with its own copy (fast tokenizers must not be
    shared across threads): the event loop never waits for a tokenizer."""

    def __init__(self, tokenizer, workers: int = 2) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._lock = threading.Lock()

    def _tok(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._lock:
                tok = self._local.tok = copy.deepcopy(self._base)
        return tok

    async def run(self, fn, *args):
        """fn(tokenizer, *args) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._tok(), *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _overloaded(message: str) -> APIError:
    return APIError(503, message, None, type="server_overloaded_error", code="overloaded",
                    headers={"Retry-After": "1"})


def _child_seed(seed: int | None, i: int) -> int | None:
    """vLLM: the i-th choice of a seeded request uses seed + i (kept within 64 bits)."""
    if seed is None:
        return None
    return seed + i if seed < 0 else (seed + i) & MASK64


def _field_of(e: ValueError) -> str:
    """The field an engine ValueError names first ('prompt: ...', 'request_id=...')."""
    head = str(e).split(":", 1)[0].split("=", 1)[0].strip()
    return head if head.isidentifier() else "prompt"


def _encode(tok, text: str, special: bool) -> list[int]:
    return list(tok(text, add_special_tokens=special).input_ids)


def _apply_template(tok, conv: list[dict], add_generation_prompt: bool, continue_final: bool) -> tuple[str, list[int]]:
    kw = {"continue_final_message": True} if continue_final else {}
    text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt and not continue_final,
                                   tokenize=False, **kw)
    return text, _encode(tok, text, False)


def create_app(engine, model_name: str = "default", max_waiting: int = 256,
               request_timeout_s: float = 600.0, request_log: str | Path | None = None,
               served_model_names: list[str] | None = None, max_body_bytes: int = 4 << 20,
               tokenizer_workers: int = 2) -> FastAPI:
    """`engine` is an LLMEngine; the app owns its loop thread (started with the app)."""
    metrics = ServerMetrics(model_name)
    log = RequestLog(request_log) if request_log else None
    aeng = AsyncEngine(engine, metrics, log, request_timeout_s)
    names = set(served_model_names or []) | {model_name}
    tokenizer = engine.tokenizer
    pool = TokenizerPool(tokenizer, tokenizer_workers) if tokenizer is not None else None
    max_model_len = engine.max_model_len
    vocab_size = engine.vocab_size
    # A token covers at most this many characters of text (byte-level BPE and SentencePiece token
    # strings are at least as long as the text they stand for): a longer text cannot fit in
    # max_model_len tokens, and is refused before tokenizing. x2 for normalisers that drop text.
    max_chars = (2 * max_model_len * max(len(t) for t in tokenizer.get_vocab())) if tokenizer is not None else 0

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        aeng.start()
        try:
            yield
        finally:
            aeng.stop()
            if pool is not None:
                pool.close()
            if log is not None:
                log.close()

    app = FastAPI(title="ServeTwin", version=VERSION, lifespan=lifespan)
    app.state.async_engine = aeng
    app.state.metrics = metrics

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

    # ---------------------------------------------------------------- plain endpoints
    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse({"status": "error", "error": repr(aeng.error)}, status_code=503)
        return {"status": "ok"}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200 if aeng.alive else 503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(n: str) -> dict:
        return {"id": n, "object": "model", "created": now_s(), "owned_by": "servetwin", "root": n,
                "parent": None, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in sorted(names)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in names:
            raise APIError(404, f"model={model_id!r}: no such model; this server serves {sorted(names)}",
                           "model", code="model_not_found")
        return model_card(model_id)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await aeng.call(lambda eng: eng.reset_prefix_cache())
        if not ok:
            raise APIError(409, "the prefix cache cannot be reset while requests hold KV blocks; "
                                "retry when idle", None, code="busy")
        return Response(status_code=200)

    # ---------------------------------------------------------------- parsing
    async def read_json(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise APIError(413, f"body: {int(size)} bytes exceeds the server's limit of {max_body_bytes}",
                           "body")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > max_body_bytes:
                raise APIError(413, f"body: more than the server's limit of {max_body_bytes} bytes", "body")
            chunks.append(chunk)
        body = loads(b"".join(chunks))
        if not isinstance(body, dict):
            raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
        check_json_values(body)
        return body

    async def parse(request: Request, cls):
        body = await read_json(request)
        check_unsupported(body)
        req = validate_model(cls, body)
        if req.model is not None and req.model not in names:
            raise APIError(404, f"model={req.model!r}: no such model; this server serves {sorted(names)}",
                           "model", code="model_not_found")
        if req.model is None:
            req.model = model_name
        return req

    def check_chars(text: str, field: str) -> None:
        if tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field)
        if len(text) > max_chars:
            raise APIError(400, f"{field}: {len(text)} characters cannot fit in max_model_len="
                                f"{max_model_len} tokens", field)

    def limits(req, n_prompt: int, field: str) -> int:
        """The request's max_tokens for a prompt of n_prompt tokens, or a 400 naming the field
        (engine.core.admission, the server's rule: prompt + max_tokens must fit)."""
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            mt = admit(n_prompt, req.requested_max_tokens, max_model_len, refuse_overflow=True,
                       max_tokens_field=name, prompt_field=field)
        except AdmissionError as e:
            raise APIError(400, str(e), e.field) from None
        problem = engine.scheduler.fit_problem(n_prompt, mt)  # config only: safe from this thread
        if problem is not None:
            raise APIError(400, f"{name}={mt}: {problem}", name)
        return mt

    def children(req, rid: str, prompts: list[tuple[str | None, list[int]]], logprobs: int | None) -> list[Child]:
        out = []
        many = len(prompts) * req.n > 1
        for p, (text, ids) in enumerate(prompts):
            field = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
            mt = limits(req, len(ids), field if isinstance(req, CompletionRequest) else "messages")
            for i in range(req.n):
                params = req.sampling_params(mt, _child_seed(req.seed, i), logprobs)
                cid = f"{rid}-{p * req.n + i}" if many else rid
                out.append(Child(cid, ids, params, text, req.priority))
        return out

    def request_id(request: Request, prefix: str) -> str:
        """vLLM's: the client's X-Request-Id header, if it sent a usable one, else random; with
        the endpoint's prefix. It is the response's `id` and the request log's request_id."""
        given = request.headers.get("x-request-id", "")
        if 0 < len(given) <= 128 and given.isprintable() and "," not in given:
            return f"{prefix}-{given}"
        return new_id(prefix)

    def check_capacity(kids: list[Child]) -> None:
        if not aeng.alive:
            raise APIError(503, f"engine is not running: {aeng.error!r}", None, type="server_error",
                           headers={"Retry-After": "1"})
        if aeng.num_waiting() + len(kids) > max_waiting:
            raise _overloaded(f"server overloaded: {aeng.num_waiting()} requests waiting "
                              f"(max_waiting={max_waiting}); retry later")

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = engine.now() - received_elapsed_s(request.scope)
        req = await parse(request, CompletionRequest)
        prompts = req.prompts(vocab_size)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: echo with logprobs (prompt logprobs) is not supported by this server",
                           "echo")
        texts = [(k, p) for k, p in enumerate(prompts) if isinstance(p, str)]
        for k, t in texts:
            check_chars(t, f"prompt[{k}]" if len(prompts) > 1 else "prompt")
        if texts:
            encoded = await pool.run(lambda tok: [_encode(tok, t, True) for _, t in texts])
            for (k, t), ids in zip(texts, encoded):
                prompts[k] = (t, ids)
        if req.echo and tokenizer is not None:
            id_prompts = [(k, p) for k, p in enumerate(prompts) if isinstance(p, list)]
            if id_prompts:
                decoded = await pool.run(lambda tok: [tok.decode(p) for _, p in id_prompts])
                for (k, p), t in zip(id_prompts, decoded):
                    prompts[k] = (t, p)
        prompts = [p if isinstance(p, tuple) else (None, p) for p in prompts]
        rid = request_id(request, "cmpl")
        kids = children(req, rid, prompts, req.logprobs)
        return await respond(request, req, rid, kids, arrival, chat=False,
                             echo=[t or "" for t, _ in prompts] if req.echo else None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrival = engine.now() - received_elapsed_s(request.scope)
        req = await parse(request, ChatCompletionRequest)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model={req.model!r} has no chat template", "model")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        conv = req.conversation()
        check_chars("".join(m["content"] for m in conv), "messages")
        try:
            text, ids = await pool.run(_apply_template, conv, req.add_generation_prompt,
                                       req.continue_final_message)
        except Exception as e:  # the template refused the conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from None
        rid = request_id(request, "chatcmpl")
        kids = children(req, rid, [(text, ids)], (req.top_logprobs or 0) if req.logprobs else None)
        return await respond(request, req, rid, kids, arrival, chat=True)

    async def respond(request: Request, req, rid: str, kids: list[Child], arrival: float, chat: bool,
                      echo: list[str] | None = None):
        check_capacity(kids)
        try:
            group = aeng.submit(kids, arrival, stream=bool(req.stream))  # same event-loop turn as check_capacity(): counted at once
        except EngineDead as e:
            raise APIError(503, str(e), None, type="server_error", headers={"Retry-After": "1"}) from None
        gen = aeng.outputs(group)
        n_prompts = len(kids) // req.n
        prompt_lens = [len(kids[p * req.n].prompt_token_ids) for p in range(n_prompts)]
        shape = Shape(rid, now_s(), req.model, chat, req.n, prompt_lens, echo)
        if req.stream:
            cont = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(sse(gen, shape, req.include_usage, cont),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": rid})
        body = await complete(request, gen, shape, len(kids))
        return body if isinstance(body, Response) else JSONResponse(body, headers={"X-Request-Id": rid})

    async def complete(request: Request, gen, shape: "Shape", n: int):
        finals: dict[int, object] = {}

        async def consume():
            async for i, out in gen:
                if out.finished:
                    finals[i] = out

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()  # the generator's cleanup aborts the requests in the engine
                    await asyncio.gather(task, return_exceptions=True)
                    return Response(status_code=499)
            exc = task.exception()
            if exc is not None:
                raise exc
        except ValueError as e:
            raise APIError(400, str(e), _field_of(e)) from None
        except EngineDead as e:
            raise APIError(503, str(e), None, type="server_error", headers={"Retry-After": "1"}) from None
        except RequestFailed as e:
            raise APIError(500, str(e), None, type="server_error") from None
        outs = [finals[i] for i in range(n)]
        if any(o.outputs[0].finish_reason == "error" for o in outs):
            raise APIError(500, "the engine failed while producing this response", None, type="server_error")
        choices = [shape.choice(i, o.outputs[0]) for i, o in enumerate(outs)]
        return {"id": shape.rid, "object": shape.obj(False), "created": shape.created, "model": shape.model,
                "choices": choices, "usage": shape.usage(outs)}

    async def sse(gen, shape: "Shape", include_usage: bool, continuous: bool):
        latest: dict[int, object] = {}
        sent = {}          # choice index -> text already sent
        sent_lp = {}       # choice index -> logprob entries already sent
        first_sent: set[int] = set()  # choices whose first token has been sent

        def event(choices: list[dict], usage_body=None) -> str:
            body = {"id": shape.rid, "object": shape.obj(True), "created": shape.created, "model": shape.model,
                    "choices": choices}
            if include_usage or continuous:
                body["usage"] = usage_body
            return f"data: {json.dumps(body)}\n\n"

        try:
            for i in range(shape.num_choices):
                if shape.chat:
                    yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                elif shape.echo is not None:
                    yield event([{"index": i, "text": shape.echo[i // shape.n], "logprobs": None,
                                  "finish_reason": None}])
            async for i, out in gen:
                latest[i] = out
                c = out.outputs[0]
                if c.finish_reason == "error":
                    raise RequestFailed("the engine failed while producing this response")
                prev = sent.get(i, "")
                delta = c.text[len(prev):] if c.text.startswith(prev) else ""
                if delta:
                    sent[i] = c.text
                lp = None
                if c.logprobs is not None and len(c.logprobs) > sent_lp.get(i, 0):
                    lp = shape.logprobs(c.logprobs[sent_lp.get(i, 0):], len(prev) + shape.echo_len(i))
                    sent_lp[i] = len(c.logprobs)
                if delta or c.finish_reason is not None or lp is not None:
                    chunk = event([shape.delta(i, delta, c, lp)],
                                  shape.usage(list(latest.values())) if continuous else None)
                    if i not in first_sent:  # the log's first token time: handed to the connection
                        first_sent.add(i)
                        aeng.first_token_sent(out.request_id)
                    yield chunk
            if include_usage:
                yield event([], shape.usage([latest[i] for i in sorted(latest)]))
            yield "data: [DONE]\n\n"
        except (ValueError, EngineDead, RequestFailed) as e:
            status = 400 if isinstance(e, ValueError) else 503 if isinstance(e, EngineDead) else 500
            err = APIError(status, str(e), _field_of(e) if status == 400 else None,
                           type="invalid_request_error" if status == 400 else "server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # on disconnect: aborts the requests in the engine

    # ---------------------------------------------------------------- tokenizer endpoints
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = validate_model(TokenizeRequest, await read_json(request))
        if req.model is not None and req.model not in names:
            raise APIError(404, f"model={req.model!r}: no such model", "model", code="model_not_found")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            check_chars(req.prompt, "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await pool.run(_encode, req.prompt, special)
        else:
            conv = [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(req.messages)]
            check_chars("".join(m["content"] for m in conv), "messages")
            _, ids = await pool.run(_apply_template, conv, req.add_generation_prompt, False)
        strs = await pool.run(lambda tok: tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate_model(DetokenizeRequest, await read_json(request))
        if req.model is not None and req.model not in names:
            raise APIError(404, f"model={req.model!r}: no such model", "model", code="model_not_found")
        if tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is not in [0, {vocab_size})", "tokens")
        return {"prompt": await pool.run(lambda tok: tok.decode(req.tokens))}

    return app


class Shape:
    """How one HTTP request's choices are written: ids, objects, choices, logprobs, usage."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, n: int, prompt_lens: list[int],
                 echo: list[str] | None) -> None:
        self.rid, self.created, self.model, self.chat, self.n = rid, created, model, chat, n
        self.prompt_lens, self.echo = prompt_lens, echo
        self.num_choices = n * len(prompt_lens)

    def obj(self, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def echo_len(self, i: int) -> int:
        return len(self.echo[i // self.n]) if self.echo is not None else 0

    def logprobs(self, entries, offset: int) -> dict:
        if self.chat:
            return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                                 "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                                  for _, s, v in e.top]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{s: v for _, s, v in e.top} for e in entries], "text_offset": offsets}

    def choice(self, i: int, c) -> dict:
        lp = self.logprobs(c.logprobs, self.echo_len(i)) if c.logprobs is not None else None
        choice = {"index": i, "finish_reason": c.finish_reason, "logprobs": lp}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = (self.echo[i // self.n] if self.echo is not None else "") + c.text
        if c.stop_reason is not None:
            choice["stop_reason"] = c.stop_reason
        return choice

    def delta(self, i: int, text: str, c, lp) -> dict:
        if self.chat:
            d = {"content": text} if text or c.finish_reason is None else {}
            return {"index": i, "delta": d, "logprobs": lp, "finish_reason": c.finish_reason}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def usage(self, outs) -> dict:
        """Prompt tokens count each prompt once (not once per choice); cached tokens are the
        prefix-cache hits of each prompt's first choice."""
        completion = sum(len(o.outputs[0].token_ids) for o in outs)
        firsts = {}
        for o in outs:
            k = o.request_id
            firsts.setdefault(self._prompt_of(k), o)
        cached = sum((o.num_cached_tokens or 0) for o in firsts.values())
        return usage(sum(self.prompt_lens), completion, cached)

    def _prompt_of(self, request_id: str) -> int:
        if self.num_choices == 1:
            return 0
        return int(request_id.rsplit("-", 1)[1]) // self.n

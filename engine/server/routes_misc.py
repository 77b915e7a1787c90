"""Routes beside generation: health, ping, version, Prometheus metrics, models, prefix-cache reset,
tokenize and detokenize, and in development mode sleep, wake_up and is_sleeping (vLLM's)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.server.context import ServerContext, _apply_template, _encode
from engine.server.protocol import (APIError, DetokenizeRequest, TokenizeRequest, now_s, template_kwargs,
                                    token_ids, validate_model)

VERSION = "0.1.0"


def tokenizer_info_body(tok, max_model_len: int) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's configuration (its init arguments that are
    JSON, its class, chat template and added tokens)."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return str(getattr(v, "content", v))  # AddedToken and the like: their text

    info = {k: plain(v) for k, v in getattr(tok, "init_kwargs", {}).items()
            if k not in ("name_or_path", "tokenizer_file", "vocab_file", "merges_file")}
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    info.update({
        "tokenizer_class": type(tok).__name__,
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": min(int(getattr(tok, "model_max_length", max_model_len) or max_model_len),
                                1 << 62),
        "added_tokens_decoder": {str(i): {"content": t.content, "special": bool(t.special),
                                          "lstrip": bool(t.lstrip), "rstrip": bool(t.rstrip),
                                          "normalized": bool(t.normalized), "single_word": bool(t.single_word)}
                                 for i, t in added.items()},
    })
    return info


def add_misc_routes(app: FastAPI, ctx: ServerContext, tokenizer_info: bool = False,
                    dev_mode: bool = False, sleep_mode: bool = False) -> None:
    aeng, metrics, names, max_model_len = ctx.aeng, ctx.metrics, ctx.names, ctx.max_model_len
    tokenizer, pool, vocab_size = ctx.tokenizer, ctx.pool, ctx.vocab_size
    read_json, check_chars = ctx.read_json, ctx.check_chars

    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse({"status": "error", "error": repr(aeng.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/ping")
    async def ping():
        return Response(status_code=200 if aeng.alive else 503)

    @app.post("/ping")
    async def ping_post(request: Request):
        await ctx.read_optional_json(request)  # none needed; anything but a JSON object is a 400
        return await ping()

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
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        ctx.check_model(model_id)
        return model_card(model_id)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        await ctx.read_optional_json(request)
        ok = await aeng.call(lambda eng: eng.reset_prefix_cache())
        if not ok:
            raise APIError(409, "the prefix cache cannot be reset while requests hold KV blocks; "
                                "retry when idle", None, code="busy")
        return Response(status_code=200)

    if dev_mode:  # vLLM's development routes (VLLM_SERVER_DEV_MODE=1)
        @app.post("/sleep")
        async def sleep(request: Request):
            """Pause the engine (AsyncEngine.sleep); `level` (1 or 2) as a query parameter."""
            if not sleep_mode:
                raise APIError(400, "sleep mode is not enabled: start the server with --enable-sleep-mode", None)
            level = request.query_params.get("level", "1")
            if level not in ("1", "2"):
                raise APIError(400, f"level={level!r}: must be 1 or 2", "level")
            await aeng.sleep(int(level))
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(request: Request):
            await aeng.wake_up()
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": aeng.sleep_level > 0}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = validate_model(TokenizeRequest, await read_json(request))
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            check_chars(req.prompt, "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await pool.run(_encode, req.prompt, special)
        else:
            check_chars("".join(m.text(f"messages[{i}]") for i, m in enumerate(req.messages)), "messages")
            parts = ctx.content_format == "openai"
            conv = [m.template_turn(f"messages[{i}]", parts) for i, m in enumerate(req.messages)]
            kw = template_kwargs(req, ctx.trust_request_chat_template)
            try:
                _, ids = await pool.run(_apply_template, conv, req.add_generation_prompt, req.continue_final_message,
                                        kw, bool(req.add_special_tokens), ctx.content_format)
            except Exception as e:  # the template refused the conversation
                raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from None
        strs = await pool.run(lambda tok: tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    if tokenizer_info and tokenizer is not None:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            """vLLM's (with --enable-tokenizer-info-endpoint): the tokenizer's configuration."""
            return await pool.run(lambda tok: tokenizer_info_body(tok, max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate_model(DetokenizeRequest, await read_json(request))
        ctx.check_model(req.model)
        if tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        token_ids(req.tokens, vocab_size, "tokens")
        return {"prompt": await pool.run(lambda tok: tok.decode(req.tokens))}

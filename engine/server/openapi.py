"""`/openapi.json` with the bodies the handlers read and answer: the handlers take the raw request
(to stamp arrival first, limit the body's size and name the bad field themselves) and answer
plain dicts, so FastAPI sees neither side's model; this puts each POST endpoint's request model
(engine.server.protocol) and every endpoint's response models (engine.server.responses: the
success body, each error status in OpenAI's error format, and the chunk of a streamed answer as
`text/event-stream`) into the document."""
from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from engine.server import responses as R
from engine.server.protocol import (BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest)
from engine.server.routes_decisions import DecisionRequest, DecisionResponse

# POST path -> the models its body may be (several: one of them)
BODIES = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/chat/completions/batch": (BatchChatCompletionRequest,),
    "/invocations": (ChatCompletionRequest, CompletionRequest),  # by the body: messages or prompt
    "/tokenize": (TokenizeRequest,),
    "/detokenize": (DetokenizeRequest,),
    "/v1/decisions": (DecisionRequest,),
}

# POST paths that need no body: an empty object may come
NO_BODY = ("/reset_prefix_cache", "/ping")

# Error statuses a generation can answer with, and why.
_GEN_ERRORS = {
    400: "a field is invalid (the error's param names it), or the prompt and max_tokens do not fit",
    404: "no such model",
    413: "the body is larger than the server's limit",
    500: "Internal server error: the engine failed while producing this response",
    503: "the engine is not running, or too many requests are waiting (Retry-After)",
}
_SSE = ("Server-Sent Events: each `data:` line is one {chunk} as JSON, the last is `data: [DONE]`; an "
        "error after the stream started comes as a `data:` line holding an ErrorResponse.")

# (path, method) -> {status: (description, model(s) of a JSON body or None, model of a stream's chunk)}
_OK = "Successful Response"
RESPONSES: dict[tuple[str, str], dict[int, tuple]] = {
    ("/v1/completions", "post"): {200: (_OK, (R.Completion,), R.CompletionChunk), **{
        s: (d, (R.ErrorResponse,), None) for s, d in _GEN_ERRORS.items()}},
    ("/v1/chat/completions", "post"): {200: (_OK, (R.ChatCompletion,), R.ChatCompletionChunk), **{
        s: (d, (R.ErrorResponse,), None) for s, d in _GEN_ERRORS.items()}},
    ("/v1/chat/completions/batch", "post"): {200: (_OK, (R.ChatCompletion,), None), **{
        s: (d, (R.ErrorResponse,), None) for s, d in _GEN_ERRORS.items()}},
    ("/invocations", "post"): {200: ("a chat completion for a body with messages, else a completion",
                                     (R.ChatCompletion, R.Completion), (R.ChatCompletionChunk, R.CompletionChunk)), **{
        s: (d, (R.ErrorResponse,), None) for s, d in _GEN_ERRORS.items()}},
    ("/v1/decisions", "post"): {200: (_OK, (DecisionResponse,), None),
                                400: ("a field is invalid, or the input and a question do not fit",
                                      (R.ErrorResponse,), None),
                                404: ("no such model", (R.ErrorResponse,), None),
                                413: ("the body is larger than the server's limit", (R.ErrorResponse,), None),
                                501: ("the model cannot answer decisions (no chat template, or an option "
                                      "letter is not one token after it)", (R.ErrorResponse,), None),
                                503: (_GEN_ERRORS[503], (R.ErrorResponse,), None)},
    ("/tokenize", "post"): {200: (_OK, (R.TokenizeResponse,), None),
                            400: ("a field is invalid", (R.ErrorResponse,), None),
                            404: ("no such model", (R.ErrorResponse,), None),
                            413: ("the body is larger than the server's limit", (R.ErrorResponse,), None)},
    ("/detokenize", "post"): {200: (_OK, (R.DetokenizeResponse,), None),
                              400: ("a field is invalid", (R.ErrorResponse,), None),
                              404: ("no such model", (R.ErrorResponse,), None),
                              413: ("the body is larger than the server's limit", (R.ErrorResponse,), None)},
    ("/v1/models", "get"): {200: (_OK, (R.ModelList,), None)},
    ("/v1/models/{model_id}", "get"): {200: (_OK, (R.ModelCard,), None),
                                        404: ("no such model", (R.ErrorResponse,), None)},
    ("/health", "get"): {200: ("the engine is running", (R.Health,), None),
                         503: ("the engine has stopped", (R.HealthError,), None)},
    ("/version", "get"): {200: (_OK, (R.Version,), None)},
    ("/reset_prefix_cache", "post"): {200: ("emptied (no body)", None, None),
                                      400: ("the body is not a JSON object", (R.ErrorResponse,), None),
                                      409: ("requests hold KV blocks", (R.ErrorResponse,), None)},
    ("/ping", "get"): {200: ("the engine is running (no body)", None, None),
                       503: ("the engine has stopped (no body)", None, None)},
    ("/ping", "post"): {200: ("the engine is running (no body)", None, None),
                        400: ("the body is not a JSON object", (R.ErrorResponse,), None),
                        503: ("the engine has stopped (no body)", None, None)},
    ("/metrics", "get"): {200: ("Prometheus text format", "text", None)},
    # development mode only (VLLM_SERVER_DEV_MODE=1)
    ("/sleep", "post"): {200: ("asleep: no step runs until /wake_up (no body)", None, None),
                         400: ("sleep mode is off, or `level` is not 1 or 2", (R.ErrorResponse,), None)},
    ("/wake_up", "post"): {200: ("awake (no body)", None, None)},
    ("/is_sleeping", "get"): {200: (_OK, (R.IsSleeping,), None)},
}


def _ref(schemas: dict, m: type[BaseModel]) -> dict:
    js = m.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(js.pop("$defs", {}))
    schemas[m.__name__] = js
    return {"$ref": f"#/components/schemas/{m.__name__}"}


def _event(payloads: list[dict]) -> dict:
    """One Server-Sent Event (OpenAPI 3.1 has a streamed media type's schema describe each event):
    its `data` is JSON in one of `payloads`, or the closing `[DONE]`."""
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "a JSON payload, or [DONE] (the last event)",
                 "contentMediaType": "application/json", "contentSchema": {"anyOf": payloads}}}}


def _one_of(refs: list[dict]) -> dict:
    return refs[0] if len(refs) == 1 else {"oneOf": refs}


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that documents the request and response bodies (built once,
    cached)."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, models in BODIES.items():
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": _one_of([_ref(schemas, m)
                                                                                      for m in models])}}}
        for (path, method), statuses in RESPONSES.items():
            if path not in doc["paths"]:  # a route of a mode this app is not in
                continue
            op = doc["paths"][path][method]
            out = {}
            for status, (desc, models, chunk) in statuses.items():
                entry: dict = {"description": desc}
                if models == "text":
                    entry["content"] = {"text/plain": {"schema": {"type": "string"}}}
                elif models:
                    entry["content"] = {"application/json": {"schema": _one_of([_ref(schemas, m) for m in models])}}
                if chunk is not None:
                    chunks = chunk if isinstance(chunk, tuple) else (chunk,)
                    names = " or ".join(c.__name__ for c in chunks)
                    entry["description"] = desc + "; with stream: true, " + _SSE.format(chunk=names)
                    entry["content"]["text/event-stream"] = {"schema": _event(
                        [_ref(schemas, c) for c in chunks] + [_ref(schemas, R.ErrorResponse)])}
                out[str(status)] = entry
            op["responses"] = out
        # FastAPI's own validation-error schemas: no route uses them any more
        for name in ("HTTPValidationError", "ValidationError"):
            if f'"#/components/schemas/{name}"' not in json.dumps(doc["paths"]):
                schemas.pop(name, None)
        for path in NO_BODY:  # an optional JSON object, ignored (anything else: a 400)
            doc["paths"][path]["post"]["requestBody"] = {
                "required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi

"""`/openapi.json` with the request bodies the handlers read: the handlers take the raw request
(to stamp arrival first, limit the body's size and name the bad field themselves), so FastAPI
cannot see their models; this puts each POST endpoint's pydantic model (its JSON schema:
fields, types, defaults, limits) into the document as its request body."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

# POST path -> the models its body may be (several: one of them)
BODIES = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/invocations": (ChatCompletionRequest, CompletionRequest),  # by the body: messages or prompt
    "/tokenize": (TokenizeRequest,),
    "/detokenize": (DetokenizeRequest,),
}
# POST paths that take no body: an optional empty object
NO_BODY = ("/reset_prefix_cache", "/ping")


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that documents the request bodies (built once, cached)."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, models in BODIES.items():
            refs = []
            for m in models:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                schemas[m.__name__] = js
                refs.append({"$ref": f"#/components/schemas/{m.__name__}"})
            body = refs[0] if len(refs) == 1 else {"oneOf": refs}
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": body}}}
        for path in NO_BODY:
            if "post" in doc["paths"].get(path, {}):
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi

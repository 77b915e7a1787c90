"""The server against OpenAI's own request and response types, not its own schema.

The `openai` SDK's request types (`CompletionCreateParams*`, chat `CompletionCreateParams*`) and
response models (`Completion`, `ChatCompletion`, `ChatCompletionChunk`, `Model`) are generated from
OpenAI's published API description. Their JSON Schemas, put into an OpenAPI document here, drive
schemathesis: every generated body is a request OpenAI would take. The server may refuse one (a
400 naming a field of the body: a feature it does not implement, a prompt longer than the model's
context), but never with a 5xx, and what it answers with a 200 must be in OpenAI's response
schema, tightened where the SDK's models loosen it: OpenAI's schema requires a choice's
`finish_reason`, `index` and `logprobs` and a chat message's `role`, `content` and `refusal`, even
when null.

And each field OpenAI marks nullable means its default when sent as null (clients such as the SDK
itself and LangChain send explicit nulls)."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import TypeAdapter

from tests.test_server import _settles
from tests.test_server_schema import TINY, tiny_served  # noqa: F401 (the fixture)

REF = "#/components/schemas/{model}"
MODEL = "default"


def _constrained(node, integer: dict, string: dict):
    """`node` with each integer and each string schema inside it replaced by the given ones."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "string"):
            return dict(integer if node["type"] == "integer" else string)
        return {k: _constrained(v, integer, string) for k, v in node.items()}
    if isinstance(node, list):
        return [_constrained(x, integer, string) for x in node]
    return node


# the ranges OpenAI's API reference documents, which the SDK's types leave out
_OPENAI_RANGES = {"frequency_penalty": {"minimum": -2, "maximum": 2},
                  "presence_penalty": {"minimum": -2, "maximum": 2},
                  "temperature": {"minimum": 0, "maximum": 2}, "top_p": {"minimum": 0, "maximum": 1},
                  "n": {"minimum": 1, "maximum": 128}, "best_of": {"minimum": 0, "maximum": 20},
                  "logprobs": {"minimum": 0, "maximum": 5}, "top_logprobs": {"minimum": 0, "maximum": 20},
                  "max_tokens": {"minimum": 0}, "max_completion_tokens": {"minimum": 0},
                  "seed": {"minimum": -(1 << 63), "maximum": (1 << 63) - 1},
                  "stop": {"minItems": 1, "maxItems": 4}, "messages": {"minItems": 1}}


def _openai_document(stream: bool = False) -> dict:
    """An OpenAPI 3.1 document of /v1/completions and /v1/chat/completions from the SDK's types,
    `model` fixed to the served name (any other name is a 404, as in OpenAI's API). With `stream`,
    the streaming requests, and the 200 schema is that of one chunk of the event stream."""
    components: dict = {}

    def schema(js: dict) -> dict:
        components.update(js.pop("$defs", {}))
        return js

    def request(t) -> dict:
        js = schema(TypeAdapter(t).json_schema(ref_template=REF))
        js["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        for name, bounds in _OPENAI_RANGES.items():
            prop = js["properties"].get(name)
            for alt in prop.get("anyOf", [prop]) if prop else []:
                if alt.get("type") in ("integer", "number", "array"):
                    alt.update(bounds)
        if "prompt" in js["properties"]:
            # required by vLLM as here (see the null test below); a prompt's token ids in the
            # model's vocabulary and its texts not empty, which OpenAI's types cannot say
            prompt = [a for a in js["properties"]["prompt"]["anyOf"] if a.get("type") != "null"]
            js["properties"]["prompt"] = {"anyOf": _constrained(
                prompt, {"type": "integer", "minimum": 0, "maximum": TINY["vocab_size"] - 1},
                {"type": "string", "minLength": 1})}
        return js

    def op(t, answer: type) -> dict:
        return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": request(t)}}},
                         "responses": {"200": {"description": "the answer", "content": {"application/json": {
                             "schema": schema(answer.model_json_schema(ref_template=REF))}}}}}}

    if stream:
        paths = {"/v1/completions": op(completion_params.CompletionCreateParamsStreaming, openai.types.Completion),
                 "/v1/chat/completions": op(chat_params.CompletionCreateParamsStreaming,
                                            openai.types.chat.ChatCompletionChunk)}
        # the SDK reads a completions stream's chunks as `Completion`s, but OpenAI's chunks carry
        # "finish_reason": null until the last one
        reason = components["CompletionChoice"]["properties"]["finish_reason"]
        components["CompletionChoice"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    else:
        paths = {"/v1/completions": op(completion_params.CompletionCreateParamsNonStreaming,
                                       openai.types.Completion),
                 "/v1/chat/completions": op(chat_params.CompletionCreateParamsNonStreaming,
                                            openai.types.chat.ChatCompletion)}
    return {"openapi": "3.1.0", "info": {"title": "OpenAI's types", "version": openai.__version__},
            "paths": paths, "components": {"schemas": components}}


# what OpenAI's schema requires of an answer beyond the SDK models' own `required`
_CHOICE_KEYS = {"/v1/completions": {"finish_reason", "index", "logprobs", "text"},
                "/v1/chat/completions": {"finish_reason", "index", "logprobs", "message"}}
_MESSAGE_KEYS = {"role", "content", "refusal"}
_CHUNK_CHOICE_KEYS = {"/v1/completions": {"finish_reason", "index", "logprobs", "text"},
                      "/v1/chat/completions": {"finish_reason", "index", "delta"}}


def _check_answer(doc: dict, path: str, body: dict, chunk: bool = False) -> None:
    answer = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**answer, "components": doc["components"]}).validate(body)
    for choice in body["choices"]:
        assert (_CHUNK_CHOICE_KEYS if chunk else _CHOICE_KEYS)[path] <= set(choice), (path, choice)
        if "message" in choice:
            assert _MESSAGE_KEYS <= set(choice["message"]), choice["message"]


def _post(url: str, body: dict) -> tuple[int, object]:
    """The status and the JSON answer, or for an event stream the list of its chunks."""
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        r.read()
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert data and data[-1] == "[DONE]", r.text[-300:]
            return 200, [json.loads(x) for x in data[:-1]]
        return r.status_code, r.json()


def _param_in(param: str, body: dict) -> bool:
    """The error's param names a field of the body (its first part: `messages[3].content`), or
    max_tokens, whose default (16 for completions) may not fit beside a long prompt."""
    return re.split(r"[.\[]", param, maxsplit=1)[0] in {*body, "max_tokens"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_requests_of_openai_types_get_no_5xx_and_answers_in_openai_schema(tiny_served, stream):  # noqa: F811
    """Streamed answers are checked chunk by chunk against OpenAI's chunk schema."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    url = tiny_served["url"]
    doc = _openai_document(stream)
    schema = schemathesis.openapi.from_dict(doc)
    failures: list[str] = []
    statuses: dict[tuple[str, int], int] = {}
    for op in [r.ok() for r in schema.get_all_operations()]:
        @settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(GenerationMode.POSITIVE))
        def fuzz(case):
            body = case.body
            status, answer = _post(url + op.path, body)
            statuses[(op.path, status)] = statuses.get((op.path, status), 0) + 1
            try:
                assert status < 500, answer
                if status == 200:
                    for part in answer if stream else [answer]:
                        _check_answer(doc, op.path, part, chunk=stream)
                else:
                    err = answer["error"]
                    assert status in (400, 404) and err["message"], answer
                    assert err["param"] is None or _param_in(err["param"], body), (err, sorted(body))
            except (AssertionError, jsonschema.ValidationError) as e:
                failures.append(f"{op.path} {json.dumps(body)[:600]}\n-> {status} {str(e)[:800]}")

        fuzz()
    assert not failures, "\n\n".join(failures[:5])
    # the generated requests reached the model, not only the validation
    assert all(statuses.get((p, 200), 0) >= 3 for p in doc["paths"]), statuses
    assert _settles(tiny_served["engine"])


def _nullable(doc: dict, prop: dict) -> bool:
    if "$ref" in prop:
        prop = doc["components"]["schemas"][prop["$ref"].rsplit("/", 1)[1]]
    return prop.get("type") == "null" or any(a.get("type") == "null" for a in prop.get("anyOf", []))


BASE = {"/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                                 "max_tokens": 2}}


@pytest.mark.parametrize("path", list(BASE))
def test_each_nullable_openai_field_sent_as_null_means_its_default(tiny_served, path):  # noqa: F811
    """A null in any field OpenAI's types allow null answers as if the field were left out. The
    completion's `prompt` stays required, as in vLLM (OpenAI's default prompt is its own
    `<|endoftext|>` token)."""
    doc = _openai_document()
    props = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    nullable = [k for k, p in props.items() if k not in ("model", "prompt") and _nullable(doc, p)]
    assert {"n", "temperature", "stop", "seed", "max_tokens"} <= set(nullable)
    url = tiny_served["url"]
    refused = {}
    for field in nullable:
        r = httpx.post(url + path, json={**BASE[path], field: None}, timeout=120)
        if r.status_code != 200:
            refused[field] = r.text[:200]
        else:
            assert len(r.json()["choices"]) == 1
    assert not refused, refused


def test_an_integer_written_with_a_zero_fraction_is_that_integer(tiny_served):  # noqa: F811
    """JSON Schema's "integer" takes 2.0 (a schema-driven client may send it); 2.5 stays a 400
    naming the field, and so does a token id of 1.5."""
    url = tiny_served["url"] + "/v1/completions"
    ints = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "seed": 11, "temperature": 1.0,
            "logprobs": 1, "stop_token_ids": [0]}
    floats = {**ints, "prompt": [5.0, 6.0, 7.0], "max_tokens": 3.0, "n": 2.0, "seed": 11.0, "logprobs": 1.0,
              "stop_token_ids": [0.0]}
    a, b = httpx.post(url, json=ints, timeout=60), httpx.post(url, json=floats, timeout=60)
    assert a.status_code == b.status_code == 200, b.text
    assert [c["text"] for c in a.json()["choices"]] == [c["text"] for c in b.json()["choices"]]
    assert b.json()["usage"]["completion_tokens"] == a.json()["usage"]["completion_tokens"]
    for field, value, param in (("n", 2.5, "n"), ("prompt", [5, 6.5], "prompt[1]"), ("max_tokens", 1e300, "max_tokens")):
        r = httpx.post(url, json={**ints, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

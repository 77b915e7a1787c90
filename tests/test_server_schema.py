"""`/openapi.json` tells clients the truth: it validates as OpenAPI 3.1, documents every request
and response body, and what the server answers conforms to it, for a matrix of real requests
and under a schema-driven fuzzer (schemathesis: generated valid and invalid bodies for every
operation; no 500, no undocumented status, no answer outside its documented schema).

The fuzzed server runs a one-layer random model with the default tokenizer's vocabulary: the
fuzzer tests the server, and a real model's steps would only make it slower."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine.llm_engine import LLMEngine
from engine.server.app import create_app
from tests.test_server import _free_port, _Server, _settles

MODEL = "default"
TINY = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 2}


def _serve(engine, **kw):
    app = create_app(engine, model_name=MODEL, **kw)
    port = _free_port()
    return app, port, _Server(app, port)


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=512, max_num_seqs=32,
                       num_gpu_blocks=400, max_model_len=1024)
    app, port, server = _serve(engine)
    with server:
        yield {"url": f"http://127.0.0.1:{port}", "doc": httpx.get(f"http://127.0.0.1:{port}/openapi.json").json()}


def _validator(doc: dict, schema: dict) -> jsonschema.Draft202012Validator:
    """A validator of `schema` whose #/components/... references resolve inside `doc`."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def _documented(doc: dict, path: str, method: str, status: int, media: str = "application/json") -> dict:
    op = doc["paths"][path][method]
    assert str(status) in op["responses"], f"{method.upper()} {path}: status {status} is not documented"
    content = op["responses"][str(status)]["content"][media]
    if media == "text/event-stream":  # each event's data: the chunk (its first payload) as JSON
        return content["schema"]["properties"]["data"]["contentSchema"]["anyOf"][0]
    return content["schema"]


def _check(doc, path, status, body, method="post") -> None:
    _validator(doc, _documented(doc, path, method, status)).validate(body)


def test_openapi_is_valid_3_1_and_documents_requests_and_responses(served):
    from openapi_spec_validator import validate
    doc = served["doc"]
    validate(doc)  # raises on any violation of the OpenAPI 3.1 schema
    assert doc["openapi"].startswith("3.1")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert any(s.startswith("2") for s in op["responses"]), (method, path)
            if method == "post":
                assert "application/json" in op["requestBody"]["content"], path
            if method == "post" and path not in ("/ping", "/reset_prefix_cache"):
                for status in ("400", "404"):
                    assert _documented(doc, path, "post", int(status)) == {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    # the request fields clients look for, with their types
    comp = doc["components"]["schemas"]["CompletionRequest"]
    assert comp["required"] == ["prompt"]
    assert {"string"} <= {a.get("type") for a in comp["properties"]["prompt"]["anyOf"]}
    assert comp["properties"]["temperature"]["minimum"] == 0
    assert {"max_tokens", "logit_bias", "prompt_logprobs", "echo", "stream_options"} <= set(comp["properties"])
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= set(doc["components"]["schemas"])


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


COMPLETIONS = [
    {"prompt": "Once upon a time", "max_tokens": 4},
    {"prompt": ["One", "Two two"], "n": 2, "max_tokens": 3, "seed": 7},
    {"prompt": [1, 2, 3, 4], "max_tokens": 3, "logprobs": 2, "return_token_ids": True},
    {"prompt": "The sky is", "max_tokens": 2, "echo": True, "logprobs": 1},
    {"prompt": "The sky is", "max_tokens": 0, "echo": True, "logprobs": 0},
    {"prompt": "Count: 1, 2,", "max_tokens": 3, "prompt_logprobs": 1, "return_tokens_as_token_ids": True,
     "logprobs": 0},
    {"prompt": "A list:", "max_tokens": 8, "stop": [","], "logit_bias": {"11": 5.0}},
]
CHATS = [
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Say yes"}]}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2},
    {"messages": [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Once"}],
     "max_tokens": 3, "echo": True, "add_generation_prompt": False, "continue_final_message": True,
     "return_token_ids": True, "prompt_logprobs": 0},
]


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completions_conform_plain_and_streamed(served, body):
    url, doc = served["url"], served["doc"]
    body = {"model": MODEL, "temperature": 0, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    _check(doc, "/v1/completions", 200, r.json())
    # vLLM's extension fields are there, null when unused: its clients read them as attributes
    for choice in r.json()["choices"]:
        assert {"stop_reason", "prompt_logprobs", "token_ids", "prompt_token_ids"} <= set(choice)
        assert (choice["prompt_logprobs"] is None) == (body.get("prompt_logprobs") is None)
        assert (choice["token_ids"] is None) == (not body.get("return_token_ids"))
    if not (body.get("echo") and body.get("logprobs") is not None):
        # OpenAI's own types (required fields, enums). An echoed prompt's first token has no
        # logprob: null, as OpenAI's legacy API and vLLM (whose tests check it) answer, where the
        # published type says a number.
        openai.types.Completion.model_validate(r.json())
    chunk = _validator(doc, _documented(doc, "/v1/completions", "post", 200, "text/event-stream"))
    # a stream carries no prompt logprobs beyond 0, as vLLM (test_server_vllm_behaviours.py)
    streamed = {k: v for k, v in body.items() if not (k == "prompt_logprobs" and v)}
    for c in _sse(url, "/v1/completions", {**streamed, "stream": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}):
        chunk.validate(c)


@pytest.mark.parametrize("body", CHATS)
def test_chat_conforms_plain_and_streamed(served, body):
    url, doc = served["url"], served["doc"]
    body = {"model": MODEL, "temperature": 0, **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["refusal"] is None and msg["role"] == "assistant"
    _check(doc, "/v1/chat/completions", 200, r.json())
    sdk = openai.types.chat.ChatCompletion.model_validate(r.json())
    assert all(c.stop_reason is None or isinstance(c.stop_reason, (int, str)) for c in sdk.choices)
    chunk = _validator(doc, _documented(doc, "/v1/chat/completions", "post", 200, "text/event-stream"))
    chunks = _sse(url, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    for c in chunks:
        chunk.validate(c)
        openai.types.chat.ChatCompletionChunk.model_validate(c)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_batch_chat_answers_each_conversation_as_its_own_chat(served):
    url, doc = served["url"], served["doc"]
    convs = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
             [{"role": "user", "content": "Count to three."}]]
    r = httpx.post(url + "/v1/chat/completions/batch", json={"model": MODEL, "messages": convs, "max_tokens": 6,
                                                             "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    batch = r.json()
    _check(doc, "/v1/chat/completions/batch", 200, batch)
    openai.types.chat.ChatCompletion.model_validate(batch)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    # each choice is what the same conversation gets alone (greedy), and usage adds them up
    singles = [httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": m, "max_tokens": 6,
                                                              "temperature": 0}, timeout=120).json() for m in convs]
    assert [c["message"]["content"] for c in batch["choices"]] == [s["choices"][0]["message"]["content"] for s in singles]
    for k in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][k] == sum(s["usage"][k] for s in singles)
    # n samples per conversation: conversation k's j-th sample is choice k * n + j
    r = httpx.post(url + "/v1/chat/completions/batch", json={"model": MODEL, "messages": convs[:2], "max_tokens": 2,
                                                             "n": 2, "temperature": 0}, timeout=120).json()
    texts = [c["message"]["content"] for c in r["choices"]]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]
    # return_token_ids (as vLLM's batch takes it): each choice its conversation's prompt ids and its
    # own generated ids; logprob tokens stay text unless return_tokens_as_token_ids
    r = httpx.post(url + "/v1/chat/completions/batch", json={
        "model": MODEL, "messages": convs[:2], "max_tokens": 3, "temperature": 0, "return_token_ids": True,
        "logprobs": True, "top_logprobs": 1}, timeout=120)
    assert r.status_code == 200, r.text
    _check(doc, "/v1/chat/completions/batch", 200, r.json())
    for c in r.json()["choices"]:
        alone = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": convs[c["index"]],
                                                               "max_tokens": 3, "temperature": 0,
                                                               "return_token_ids": True}, timeout=120).json()
        assert c["prompt_token_ids"] == alone["prompt_token_ids"] and c["token_ids"] == alone["choices"][0]["token_ids"]
        assert not any(e["token"].startswith("token_id:") for e in c["logprobs"]["content"])
    # refused, naming the field: a stream, an empty conversation, a bad message deep inside
    for body, field in (({"messages": convs, "stream": True}, "stream"),
                        ({"messages": [convs[0], []]}, "messages[1]"),
                        ({"messages": [convs[0], [{"role": "user", "content": 5}]]}, "messages[1][0].content")):
        r = httpx.post(url + "/v1/chat/completions/batch", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        _check(doc, "/v1/chat/completions/batch", 400, r.json())


def test_other_answers_and_errors_conform(served):
    url, doc = served["url"], served["doc"]
    _check(doc, "/v1/models", 200, httpx.get(url + "/v1/models").json(), "get")
    for m in httpx.get(url + "/v1/models").json()["data"]:
        openai.types.Model.model_validate(m)
    _check(doc, "/v1/models/{model_id}", 200, httpx.get(url + f"/v1/models/{MODEL}").json(), "get")
    _check(doc, "/v1/models/{model_id}", 404, httpx.get(url + "/v1/models/nope").json(), "get")
    _check(doc, "/health", 200, httpx.get(url + "/health").json(), "get")
    _check(doc, "/version", 200, httpx.get(url + "/version").json(), "get")
    for body in ({"prompt": "hi", "return_token_strs": True}, {"messages": [{"role": "user", "content": "hi"}]}):
        _check(doc, "/tokenize", 200, httpx.post(url + "/tokenize", json=body).json())
    _check(doc, "/detokenize", 200, httpx.post(url + "/detokenize", json={"tokens": [1, 2, 3]}).json())
    for path, body, status in (("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
                               ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404),
                               ("/v1/chat/completions", {"messages": []}, 400),
                               ("/tokenize", {"messages": []}, 400),
                               ("/detokenize", {"tokens": [10 ** 9]}, 400)):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == status, (path, r.text)
        _check(doc, path, status, r.json())


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("tiny") / "config.json"
    cfg.write_text(json.dumps(TINY))
    engine = LLMEngine(model=f"random:{cfg}", device="cpu", max_num_batched_tokens=256, max_num_seqs=16,
                       num_gpu_blocks=300, max_model_len=128)
    app, port, server = _serve(engine, max_waiting=64)
    with server:
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine}


def test_schema_fuzzer_finds_no_500_and_no_schema_violation(tiny_served):
    """schemathesis drives every operation from /openapi.json with generated bodies, valid and
    invalid, and checks each answer: never a 5xx, a documented status and content type, a body
    in the documented schema, and invalid bodies refused. Afterwards the engine holds no request
    and no KV block."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    from schemathesis import GenerationMode, checks as st_checks
    url = tiny_served["url"]
    # what the fuzzer first found: more sequences than may ever wait is the request's fault (400)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 65, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    wanted = [st_checks.not_a_server_error, st_checks.status_code_conformance,
              st_checks.content_type_conformance, st_checks.response_schema_conformance,
              st_checks.negative_data_rejection]
    failures, calls = [], {}
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path != "/reset_prefix_cache"]  # 409 while busy: test_server covers it
    assert len(ops) >= 12
    for op in ops:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def fuzz(case):
            calls[op.label] = calls.get(op.label, 0) + 1
            try:
                case.call_and_validate(checks=wanted, timeout=120)
            except Exception as e:  # every operation's failures are collected, then reported together
                failures.append(f"{case.method.upper()} {case.path}: {e}"[:2000])
                raise

        try:
            fuzz()
        except Exception as e:  # a failure hypothesis reproduced, or a generation error
            if not failures:
                failures.append(f"{op.method.upper()} {op.path}: {e!r}"[:2000])
    # every operation with a body got that many examples (the others have one request to make)
    assert all(calls.get(op.label, 0) >= 16 for op in ops if op.method == "post" and op.path != "/ping"), calls
    assert not failures, "\n\n".join(failures[:5])
    assert _settles(tiny_served["engine"])
    assert httpx.get(tiny_served["url"] + "/health").json() == {"status": "ok"}

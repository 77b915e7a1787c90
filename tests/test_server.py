"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP."""
from __future__ import annotations

import asyncio
import csv
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from engine.llm_engine import LLMEngine
from engine.server.app import create_app
from engine.server.receipt import http_protocol

MODEL = "default"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settles(engine, timeout_s: float = 30.0) -> bool:
    """Whether, within timeout_s, the engine holds no request and every KV block is free again."""
    kvm = engine.scheduler.kv_cache_manager
    deadline = time.time() + timeout_s
    while time.time() < deadline and (engine.has_unfinished_requests()
                                      or kvm.num_free_blocks != kvm.num_usable_blocks):
        time.sleep(0.1)
    return not engine.has_unfinished_requests() and kvm.num_free_blocks == kvm.num_usable_blocks


class _Server:
    def __init__(self, app, port):
        # The HTTP protocol `servetwin serve` runs (arrival stamped at the request's first bytes).
        self.config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                     http=http_protocol())
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.csv"
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=512, max_num_seqs=32,
                       num_gpu_blocks=400, max_model_len=1024)
    app = create_app(engine, model_name=MODEL, max_waiting=200, request_log=log)
    port = _free_port()
    with _Server(app, port):
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine, "app": app, "log": log}


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_and_health(served, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert httpx.get(served["url"] + "/health").json() == {"status": "ok"}


def test_completion_non_streaming_usage(served, client):
    tok = served["engine"].tokenizer
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    n_prompt = len(tok(prompt).input_ids)
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == n_prompt + 8
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) > 0


def test_completion_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming(served, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].message.role == "assistant"
    # Usage counts the chat-templated prompt, computed here independently.
    tok = served["engine"].tokenizer
    templated = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tok(templated, add_special_tokens=False).input_ids)
    assert 0 < r.usage.completion_tokens <= 24
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 24
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
    assert "".join(parts) == answer
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_stop_strings_honoured(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, text  # the greedy continuation counts on
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                  stop=[" 6"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(" 6")]
    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                  stop=" 6", stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


@pytest.mark.parametrize("body,field", [
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": [1] * 1024}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
])
def test_bad_requests_get_400_naming_the_field(served, body, field):
    r = httpx.post(served["url"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404_like_openai(served):
    r = httpx.post(served["url"] + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"
    assert "The model `nope` does not exist" in r.json()["error"]["message"]  # vLLM's words, which its clients match
    r = httpx.get(served["url"] + "/v1/models/nope", timeout=30)
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def test_bad_json_and_openai_client_error(served, client):
    r = httpx.post(served["url"] + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature" in str(e.value)
    # ... and the server keeps serving.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_metrics_endpoint(served, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    text = httpx.get(served["url"] + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert gen[0].startswith('vllm:generation_tokens_total{model_name="default"}')
    assert float(gen[0].split()[-1]) >= 4

    def value(txt, name):
        line = next(x for x in txt.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
        return float(line.split()[-1])

    # the rest of vLLM's names: per-step tokens, request parameters, the cache's settings
    before = text
    client.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=3, temperature=1.0)
    after = httpx.get(served["url"] + "/metrics").text
    assert value(after, "vllm:request_params_n_count") - value(before, "vllm:request_params_n_count") == 2
    assert value(after, "vllm:request_params_n_sum") - value(before, "vllm:request_params_n_sum") == 4
    assert value(after, "vllm:request_params_max_tokens_sum") - value(before, "vllm:request_params_max_tokens_sum") == 6
    assert value(after, "vllm:request_max_num_generation_tokens_count") > value(before, "vllm:request_max_num_generation_tokens_count")
    # one request alone: vLLM counts a step per generated token, and in them the prompt once and
    # every generated token
    r = client.completions.create(model=MODEL, prompt="One two three", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    last = httpx.get(served["url"] + "/metrics").text
    assert value(last, "vllm:iteration_tokens_total_count") - value(after, "vllm:iteration_tokens_total_count") == 5
    assert (value(last, "vllm:iteration_tokens_total_sum") - value(after, "vllm:iteration_tokens_total_sum")
            == r.usage.prompt_tokens + 5)
    eng = served["engine"]
    assert (f'vllm:cache_config_info{{block_size="{eng.scheduler_config.block_size}",'
            f'cache_dtype="float32",enable_prefix_caching="True",'
            f'num_gpu_blocks="{eng.scheduler_config.num_gpu_blocks}"}} 1.0') in after


def test_load_with_disconnects_frees_everything(served, client):
    """100 concurrent streaming requests, 20% of clients hang up mid-stream."""
    engine = served["engine"]
    url = served["url"] + "/v1/completions"

    async def one(i: int, ac: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": f"Request {i}: tell me a story about", "max_tokens": 24,
                "temperature": 0.8, "seed": i, "stream": True}
        hang_up = i % 5 == 0
        got = 0
        async with ac.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done"
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    got += 1
                if hang_up and got >= 3:
                    return "hung_up"  # leaving the block closes the connection mid-stream
        return "eof"

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as ac:
            return await asyncio.gather(*(one(i, ac) for i in range(100)))

    results = asyncio.run(main())
    assert results.count("hung_up") == 20 and results.count("done") == 80
    # Every request ends completed or aborted, and the KV pool returns to full.
    assert _settles(engine)
    metrics = httpx.get(served["url"] + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line]
    assert float(aborted[0].split()[-1]) >= 20
    # Still answering.
    assert client.completions.create(model=MODEL, prompt="Still there?", max_tokens=3).usage.completion_tokens == 3


def test_request_log_matches_simulator_format(served, client):
    from sim.metrics import read_request_log
    client.completions.create(model=MODEL, prompt="Log me", max_tokens=5)
    with open(served["log"]) as f:
        header = next(csv.reader(f))
    from engine.core.records import RequestRecord
    assert header[:len(RequestRecord.COLUMNS)] == list(RequestRecord.COLUMNS)
    df = read_request_log(served["log"])
    done = df[df["finish_reason"].isin(["stop", "length"])]
    assert len(done) > 0 and (done["ttft_s"] > 0).all() and (done["e2e_s"] >= done["ttft_s"]).all()
    assert set(df["finish_reason"]) <= {"stop", "length", "abort"}


def test_a_stopped_app_lets_its_engine_go():
    """Once its server has stopped and the caller drops them, an app's engine (weights, KV cache) is
    freed: nothing process-wide (FastAPI's memos of its endpoints) keeps it alive."""
    import gc
    import weakref
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=64, max_num_seqs=2,
                       num_gpu_blocks=32, max_model_len=256)
    app = create_app(engine, model_name=MODEL)
    port = _free_port()
    with _Server(app, port):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    gone = weakref.ref(engine)
    del engine, app, r
    gc.collect()
    assert gone() is None


def test_admission_bound_gives_503(tmp_path):
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=64, max_num_seqs=1,
                       num_gpu_blocks=64, max_model_len=512)
    app = create_app(engine, model_name=MODEL, max_waiting=2)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1/completions"
    with _Server(app, port):
        async def main():
            async with httpx.AsyncClient(timeout=300) as ac:
                # A long first request, streamed: once its first chunk is out it runs
                # (max_num_seqs=1) and a step has ended, so it no longer counts as waiting.
                first = {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True,
                         "stream": True}
                async with ac.stream("POST", url, json=first) as r0:
                    assert r0.status_code == 200
                    lines = r0.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass
                    reqs = [ac.post(url, json={"model": MODEL, "prompt": f"x {i}", "max_tokens": 8})
                            for i in range(11)]
                    rest = await asyncio.gather(*reqs)
                    async for _ in lines:
                        pass
                return rest
        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        # One runs, two may wait (max_waiting=2): of the eleven sent while it runs, two are
        # queued and the other nine refused.
        assert codes == [200] * 2 + [503] * 9
        refused = next(r for r in responses if r.status_code == 503)
        err = refused.json()["error"]
        assert err["code"] == "overloaded" and "max_waiting=2" in err["message"]
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


def test_request_timeout_aborts(tmp_path):
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=256, max_num_seqs=4,
                       num_gpu_blocks=64, max_model_len=512)
    app = create_app(engine, model_name=MODEL, request_timeout_s=0.3)
    port = _free_port()
    with _Server(app, port):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Count slowly", "max_tokens": 400, "ignore_eos": True})
        assert r.status_code == 200
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "abort"
        # It answers with what it generated before the timeout.
        assert 0 < body["usage"]["completion_tokens"] < 400 and body["choices"][0]["text"]
        kvm = engine.scheduler.kv_cache_manager
        time.sleep(0.3)
        assert kvm.num_free_blocks == kvm.num_usable_blocks


def test_broken_device_is_reported_not_hung():
    """A step that always fails is not a bad request: after a few failed steps in a row the loop
    stops, every waiting client is answered, and /health says why."""
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=64, max_num_seqs=2,
                       num_gpu_blocks=64, max_model_len=512)

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.step = broken_step
    engine.fail_step = lambda: []
    app = create_app(engine, model_name=MODEL)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with _Server(app, port):
        async def main():
            async with httpx.AsyncClient(timeout=60) as ac:
                return await asyncio.gather(*(ac.post(base + "/v1/completions", json={
                    "model": MODEL, "prompt": f"x {i}", "max_tokens": 4}) for i in range(4)))
        codes = [r.status_code for r in asyncio.run(main())]
        assert codes == [503] * 4  # answered (not hung), as server errors
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and "simulated device failure" in health.text


def test_openai_defaults_and_stream_details_as_vllm_has_them(served, client):
    """Behaviours vLLM's own OpenAI entrypoint tests check, in this project's words."""
    url = served["url"]
    # completions without max_tokens: 16 tokens, as OpenAI and vLLM default (not the whole context)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                  "ignore_eos": True, "temperature": 0}, timeout=120).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    # stream_options only with stream: a 400 naming the field
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "stream_options": {"include_usage": True}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    # continuous_usage_stats without include_usage: no usage in any chunk
    kw = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 4, "temperature": 0, "stream": True}
    bodies = []
    for so in ({"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": True}):
        with httpx.stream("POST", url + "/v1/completions", json={**kw, "stream_options": so}, timeout=60) as s:
            bodies.append([json.loads(line[6:]) for line in s.iter_lines()
                           if line.startswith("data: ") and line != "data: [DONE]"])
    assert not any("usage" in b for b in bodies[0])
    with httpx.stream("POST", url + "/v1/completions", json={**kw, "stream_options": {"include_usage": None}},
                      timeout=60) as s:  # null is vLLM's "not set": no usage, not a 400
        assert s.status_code == 200 and not any('"usage"' in line for line in s.iter_lines())
    with_usage = bodies[1]
    assert all(b.get("usage") for b in with_usage)          # every chunk, the counts so far
    done = [b["usage"]["completion_tokens"] for b in with_usage]
    assert done == sorted(done) and done[-1] == 4
    # the chat message carries the fields the OpenAI schema requires (vLLM sends them null/empty)
    msg = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=60).json()["choices"][0]["message"]
    assert msg["refusal"] is None and msg["tool_calls"] == [] and msg["role"] == "assistant"
    # logprobs=0: each position's top_logprobs holds the sampled token itself
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert all(tok in t and len(t) in (2, 3) for t, tok in zip(lp.top_logprobs, lp.tokens))


def test_tokenize_a_conversation_the_template_refuses_is_a_400(served):
    r = httpx.post(served["url"] + "/tokenize", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code in (200, 400), r.text           # never a 500
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "messages"


def test_echo_with_logprobs_scores_a_continuation_as_lm_eval_does(served, client):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, then 0): the
    prompt's tokens lead the logprobs (the first with None), each the model's own log-probability
    given the tokens before it (checked against a 1-token greedy continuation of each prefix), and
    prompt_logprobs in vLLM's format agrees."""
    url = served["url"]
    tok = served["engine"].tokenizer
    ctx, cont = "The capital of France is", " Paris"
    ids = tok.encode(ctx + cont, add_special_tokens=False)
    for max_tokens in (1, 0):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                                       "max_tokens": max_tokens, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(ctx + cont) and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert "".join(lp["tokens"][:len(ids)]) == tok.decode(ids)
        assert all(v < 0 for v in lp["token_logprobs"][1:])
        if max_tokens == 0:
            assert ch["text"] == tok.decode(ids) and r.json()["usage"]["completion_tokens"] == 0
        else:
            first_gen = lp["token_logprobs"][len(ids)]
    # each prompt token's logprob equals the sampled-token logprob of a 1-token request on its prefix
    checked = 0
    for j in range(2, len(ids)):
        one = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids[:j], "max_tokens": 1,
                                                         "logprobs": 5, "temperature": 0}, timeout=60).json()
        top = one["choices"][0]["logprobs"]["top_logprobs"][0]
        want = tok.decode(ids[j:j + 1])
        if want in top:
            assert abs(top[want] - lp["token_logprobs"][j]) < 2e-3
            checked += 1
    assert checked >= 2 and first_gen < 0
    # vLLM's prompt_logprobs field (completions and chat): None first, then {id: {logprob, rank, decoded_token}}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                   "prompt_logprobs": 2, "temperature": 0}, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        entry = plp[j][str(ids[j])]
        assert abs(entry["logprob"] - lp["token_logprobs"][j]) < 2e-3 and entry["rank"] >= 1
        assert 2 <= len(plp[j]) <= 3
    chat = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                          "messages": [{"role": "user", "content": "Hi"}]},
                      timeout=60).json()
    # chat: on the response, as vLLM's ChatCompletionResponse has it (not on the choice)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    assert "prompt_logprobs" not in chat["choices"][0]
    # streamed: the echoed prompt and its logprobs in the first chunk
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True,
                                                             "logprobs": 1, "max_tokens": 2, "stream": True,
                                                             "temperature": 0}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and "[DONE]" not in line]
    head = chunks[0]["choices"][0]
    assert head["text"] == tok.decode(ids) and len(head["logprobs"]["tokens"]) == len(ids)
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks[1:] if c["choices"][0]["logprobs"]) == 2


def test_vllm_extensions_token_ids_invocations_roles_and_chat_echo(served):
    """vLLM's extensions its clients use, in this project's words: return_token_ids (streamed and
    not), return_tokens_as_token_ids, /invocations, custom message roles, chat echo."""
    url = served["url"]
    tok = served["engine"].tokenizer
    kw = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**kw, "return_token_ids": True}, timeout=60).json()
    ch = r["choices"][0]
    assert ch["prompt_token_ids"] == tok.encode("The sky is") and len(ch["token_ids"]) == 5
    assert tok.decode(ch["token_ids"]) == ch["text"]
    with httpx.stream("POST", url + "/v1/completions", json={**kw, "return_token_ids": True, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and "[DONE]" not in line]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert streamed == ch["token_ids"] and chunks[0]["choices"][0]["prompt_token_ids"] == ch["prompt_token_ids"]
    r = httpx.post(url + "/v1/completions", json={**kw, "logprobs": 1, "return_tokens_as_token_ids": True},
                   timeout=60).json()
    assert [f"token_id:{t}" for t in ch["token_ids"]] == r["choices"][0]["logprobs"]["tokens"]
    chat_body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
                 "messages": [{"role": "user", "content": "Say hi"}], "return_token_ids": True}
    c = httpx.post(url + "/v1/chat/completions", json=chat_body, timeout=60).json()
    assert c["prompt_token_ids"][:3] and len(c["choices"][0]["token_ids"]) == c["usage"]["completion_tokens"]
    # /invocations: SageMaker's entry, dispatched by the body
    inv = httpx.post(url + "/invocations", json=chat_body, timeout=60).json()
    assert inv["object"] == "chat.completion" and inv["choices"][0]["message"]["content"] == c["choices"][0]["message"]["content"]
    inv = httpx.post(url + "/invocations", json=kw, timeout=60).json()
    assert inv["object"] == "text_completion" and inv["choices"][0]["text"] == ch["text"]
    bad = httpx.post(url + "/invocations", json={"model": MODEL}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    # a role the OpenAI schema does not list reaches the chat template (which decides)
    r = httpx.post(url + "/v1/chat/completions", json={**chat_body, "messages": [
        {"role": "observer", "content": "It rains."}, {"role": "user", "content": "Weather?"}]}, timeout=60)
    assert r.status_code in (200, 400) and (r.status_code == 200 or r.json()["error"]["param"] == "messages")
    # chat echo: continuing an assistant message, the reply starts with it
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 3, "temperature": 0, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True, "messages": [{"role": "user", "content": "Count to five."},
                                                     {"role": "assistant", "content": "1, 2,"}]}, timeout=60).json()
    assert r["choices"][0]["message"]["content"].startswith("1, 2,")
    assert len(r["choices"][0]["message"]["content"]) > len("1, 2,")


def test_vllm_sampling_extensions_reach_the_sampler(served):
    """min_p, allowed_token_ids, truncate_prompt_tokens and chat_template_kwargs as vLLM's clients
    send them: each changes what is generated, none is silently ignored."""
    url = served["url"]
    tok = served["engine"].tokenizer

    def comp(**kw):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                      "max_tokens": 6, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    # min_p 1 keeps only the most likely token: sampling at any temperature gives the greedy text
    greedy = comp(temperature=0)["choices"][0]["text"]
    assert all(comp(temperature=1.5, min_p=1.0, seed=s)["choices"][0]["text"] == greedy for s in (1, 2, 3))
    # allowed_token_ids: every generated token is one of them
    allowed = tok(" yes no maybe", add_special_tokens=False).input_ids
    out = comp(temperature=1.0, seed=4, allowed_token_ids=allowed, return_token_ids=True, ignore_eos=True)
    assert out["choices"][0]["token_ids"] and set(out["choices"][0]["token_ids"]) <= set(allowed)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "allowed_token_ids": [10 ** 7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    assert "out of vocabulary" in r.json()["error"]["message"]
    # truncate_prompt_tokens: the prompt is its last k tokens (the usage counts them)
    full = comp(temperature=0, max_tokens=1)["usage"]["prompt_tokens"]
    assert full > 3 and comp(temperature=0, max_tokens=1, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert "greater than max_model_len" in r.json()["error"]["message"]
    # chat_template_kwargs reach the template (an unused variable is harmless); the server's own
    # template arguments cannot be overridden; bad_words is refused, not ignored
    chat = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    base = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    same = httpx.post(url + "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": False}},
                      timeout=60).json()
    assert same["usage"]["prompt_tokens"] == base["usage"]["prompt_tokens"]
    assert same["choices"][0]["message"] == base["choices"][0]["message"]
    for body, field in (({"chat_template_kwargs": {"add_generation_prompt": False}},
                         "chat_template_kwargs.add_generation_prompt"), ({"bad_words": ["Paris"]}, "bad_words")):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tokenize_a_conversation_as_the_tokenizer_templates_it(served):
    """/tokenize with messages gives the ids of transformers' own apply_chat_template for every
    combination vLLM's tokenization tests try; both flags together are a 400, as in chat."""
    url, tok = served["url"], served["engine"].tokenizer
    conv = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Nice to meet"}]
    for gen, cont, special in ((True, False, False), (False, False, True), (False, True, False), (False, True, True)):
        text = tok.apply_chat_template(conv, add_generation_prompt=gen, continue_final_message=cont, tokenize=False)
        want = tok(text, add_special_tokens=special).input_ids
        r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": conv, "add_generation_prompt": gen,
                                                "continue_final_message": cont, "add_special_tokens": special})
        assert r.status_code == 200 and r.json()["tokens"] == want, (gen, cont, special, r.text)
    for path, body in (("/tokenize", {"messages": conv, "continue_final_message": True}),
                       ("/v1/chat/completions", {"messages": conv, "continue_final_message": True, "max_tokens": 2})):
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_vllm_serve_command_lines_and_server_options(tmp_path):
    """`servetwin serve` takes `vllm serve` command lines (positional model, several served names,
    flags that change nothing here) and vLLM's server options: --api-key guards the /v1/ routes,
    --max-logprobs bounds requests, --enable-server-load-tracking answers GET /load; a body
    that is not JSON by its Content-Type is a 400."""
    import argparse
    import functools

    hget = functools.partial(httpx.get, timeout=120)
    hpost = functools.partial(httpx.post, timeout=120)

    from engine.server.cli import add_serve_args, build_app
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers())
    a = parser.parse_args(["serve", MODEL, "--served-model-name", "alias-b", "alias-a", "--enforce-eager",
                           "--trust-remote-code", "--no-enable-prefix-caching", "--max-model-len", "512",
                           "--num-gpu-blocks", "64", "--device", "cpu", "--api-key", "sk-test", "--max-logprobs", "5",
                           "--enable-server-load-tracking", "--seed", "3", "--enable-request-id-headers",
                           "--return-tokens-as-token-ids"])
    app = build_app(a)
    ctx = app.state.context
    assert list(ctx.names) == ["alias-b", "alias-a"] and ctx.model_name == "alias-b"  # the order given
    assert not ctx.engine.scheduler_config.enable_prefix_caching and ctx.max_model_len == 512
    with pytest.raises(SystemExit, match="tensor-parallel-size"):
        build_app(parser.parse_args(["serve", MODEL, "-tp", "2", "--device", "cpu"]))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer sk-test"}
    with _Server(app, port):
        assert hget(url + "/v1/models").status_code == 401
        assert hget(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert [m["id"] for m in hget(url + "/v1/models", headers=key).json()["data"]] == ["alias-b", "alias-a"]
        assert hget(url + "/health").status_code == 200   # outside /v1/: no key, as vLLM
        # --enable-request-id-headers: the client's id comes back verbatim, else a fresh one
        assert hget(url + "/health", headers={"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"
        assert len(hget(url + "/health").headers["x-request-id"]) == 32
        r = hpost(url + "/v1/completions", headers={**key, "X-Request-Id": "mine"},
                       json={"prompt": "Hi", "max_tokens": 1})
        assert r.headers.get_list("x-request-id") == ["mine"] and r.json()["id"] == "cmpl-mine"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        assert client.completions.create(model="alias-a", prompt="Hi", max_tokens=2).model == "alias-a"
        r = hpost(url + "/v1/completions", headers=key, json={"prompt": "Hi", "max_tokens": 1, "logprobs": 0})
        assert r.json()["model"] == "alias-b"  # no model named: the first served name
        # as vLLM by default: no prompt_tokens_details; --return-tokens-as-token-ids is the default
        assert "prompt_tokens_details" not in r.json()["usage"]
        assert r.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        r = hpost(url + "/v1/completions", headers=key, json={"prompt": "Hi", "max_tokens": 2, "logprobs": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = hpost(url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}]}',
                       headers={**key, "Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Content-Type"
        # /load: nothing in flight, then a stream counts until it ends
        assert hget(url + "/load").json() == {"server_load": 0}
        with httpx.stream("POST", url + "/v1/completions", headers=key, timeout=60,
                          json={"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            assert hget(url + "/load").json() == {"server_load": 1}
            for _ in lines:
                pass
        deadline = time.time() + 10
        while hget(url + "/load").json()["server_load"] and time.time() < deadline:
            time.sleep(0.05)
        assert hget(url + "/load").json() == {"server_load": 0}


def _sse_bodies(url: str, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=120) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_vllm_request_checks_and_response_shapes(served):
    """What vLLM's entrypoint tests found missing, in this project's words: truncation_side picks
    the end truncate_prompt_tokens keeps; out-of-vocabulary stop_token_ids and every bad
    logit_bias key are 400s naming them; an absent prompt gets vLLM's words; a chat answer carries
    vLLM's response fields (prompt_logprobs on the response, not the choice); a chat stream's first
    chunk carries the prompt's ids and every delta its content; echoed prompt tokens are written
    token_id:ID like the generated ones."""
    url, tok = served["url"], served["engine"].tokenizer
    vocab = served["engine"].vocab_size

    def post(path, **body):
        return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)

    # truncation_side: "right" keeps the first k prompt tokens, "left" (the default) the last k
    ids = tok("One two three four five six seven eight", add_special_tokens=False).input_ids
    kw = {"prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True, "truncate_prompt_tokens": 4}
    assert post("/v1/completions", **kw, truncation_side="right").json()["choices"][0]["prompt_token_ids"] == ids[:4]
    assert post("/v1/completions", **kw, truncation_side="left").json()["choices"][0]["prompt_token_ids"] == ids[-4:]
    assert post("/v1/completions", **kw).json()["choices"][0]["prompt_token_ids"] == ids[-4:]
    chat = {"messages": [{"role": "user", "content": "Tell me how prompts are truncated."}], "max_tokens": 1,
            "temperature": 0, "return_token_ids": True}
    full = post("/v1/chat/completions", **chat).json()["prompt_token_ids"]
    right = post("/v1/chat/completions", **chat, truncate_prompt_tokens=5, truncation_side="right").json()
    assert len(full) > 5 and right["prompt_token_ids"] == full[:5]
    r = post("/v1/completions", **kw, truncation_side="middle")
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"

    # stop_token_ids: in the vocabulary, or a 400 that names the id and the vocabulary's size
    r = post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
             stop_token_ids=[vocab + 1])
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop_token_ids"
    assert str(vocab + 1) in err["message"] and str(vocab) in err["message"]
    assert post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                stop_token_ids=[vocab - 1]).status_code == 200
    # logit_bias: every key that is not a token id is named at once
    r = post("/v1/completions", prompt="Hi", max_tokens=1, logit_bias={"first_bad": 1.0, "second_bad": 2.0})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias"
    assert "first_bad" in err["message"] and "second_bad" in err["message"]
    # no prompt (an empty prompt_embeds is none either): vLLM's message
    for body in ({"prompt": None, "prompt_embeds": []}, {"prompt": []}, {}):
        r = post("/v1/completions", max_tokens=1, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "Either prompt or prompt_embeds must be provided and non-empty." in r.json()["error"]["message"]

    # a chat answer: OpenAI's service_tier (null) and system_fingerprint (vLLM's default "full"
    # mode: the server's version and a hash of its settings), vLLM's prompt_token_ids and
    # prompt_logprobs on the response (null when not asked)
    plain = post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2).json()
    assert {k: plain[k] for k in ("service_tier", "prompt_token_ids", "prompt_logprobs")} == \
        dict.fromkeys(("service_tier", "prompt_token_ids", "prompt_logprobs"))
    assert re.fullmatch(r"servetwin-[0-9.]+-[0-9a-f]{8}", plain["system_fingerprint"])
    assert "prompt_logprobs" not in plain["choices"][0]
    for k in (1, 2):
        lps = post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                   prompt_logprobs=k).json()["prompt_logprobs"]
        assert lps[0] is None and all(k <= len(e) <= k + 1 for e in lps[1:])
    comp = post("/v1/completions", prompt="Hi", max_tokens=1).json()
    assert comp["service_tier"] is None and comp["system_fingerprint"] == plain["system_fingerprint"]

    # a chat stream with return_token_ids: the prompt's ids on the first chunk only; each delta
    # has its content ("" when a last chunk brings no text)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
            "temperature": 0, "return_token_ids": True}
    whole = post("/v1/chat/completions", **{k: v for k, v in body.items() if k != "model"}).json()
    chunks = _sse_bodies(url, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    assert all(isinstance(c["choices"][0]["delta"]["content"], str) for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole["choices"][0]["message"]["content"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == whole["choices"][0]["token_ids"]

    # echo + logprobs + return_tokens_as_token_ids: the prompt's first token is token_id:ID too
    r = post("/v1/completions", prompt="Say hello", echo=True, max_tokens=2, temperature=0, logprobs=1,
             return_tokens_as_token_ids=True, return_token_ids=True).json()["choices"][0]
    want = r["prompt_token_ids"] + r["token_ids"]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
    # past the server's max_logprobs (vLLM's 20 by default), -1 (the whole vocabulary) included
    for body in ({"logprobs": True, "top_logprobs": -1}, {"prompt_logprobs": -1}, {"logprobs": True, "top_logprobs": 21}):
        r = post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] in body, r.text


def test_vllm_serve_root_path_usage_tokenizer_info_hidden_metrics_and_whole_vocab_logprobs():
    """More of `vllm serve`'s options: --root-path (the routes answer under the proxy's prefix and
    without it, the API key guarding both), --enable-force-include-usage (usage in every chunk of
    every stream), --enable-tokenizer-info-endpoint (GET /tokenizer_info),
    --show-hidden-metrics-for-version (the deprecated metric names too), --enable-chunked-prefill
    (how prompts always run here) and --max-logprobs -1 (requests may ask for the whole
    vocabulary with -1)."""
    import argparse

    from engine.server.cli import add_serve_args, build_app
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers())
    a = parser.parse_args(["serve", MODEL, "--served-model-name", "m", "--device", "cpu", "--max-model-len", "512",
                           "--num-gpu-blocks", "64", "--root-path", "/llm", "--api-key", "k",
                           "--enable-force-include-usage", "--enable-tokenizer-info-endpoint",
                           "--show-hidden-metrics-for-version", "0.10", "--enable-chunked-prefill",
                           "--max-logprobs", "-1"])
    app = build_app(a)
    engine = app.state.context.engine
    tok, vocab = engine.tokenizer, engine.vocab_size
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer k"}
    with _Server(app, port):
        for prefix in ("", "/llm"):
            assert httpx.get(url + prefix + "/v1/models", headers=key).json()["data"][0]["id"] == "m"
            assert httpx.get(url + prefix + "/v1/models").status_code == 401
            assert httpx.get(url + prefix + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/llm/v1", api_key="k", max_retries=0, timeout=120)
        assert client.completions.create(model="m", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        # every chunk of a stream that asked for no usage carries it, the counts so far
        chunks = _sse_bodies(url, "/v1/chat/completions", {"model": "m", "max_tokens": 4, "min_tokens": 4,
                                                           "stream": True, "temperature": 0,
                                                           "messages": [{"role": "user", "content": "Hi"}]}, key)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done) and done[-1] == 4 and chunks[-1]["choices"] == []
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in chunks)
        # vLLM's min_characters: EOS held back until the answer has that many characters
        hi = [{"role": "user", "content": "Say hi."}]
        short = client.chat.completions.create(model="m", messages=hi, max_tokens=40, temperature=0).choices[0]
        want = len(short.message.content) + 10
        longer = client.chat.completions.create(model="m", messages=hi, max_tokens=40, temperature=0,
                                                extra_body={"min_characters": want}).choices[0]
        assert short.finish_reason == "stop" and longer.message.content.startswith(short.message.content)
        assert len(longer.message.content) >= want or longer.finish_reason == "length"
        info = httpx.get(url + "/tokenizer_info").json()
        assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == tok.chat_template
        assert info["eos_token"] == tok.eos_token and isinstance(info["model_max_length"], int)
        assert all(isinstance(v["content"], str) and isinstance(v["special"], bool)
                   for v in info["added_tokens_decoder"].values()) and info["added_tokens_decoder"]
        # the whole vocabulary's logprobs: every token at the first generated position, and at
        # each prompt position (the prompt token among them)
        r = httpx.post(url + "/v1/chat/completions", headers=key, timeout=120, json={
            "model": "m", "max_tokens": 1, "logprobs": True, "top_logprobs": -1,
            "messages": [{"role": "user", "content": "Hi"}]}).json()
        top = r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        assert len(top) == vocab and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        ids = tok("The sky is blue", add_special_tokens=False).input_ids
        r = httpx.post(url + "/v1/completions", headers=key, timeout=120, json={
            "model": "m", "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1}).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and all(len(e) == vocab and str(t) in e for e, t in zip(plp[1:], ids[1:]))
        metrics = httpx.get(url + "/metrics").text
        for name in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
                     "vllm:time_per_output_token_seconds_count", "vllm:kv_cache_usage_perc"):
            assert name in metrics, name


def test_boolean_fields_take_json_strings_true_and_false_only(served):
    """vLLM's parsing takes `"logprobs": "true"` (its tests send it): a boolean field takes the
    strings "true" and "false" as the booleans; other strings and numbers stay 400s naming it."""
    url = served["url"]
    msgs = [{"role": "user", "content": "Which country is Beijing the capital of?"}]

    def chat(**kw):
        return httpx.post(url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0, **kw}, timeout=120)

    as_string, as_bool = chat(logprobs="true", top_logprobs=3), chat(logprobs=True, top_logprobs=3)
    assert as_string.status_code == 200, as_string.text
    content = as_string.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(e["top_logprobs"]) == 3 for e in content)
    assert content == as_bool.json()["choices"][0]["logprobs"]["content"]
    assert chat(logprobs="false").json()["choices"][0]["logprobs"] is None
    for bad in ("yes", "True", 1):
        r = chat(logprobs=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", (bad, r.text)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                  "echo": "true", "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Hi")
    # and /openapi.json says so
    doc = httpx.get(url + "/openapi.json").json()["components"]["schemas"]
    for model, field in (("ChatCompletionRequest", "logprobs"), ("CompletionRequest", "echo"),
                         ("ChatCompletionRequest", "add_generation_prompt")):
        assert {"type": "string", "enum": ["true", "false"]} in doc[model]["properties"][field]["anyOf"], field


def test_vllm_serve_shutdown_timeout_zero_and_skip_tokenizer_init(tmp_path):
    """`servetwin serve` as a process, with two more `vllm serve` flags: --skip-tokenizer-init
    (token ids in: a text prompt is a 400 naming it, a token-id prompt is served) and
    --shutdown-timeout 0 (SIGTERM aborts the stream in flight and the process exits at once,
    where the default waits for it)."""
    import signal
    import subprocess
    import sys
    import threading

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "scenarios.cli", "serve", MODEL, "--device", "cpu", "--port",
                             str(port), "--max-model-len", "512", "--num-gpu-blocks", "64", "--threads", "1",
                             "--shutdown-timeout", "0", "--skip-tokenizer-init"], stdout=log, stderr=log)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "--skip-tokenizer-init" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 504, 28], "max_tokens": 3,
                                                     "temperature": 0, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        assert r.json()["choices"][0]["prompt_token_ids"] == [1, 504, 28]
        # a long stream in flight when SIGTERM comes
        got, ended = [], threading.Event()

        def stream():
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                        "model": MODEL, "prompt": [1, 504, 28], "max_tokens": 500, "ignore_eos": True,
                        "stream": True}) as resp:
                    for line in resp.iter_lines():
                        got.append(line)
            except httpx.HTTPError:
                got.append("<cut>")
            ended.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        while not any(x.startswith("data: {") for x in got):
            assert time.time() < deadline and not ended.is_set()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # (a guard against a hang: the default would wait for the stream)
        assert proc.returncode in (0, -15)
        assert ended.wait(30)
        # cut, not finished: no [DONE], and far fewer than the 500 tokens asked for
        assert "data: [DONE]" not in got and sum(x.startswith("data: {") for x in got) < 500
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_chat_token_in_equals_the_templated_conversation(served):
    """vLLM's token-in chat: messages [] and the conversation's templated ids (from /tokenize)
    generate what the messages do; a template option with them, or neither, is a 400 naming it."""
    url = served["url"]
    msgs = [{"role": "user", "content": "Name a colour."}]
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=60).json()["tokens"]
    base = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).json()
    tin = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [], "prompt_token_ids": ids, "max_tokens": 8, "temperature": 0,
        "return_token_ids": True}).json()
    assert tin["prompt_token_ids"] == ids == base["prompt_token_ids"]
    assert tin["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
    assert tin["usage"]["prompt_tokens"] == len(ids)
    for extra, field in (({"add_generation_prompt": True}, "add_generation_prompt"),
                         ({"messages": msgs}, "prompt_token_ids"), ({"prompt_token_ids": None}, "messages"),
                         ({"prompt_token_ids": [10 ** 7]}, "prompt_token_ids")):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [], "prompt_token_ids": ids, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)


def test_logprob_token_ids_pin_the_reported_alternatives(served):
    """vLLM's logprob_token_ids: each sampled token's alternatives are the sampled token and the
    requested ids, with their raw log-probabilities; without logprobs, or out of the vocabulary, a
    400 naming the field."""
    url = served["url"]
    want = [100, 1000, 5000]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "logprob_token_ids": want, "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    plain = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        **{k: v for k, v in body.items() if k != "logprob_token_ids"}, "top_logprobs": 20}).json()
    for e, p in zip(r["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"]):
        got = [int(t["token"].removeprefix("token_id:")) for t in e["top_logprobs"]]
        sampled = int(e["token"].removeprefix("token_id:"))
        assert got == ([sampled] if sampled not in want else []) + want
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"]) or sampled in want
        # the same raw distribution as the natural top-k where they overlap
        natural = {t["token"]: t["logprob"] for t in p["top_logprobs"]}
        for t in e["top_logprobs"]:
            if t["token"] in natural:
                assert t["logprob"] == pytest.approx(natural[t["token"]], abs=1e-4)
            assert t["logprob"] <= 0
    comp = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": 1, "logprob_token_ids": [7, 8],
        "return_tokens_as_token_ids": True}).json()
    assert {"token_id:7", "token_id:8"} <= set(comp["choices"][0]["logprobs"]["top_logprobs"][0])
    for extra, field in (({"logprobs": False, "top_logprobs": None}, "logprob_token_ids"),
                         ({"logprob_token_ids": [10 ** 7]}, "logprob_token_ids"),
                         ({"logprob_token_ids": []}, "logprob_token_ids")):
        bad = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (extra, bad.text)


PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_content_format_reaches_the_template_as_vllm_reads_it(tmp_path):
    """--chat-template-content-format: 'auto' reads from the template whether it loops over a
    message's content (then content goes as OpenAI content parts, else as one string, as vLLM's
    detection); a template that loops over parts renders a conversation with 'auto' and 'openai'
    exactly as transformers renders it given parts, and given strings when forced to 'string'."""
    import argparse

    from engine.server.cli import add_serve_args, build_app
    from engine.server.context import content_format
    assert content_format(PARTS_TEMPLATE) == "openai"
    assert content_format("{% for m in messages %}{% for p in m.content | selectattr('type') %}"
                          "{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert content_format(None) == "string"
    path = tmp_path / "parts.jinja"
    path.write_text(PARTS_TEMPLATE)
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers())
    conv = [{"role": "user", "content": "Hi there"},
            {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}, conv[1]]  # parts as sent
    rendered = []
    as_strings = [{"role": "user", "content": "Hi there"}, {"role": "user", "content": "two parts"}]
    for fmt, template, given in (("auto", str(path), as_parts), ("openai", str(path), as_parts),
                                 ("string", str(path), as_strings), ("auto", None, as_strings)):
        argv = ["serve", MODEL, "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks", "32",
                "--chat-template-content-format", fmt] + (["--chat-template", template] if template else [])
        app = build_app(parser.parse_args(argv))
        tok = app.state.context.engine.tokenizer
        port = _free_port()
        with _Server(app, port):
            r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"model": MODEL, "messages": conv}, timeout=60)
        assert r.status_code == 200, (fmt, template, r.text)
        want = tok(tok.apply_chat_template(given, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids
        assert r.json()["tokens"] == want, (fmt, template)
        rendered.append(want)
    # the parts template renders the text only when given parts (as a string, it loops over
    # characters and finds no 'text' in them); the model's own template renders the strings
    assert rendered[0] == rendered[1] != rendered[2] and len(rendered[0]) > len(rendered[2])

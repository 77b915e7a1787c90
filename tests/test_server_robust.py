"""The server against bad input, and as a drop-in for vLLM users: no input stops the engine loop,
latency counts from HTTP receipt, tokenization stays off the event loop, gauges stay fresh,
n > 1 / several prompts / echo / logprobs / cached tokens, vLLM's extra endpoints and metrics."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
import transformers

from engine.llm_engine import LLMEngine
from engine.model.loader import resolve_model
from engine.server.app import create_app
from tests.fuzz_bodies import fuzz_body
from tests.test_server import MODEL, _free_port, _Server


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.csv"
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=256, max_num_seqs=16,
                       num_gpu_blocks=300, max_model_len=512)
    app = create_app(engine, model_name=MODEL, max_waiting=500, request_log=log, max_body_bytes=256 << 10)
    port = _free_port()
    with _Server(app, port):
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine, "log": log, "app": app}


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def post(srv, path, body=None, content=None):
    if content is not None:
        return httpx.post(srv["url"] + path, content=content, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(srv["url"] + path, json=body, timeout=60)


def complete(srv, **kw):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, **kw}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- the defects
@pytest.mark.parametrize("path,raw,field", [
    ("/v1/completions", b'{"model":"default","prompt":"hi","max_tokens":2,"seed":1180591620717411303424}', "seed"),
    ("/v1/completions", b'{"model":"default","prompt":"x\\ud800y"}', "prompt"),
    ("/v1/completions", b'{"model":"default","prompt":["ok","x\\udfffy"]}', "prompt[1]"),
    ("/v1/chat/completions", b'{"model":"default","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions",
     b'{"model":"default","messages":[{"role":"user","content":[{"type":"text","text":null}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"model":"default","messages":[{"role":"user","content":[{"type":"image_url",'
                             b'"image_url":{"url":"http://x/y.png"}}]}]}', "messages[0].content[0].type"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","extra":' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","extra":' + b"[" * 40 + b"]" * 40 + b"}", "extra"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","temperature":Infinity}', "body"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","temperature":1e999}', "temperature"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","max_tokens":"5"}', "max_tokens"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","max_tokens":5.5}', "max_tokens"),  # 5.0 is 5
    ("/v1/completions", b'{"model":"default","prompt":"hi","stream":"yes"}', "stream"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","ignore_eos":1}', "ignore_eos"),
    ("/v1/completions", b'{"model":"default","prompt":[1, true, 3]}', "prompt[1]"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","stop":[1]}', "stop"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","best_of":3}', "best_of"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","suffix":"end"}', "suffix"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","logit_bias":{"99999999":10}}', "logit_bias"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","logit_bias":{"x":10}}', "logit_bias"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","logit_bias":{"5":101}}', "logit_bias"),
    ("/v1/chat/completions", b'{"model":"default","messages":[{"role":"user","content":"hi"}],'
                             b'"tools":[{"type":"function","function":{"name":"f"}}]}', "tools"),
    ("/v1/chat/completions", b'{"model":"default","messages":[{"role":"user","content":"hi"}],'
                             b'"tool_choice":"required"}', "tool_choice"),
    ("/v1/chat/completions", b'{"model":"default","messages":[{"role":"user","content":"hi"}],'
                             b'"response_format":{"type":"json_object"}}', "response_format"),
    ("/v1/completions", b'{"model":"default","prompt":"hi","prompt_logprobs":21}', "prompt_logprobs"),
    ("/v1/completions", b'\xff\xfe{"model"', "body"),
    ("/v1/completions", b'[1, 2]', "body"),
])
def test_defects_answer_400_naming_the_field(srv, path, raw, field):
    r = post(srv, path, content=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["type"] == "invalid_request_error" and err["message"].startswith(field)
    assert r.headers.get("connection") != "close"  # a 400 keeps the keep-alive connection
    assert httpx.get(srv["url"] + "/health").json() == {"status": "ok"}


def test_logit_bias_steers_the_tokens(srv):
    """+100 on one token makes greedy decoding produce only it; the reported logprobs stay the
    model's own (raw), so that token's logprob is what it was without the bias."""
    tok = srv["engine"].tokenizer
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    body = complete(srv, prompt="hi", max_tokens=4, temperature=0, logit_bias={str(forced): 100})
    assert body["choices"][0]["text"] == tok.decode([forced] * 4)
    plain = complete(srv, prompt="hi", max_tokens=1, temperature=0, logprobs=0)
    biased = complete(srv, prompt="hi", max_tokens=1, temperature=0, logprobs=0,
                      logit_bias={str(forced): 100})
    assert biased["choices"][0]["logprobs"]["tokens"] != plain["choices"][0]["logprobs"]["tokens"]
    assert biased["choices"][0]["logprobs"]["token_logprobs"][0] < plain["choices"][0]["logprobs"]["token_logprobs"][0]


def test_unsupported_fields_at_their_off_values_are_accepted(srv):
    body = complete(srv, prompt="hi", tools=[], tool_choice="none", response_format={"type": "text"},
                    logit_bias={}, best_of=1, suffix=None)
    assert body["usage"]["completion_tokens"] == 6


def test_body_limit_and_length_check_refuse_before_tokenizing(srv):
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x" * (300 << 10)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    # Under the body limit but more characters than max_model_len tokens can ever cover.
    tok = srv["engine"].tokenizer
    bound = 2 * srv["engine"].max_model_len * max(len(t) for t in tok.get_vocab())
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "y" * (bound + 1)})
    assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"]


def test_seeds_take_vllm_s_signed_64_bits(srv):
    def text(seed):
        return complete(srv, prompt="Once upon a time", temperature=1.0, max_tokens=12, seed=seed)["choices"][0]["text"]
    assert text(5) == text(5)
    assert text(5) != text(5 + 2 ** 32)
    assert text(2 ** 63 - 1) == text(2 ** 63 - 1) and text(-2 ** 63) == text(-2 ** 63)
    # one beyond torch.long either way: a 400 naming the field, the limit and pydantic's error type
    for seed, kind in ((2 ** 63, "less_than_equal"), (-2 ** 63 - 1, "greater_than_equal")):
        r = post(srv, "/v1/chat/completions", {"model": MODEL, "seed": seed, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "seed" and kind in err["message"], err
        assert str(2 ** 63 - 1 if seed > 0 else -2 ** 63) in err["message"]
    # an out-of-vocabulary prompt token and an empty prompt: named as vLLM names them
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 7], "max_tokens": 2})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2})
    assert r.status_code == 400 and "decoder prompt cannot be empty" in r.json()["error"]["message"]


# ---------------------------------------------------------------- compatibility
def test_n_choices_follow_vllm_seeding(srv):
    kw = dict(prompt="The weather today is", temperature=1.0, max_tokens=8)
    both = complete(srv, n=2, seed=42, **kw)
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == complete(srv, seed=42, **kw)["choices"][0]["text"]
    assert both["choices"][1]["text"] == complete(srv, seed=43, **kw)["choices"][0]["text"]
    assert both["usage"]["completion_tokens"] == 16
    assert both["usage"]["prompt_tokens"] == len(srv["engine"].tokenizer(kw["prompt"]).input_ids)


def test_several_prompts_answer_like_single_requests(srv):
    tok = srv["engine"].tokenizer
    prompts = ["The capital of France is", tok("1, 2, 3,").input_ids]
    many = complete(srv, prompt=prompts)
    for i, p in enumerate(prompts):
        assert many["choices"][i]["text"] == complete(srv, prompt=p)["choices"][0]["text"]
    assert many["usage"]["prompt_tokens"] == len(tok(prompts[0]).input_ids) + len(prompts[1])


def test_echo_prepends_the_prompt(srv):
    p = "The capital of France is"
    plain = complete(srv, prompt=p)["choices"][0]["text"]
    assert complete(srv, prompt=p, echo=True)["choices"][0]["text"] == p + plain
    s = httpx.post(srv["url"] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in s.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == p + plain


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model(MODEL)), dtype=torch.float32, local_files_only=True).eval()


def test_logprobs_match_transformers(srv, client, hf_model):
    """Completions and chat logprobs against log_softmax of transformers' own logits."""
    tok = srv["engine"].tokenizer
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = tok(prompt).input_ids
    gen = [tok.convert_tokens_to_ids(t) for t in []]  # filled below from the greedy ids
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=2,
                                output_logits=True, return_dict_in_generate=True)
    gen = out.sequences[0, len(ids):].tolist()
    assert lp.tokens == [tok.decode([t]) for t in gen]
    assert "".join(lp.tokens) == r.choices[0].text
    for k, logits in enumerate(out.logits):
        ref = logits[0].float().log_softmax(-1)
        assert lp.token_logprobs[k] == pytest.approx(ref[gen[k]].item(), abs=2e-3)
        top_v, top_i = ref.topk(3)
        assert list(lp.top_logprobs[k]) == [tok.decode([t]) for t in top_i.tolist()]
        assert list(lp.top_logprobs[k].values()) == pytest.approx(top_v.tolist(), abs=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(4)]
    # streamed, with a stop string holding text back: the same offsets (counted from the tokens)
    kw = dict(model=MODEL, prompt="Hi", max_tokens=8, temperature=0, logprobs=0, stop=["\n\n"])
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = [o for ch in client.completions.create(stream=True, **kw) for c in ch.choices if c.logprobs
                for o in c.logprobs.text_offset]
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:k]) for k in range(len(whole.tokens))]
    assert streamed == whole.text_offset
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    for e in content:  # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode() == e.token


def test_cached_tokens_and_reset_prefix_cache(srv):
    p = "A long shared preamble about the history of the bicycle, from the draisine onwards. " * 4
    n_prompt = len(srv["engine"].tokenizer(p).input_ids)
    first = complete(srv, prompt=p, max_tokens=2)["usage"]
    again = complete(srv, prompt=p, max_tokens=2)["usage"]
    bs = srv["engine"].block_size
    assert again["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // bs * bs
    # vLLM's created_cache_tokens: the prompt's tokens in full blocks that were not read from the
    # cache (a hit stops one token short of the prompt, whose last token is always computed)
    assert first["prompt_tokens_details"]["created_cache_tokens"] == n_prompt // bs * bs
    assert again["prompt_tokens_details"]["created_cache_tokens"] == n_prompt // bs * bs - (n_prompt - 1) // bs * bs
    assert "cache_read_input_tokens" not in again  # vLLM's Anthropic usage, not OpenAI's
    deadline = time.time() + 30
    while True:  # refused (409) only while a request holds blocks
        r = post(srv, "/reset_prefix_cache")
        if r.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200
    cold = complete(srv, prompt=p, max_tokens=2)["usage"]
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": n_prompt // bs * bs}


def test_cache_salt_keeps_tenants_apart(srv):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for the same salt only (nor
    for requests without one); an empty salt is a 400 naming the field."""
    p = "Salted preamble: the tenants of this server must not see each other's cached prompts. " * 4
    n_prompt = len(srv["engine"].tokenizer(p).input_ids)
    full = (n_prompt - 1) // srv["engine"].block_size * srv["engine"].block_size

    def cached(**kw):
        return complete(srv, prompt=p, max_tokens=2, **kw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0     # another salt: nothing shared
    assert cached() == 0                           # no salt: nothing shared either
    assert cached(cache_salt="tenant-a") == full  # its own salt: every full block hits
    assert cached() == full                        # the unsalted copy cached by the third request
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text


def test_vllm_endpoints(srv, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    tok = srv["engine"].tokenizer
    t = post(srv, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert t["tokens"] == tok("Hello world").input_ids and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == srv["engine"].max_model_len
    assert post(srv, "/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json() == {"prompt": "Hello world"}
    msgs = [{"role": "user", "content": "Hi"}]
    t = post(srv, "/tokenize", {"model": MODEL, "messages": msgs}).json()
    templ = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert t["tokens"] == tok(templ, add_special_tokens=False).input_ids
    assert httpx.get(srv["url"] + "/version").json()["version"]
    assert httpx.get(srv["url"] + "/ping").status_code == 200
    assert httpx.post(srv["url"] + "/ping").status_code == 200
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, srv["url"] + path)
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_x_request_id_names_the_request(srv):
    """As in vLLM, the client's X-Request-Id becomes the response id and the log's request_id,
    so a load generator's records can be matched with the server's."""
    r = httpx.post(srv["url"] + "/v1/chat/completions", headers={"X-Request-Id": "abc-123"}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-abc-123" and r.headers["x-request-id"] == "chatcmpl-abc-123"
    import csv
    with open(srv["log"]) as f:
        assert "chatcmpl-abc-123" in {row["request_id"] for row in csv.DictReader(f)}


def test_duplicate_live_request_id_is_refused(srv):
    """Two requests in flight under one X-Request-Id: the second is refused naming request_id,
    the first is unaffected."""
    async def both():
        async with httpx.AsyncClient(timeout=60) as ac:
            body = {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": 24, "ignore_eos": True}
            first = asyncio.ensure_future(ac.post(srv["url"] + "/v1/completions", json=body,
                                                  headers={"X-Request-Id": "dup"}))
            await asyncio.sleep(0.3)
            second = await ac.post(srv["url"] + "/v1/completions", json=body, headers={"X-Request-Id": "dup"})
            return await first, second
    first, second = asyncio.run(both())
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 24
    assert second.status_code == 400 and second.json()["error"]["param"] == "request_id"


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.split()[-1])
    raise AssertionError(f"{name} {labels} not exported")


def test_gauges_fresh_after_an_abort(srv):
    """The last event is an abort: running/waiting must go back to 0 (they used to stay at 1)."""
    url = srv["url"]

    async def hang_up():
        async with httpx.AsyncClient(timeout=60) as ac:
            async with ac.stream("POST", url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and '"text": "' in line:
                        return
    asyncio.run(hang_up())
    eng = srv["engine"]
    deadline = time.time() + 30
    while eng.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.6)  # one idle turn of the engine loop (it wakes every 0.5 s when idle)
    m = httpx.get(url + "/metrics").text
    assert _metric(m, "vllm:num_requests_running", model_name=MODEL) == 0
    assert _metric(m, "vllm:num_requests_waiting", model_name=MODEL) == 0
    assert _metric(m, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0
    assert _metric(m, "vllm:request_success_total", model_name=MODEL, finished_reason="abort") >= 1


# ---------------------------------------------------------------- latency from HTTP receipt
def test_arrival_is_stamped_at_http_receipt(srv, monkeypatch):
    """B arrives while A's (slow) step runs: B's arrival must be before A's first token, not when
    the engine thread got round to it after the step."""
    eng = srv["engine"]
    real = eng.runner.execute
    started = threading.Event()

    def slow(out):
        if out.num_scheduled_tokens:
            started.set()
            time.sleep(0.4)
        return real(out)
    monkeypatch.setattr(eng.runner, "execute", slow)
    ids = {}

    def send(name, prompt):
        ids[name] = complete(srv, prompt=prompt, max_tokens=2)["id"]
    a = threading.Thread(target=send, args=("a", "First request"))
    a.start()
    assert started.wait(30)
    send("b", "Second request")
    a.join()
    import csv
    with open(srv["log"]) as f:
        rows = {r["request_id"]: r for r in csv.DictReader(f)}
    ra, rb = rows[ids["a"]], rows[ids["b"]]
    assert float(rb["arrival_s"]) < float(ra["first_token_s"])
    # B waited for A's step: its queue time shows it (before the fix it was 0).
    assert float(rb["first_scheduled_s"]) >= float(ra["first_token_s"])


def test_arrival_counts_a_slow_upload(srv):
    """Headers first, the body 0.4 s later: the client has waited since its first bytes, so the
    logged arrival is then (queue time >= 0.4 s), not when the handler could start."""
    import csv
    import socket
    body = json.dumps({"model": MODEL, "prompt": "Slow upload", "max_tokens": 2}).encode()
    host, port = srv["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: slow-upload\r\nContent-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.4)
        s.sendall(body)
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    with open(srv["log"]) as f:
        row = next(r for r in csv.DictReader(f) if r["request_id"] == "cmpl-slow-upload")
    assert float(row["first_scheduled_s"]) - float(row["arrival_s"]) >= 0.4


def test_tokenization_runs_off_the_event_loop(srv, monkeypatch):
    """The tokenizer is called on worker threads, never on the event loop's thread."""
    from engine.server import routes_openai as app_mod  # the completions route's encoder
    seen = []
    real = app_mod._encode

    def spy(tok, text, special):
        seen.append(threading.current_thread().name)
        return real(tok, text, special)
    monkeypatch.setattr(app_mod, "_encode", spy)
    complete(srv, prompt="Where am I tokenized?", max_tokens=1)
    assert seen and all(name.startswith("tokenize") for name in seen)


# ---------------------------------------------------------------- failures inside a step
def test_failed_step_fails_only_its_requests(srv, monkeypatch):
    eng = srv["engine"]
    real = eng.runner.execute
    poison = eng.tokenizer("POISON").input_ids

    def execute(out):
        for d in out.scheduled_new_reqs:
            if list(d.prompt_token_ids) == poison:
                raise RuntimeError("kernel failure on this request")
        return real(out)
    monkeypatch.setattr(eng.runner, "execute", execute)
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "POISON", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    # The loop goes on; nothing leaked.
    assert complete(srv, prompt="Still serving?", max_tokens=3)["usage"]["completion_tokens"] == 3
    kvm = eng.scheduler.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_usable_blocks
    assert httpx.get(srv["url"] + "/health").json() == {"status": "ok"}


# ---------------------------------------------------------------- fuzz
def test_fuzz_never_500_never_stops(srv):
    """300 random and malformed bodies to both endpoints, a well-formed greedy request after
    every 25: no 500, the same correct answer each time, and the loop still serving."""
    rng = random.Random(1234)
    url = srv["url"]
    ref = complete(srv, prompt="Count: 1, 2, 3,", max_tokens=5)["choices"][0]["text"]
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=120) as c:
        for i in range(300):
            path = "/v1/chat/completions" if rng.random() < 0.4 else "/v1/completions"
            r = c.post(url + path, content=fuzz_body(rng), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text)
            if r.status_code != 200:
                assert "error" in r.json() and r.json()["error"]["message"]
            if i % 25 == 24:
                ok = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Count: 1, 2, 3,",
                                                           "max_tokens": 5, "temperature": 0})
                assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 100, statuses
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def stream_first_text_at(srv, body: dict, request_id: str) -> float | None:
    """Stream a completion to its end; the engine-clock time its first text chunk was read."""
    got_first = None
    with httpx.stream("POST", srv["url"] + "/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": request_id}) as r:
        for line in r.iter_lines():
            if got_first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                got_first = srv["engine"].now()
    return got_first


def test_log_first_token_is_when_the_client_was_sent_it(srv, monkeypatch):
    """The event loop is held up for 0.3 s right after the step that produced a streamed
    request's first token: the client gets that token 0.3 s after the step ended, and the request
    log's first token time says so (>= the step's end + 0.3 s), no later than the client read it."""
    import csv
    aeng = srv["app"].state.async_engine
    real = aeng._flush
    step_end = []

    def flush(batch):
        for loop, items in batch.items():
            for _, (_, out) in items:
                if not step_end and out.request_id == "cmpl-held-loop":
                    step_end.append(out.metrics.first_token_s)  # the engine's stamp: the step's end
                    loop.call_soon_threadsafe(time.sleep, 0.3)
        real(batch)
    monkeypatch.setattr(aeng, "_flush", flush)
    body = {"model": MODEL, "prompt": "Held up", "max_tokens": 6, "stream": True, "ignore_eos": True}
    got_first = stream_first_text_at(srv, body, "held-loop")
    assert step_end and got_first is not None
    with open(srv["log"]) as f:
        row = next(r for r in csv.DictReader(f) if r["request_id"] == "cmpl-held-loop")
    first = float(row["first_token_s"])
    assert step_end[0] + 0.3 <= first <= got_first
    times = [float(t) for t in row["token_times_s"].split()]
    assert times[0] == pytest.approx(first, abs=1e-6) and times == sorted(times) and len(times) == 6


def test_log_row_of_a_stream_that_finished_before_its_first_chunk_went_out(srv, monkeypatch):
    """The event loop is held from the step of a streamed request's first token until the engine
    has finished the request (the race of a loop stalled past a short request's last step): the
    row is still written, once the first chunk goes out, with that hand-over as its first token
    time and the tokens and end it came with no earlier."""
    import csv
    aeng = srv["app"].state.async_engine
    rid = "cmpl-finished-first"
    finished = threading.Event()
    real_finish, real_flush = aeng._finish_record, aeng._flush
    step_end = []

    def finish(r):
        real_finish(r)
        if r == rid:
            finished.set()

    def flush(batch):
        for loop, items in batch.items():
            for _, (_, out) in items:
                if not step_end and out.request_id == rid:
                    step_end.append(out.metrics.first_token_s)
                    loop.call_soon_threadsafe(finished.wait, 60)  # the loop waits for the finish
        real_flush(batch)
    monkeypatch.setattr(aeng, "_finish_record", finish)
    monkeypatch.setattr(aeng, "_flush", flush)
    body = {"model": MODEL, "prompt": "Finished first", "max_tokens": 3, "stream": True, "ignore_eos": True}
    got_first = stream_first_text_at(srv, body, "finished-first")
    assert finished.is_set() and step_end and got_first is not None
    with open(srv["log"]) as f:
        rows = [r for r in csv.DictReader(f) if r["request_id"] == rid]
    assert len(rows) == 1
    row = rows[0]
    first, last, end = (float(row[k]) for k in ("first_token_s", "last_token_s", "finish_s"))
    times = [float(t) for t in row["token_times_s"].split()]
    assert step_end[0] < first <= got_first
    assert len(times) == 3 and times == sorted(times) and times[0] == pytest.approx(first, abs=1e-6)
    assert first <= last and first <= end                       # nothing before the first token

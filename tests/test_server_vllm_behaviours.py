"""Behaviours of vLLM's OpenAI entrypoint that its own end-to-end tests rely on (issue 38), checked
over HTTP against this server: packed logprobs, a completion stream's extension fields, the
system fingerprint, content parts reaching the chat template, and the wording of refusals."""
from __future__ import annotations

import argparse
import base64
import json
import struct

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server.app import create_app, system_fingerprint
from engine.server.routes_misc import VERSION
from tests.test_server import MODEL, _free_port, _Server


@pytest.fixture(scope="module")
def srv():
    # --fingerprint-mode none here: test_server.py's app answers with the default ("full")
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=256, max_num_seqs=8,
                       num_gpu_blocks=128, max_model_len=512)
    app = create_app(engine, model_name=MODEL, fingerprint_mode="none")
    port = _free_port()
    with _Server(app, port):
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine}


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv["url"] + path, json={"model": MODEL, **body}, timeout=120)


def events(srv, path: str, body: dict) -> list[dict]:
    """A stream's `data:` bodies, [DONE] left out."""
    out = []
    with httpx.stream("POST", srv["url"] + path, json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def unpack(block: dict) -> tuple[list[list[int]], list[list[float]]]:
    """A packed_top_logprobs block decoded by its own description: rows of ids and of logprobs."""
    rows, k = block["shape"]
    assert (block["token_ids_dtype"], block["logprobs_dtype"]) == ("<i4", "<f4")
    ids = struct.unpack(f"<{rows * k}i", base64.b64decode(block["token_ids_b64"]))
    values = struct.unpack(f"<{rows * k}f", base64.b64decode(block["logprobs_b64"]))
    return [list(ids[r * k:(r + 1) * k]) for r in range(rows)], [list(values[r * k:(r + 1) * k]) for r in range(rows)]


def test_packed_top_logprobs_carry_the_same_alternatives_as_the_dict_form(srv):
    """packed_top_logprobs: each generated token's k alternatives arrive as base64 int32 ids and
    float32 logprobs ([tokens, k]), the same ids and values the ordinary answer lists per token,
    best first; top_logprobs is empty and tokens / token_logprobs / text_offset are unchanged.
    Streamed, each chunk packs only its own tokens and the rows add up to the whole answer's."""
    k = 3
    body = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": k,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    plain = post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]
    packed = post(srv, "/v1/completions", {**body, "packed_top_logprobs": True}).json()["choices"][0]["logprobs"]
    assert packed["top_logprobs"] == [] and packed["packed_top_logprobs"]["shape"] == [5, k]
    for name in ("tokens", "token_logprobs", "text_offset"):
        assert packed[name] == plain[name], name
    ids, values = unpack(packed["packed_top_logprobs"])
    for row_ids, row_values, alternatives in zip(ids, values, plain["top_logprobs"]):
        listed = {int(t.removeprefix("token_id:")): v for t, v in alternatives.items()}
        assert set(row_ids) <= set(listed) and len(set(row_ids)) == k
        assert row_values == sorted(row_values, reverse=True)
        for t, v in zip(row_ids, row_values):
            assert v == pytest.approx(listed[t], abs=1e-5)  # float32 on the wire

    chunks = events(srv, "/v1/completions", {**body, "packed_top_logprobs": True})
    blocks = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    streamed = [unpack(b["packed_top_logprobs"]) for b in blocks]
    assert [row for s_ids, _ in streamed for row in s_ids] == ids
    assert [off for b in blocks for off in b["text_offset"]] == packed["text_offset"]


@pytest.mark.parametrize("change", [{"echo": True}, {"logprobs": 0}, {"logprobs": -1}, {"logprobs": None},
                                    {"logprob_token_ids": [5]}, {"return_tokens_as_token_ids": False},
                                    {"return_tokens_as_token_ids": None}])
def test_packed_top_logprobs_refuses_what_it_cannot_pack(srv, change):
    """Packing needs k >= 1 alternatives and tokens written as ids, and takes neither echo nor
    logprob_token_ids: each otherwise a 400 naming packed_top_logprobs."""
    body = {"prompt": "Hi", "max_tokens": 2, "logprobs": 2, "packed_top_logprobs": True,
            "return_tokens_as_token_ids": True, **change}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "packed_top_logprobs", (change, r.text)


def test_completion_stream_chunks_carry_the_extension_fields(srv):
    """Every streamed completion choice has stop_reason, prompt_token_ids and token_ids (null when
    unused), as an answer's choices do; return_token_ids fills the ids (the prompt's on a choice's
    first chunk), and the last chunk of a choice stopped by a stop string names it."""
    for c in events(srv, "/v1/completions", {"prompt": "One, two,", "max_tokens": 3, "temperature": 0}):
        for ch in c["choices"]:
            assert {"stop_reason", "prompt_token_ids", "token_ids"} <= set(ch) and ch["token_ids"] is None
            assert ch["prompt_token_ids"] is None and ch["stop_reason"] is None
    whole = post(srv, "/v1/completions", {"prompt": "One, two,", "max_tokens": 6, "temperature": 0,
                                          "return_token_ids": True}).json()["choices"][0]
    chunks = [c["choices"][0] for c in events(srv, "/v1/completions", {
        "prompt": "One, two,", "max_tokens": 6, "temperature": 0, "return_token_ids": True})]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(ch["prompt_token_ids"] is None for ch in chunks[1:])
    assert [t for ch in chunks for t in ch["token_ids"]] == whole["token_ids"]
    stop = whole["text"][2:4]
    stopped = events(srv, "/v1/completions", {"prompt": "One, two,", "max_tokens": 6, "temperature": 0,
                                              "stop": [stop]})
    assert stopped[-1]["choices"][0]["finish_reason"] == "stop"
    assert stopped[-1]["choices"][0]["stop_reason"] == stop


def test_fingerprint_none_leaves_the_field_out(srv):
    """--fingerprint-mode none: non-streamed answers have no system_fingerprint key at all."""
    chat = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    comp = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert chat.status_code == comp.status_code == 200
    assert "system_fingerprint" not in chat.json() and "system_fingerprint" not in comp.json()


def test_fingerprint_modes(srv):
    """full and hash: servetwin-VERSION-8 hex digits, the same for the same settings (one device:
    nothing to strip for hash); custom: the value given (none given: refused); none: None."""
    engine = srv["engine"]
    full = system_fingerprint(engine, "full")
    assert full.startswith(f"servetwin-{VERSION}-") and len(full.rsplit("-", 1)[1]) == 8
    assert system_fingerprint(engine, "hash") == full == system_fingerprint(engine)
    assert system_fingerprint(engine, "custom", "fp-7") == "fp-7"
    assert system_fingerprint(engine, "none") is None
    for mode, value in (("custom", None), ("loud", None)):
        with pytest.raises(ValueError, match="fingerprint"):
            system_fingerprint(engine, mode, value)


def test_refusals_in_vllm_words(srv):
    """Bad values vLLM's clients and tests match by their words: each a 400 naming the field."""
    def refused(path, body, param, words):
        r = post(srv, path, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], (body, r.text)

    msgs = [{"role": "user", "content": "Hi"}]
    refused("/v1/completions", {"prompt": [-1], "max_tokens": 1}, "prompt", "greater than or equal to 0")
    refused("/v1/completions", {"prompt": [[5], [-3]], "max_tokens": 1}, "prompt[1]", "greater than or equal to 0")
    refused("/v1/completions", {"prompt": [10 ** 6], "max_tokens": 1}, "prompt", "out of vocabulary")
    for path, base in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions/batch", {"messages": [msgs]})):
        refused(path, {**base, "logprob_token_ids": []}, "logprob_token_ids", "must not be an empty list")
        refused(path, {**base, "logprob_token_ids": [7]}, "logprob_token_ids", "when using `logprob_token_ids`")
        refused(path, {**base, "response_format": {"type": "json_schema"}}, "response_format.json_schema",
                "must be provided")
        refused(path, {**base, "kv_transfer_params": {"return_last_hidden_state": True}}, "kv_transfer_params",
                "return_last_hidden_state")
    # a KV connector's parameters mean nothing without one: ignored, as vLLM ignores them
    ok = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": False}})
    assert ok.status_code == 200


def test_a_stream_carries_no_prompt_logprobs(srv):
    """vLLM refuses prompt_logprobs above 0 (or -1, the whole vocabulary) on a stream; 0, the prompt
    tokens' own logprobs without alternatives, and echo with logprobs still stream."""
    msgs = [{"role": "user", "content": "Hi"}]
    for path, base in (("/v1/completions", {"prompt": "Hi there"}), ("/v1/chat/completions", {"messages": msgs})):
        for k in (1, 5, -1):
            r = post(srv, path, {**base, "max_tokens": 2, "stream": True, "prompt_logprobs": k})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "prompt_logprobs"
            assert "not available when `stream=True`" in err["message"]
        assert events(srv, path, {**base, "max_tokens": 2, "prompt_logprobs": 0})
        assert post(srv, path, {**base, "max_tokens": 2, "prompt_logprobs": 1}).status_code == 200
    chunks = events(srv, "/v1/completions", {"prompt": "Hi there", "max_tokens": 2, "echo": True, "logprobs": 1})
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the echoed prompt's first token


def test_a_failed_request_says_internal_server_error(srv, monkeypatch):
    """A request the engine fails is a 500 (not streamed) or an error event before [DONE]
    (streamed) whose message starts "Internal server error", as vLLM's."""
    eng = srv["engine"]
    real = eng.runner.execute
    poison = eng.tokenizer("POISON PILL").input_ids

    def execute(out):
        if any(list(d.prompt_token_ids) == poison for d in out.scheduled_new_reqs):
            raise RuntimeError("kernel failure on this request")
        return real(out)
    monkeypatch.setattr(eng.runner, "execute", execute)
    r = post(srv, "/v1/completions", {"prompt": "POISON PILL", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("Internal server error")
    with httpx.stream("POST", srv["url"] + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "POISON PILL", "max_tokens": 2, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["message"].startswith("Internal server error")


PART_FIELDS_TEMPLATE = ("{% for m in messages %}{% for p in m['content'] %}"
                        "[{{ p['source_lang_code'] }}>{{ p['target_lang_code'] }}]{{ p['text'] }}"
                        "{% endfor %}|{% endfor %}")


def test_content_part_fields_reach_the_template(tmp_path):
    """--chat-template-content-format openai: a content part reaches the chat template as sent,
    with fields beyond type and text (a translation template's language codes), one part each."""
    from engine.server.cli import add_serve_args, build_app
    path = tmp_path / "langs.jinja"
    path.write_text(PART_FIELDS_TEMPLATE)
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers())
    app = build_app(parser.parse_args(["serve", MODEL, "--device", "cpu", "--max-model-len", "256",
                                       "--num-gpu-blocks", "32", "--chat-template", str(path),
                                       "--chat-template-content-format", "openai"]))
    tok = app.state.context.engine.tokenizer
    parts = [{"type": "text", "text": "The fox.", "source_lang_code": "en", "target_lang_code": "es"},
             {"type": "text", "text": " The dog.", "source_lang_code": "en", "target_lang_code": "de"}]
    port = _free_port()
    with _Server(app, port):
        r = httpx.post(f"http://127.0.0.1:{port}/tokenize", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": parts}], "add_generation_prompt": False})
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert r.status_code == 200 and chat.status_code == 200, (r.text, chat.text)
    want = "[en>es]The fox.[en>de] The dog.|"
    assert r.json()["tokens"] == tok(want, add_special_tokens=False).input_ids
    assert chat.json()["usage"]["prompt_tokens"] == len(r.json()["tokens"])


def test_a_batch_refuses_one_pre_tokenized_prompt_for_several_conversations(srv):
    """kv_transfer_params.prompt_token_ids is one prompt's tokens: with several conversations in a
    batch it cannot stand for each of them, so the batch is a 400 naming that field."""
    convs = [[{"role": "user", "content": "first"}], [{"role": "user", "content": "second"}]]
    r = post(srv, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 1,
                                                 "kv_transfer_params": {"prompt_token_ids": [10, 20, 30]}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"
    ok = post(srv, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_prefill": False}})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text


def serve_parser() -> argparse.ArgumentParser:
    from engine.server.cli import add_serve_args
    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers())
    return parser


def test_config_file_gives_flags_the_command_line_overrides(tmp_path):
    """--config FILE (YAML, dashes or underscores): its flags apply, parsed as on the command line
    (an int port, a boolean pair, a list of names); a flag on the command line wins whether it
    stands before or after --config; an unknown name or a missing file stops the parse."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 12312\nenable_prefix_caching: false\nserved-model-name: [first, second]\n")
    parser = serve_parser()
    assert parser.parse_args(["serve"]).port == 8000
    a = parser.parse_args(["serve", "--config", str(cfg)])
    assert (a.port, a.enable_prefix_caching, a.served_model_name) == (12312, False, ["first", "second"])
    assert parser.parse_args(["serve", "--config", str(cfg), "--port", "9000"]).port == 9000
    assert parser.parse_args(["serve", "--port", "9000", "--config", str(cfg)]).port == 9000
    (tmp_path / "bad.yaml").write_text("no_such_flag: 1\n")
    for path in (tmp_path / "bad.yaml", tmp_path / "missing.yaml"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--config", str(path)])


def test_chat_template_flag_refuses_a_missing_path_but_takes_a_template(tmp_path):
    """--chat-template: a file is read; a string with Jinja's characters is the template itself;
    a string without them that cannot be opened is a mistyped path, refused rather than served
    as a template that would print itself."""
    from engine.server.cli import read_chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(SystemExit, match="looks like a file path"):
        read_chat_template("does/not/exist")


async def stamp_header(request, call_next):
    """A --middleware function for the test below."""
    response = await call_next(request)
    response.headers["x-stamped"] = "yes"
    return response


def test_middleware_flag_adds_a_function_or_refuses_a_bad_name():
    """--middleware MODULE.NAME: an async (request, call_next) function wraps every response; a
    name that cannot be imported, or is neither a class nor an async function, stops the server."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from engine.server.cli import add_middleware
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    add_middleware(app, "tests.test_server_vllm_behaviours.stamp_header")
    assert TestClient(app).get("/ping").headers["x-stamped"] == "yes"
    assert serve_parser().parse_args(["serve", "--middleware", "a.b", "--middleware", "c.d"]).middleware == ["a.b", "c.d"]
    for bad in ("no_such_module.thing", "tests.test_server_vllm_behaviours.MODEL"):
        with pytest.raises(SystemExit, match="--middleware"):
            add_middleware(FastAPI(), bad)


def test_lora_flags_start_and_extra_api_servers_are_refused():
    """vLLM's LoRA flags parse (adapters are not loaded: a request naming one is an unknown model),
    and --api-server-count above 1 is refused before any model loads."""
    from engine.server.cli import build_app
    parser = serve_parser()
    a = parser.parse_args(["serve", "--enable-lora", "--lora-modules", "adapter=/some/dir", "--max-lora-rank", "64",
                           "--max-cpu-loras", "2", "--api-server-count", "1"])
    assert a.enable_lora and a.lora_modules == ["adapter=/some/dir"] and a.api_server_count == 1
    with pytest.raises(SystemExit, match="api-server-count=2"):
        build_app(parser.parse_args(["serve", MODEL, "--device", "cpu", "--api-server-count", "2"]))


def test_a_unix_socket_server_sleeps_and_wakes(tmp_path):
    """`servetwin serve --uds PATH --enable-sleep-mode` with VLLM_SERVER_DEV_MODE=1, as vLLM's
    tests start it: it answers on the socket; POST /sleep pauses the engine (a request sent while
    asleep waits, then finishes after /wake_up); /is_sleeping says which; a level other than 1 or
    2 is a 400. A hub --revision is accepted and named in the log as ignored."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from tests.test_server_schema import TINY
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    sock = tmp_path / "serve.sock"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scenarios.cli", "serve", f"random:{cfg}", "--device", "cpu",
                                 "--uds", str(sock), "--enable-sleep-mode", "--revision", "abc123", "--threads", "1",
                                 "--max-model-len", "128", "--num-gpu-blocks", "64"],
                                env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=log)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://servetwin", timeout=60)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        assert client.post("/sleep", data={"level": "1"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        answer = {}
        asleep = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})))
        asleep.start()
        asleep.join(1.5)
        assert asleep.is_alive() and not answer  # no step runs while asleep
        assert client.post("/wake_up").status_code == 200
        asleep.join(60)
        assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 3
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        r = client.post("/sleep", params={"level": "3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "level"
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    finally:
        proc.terminate()
        proc.wait(30)
        client.close()
    assert "--revision abc123 ignored" in log_path.read_text()


def test_sleep_routes_exist_in_development_mode_only(srv):
    assert httpx.post(srv["url"] + "/sleep").status_code == 404
    assert httpx.get(srv["url"] + "/is_sleeping").status_code == 404


def test_a_predicted_output_is_a_hint_that_changes_nothing(srv):
    """OpenAI's `prediction` (predicted output, a speed hint) is ignored as vLLM ignores it: the
    greedy answer is the same with and without it; `functions` still changes what a model may do
    and stays refused."""
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    plain = post(srv, "/v1/chat/completions", body)
    hinted = post(srv, "/v1/chat/completions", {**body, "prediction": {"type": "content", "content": "hi"}})
    assert plain.status_code == hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    r = post(srv, "/v1/chat/completions", {**body, "functions": [{"name": "f", "parameters": {}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions"

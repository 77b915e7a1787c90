"""vLLM entrypoint behaviours that vLLM's own tests of its OpenAI server check (issue 38): a
reasoning parser (message.reasoning, thinking_token_budget, reasoning_tokens), per-request
metrics, a request's own chat template, decode-side token reuse (kv_transfer_params), prompt
tokens written to the prefix cache, streamed token ids of text held back, and the Decisions API."""
from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.sampler import Row, Sampler, forced_thinking_token
from engine.server.app import create_app
from engine.server.protocol import APIError, ChatCompletionRequest, template_kwargs
from engine.server.reasoning import ReasoningParser
from tests.test_server import MODEL, _free_port, _Server

SPACE = 216  # SmolLM2's token for " ": the end marker of the parser below, so its split is checkable


@pytest.fixture(scope="module")
def srv():
    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=256, max_num_seqs=8,
                       num_gpu_blocks=128, max_model_len=512)
    # deepseek_r1 with " " as its end marker: a reply's first word is its reasoning, the rest its
    # content (SmolLM2 writes no <think>): real text through the parser, with a known answer
    parser = ReasoningParser.build("deepseek_r1", {"reasoning_end_str": " "}, engine.tokenizer)
    assert parser.end_ids == (SPACE,) and parser.start_ids == tuple(engine.tokenizer.encode("<think>", add_special_tokens=False))
    app = create_app(engine, model_name=MODEL, per_request_metrics=True, trust_request_chat_template=True,
                     reasoning=parser, prompt_tokens_details=True)
    port = _free_port()
    with _Server(app, port):
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine}


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv["url"] + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)


def events(srv, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", srv["url"] + "/v1/chat/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name, text, final, expected", [
    ("qwen3", "<think>a b</think>answer", True, ("a b", "answer", 0)),
    ("qwen3", "a b</think>answer", True, ("a b", "answer", 0)),      # the start marker in the prompt
    ("qwen3", "plain answer", True, (None, "plain answer", 0)),        # thinking off
    ("qwen3", "<think>cut short", True, ("cut short", None, 0)),
    ("qwen3", "<thi", False, (None, None, 4)),                         # may still open with <think>
    ("qwen3", "<think>ab</thi", False, ("ab", None, 5)),               # may be closing
    ("deepseek_r1", "plain answer", True, ("plain answer", None, 0)),  # no end yet: all reasoning
    ("deepseek_r1", "a</think>", True, ("a", None, 0)),
])
def test_think_tag_parsers_split_a_reply(name, text, final, expected):
    assert ReasoningParser(name).split(text, final) == expected


def test_a_reply_is_split_into_reasoning_and_content(srv):
    """Non-streamed and streamed, the reply's text up to the end marker is message.reasoning and
    the rest message.content; include_reasoning false drops the reasoning only; usage counts the
    reasoning's tokens."""
    tok = srv["engine"].tokenizer
    body = {"messages": chat("Say hello in French."), "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    r = post(srv, body).json()
    raw = tok.decode(r["choices"][0]["token_ids"])
    thought, _, answer = raw.partition(" ")
    assert " " in raw, raw  # the reply has a space: both parts are exercised
    msg = r["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == (thought or None, answer or None)
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(tok.encode(thought))
    chunks = events(srv, {**body, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert chunks[-1]["usage"]["completion_tokens_details"] == r["usage"]["completion_tokens_details"]
    hidden = post(srv, {**body, "include_reasoning": False}).json()["choices"][0]["message"]
    assert hidden["reasoning"] is None and hidden["content"] == msg["content"]
    quiet = events(srv, {**body, "include_reasoning": False})
    assert not any(c["choices"][0]["delta"].get("reasoning") for c in quiet if c["choices"])


def test_the_thinking_token_budget_forces_the_end_marker(srv):
    """The prompt opens the reasoning (its last <think>); with a budget of 2 the end marker is
    the third generated token at the latest."""
    r = post(srv, {"messages": chat("Count from one to ten.\n<think>"), "max_tokens": 8, "temperature": 0,
                   "return_token_ids": True, "ignore_eos": True, "thinking_token_budget": 2}).json()
    assert SPACE in r["choices"][0]["token_ids"][:3], r
    for bad in (-2, 1.5, True):
        e = post(srv, {"messages": chat("hi"), "thinking_token_budget": bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == "thinking_token_budget"


def test_a_spent_budget_leaves_only_the_end_markers_tokens():
    """forced_thinking_token: after the last start marker (prompt or output), `budget` free
    tokens, then the end marker's tokens one at a time, then nothing."""
    sp = SamplingParams(thinking_token_budget=3, reasoning_start_ids=(1, 2), reasoning_end_ids=(7, 8))
    prompt = (5, 1, 2)
    assert forced_thinking_token(Row(sp, prompt, (9, 9))) is None
    assert forced_thinking_token(Row(sp, prompt, (9, 9, 9))) == 7
    assert forced_thinking_token(Row(sp, prompt, (9, 9, 9, 7))) == 8
    assert forced_thinking_token(Row(sp, prompt, (9, 9, 9, 7, 8))) is None   # the reasoning ended
    assert forced_thinking_token(Row(sp, (5,), (9, 9, 9, 9))) is None        # no reasoning opened
    assert forced_thinking_token(Row(sp, (5,), (1, 2, 9, 9, 9))) == 7        # opened in the output
    logits = torch.randn(1, 16)
    assert Sampler()(logits, [Row(SamplingParams(temperature=1.0, thinking_token_budget=0,
                                                 reasoning_start_ids=(1,), reasoning_end_ids=(11,)), (1,))]) == [11]
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=2)  # no markers to count from


def test_per_request_metrics_describe_the_request(srv):
    """--enable-per-request-metrics: vLLM's timings on a single answer; on a stream, only on its
    usage chunk, without mean ITL for a one-token reply."""
    r = post(srv, {"messages": chat("Count to four."), "max_tokens": 4, "min_tokens": 4, "temperature": 0}).json()
    m = r["metrics"]
    assert set(m) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second"} and all(v >= 0 for v in m.values())
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 3)
    chunks = events(srv, {"messages": chat("Say hello."), "max_tokens": 1, "min_tokens": 1,
                          "stream_options": {"include_usage": True}})
    assert all("metrics" not in c for c in chunks[:-1])
    last = chunks[-1]["metrics"]
    assert last["time_to_first_token_ms"] >= 0 and "mean_itl_ms" not in last
    n2 = post(srv, {"messages": chat("hi"), "max_tokens": 2, "n": 2}).json()
    assert "metrics" not in n2  # several generations: none is the request's


def test_a_requests_own_chat_template(srv):
    """With --trust-request-chat-template the request's template renders the prompt; without it
    the request is refused in vLLM's words."""
    tok = srv["engine"].tokenizer
    r = post(srv, {"messages": chat("hello there"), "max_tokens": 2, "return_token_ids": True,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}).json()
    assert r["prompt_token_ids"] == tok.encode("hello there", add_special_tokens=False)
    req = ChatCompletionRequest.model_validate({"messages": chat("x"), "chat_template": "{{ 1 }}"})
    with pytest.raises(APIError, match="--trust-request-chat-template is not set"):
        template_kwargs(req, trust_request_chat_template=False)


def test_forwarded_prompt_ids_are_generated_from_as_they_are(srv):
    """vLLM's decode-side reuse: kv_transfer_params.prompt_token_ids stand in for the messages
    (not with echo); malformed ids are a 400 naming the field."""
    base = post(srv, {"messages": chat("What is 2+2?"), "max_tokens": 4, "temperature": 0,
                      "return_token_ids": True}).json()
    body = {"messages": chat("Something else entirely."), "max_tokens": 4, "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": {"prompt_token_ids": base["prompt_token_ids"]}}
    reused = post(srv, body).json()
    assert reused["prompt_token_ids"] == base["prompt_token_ids"]
    first = [c for c in events(srv, body) if c["choices"]][0]
    assert first["prompt_token_ids"] == base["prompt_token_ids"]
    echoed = post(srv, {**body, "echo": True}).json()
    assert echoed["prompt_token_ids"] != base["prompt_token_ids"]  # echo needs the messages templated
    for bad in ([], [-1], "12", [1.5]):
        e = post(srv, {**body, "kv_transfer_params": {"prompt_token_ids": bad}})
        assert e.status_code == 400 and e.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"


def test_streamed_token_ids_include_those_whose_text_is_held_back(srv):
    """With return_token_ids every token's id is streamed, also while its text waits for the
    rest of a character (an emoji is several byte tokens): the chunks' ids add up to the answer's."""
    body = {"messages": chat("Write a cat emoji:"), "max_tokens": 20, "temperature": 0, "return_token_ids": True,
            "include_reasoning": False}
    whole = post(srv, body).json()["choices"][0]["token_ids"]
    chunks = [c for c in events(srv, body) if c["choices"]]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert streamed == whole and len(whole) == 20


def test_created_cache_tokens_count_the_blocks_a_request_wrote(srv):
    """usage.prompt_tokens_details: cached_tokens read from the prefix cache, created_cache_tokens
    the rest of the prompt's full blocks; a batch of two counts both conversations."""
    bs = srv["engine"].block_size
    msgs = chat("A preamble long enough to fill a few blocks of the cache. " * 3)
    first = post(srv, {"messages": msgs, "max_tokens": 1}).json()["usage"]
    again = post(srv, {"messages": msgs, "max_tokens": 1}).json()["usage"]
    n = first["prompt_tokens"]
    for u in (first, again):  # (the chat template's system prompt may be cached from earlier requests)
        d = u["prompt_tokens_details"]
        assert d["created_cache_tokens"] == n // bs * bs - d["cached_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (n - 1) // bs * bs
    assert first["prompt_tokens_details"]["cached_tokens"] < (n - 1) // bs * bs
    batch = httpx.post(srv["url"] + "/v1/chat/completions/batch",
                       json={"model": MODEL, "messages": [msgs, msgs], "max_tokens": 1}, timeout=120).json()["usage"]
    assert batch["prompt_tokens_details"] == {k: 2 * v for k, v in again["prompt_tokens_details"].items()}


def test_decisions_are_the_option_letters_next_token_probabilities(srv):
    """vLLM's POST /v1/decisions: a choice's probabilities are the softmax of its option letters'
    log-probabilities as the reply's first token, the same as /v1/completions reports for that
    prompt; a predicate is false/true, a score the expected level; one token per question."""
    tok = srv["engine"].tokenizer
    choice = {"type": "choice", "name": "dept", "instructions": "Which department should handle it?",
              "choices": [{"value": "returns"}, {"value": "billing", "description": "money matters"}]}
    body = {"model": MODEL, "input": "The package arrived with a broken screen.",
            "questions": [choice, {"type": "predicate", "instructions": "Is the screen broken?"},
                          {"type": "score", "instructions": "Rate the damage.",
                           "levels": [{"label": "none"}, {"label": "some"}, {"label": "total"}]}]}
    r = httpx.post(srv["url"] + "/v1/decisions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    content = ("The package arrived with a broken screen.\n\nQuestion: Which department should handle it?\n"
               'A: "returns"\nB: "billing" - money matters\nAnswer with the letter of one option only.')
    ids = httpx.post(srv["url"] + "/tokenize", json={"model": MODEL, "messages": chat(content)},
                     timeout=60).json()["tokens"]
    a, b = tok.convert_tokens_to_ids(["A", "B"])
    lp = httpx.post(srv["url"] + "/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 2,
        "logprob_token_ids": [a, b]}, timeout=60).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    za, zb = math.exp(lp["A"]), math.exp(lp["B"])
    dept, pred, score = got["answers"]
    assert [p["probability"] for p in dept["probabilities"]] == pytest.approx([za / (za + zb), zb / (za + zb)], abs=1e-4)
    assert dept["choice"] == ("returns" if za >= zb else "billing") and dept["name"] == "dept"
    assert dept["confidence"] == pytest.approx(max(za, zb), abs=1e-4)
    assert pred["name"] is None and 0 <= pred["probability"] <= 1
    assert score["score"] == pytest.approx(sum(p["value"] * p["probability"] for p in score["probabilities"]))
    assert got["usage"]["output_tokens"] == 3
    assert got["usage"]["total_tokens"] == got["usage"]["input_tokens"] + 3
    image = {**body, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}
    e = httpx.post(srv["url"] + "/v1/decisions", json=image, timeout=60)
    assert e.status_code == 400 and "text input only" in e.json()["error"]["message"]
    same = {**body, "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "x"}, {"value": "x"}]}]}
    assert httpx.post(srv["url"] + "/v1/decisions", json=same, timeout=60).status_code == 400


def test_an_assistant_messages_reasoning_reaches_the_template(srv):
    """vLLM hands an assistant message's `reasoning` (or `reasoning_content`) to the chat template;
    anything but text (or, on a server started with --enable-prompt-embeds, a well-formed
    prompt_embeds part) there is a 400 naming the field."""
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content') or '' }}|"
                "{{ m['content'] }}\n{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning": "thought"}]
    r = post(srv, {"messages": msgs, "max_tokens": 1, "return_token_ids": True, "chat_template": template}).json()
    tok = srv["engine"].tokenizer
    assert tok.decode(r["prompt_token_ids"]) == "user:|hi\nassistant:thought|ok\n"
    for bad in ({"type": "prompt_embeds"}, {"type": "prompt_embeds", "data": ""}, 3):
        e = post(srv, {"messages": [{"role": "assistant", "reasoning": bad, "content": ""}], "chat_template": template})
        assert e.status_code == 400 and e.json()["error"]["param"].startswith("messages[0].reasoning")

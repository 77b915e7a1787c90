"""Prompt embeddings (vLLM's --enable-prompt-embeds, issue 38): prompts, or parts of chat messages,
given as vectors instead of text. The independent expectation: a prompt given as the model's own
embeddings of some tokens is the same prompt as those tokens, so greedy decoding gives the same
tokens, through the engine and through the server's completions and chat routes."""
from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.prompt_embeds import PromptEmbeds, load_prompt_embeds
from engine.server.app import create_app
from tests.test_server import MODEL, _free_port, _Server, _settles

TEXT = "The capital of France is a city that"
OTHER = "My favourite animal is a small cat which"  # other tokens, used for the cache-salt check


def encode(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=128, max_num_seqs=8,
                     num_gpu_blocks=160, max_model_len=512)


def token_embeds(engine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.model.model.embed_tokens(torch.tensor(ids)).float().clone()


@pytest.fixture(scope="module")
def srv(engine):
    app = create_app(engine, model_name=MODEL, enable_prompt_embeds=True, trust_request_chat_template=True)
    port = _free_port()
    with _Server(app, port):
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine}


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv["url"] + path, json={"model": MODEL, **body}, timeout=120)


def run(engine, rid: str, ids: list[int], pe: PromptEmbeds | None = None, max_tokens: int = 8):
    engine.add_tokenized_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 prompt_embeds=pe)
    done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                done = o
    return done.outputs[0].token_ids


def test_engine_embeddings_of_tokens_generate_as_the_tokens(engine):
    ids = engine.tokenizer(TEXT).input_ids
    expected = run(engine, "ids", ids)
    emb = token_embeds(engine, ids)
    assert run(engine, "all", [0] * len(ids), PromptEmbeds.from_spans([(0, emb)])) == expected
    # some positions as vectors, the others as ids (their placeholder ids ignored)
    mixed = ids[:2] + [0] * 3 + ids[5:7] + [0] * (len(ids) - 7)
    assert run(engine, "mixed", mixed, PromptEmbeds.from_spans([(2, emb[2:5]), (7, emb[7:])])) == expected
    # zero vectors are another prompt: the placeholders' embeddings are really replaced
    assert run(engine, "zeros", [0] * len(ids), PromptEmbeds.from_spans([(0, emb * 0)])) != expected
    assert engine.runner.embeds.keys() <= {"zeros"}  # dropped once the scheduler reports them finished


def test_engine_prefix_cache_keeps_apart_prompts_of_equal_placeholders(engine):
    """Two prompts given wholly as vectors have equal token lists (all placeholders): only their
    cache salts (a digest of the vectors) keep the second from reading the first's KV blocks."""
    a, b = engine.tokenizer(TEXT).input_ids, engine.tokenizer(OTHER).input_ids
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    want_a, want_b = run(engine, "ta", a), run(engine, "tb", b)
    assert want_a != want_b
    pa = PromptEmbeds.from_spans([(0, token_embeds(engine, a))])
    pb = PromptEmbeds.from_spans([(0, token_embeds(engine, b))])
    assert run(engine, "ea", [0] * n, pa) == want_a
    assert run(engine, "eb", [0] * n, pb) == want_b
    # the same vectors again do hit the cache (the salt is a digest of the content)
    engine.add_tokenized_request("ea2", [0] * n, SamplingParams(max_tokens=2, temperature=0.0), prompt_embeds=pa)
    engine.step()
    assert engine.request_records["ea2"].num_cached_tokens == n // engine.block_size * engine.block_size
    while engine.has_unfinished_requests():
        engine.step()


def test_engine_refuses_embeddings_that_do_not_fit(engine):
    ids = engine.tokenizer(TEXT).input_ids
    emb = token_embeds(engine, ids)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="hidden_size"):
        engine.add_tokenized_request("bad1", ids, sp, prompt_embeds=PromptEmbeds.from_spans([(0, emb[:, :10])]))
    with pytest.raises(ValueError, match="outside the prompt"):
        engine.add_tokenized_request("bad2", ids[:3], sp, prompt_embeds=PromptEmbeds.from_spans([(0, emb)]))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_tokenized_request("bad3", ids, SamplingParams(max_tokens=2, prompt_logprobs=1),
                                     prompt_embeds=PromptEmbeds.from_spans([(0, emb)]))
    assert not engine.has_unfinished_requests()


def test_load_prompt_embeds_checks_the_payload():
    t = torch.randn(3, 8)
    assert torch.equal(load_prompt_embeds(encode(t.unsqueeze(0)), 8, torch.float32, "f"), t)
    assert load_prompt_embeds(encode(t.half()), 8, torch.float32, "f").dtype == torch.float32
    cases = [("not base64!!", "not valid base64"), ("", "non-empty"),
             (base64.b64encode(b"not a tensor file").decode(), "could not be read"),
             (encode(torch.randn(3, 7)), "hidden_size 7 does not match the model's hidden_size 8"),
             (encode(torch.randn(2, 3, 8)), "2D tensor"),
             (encode(torch.ones(3, 8, dtype=torch.int64)), "not a floating-point"),
             (encode(torch.full((3, 8), float("nan"))), "NaN"),
             (encode(torch.randn(0, 8)), "no rows")]
    for payload, why in cases:
        with pytest.raises(ValueError, match=why) as e:
            load_prompt_embeds(payload, 8, torch.float32, "prompt_embeds[1]")
        assert str(e.value).startswith("prompt_embeds[1]:")


def test_completions_prompt_embeds_as_vllm_serves_them(srv):
    engine = srv["engine"]
    ids = engine.tokenizer(TEXT).input_ids
    emb = encode(token_embeds(engine, ids))
    text = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    got = post(srv, "/v1/completions", {"prompt": None, "prompt_embeds": emb, "max_tokens": 8, "temperature": 0})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["choices"][0]["text"] == text["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    # a list of them, and a text prompt beside: the vectors' choices first (vLLM's order)
    both = post(srv, "/v1/completions", {"prompt": "Hello", "prompt_embeds": [emb, emb], "max_tokens": 8,
                                         "temperature": 0, "logprobs": 2}).json()
    hello = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
    assert [c["text"] for c in both["choices"]] == [text["choices"][0]["text"]] * 2 + [hello["choices"][0]["text"]]
    assert len(both["choices"][0]["logprobs"]["tokens"]) == 8
    # return_token_ids: a prompt given wholly as vectors has no token ids (vLLM's null)
    ids_back = post(srv, "/v1/completions", {"prompt": "Hello", "prompt_embeds": emb, "max_tokens": 1,
                                             "return_token_ids": True}).json()["choices"]
    assert [c["prompt_token_ids"] for c in ids_back] == [None, engine.tokenizer("Hello").input_ids]
    # streamed, the same text
    with httpx.stream("POST", srv["url"] + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt_embeds": emb, "max_tokens": 8, "temperature": 0,
                            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text["choices"][0]["text"]
    # an empty list is no prompt: the text prompt alone
    alone = post(srv, "/v1/completions", {"prompt": "Hello", "prompt_embeds": [], "max_tokens": 8,
                                          "temperature": 0}).json()
    assert [c["text"] for c in alone["choices"]] == [hello["choices"][0]["text"]]


def test_completions_prompt_embeds_errors_name_the_field(srv):
    engine = srv["engine"]
    emb = encode(token_embeds(engine, engine.tokenizer(TEXT).input_ids))
    cases = [({"prompt_embeds": "invalid_base64"}, "prompt_embeds", "base64"),
             ({"prompt_embeds": [emb, encode(torch.randn(4, 9))]}, "prompt_embeds[1]", "hidden_size 9"),
             ({"prompt_embeds": encode(torch.full((4, 576), float("inf")))}, "prompt_embeds", "infinite"),
             ({"prompt_embeds": emb, "echo": True}, "echo", "Echo is unsupported"),
             ({"prompt_embeds": emb, "prompt_logprobs": 1}, "prompt_logprobs", "not compatible"),
             ({"prompt_embeds": [emb, 3]}, "prompt_embeds[1]", "base64 string"),
             ({"prompt": None, "prompt_embeds": []}, "prompt", "Either prompt or prompt_embeds")]
    for body, field, words in cases:
        r = post(srv, "/v1/completions", {"max_tokens": 2, **body})
        assert r.status_code == 400, (body.keys(), r.text)
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], err
    assert _settles(engine)


def chat_text(srv, messages, **kw) -> dict:
    r = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_prompt_embeds_parts_stand_for_the_tokens_they_embed(srv):
    engine = srv["engine"]
    content = "Hello, my name is"
    emb = encode(token_embeds(engine, engine.tokenizer(content, add_special_tokens=False).input_ids))
    text = chat_text(srv, [{"role": "user", "content": content}])
    part = {"type": "prompt_embeds", "data": emb}
    embedded = chat_text(srv, [{"role": "user", "content": [part]}])
    assert embedded["choices"][0]["message"]["content"] == text["choices"][0]["message"]["content"]
    assert embedded["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"]
    # between text parts, in two messages; at boundaries where the whole text tokenizes as its pieces
    tok = engine.tokenizer
    pieces = ["Say:\n", content, "\n"]
    assert tok("".join(pieces)).input_ids == sum((tok(p).input_ids for p in pieces), [])
    split = chat_text(srv, [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                            {"role": "user", "content": [{"type": "text", "text": pieces[0]}, part,
                                                         {"type": "text", "text": pieces[2]}]}])
    same = chat_text(srv, [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "".join(pieces)}])
    assert split["choices"][0]["message"]["content"] == same["choices"][0]["message"]["content"]
    # an assistant's earlier reasoning given as vectors, through a request's template that renders it
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.get('reasoning') %}"
                "{{ '<think>' + m['reasoning'] + '</think>' }}{% endif %}{{ m['content'] }}{{ '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    conv = [{"role": "assistant", "content": "", "reasoning": content}, {"role": "user", "content": "Go on."}]
    want = chat_text(srv, conv, chat_template=template)
    conv[0]["reasoning"] = part
    got = chat_text(srv, conv, chat_template=template)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def test_chat_prompt_embeds_errors(srv):
    cases = [([{"type": "prompt_embeds"}], "messages[0].content[0].data"),
             ([{"type": "prompt_embeds", "data": "not_valid_base64!!"}], "messages[0].content[0]"),
             ([{"type": "prompt_embeds", "data": encode(torch.randn(2, 5))}], "messages[0].content[0]")]
    for content, field in cases:
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    assert _settles(srv["engine"])


def test_prompt_embeds_need_the_flag(engine):
    app = create_app(engine, model_name=MODEL)  # no --enable-prompt-embeds
    port = _free_port()
    emb = encode(torch.randn(3, engine.model.config.hidden_size))
    with _Server(app, port):
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt_embeds": emb, "max_tokens": 2})
        assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "prompt_embeds", "data": emb}]}]})
        assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]


def test_offline_generate_takes_prompt_embeds():
    from engine.llm_engine import LLM
    llm = LLM(model=MODEL, device="cpu", max_num_batched_tokens=128, max_num_seqs=4, num_gpu_blocks=64,
              max_model_len=256)
    ids = llm.get_tokenizer()(TEXT).input_ids
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    emb = token_embeds(llm.llm_engine, ids)
    by_ids, by_vectors = llm.generate([ids, {"prompt_embeds": emb}], sp)
    assert by_vectors.outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_embeds"):
        llm.generate([{"prompt_embeds": emb[0]}], sp)


def test_preempted_requests_recompute_from_their_vectors():
    """A pool too small for three requests at once preempts them (recompute): a resumed request's
    prompt is computed again from its vectors. Given as the tokens' own embeddings, the requests
    schedule exactly as the same prompts given as ids, so their greedy tokens are equal."""
    eng = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=13,
                    max_model_len=192)
    texts = [TEXT, OTHER, "Water boils at a temperature that depends on"]
    prompts = [eng.tokenizer(t).input_ids for t in texts]
    sp = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)  # 3 x ~100 tokens > 12 x 16

    def serve(vectors: bool) -> tuple[list[list[int]], int]:
        for i, ids in enumerate(prompts):
            pe = PromptEmbeds.from_spans([(0, token_embeds(eng, ids))]) if vectors else None
            eng.add_tokenized_request(f"{vectors}-{i}", [0] * len(ids) if vectors else ids, sp, prompt_embeds=pe)
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
        preempted = sum(eng.request_records[f"{vectors}-{i}"].num_preemptions for i in range(len(prompts)))
        return [out[f"{vectors}-{i}"] for i in range(len(prompts))], preempted

    by_ids, preempted_ids = serve(False)
    eng.reset_prefix_cache()
    by_vectors, preempted_vectors = serve(True)
    assert preempted_vectors > 0 and preempted_vectors == preempted_ids
    assert by_vectors == by_ids


def test_split_markers_tokenizes_as_the_whole_text_with_its_special_tokens_once():
    """Pieces between prompt_embeds markers are tokenized apart; the tokenizer's own special tokens
    (a BOS here) wrap the whole prompt once, also when the prompt starts with a marker."""
    from engine.server.context import split_markers
    from engine.server.protocol import EmbedSlots

    class BosTokenizer:  # one id per character, BOS (1) first, as a Llama tokenizer adds it
        def __call__(self, text, add_special_tokens=True):
            class R:
                input_ids = ([1] if add_special_tokens else []) + [100 + ord(c) for c in text]
            return R()

    slots = EmbedSlots()
    m0, m1 = slots.marker("a", "x"), slots.marker("b", "y")
    tok = BosTokenizer()
    text, ids, spans = split_markers(tok, m0 + "hi" + m1 + "!", slots, add_special_tokens=True)
    assert text == "hi!"
    assert ids == [1, 0, 100 + ord("h"), 100 + ord("i"), 0, 100 + ord("!")] and spans == [(1, 0), (4, 1)]
    text, ids, spans = split_markers(tok, "hi" + m1, slots, add_special_tokens=False)  # m0 dropped by the template
    assert ids == [100 + ord("h"), 100 + ord("i"), 0] and spans == [(2, 1)]

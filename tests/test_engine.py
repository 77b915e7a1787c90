"""The real engine end to end on the default model (CPU, fp32): greedy outputs token-identical to
transformers generate() under chunked prefill, preemption, prefix caching and abort; the step log;
chat; request validation."""
from __future__ import annotations

import pytest

import torch  # noqa: E402  (make test installs it)
import transformers  # noqa: E402  (make test installs it)

from engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from engine.model.loader import resolve_model  # noqa: E402

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves the "
    "green pigment chlorophyll and generates oxygen as a byproduct. The light reactions take place in "
    "the thylakoid membranes, while the Calvin cycle runs in the stroma. Summarise the two stages of "
    "photosynthesis in simple words:",
    "Q: What is 12 times 12?\nA:",
]

SHARED = ("You are a careful assistant. Answer every question in one short sentence, without "
          "repeating the question, and never use more than twenty words. Be precise and friendly. ")
SHARED_PROMPTS = [SHARED + "Question: why is the sky blue?",
                  SHARED + "Question: what do bees make?",
                  SHARED + "Question: how many legs does a spider have?"]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(resolve_model("default")), local_files_only=True)


@pytest.fixture(scope="module")
def hf_greedy():
    """prompt ids (tuple) -> transformers greedy continuation (each prompt alone, no padding)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model("default")), dtype=torch.float32, local_files_only=True).eval()
    cache: dict[tuple, list[int]] = {}

    def ref(ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(ids), max_tokens)
        if key not in cache:
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=2)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return ref


def engine(**kw) -> LLMEngine:
    base = dict(max_num_batched_tokens=512, max_num_seqs=16, block_size=16, num_gpu_blocks=256)
    base.update(kw)
    return LLMEngine(model="default", device="cpu", **base)


def run_all(eng: LLMEngine, prompts: list[list[int]], params=GREEDY, on_step=None) -> dict[str, object]:
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if on_step is not None:
            on_step(eng)
    return done


def assert_matches_hf(done, prompts, hf_greedy, skip=()):
    for i, ids in enumerate(prompts):
        if str(i) in skip:
            continue
        got = done[str(i)].outputs[0].token_ids
        assert got == hf_greedy(ids), f"prompt {i}: engine {got} != transformers {hf_greedy(ids)}"


def test_generate_matches_transformers(tokenizer, hf_greedy):
    """The public LLM.generate path on a batch of prompts of different lengths (strings and ids)."""
    llm = LLM(model="default", device="cpu", max_num_batched_tokens=2048, max_num_seqs=128,
              block_size=16, num_gpu_blocks=None, enable_prefix_caching=True)
    eng = llm.llm_engine
    assert eng.num_gpu_blocks >= 2 and eng.max_model_len == 8192
    assert eng.memory_profile["num_gpu_blocks"] == eng.num_gpu_blocks
    outs = llm.generate(PROMPTS, GREEDY)
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert [o.prompt for o in outs] == PROMPTS
    for o, p in zip(outs, ids):
        c = o.outputs[0]
        assert o.finished and o.prompt_token_ids == p
        assert c.token_ids == hf_greedy(p)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    # Token-id prompts give the same outputs, in input order.
    outs2 = llm.generate(ids[::-1], GREEDY)
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs][::-1]
    # Step log: one record per step, times ordered, features consistent.
    log = eng.step_log
    assert log and all(r.start_s <= r.end_s for r in log)
    assert all(a.end_s <= b.start_s for a, b in zip(log, log[1:]))
    assert all(r.num_tokens == r.num_prefill_tokens + r.num_decode_reqs > 0 for r in log)
    assert all(r.forward_s > 0 and r.schedule_s >= 0 and r.prepare_s >= 0 for r in log)
    rec = outs[0].metrics
    assert rec.arrival_s <= rec.first_scheduled_s <= rec.first_token_s <= rec.finish_s
    assert rec.num_output_tokens == len(rec.token_times_s) == len(outs[0].outputs[0].token_ids)


def test_chunked_prefill_matches_transformers(tokenizer, hf_greedy):
    """A 32-token budget: long prompts are split over several steps, mixed with decodes."""
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    eng = engine(max_num_batched_tokens=32)
    done = run_all(eng, prompts)
    assert_matches_hf(done, prompts, hf_greedy)
    chunks = [r for r in eng.step_log if r.prefill_context_tokens > 0]
    assert chunks, "no prefill chunk on top of cached context"
    assert any(r.num_prefill_reqs and r.num_decode_reqs for r in eng.step_log), "no mixed step"
    assert max(r.num_tokens for r in eng.step_log) <= 32


def test_preemption_recompute_matches_transformers(tokenizer, hf_greedy):
    """A pool of 12 usable blocks for 5 requests that need up to 7 each: preempted and recomputed."""
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    eng = engine(num_gpu_blocks=13, max_num_batched_tokens=64)

    def check(e):
        e.scheduler.check_invariants()

    done = run_all(eng, prompts, on_step=check)
    assert_matches_hf(done, prompts, hf_greedy)
    assert sum(r.num_preempted for r in eng.step_log) > 0
    assert sum(rec.num_preemptions for rec in eng.request_records.values()) > 0
    assert eng.scheduler.kv_cache_manager.num_free_blocks == 12


def test_prefix_cache_hits_match_transformers(tokenizer, hf_greedy):
    prompts = [tokenizer(p).input_ids for p in SHARED_PROMPTS]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    assert common >= 32
    eng = engine()
    done = run_all(eng, prompts[:1])  # computes (and caches) the shared prefix
    later = run_all(eng, prompts[1:])
    done.update({str(int(k) + 1): v for k, v in later.items()})
    assert_matches_hf(done, prompts, hf_greedy)
    hits = sum(r.extra["num_prefix_hit_tokens"] for r in eng.step_log)
    assert hits >= 2 * (common // 16) * 16
    assert done["1"].metrics.num_cached_tokens == (common // 16) * 16
    # In one batch, later requests hit the blocks the first computes in the same step.
    eng2 = engine()
    done2 = run_all(eng2, prompts)
    assert_matches_hf(done2, prompts, hf_greedy)
    assert eng2.step_log[0].extra["num_prefix_hit_tokens"] > 0


def test_abort_frees_blocks_and_others_match(tokenizer, hf_greedy):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    eng = engine(enable_prefix_caching=False)
    kvm = eng.scheduler.kv_cache_manager
    victim = "3"
    state = {"aborted": False}

    def maybe_abort(e):
        rec = e.request_records[victim]
        if not state["aborted"] and rec.num_output_tokens >= 4:
            held = len(kvm.req_to_blocks[victim])
            free_before = kvm.num_free_blocks
            e.abort_request(victim)
            assert kvm.num_free_blocks == free_before + held
            assert victim not in kvm.req_to_blocks
            state["aborted"] = True
            state["step"] = len(e.step_log)
        elif state["aborted"] and len(e.step_log) == state["step"] + 1:
            assert victim not in e.runner.requests  # the runner dropped it at the next step

    done = run_all(eng, prompts, on_step=maybe_abort)
    assert state["aborted"] and victim not in done
    assert eng.request_records[victim].finish_reason == "abort"
    assert_matches_hf(done, prompts, hf_greedy, skip={victim})
    assert kvm.num_free_blocks == kvm.num_usable_blocks


def test_chat_capital_of_france():
    llm = LLM(model="default", device="cpu", num_gpu_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_invalid_requests_raise_and_do_not_disturb(tokenizer, hf_greedy):
    eng = engine(max_model_len=64, num_gpu_blocks=32)
    ids = tokenizer(PROMPTS[0]).input_ids
    eng.add_request("ok", ids, GREEDY)
    for _ in range(3):
        eng.step()
    bad_temp = SamplingParams(temperature=0.5)
    bad_temp.temperature = -1.0
    bad_top_p = SamplingParams()
    bad_top_p.top_p = 1.5
    zero_top_p = SamplingParams()
    zero_top_p.top_p = 0.0
    cases = [
        (dict(prompt=list(range(100, 200))), r"prompt.*100 tokens.*max_model_len=64"),
        (dict(prompt=[]), r"prompt.*empty"),
        (dict(prompt=""), r"prompt.*empty"),
        (dict(prompt=ids, sampling_params=bad_temp), r"temperature=-1\.0"),
        (dict(prompt=ids, sampling_params=bad_top_p), r"top_p=1\.5"),
        (dict(prompt=ids, sampling_params=zero_top_p), r"top_p=0\.0"),
        (dict(prompt=[1, 2, 10**6]), r"prompt_token_ids.*1000000"),
        (dict(prompt="hi", request_id="ok"), r"request_id='ok'"),
    ]
    for kw, pattern in cases:
        kw.setdefault("request_id", "bad")
        with pytest.raises(ValueError, match=pattern):
            eng.add_request(**kw)
        assert "bad" not in eng.scheduler.requests and "bad" not in eng.request_records
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert eng.get_num_unfinished_requests() == 1
    # A prompt of exactly max_model_len is the engine core's truncated case (engine.core.admission):
    # queued, and it finishes with one token, "length".
    eng.add_request("full", list(range(100, 164)), GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["ok"].outputs[0].token_ids == hf_greedy(ids)
    full = done["full"].outputs[0]
    assert len(full.token_ids) == 1 and full.finish_reason == "length"


def test_generate_validates_every_prompt_first():
    llm = LLM(model="default", device="cpu", num_gpu_blocks=32, max_model_len=128)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([[5] * 10, [5] * 300], SamplingParams(max_tokens=4))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.request_records == {}
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) <= 3


def test_prompt_logprobs_equal_transformers_through_chunks_and_prefix_hits(tokenizer, monkeypatch):
    """Each prompt token's log-probability given the tokens before it, its rank and the top-k,
    against transformers' log-softmax of the whole prompt; in prefill chunks of 16 tokens, and for
    a second request of the same prompt whose blocks are cached (it computes them again, as vLLM)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model("default")), dtype=torch.float32, local_files_only=True).eval()
    ids = tokenizer(SHARED_PROMPTS[0]).input_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    eng = engine(max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first = run_all(eng, [ids], sp)["0"]
    plain = run_all(eng, [ids], GREEDY)["0"]            # no prompt logprobs: reads the cache
    from engine.runner import model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 5)   # logits in slices of 5 rows
    eng.add_request("again", ids, sp)
    again = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            again = o if o.finished else again
    assert plain.num_cached_tokens >= 32 and again.num_cached_tokens == 0
    for out in (first, again):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for j in range(1, len(ids)):
            row, e = ref[j - 1], lps[j]
            assert e.token_id == ids[j] and abs(e.logprob - float(row[ids[j]])) < 2e-3, j
            assert abs(e.rank - (int((row > row[ids[j]]).sum()) + 1)) <= 1   # ties within fp32 rounding
            assert [t for t, _s, _v in e.top] == row.topk(3).indices.tolist()
            assert e.token == tokenizer.decode([ids[j]])
    assert first.outputs[0].token_ids == plain.outputs[0].token_ids[:2]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"logit_bias: token id 49152 is not in \[0, 49152\)"):
        eng.add_request("oov", ids, SamplingParams(logit_bias={49152: 1.0}))

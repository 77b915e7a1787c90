"""Engine features beyond greedy parity: seeded sampling independent of batch mates, stop strings,
min_tokens, ignore_eos, step/request records, the generate CLI."""
from __future__ import annotations

import pytest

import torch  # noqa: E402  (make test installs it)
import transformers  # noqa: E402,F401  (make test installs it)

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.request import RequestStatus  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return LLM(model="default", device="cpu", num_gpu_blocks=128, max_num_batched_tokens=256)


def test_seeded_sampling_independent_of_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42, max_tokens=12, ignore_eos=True)
    prompt = "Write a sentence about cats:"
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=1.0, max_tokens=7), SamplingParams(temperature=0, max_tokens=12),
             SamplingParams(temperature=0.5, seed=1, max_tokens=15)]
    crowd = llm.generate(["Hello", prompt, "List some fruits:", "Once upon a time"], [mates[0], sp, mates[1], mates[2]])
    assert crowd[1].outputs[0].token_ids == alone
    again = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7,
                                                       max_tokens=12, ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_stop_string_finishes_request(llm):
    eng = llm.llm_engine
    base = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[0]
    text = base.outputs[0].text
    assert "." in text
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, stop=["."]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "."
    assert c.text == text[:text.index(".")]
    assert len(c.token_ids) < len(base.outputs[0].token_ids)
    assert c.token_ids == base.outputs[0].token_ids[:len(c.token_ids)]
    assert out.metrics.finish_reason == "stop"
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.kv_cache_manager.num_free_blocks == eng.num_gpu_blocks - 1
    inc = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=12, stop=["."], include_stop_str_in_output=True))[0]
    assert inc.outputs[0].text == text[:text.index(".") + 1]


def test_min_tokens_and_ignore_eos(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == 2
    n = len(short.token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0, min_tokens=n + 3, max_tokens=40))[0].outputs[0]
    assert len(longer.token_ids) >= n + 3 and 2 not in longer.token_ids[:n + 2]
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == n + 5 and forced.finish_reason == "length"
    assert forced.token_ids[:n] == short.token_ids  # ran past EOS


def test_min_characters_holds_eos_until_the_text_is_long_enough(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == 2
    want = len(short.text) + 10
    longer = llm.chat(chat, SamplingParams(temperature=0, min_characters=want, max_tokens=40))[0].outputs[0]
    # EOS was masked until the text reached `want` characters, then it may end as usual
    assert len(longer.text) >= want or longer.finish_reason == "length"
    assert longer.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]  # same text up to the EOS
    assert 2 not in longer.token_ids[:-1]
    # a stop string inside the first `want` characters does not count; min_characters 0 is as before
    first_word = short.text.split()[0]
    cut = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop=[first_word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == short.text[:short.text.index(first_word)]
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop=[first_word],
                                         min_characters=len(short.text)))[0].outputs[0]
    assert held.text.startswith(first_word) and len(held.text) > len(cut.text)


def test_stop_token_ids(llm):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    stop_id = base.token_ids[3]
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]


def test_engine_step_outputs_and_records(llm):
    eng = llm.llm_engine
    eng.add_request("r1", "Tell me a joke.", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.add_request("r2", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen = {"r1": [], "r2": []}
    n_steps = len(eng.step_log)
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(len(o.outputs[0].token_ids))
    assert seen == {"r1": [1, 2, 3, 4, 5], "r2": [1, 2, 3]}
    new = eng.step_log[n_steps:]
    assert len(new) == 5
    assert new[0].num_prefill_reqs == 2 and new[0].num_decode_reqs == 0
    assert new[1].num_decode_reqs == 2 and new[1].decode_context_tokens > 0
    rec = eng.request_records["r1"]
    assert rec.first_scheduled_s == new[0].start_s and rec.first_token_s == new[0].end_s
    assert rec.token_times_s == [r.end_s for r in new] and rec.finish_s == new[-1].end_s
    assert rec.finish_reason == "length" and rec.num_output_tokens == 5
    row = new[0].as_row()
    assert "num_prefix_hit_tokens" in row and row["num_tokens"] == new[0].num_prefill_tokens


def test_abort_unknown_and_waiting(llm):
    eng = llm.llm_engine
    eng.add_request("w", "Hello there", SamplingParams(max_tokens=4))
    eng.abort_request(["w", "never-existed"])
    assert not eng.has_unfinished_requests()
    assert eng.request_records["w"].finish_reason == "abort"
    assert eng.step() == []  # the runner is told to drop it; nothing to run
    assert eng.scheduler.requests == {}
    eng.scheduler.finish_requests([], RequestStatus.FINISHED_ABORTED)


def test_generate_cli(capsys):
    import argparse

    from engine.cli import add_generate_args

    parser = argparse.ArgumentParser()
    add_generate_args(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["generate", "--prompt", "What is the capital of France?", "--chat",
                              "--max-tokens", "16", "--num-gpu-blocks", "32"])
    assert args.func(args) == 0
    assert "Paris" in capsys.readouterr().out
    args = parser.parse_args(["generate", "--prompt", "x", "--temperature", "-1"])
    assert args.func(args) == 2
    assert "temperature" in capsys.readouterr().err


def test_dummy_load_format_gives_a_directory_random_weights(tmp_path):
    """vLLM's --load-format dummy: a model directory with its config.json and tokenizer but no
    weight files serves with random weights, its own shape and its own tokenizer; without it the
    directory is refused for lacking weights."""
    import shutil

    from engine.llm_engine import LLMEngine
    from engine.model.loader import resolve_model
    real = resolve_model("default")
    for f in real.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(model=str(tmp_path), num_gpu_blocks=16, max_model_len=128)
    with pytest.raises(ValueError, match="load_format='pt'"):
        LLMEngine(model=str(tmp_path), num_gpu_blocks=16, max_model_len=128, load_format="pt")
    dummy = LLMEngine(model=str(tmp_path), num_gpu_blocks=16, max_model_len=128, load_format="dummy")
    ref = LLMEngine(model="default", num_gpu_blocks=16, max_model_len=128)
    assert dummy.tokenizer is not None and dummy.tokenizer.chat_template == ref.tokenizer.chat_template
    assert dummy.model.config.num_layers == ref.model.config.num_layers
    w, w_ref = dummy.model.model.embed_tokens.weight, ref.model.model.embed_tokens.weight
    assert w.shape == w_ref.shape and not torch.equal(w, w_ref)
    assert 0.015 < float(w.std()) < 0.025                      # N(0, 0.02), as build_random_model draws
    dummy.add_request("d", "Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    out = []
    while dummy.has_unfinished_requests():
        out += [o for o in dummy.step() if o.finished]
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3

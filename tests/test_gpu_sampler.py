"""The GPU sampler's top-k/top-p filtering (sim.sampling): its cost against vLLM's published
microbenchmarks, which release runs which implementation, and how the requests' sampling
parameters reach the kernel cost model through a scenario."""
import json
import sys
from pathlib import Path

import pytest

from engine.core.features import BatchFeatures
from sim.kernel_model import KernelCostModel
from sim.sampling import filter_cost_s, filter_implementation, filters
from sim.scenario import ScenarioError, parse_scenario
from sim.specs import generation_filter_of, get_model, vllm_version_tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from silicon_check import scenario_data  # noqa: E402


@pytest.mark.parametrize("rows,vocab,ms,tol", [
    (64, 32768, 0.373, 0.06),     # top-p, vLLM PR #40376's table (PyTorch column)
    (128, 32768, 0.613, 0.06),    # the same table
    (1024, 32768, 4.236, 0.06),   # top-p, PR #33538
    (1, 32768, 0.094, 0.12),      # one row, PR #42191 / #51507
])
def test_the_pytorch_filter_costs_what_vllm_measured(rows, vocab, ms, tol):
    assert filter_cost_s("pytorch", rows, vocab) * 1e3 == pytest.approx(ms, rel=tol)


def test_the_triton_filter_is_used_from_eight_rows_and_costs_what_vllm_measured():
    assert filter_cost_s("triton", 512, 32768) * 1e3 == pytest.approx(0.916, abs=0.12)  # PR #40376
    assert filter_cost_s("triton", 7, 32768) == filter_cost_s("pytorch", 7, 32768)      # below 8 rows
    assert filter_cost_s("flashinfer", 512, 131072) == 0.0 and filter_cost_s("pytorch", 0, 32768) == 0.0


@pytest.mark.parametrize("version,impl", [
    ("0.8.5", "pytorch"), ("0.10.1", "pytorch"), ("0.15.1", "pytorch"), ("0.16.0", "pytorch"),
    ("0.17.0", "triton"), ("v0.19", "triton"), ("0.20.1", "flashinfer"), (None, "flashinfer"),
])
def test_each_release_filters_with_its_default_implementation(version, impl):
    assert filter_implementation(vllm_version_tuple(version)) == impl


def test_which_requests_filter():
    v15 = (0, 15)
    assert filters("model_default", "top_p", v15) and not filters("model_default", "", v15)
    assert not filters("model_default", "top_p", (0, 7))  # before 0.8 vLLM ignores generation_config.json
    assert filters("top_k", "", (0, 7)) and not filters("greedy", "top_k_top_p", v15)
    assert not filters("random", "top_p", v15)
    with pytest.raises(ValueError, match="workload.sampling='nucleus'"):
        filters("nucleus", "", v15)
    with pytest.raises(ValueError, match="generation_filter='topp'"):
        filters("model_default", "topp", v15)


def test_generation_config_sets_the_default_filter():
    assert generation_filter_of({"temperature": 0.6, "top_p": 0.9}) == "top_p"
    assert generation_filter_of({"temperature": 0.7, "top_p": 0.8, "top_k": 20}) == "top_k_top_p"
    assert generation_filter_of({"top_k": 50}) == "top_k"
    assert generation_filter_of({"bos_token_id": 1, "eos_token_id": 2}) == ""
    assert generation_filter_of({"top_p": 1.0, "top_k": 0}) == ""
    assert generation_filter_of({"temperature": 0, "top_p": 0.9}) == ""  # greedy: nothing to filter
    assert get_model("meta-llama/Llama-3.1-8B-Instruct").generation_filter == "top_p"
    assert get_model("Qwen/Qwen3-32B").generation_filter == "top_k_top_p"
    assert get_model("mixtral-8x7b").generation_filter == ""


def _step(n: int, ctx: int = 800) -> BatchFeatures:
    f = BatchFeatures()
    for _ in range(n):
        f.add(1, ctx)
    f.num_reqs = n
    return f


def test_a_release_that_sorts_adds_the_filter_to_every_step_of_filtering_requests():
    n, ctx = 48, 900
    plain = KernelCostModel("qwen2.5-7b", "h100-sxm", 1, sampling="greedy", vllm_version="0.15.1")
    sorts = KernelCostModel("qwen2.5-7b", "h100-sxm", 1, vllm_version="0.15.1")
    extra = filter_cost_s("pytorch", n, 152064)
    assert sorts.metadata["sampler_filter"] == "pytorch" and plain.metadata["sampler_filter"] == "none"
    assert sorts.gpu_time(_step(n, ctx)) == pytest.approx(plain.gpu_time(_step(n, ctx)) + extra)
    assert sorts.decode_gpu_time(n, n * (ctx + 1)) == pytest.approx(sorts.gpu_time(_step(n, ctx)))
    assert sorts.breakdown(_step(n, ctx))["sampler"] == pytest.approx(plain.ovh.sampler_s + extra)
    # today's release filters with FlashInfer: nothing beyond the plain sampler
    now = KernelCostModel("qwen2.5-7b", "h100-sxm", 1)
    assert now.gpu_time(_step(n, ctx)) == plain.gpu_time(_step(n, ctx))
    # set_sampling re-prices a model already built (a profile's), the memoised decode steps too
    now.set_sampling("top_p", "0.15.1")
    assert now.decode_gpu_time(n, n * (ctx + 1)) == pytest.approx(sorts.decode_gpu_time(n, n * (ctx + 1)))
    # a profile keeps what it was priced for
    again = KernelCostModel.from_profile(json.loads(json.dumps(now.to_profile())))
    assert again.metadata["sampler_filter"] == "pytorch" and again.metadata["vllm_version"] == "0.15.1"
    # (a profile holds the tables reduced to a coarser grid: within 0.1%)
    assert again.decode_gpu_time(n, n * (ctx + 1)) == pytest.approx(sorts.decode_gpu_time(n, n * (ctx + 1)), rel=1e-3)
    with pytest.raises(ValueError, match="deployment.vllm_version='banana'"):
        KernelCostModel("qwen2.5-7b", "h100-sxm", 1, sampling="greedy", vllm_version="banana")


BASE = {"name": "s", "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "vllm_version": "0.15.1"},
        "workload": {"arrival": {"type": "poisson", "rate": 1}, "num_requests": 10,
                     "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}


def _with(deployment=None, **workload):
    return {**BASE, "deployment": {**BASE["deployment"], **(deployment or {})},
            "workload": {**BASE["workload"], **workload}}


def test_a_scenario_prices_its_requests_sampling_on_a_shipped_profile_too():
    # llama-3.1-8b on an H100 is timed by a shipped profile, whose stored spec may predate the field
    sc = parse_scenario(_with())
    assert sc.cost_model.describe()["sampler_filter"] == "pytorch"
    assert parse_scenario(_with(sampling="greedy")).cost_model.describe()["sampler_filter"] == "none"
    assert parse_scenario(_with({"vllm_version": "0.17.0"})).cost_model.describe()["sampler_filter"] == "triton"
    assert parse_scenario(_with({"vllm_version": "0.7.3"})).cost_model.describe()["sampler_filter"] == "none"
    assert parse_scenario(_with({"vllm_version": "0.20.0"})).cost_model.describe()["sampler_filter"] == "flashinfer"
    bench = {**BASE, "workload": {"benchmark": {"concurrency": 4, "isl": 100, "osl": 10, "num_prompts": 8},
                                  "sampling": "greedy"}}
    assert parse_scenario(bench).cost_model.describe()["sampler_filter"] == "none"
    with pytest.raises(ScenarioError, match="workload.sampling='nucleus'"):
        parse_scenario(_with(sampling="nucleus"))


def test_a_local_checkpoint_reads_its_generation_config(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}))
    assert get_model(str(d / "config.json")).generation_filter == ""
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    assert get_model(str(d / "config.json")).generation_filter == "top_p"
    (d / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        get_model(str(d / "config.json"))


def test_each_benchmark_client_sends_what_it_sends():
    case = {"backend": "vllm", "system": "h100_sxm", "model": "llama-3.1-8b", "weight_dtype": None, "tp": 1,
            "concurrency": 8, "isl": 128, "osl": 16, "ttft_ms": 1.0, "tpot_ms": 1.0}
    assert scenario_data({**case, "source": "inferencemax"}, protocol="auto")["workload"]["sampling"] == "greedy"
    assert scenario_data({**case, "source": "gap-analysis"}, protocol="auto")["workload"]["sampling"] == "model_default"

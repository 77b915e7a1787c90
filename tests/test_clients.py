"""Benchmark clients: overheads that break lock-step waves, the benchmark protocol, warm-up."""
import numpy as np
import pytest

from engine.core import SchedulerConfig
from sim.scenario import parse_scenario
from sim.clients import ENGINE_DIRECT, HTTP_DEFAULTS, ClientModel
from sim.cost_model import AnalyticCostModel
from sim.simulation import Simulation
from sim.workload import WorkloadError, build_workload

CFG = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096,
                      block_size=16, num_gpu_blocks=20000)
COST = AnalyticCostModel("llama-3.1-8b", "h100-sxm")


def run(spec, seed=0, **kw):
    return Simulation(build_workload(spec, seed=seed), CFG, COST, **kw).run()


def closed(c, n, client=None):
    spec = {"num_requests": n, "arrival": {"type": "concurrency", "concurrency": c},
            "prompt_len": {"type": "fixed", "value": 1024}, "output_len": {"type": "fixed", "value": 128}}
    if client is not None:
        spec["client"] = client
    return spec


def test_zero_overhead_closed_loop_is_lock_step_and_overheads_break_it():
    # The defect of issue 9: with no client or server time, c=8 sends 64 requests at 8 instants
    # and every wave prefills in one step.
    direct = run(closed(8, 64, {"type": "engine_direct"}))
    assert len(np.unique(direct.request_table["arrival_s"])) == 8
    prefill = direct.step_table["num_prefill_reqs"]
    assert (prefill[prefill > 0] == 8).all()
    # With the HTTP client (the default for closed loops) every send has its own instant, the
    # sends of a wave are spread out, and waves no longer prefill as one step.
    real = run(closed(8, 64))
    a = real.request_table["arrival_s"]
    assert len(np.unique(a)) == 64
    waves = np.sort(a)[8:].reshape(-1, 8)  # sends after the first wave, in groups of c
    assert (np.ptp(waves, axis=1) > 1e-4).all()
    p = real.step_table["num_prefill_reqs"]
    assert (p[p > 0] < 8).any()
    assert real.summary["requests"]["completed"] == 64


def test_benchmark_gives_exact_requests_and_tool_metrics():
    res = run({"benchmark": {"concurrency": 4, "isl": 300, "osl": 50, "num_prompts": 40, "warmup": 4}},
              keep_token_times=True)
    t = res.request_table
    assert len(t["request_id"]) == 40 and all(r.startswith("req-") for r in t["request_id"])
    assert (t["num_prompt_tokens"] == 300).all() and (t["num_output_tokens"] == 50).all()
    assert res.summary["requests"]["completed"] == 40
    # vllm bench serve's TPOT: (e2e - ttft) / (osl - 1), the first token excluded.
    assert np.allclose(t["tpot_s"], (t["e2e_s"] - t["ttft_s"]) / 49)
    # ITL: every gap of the measured requests' token times (the warm-up's are not in it).
    assert res.summary["itl_s"]["count"] == 40 * 49
    # Throughput over the measured phase: first send to last response.
    dur = np.nanmax(t["finish_s"]) - t["arrival_s"].min()
    assert res.summary["throughput"]["output_tokens_per_s"] == pytest.approx(40 * 50 / dur)
    assert res.summary["client"]["warmup_requests"] == 4


def test_warmup_finishes_before_the_measured_phase():
    sim = Simulation(build_workload({"benchmark": {"concurrency": 3, "isl": 64, "osl": 20,
                                                   "num_prompts": 9, "warmup": 5}}, 0), CFG, COST)
    res = sim.run()
    warm_end = max(r.finish_s for r in sim.warmup_records) + HTTP_DEFAULTS.output_s
    assert len(sim.warmup_records) == 5
    assert res.request_table["arrival_s"].min() >= warm_end


def test_concurrency_cap_and_request_rate():
    res = run({"benchmark": {"concurrency": 5, "isl": 128, "osl": 64, "num_prompts": 60,
                             "request_rate": 20.0}})
    t = res.request_table
    start, end = t["arrival_s"], t["finish_s"]
    in_flight = [(start <= x).sum() - (end <= x).sum() for x in start]
    assert max(in_flight) <= 5
    # A rate of 20/s over 60 requests: sends span at least the drawn gaps (~3 s).
    assert np.ptp(start) > 1.5


def test_output_delay_shifts_ttft_and_e2e_not_tpot():
    spec = {"num_requests": 30, "arrival": {"type": "poisson", "rate": 4.0},
            "prompt_len": {"type": "uniform", "min": 100, "max": 800},
            "output_len": {"type": "uniform", "min": 10, "max": 60}}
    base = run({**spec, "client": {"type": "engine_direct"}})
    d = 0.003
    shifted = run({**spec, "client": {"type": "engine_direct", "output_s": d}})
    a, b = base.request_table, shifted.request_table
    assert np.allclose(b["ttft_s"], a["ttft_s"] + d)
    assert np.allclose(b["e2e_s"], a["e2e_s"] + d)
    assert np.allclose(b["tpot_s"], a["tpot_s"], equal_nan=True)


def test_frontend_tokenizes_one_request_at_a_time():
    # Ten prompts sent at once: the engine sees them tokenize_s_per_token * 1024 apart.
    client = ClientModel(http_s=0.001, tokenize_s_per_token=1e-5)
    sim = Simulation(build_workload(closed(10, 10, {"think_s": 0.0, "http_s": 0.001, "http_cv": 0.0,
                                                    "tokenize_s_per_token": 1e-5, "output_s": 0.0}), 0),
                     CFG, COST, keep_steps=True)
    assert sim.client == client
    sim.run()
    # queue_s = first scheduled - send: at least http + its place in the tokenizer's queue.
    res = sim.collect(0.0)
    q = np.sort(res.request_table["queue_s"])
    assert q[0] >= 0.001 + 0.01 - 1e-12
    assert q[-1] >= 0.001 + 0.1 - 1e-12
    # the tokenizer's load: 10 prompts x 1024 tokens x 10 us over the run (http_s is a latency)
    assert res.summary["client"]["tokenizer_busy_fraction"] == pytest.approx(10 * 1024 * 1e-5
                                                                             / res.summary["duration_s"])


# an open loop whose prompts take 0.5-20 ms each to tokenize: with two API servers a short prompt
# sent later can reach the engine first
MIXED = {"num_requests": 60, "arrival": {"type": "poisson", "rate": 40.0},
         "prompt_len": {"type": "uniform", "min": 50, "max": 2000}, "output_len": {"type": "fixed", "value": 20},
         "client": {"tokenize_s_per_token": 1e-5}}


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("spec", [closed(6, 40), {"benchmark": {"concurrency": 6, "isl": 200, "osl": 40,
                                                                  "num_prompts": 40, "request_rate": 30.0}}, MIXED])
def test_steady_decoding_exact_with_client_delays(spec, servers):
    slow = run(spec, use_steady=False, keep_token_times=True, api_servers=servers)
    fast = run(spec, use_steady=True, keep_token_times=True, api_servers=servers)
    cols = ["arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s"]
    for c in cols:
        assert np.array_equal(slow.request_table[c], fast.request_table[c]), c
    assert len(fast.steps) < len(slow.steps)


def test_client_jitter_is_seeded():
    a = run(closed(4, 20), seed=3).request_table["arrival_s"]
    b = run(closed(4, 20), seed=3).request_table["arrival_s"]
    c = run(closed(4, 20), seed=4).request_table["arrival_s"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_open_loop_default_is_a_servers_request_path_sent_on_schedule():
    # Open-loop arrivals reach the engine through the API server's request path, as clients of a
    # deployed server see it (TTFT from the send); the sends are the arrivals themselves: no
    # turnaround, which is a closed loop's time between a response and the next send.
    spec = {"num_requests": 40, "arrival": {"type": "poisson", "rate": 2.0},
            "prompt_len": {"type": "fixed", "value": 300}, "output_len": {"type": "fixed", "value": 5}}
    w = build_workload(spec, 0)
    assert w.client == HTTP_DEFAULTS
    sim = Simulation(w, CFG, COST)
    assert sim.client == HTTP_DEFAULTS and sim.direct_feed
    res = sim.run()
    t = res.request_table
    np.testing.assert_array_equal(t["arrival_s"], w.arrival_s)
    # Each request reaches the engine at least its HTTP handling and its tokenization after the
    # send; at 2 req/s the tokenizer is never busy, so that is all the wait an idle engine adds.
    wait = np.asarray(t["first_scheduled_s"]) - np.asarray(t["arrival_s"])
    assert (wait >= HTTP_DEFAULTS.tokenize_s_per_token * 300).all()
    direct = run({**spec, "client": {"type": "engine_direct"}})
    assert Simulation(build_workload({**spec, "client": {"type": "engine_direct"}}, 0), CFG, COST).client == ENGINE_DIRECT
    assert np.mean(t["ttft_s"]) > np.mean(direct.request_table["ttft_s"]) + HTTP_DEFAULTS.http_s / 2


@pytest.mark.parametrize("bad, where", [
    ({"benchmark": {"concurrency": 4, "isl": 10, "osl": 5, "num_prompts": 8}, "num_requests": 3}, "workload.num_requests"),
    ({"benchmark": {"isl": 10, "osl": 5, "num_prompts": 8}}, "workload.benchmark"),
    ({"benchmark": {"concurrency": 4, "isl": 10, "osl": 5}}, "workload.benchmark.num_prompts"),
    ({"benchmark": {"concurrency": 4, "isl": 10, "osl": 5, "num_prompts": 8, "warmpu": 1}}, "workload.benchmark.warmpu"),
    ({"benchmark": {"concurrency": 4, "isl": 10, "osl": 5, "num_prompts": 8}, "client": {"http_s": -1}}, "workload.client.http_s"),
    ({"benchmark": {"concurrency": 4, "isl": 10, "osl": 5, "num_prompts": 8, "range_ratio": 1.0}},
     "workload.benchmark.range_ratio"),
])
def test_benchmark_spec_errors_name_the_key(bad, where):
    with pytest.raises(WorkloadError, match=where.replace(".", r"\.")):
        build_workload(bad, 0)


def test_range_ratio_draws_lengths_as_vllm_bench_serve():
    # --random-range-ratio r: uniform integers in [L(1-r), L(1+r)] for prompt and output alike.
    wl = build_workload({"benchmark": {"concurrency": 8, "isl": 1000, "osl": 200, "num_prompts": 4000,
                                       "range_ratio": 0.2}}, 3)
    p, o = np.asarray(wl.prompt_len), np.asarray(wl.output_len)
    assert len(p) == 4000 and p.min() >= 800 and p.max() <= 1200 and o.min() >= 160 and o.max() <= 240
    assert abs(p.mean() - 1000) < 10 and abs(o.mean() - 200) < 2      # uniform: mean L (se ~1.8, ~0.4)
    assert len(set(p.tolist())) > 300                                  # not a handful of values
    # Prompts stay unique (no prefix-cache hits between requests), as the random dataset's are.
    heads = {tuple(s.token_ids()[:16]) for s in wl}
    assert len(heads) == 4000
    fixed = build_workload({"benchmark": {"concurrency": 8, "isl": 1000, "osl": 200, "num_prompts": 10}}, 3)
    assert set(np.asarray(fixed.prompt_len).tolist()) == {1000} and set(np.asarray(fixed.output_len).tolist()) == {200}


def test_min_ratio_draws_lengths_as_benchmark_serving():
    # benchmark_serving.py / sglang --random-range-ratio r (InferenceMAX: 0.8): uniform integers
    # in [int(L r), L], for prompt and output alike.
    wl = build_workload({"benchmark": {"concurrency": 8, "isl": 1000, "osl": 201, "num_prompts": 4000,
                                       "min_ratio": 0.8}}, 3)
    p, o = np.asarray(wl.prompt_len), np.asarray(wl.output_len)
    assert p.min() >= 800 and p.max() <= 1000 and o.min() >= 160 and o.max() <= 201
    assert abs(p.mean() - 900) < 5 and abs(o.mean() - 180.5) < 1.5    # means (800+1000)/2, (160+201)/2
    assert p.min() == 800 and p.max() == 1000                          # both ends drawn (4000 of 201 values)
    assert wl.benchmark["protocol"].startswith("benchmark_serving.py") and "0.8" in wl.benchmark["protocol"]
    with pytest.raises(WorkloadError, match="range_ratio=0.1 and min_ratio=0.8"):
        build_workload({"benchmark": {"concurrency": 8, "isl": 10, "osl": 5, "num_prompts": 8,
                                      "range_ratio": 0.1, "min_ratio": 0.8}}, 0)
    with pytest.raises(WorkloadError, match="workload.benchmark.min_ratio"):
        build_workload({"benchmark": {"concurrency": 8, "isl": 10, "osl": 5, "num_prompts": 8, "min_ratio": 0}}, 0)


def test_scenario_benchmark_round_trip():
    sc = parse_scenario({"deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "num_gpu_blocks": 20000},
                         "cost_model": {"type": "analytic"},
                         "workload": {"benchmark": {"concurrency": 8, "isl": 512, "osl": 64, "num_prompts": 24}}})
    assert sc.workload.benchmark["concurrency"] == 8 and len(sc.workload) == 24
    with pytest.raises(WorkloadError, match="workload.benchmark.concurrency=0"):
        parse_scenario({"workload": {"benchmark": {"concurrency": 0, "isl": 1, "osl": 1, "num_prompts": 1}}})


def test_vllm_bench_keys_and_shared_prefix():
    res = run({"benchmark": {"concurrency": 4, "isl": 200, "osl": 30, "num_prompts": 16, "prefix_len": 64}})
    s, v = res.summary, res.summary["vllm_bench"]
    assert v["completed"] == 16 and v["total_input_tokens"] == 16 * 264 and v["total_output_tokens"] == 16 * 30
    assert v["median_ttft_ms"] == pytest.approx(1e3 * s["ttft_s"]["p50"])
    assert v["p99_tpot_ms"] == pytest.approx(1e3 * s["tpot_s"]["p99"])
    assert v["output_throughput"] == pytest.approx(s["throughput"]["output_tokens_per_s"])
    # Every prompt after the first finds the 64-token prefix (4 full blocks) in the cache.
    assert s["requests"]["prefix_cached_tokens"] == 15 * 64


def test_example_benchmark_scenario_runs():
    from pathlib import Path

    from sim.scenario import load_scenario, run_scenario
    sc = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "benchmark-h100.yaml")
    assert sc.cost_model.describe()["async_scheduling"] is True
    s = run_scenario(sc).summary
    assert s["vllm_bench"]["completed"] == 320 and s["client"]["warmup_requests"] == 32
    assert s["requests"]["preemptions"] == 0


def test_a_varying_request_path_breaks_the_lock_step_of_equal_requests():
    """Eight equal requests in a closed loop: with a fixed request path every wave reaches the
    engine together and is prefilled in one step, wave after wave; with the request path's time
    varying per request (gamma, the HTTP default) the waves spread over several steps, as real
    clients drift out of phase. The mean request path is the same."""
    def first_steps(cv):
        spec = {"benchmark": {"concurrency": 8, "isl": 512, "osl": 32, "num_prompts": 64},
                "client": {"think_s": 0.0, "http_s": 0.005, "http_cv": cv, "tokenize_s_per_token": 0.0}}
        sim = Simulation(build_workload(spec, 0), CFG, COST)
        sim.run()
        t = sim.collect(0.0).request_table
        return np.unique(np.round(t["first_scheduled_s"], 9)).size, np.nanmean(t["queue_s"])
    fixed, q_fixed = first_steps(0.0)
    varied, q_varied = first_steps(1.0)
    assert fixed <= 64 // 8 + 1      # eight waves, each admitted in one step
    assert varied > 2 * fixed
    from sim.clients import HTTP_DEFAULTS, ClientModel
    assert HTTP_DEFAULTS.http_cv == 1.0
    draws = [ClientModel(http_s=0.005, http_cv=1.0).request_path(np.random.default_rng(0)) for _ in range(1)]
    rng = np.random.default_rng(1)
    many = [ClientModel(http_s=0.005, http_cv=1.0).request_path(rng) for _ in range(20000)]
    assert np.mean(many) == pytest.approx(0.005, rel=0.03) and np.std(many) == pytest.approx(0.005, rel=0.05)
    assert draws[0] > 0 and ClientModel(http_s=0.005).request_path(rng) == 0.005


def test_api_servers_tokenize_side_by_side():
    # Ten 1024-token prompts sent at once to an engine with two API servers (10.24 ms of
    # tokenization each): each request takes the server free first, so they reach the engine in
    # pairs, 1 ms of request path plus 1, 1, 2, 2, ... 5 tokenizations after the send.
    client = ClientModel(http_s=0.001, tokenize_s_per_token=1e-5)
    spec = closed(10, 10, {"type": "engine_direct"})
    for servers in (1, 2, 3):
        sim = Simulation(build_workload(spec, 0), CFG, COST, client=client, api_servers=servers)
        got = [sim._reaches_engine(0.0, s, 0) for s in sim.workload]
        want = [0.001 + 1024e-5 * (i // servers + 1) for i in range(10)]
        assert got == pytest.approx(want)
    two = Simulation(build_workload(closed(10, 10, {"think_s": 0.0, "http_s": 0.001, "http_cv": 0.0,
                                                    "tokenize_s_per_token": 1e-5, "output_s": 0.0}), 0),
                     CFG, COST, api_servers=2).run()
    c = two.summary["client"]
    assert c["api_servers_per_engine"] == 2
    # per server: the ten prompts' tokenization shared by the two
    assert c["tokenizer_busy_fraction"] == pytest.approx(10 * 1024 * 1e-5 / 2 / two.summary["duration_s"])
    with pytest.raises(ValueError, match="deployment.api_server_count=0: must be >= 1"):
        Simulation(build_workload(spec, 0), CFG, COST, api_servers=0)


def test_api_server_count_follows_vllm_release():
    # vLLM 0.15 starts one API server per data-parallel rank (--api-server-count's default), 0.14
    # one; a scenario may set it; disaggregated pools keep one per prefill engine.
    from sim.clients import default_api_servers
    from sim.scenario import ScenarioError
    assert default_api_servers("0.14.1", 4) == 1 and default_api_servers("0.15.1", 4) == 4
    assert default_api_servers(None, 2) == 2 and default_api_servers("0.19", 1) == 1
    wl = {"num_requests": 20, "arrival": {"type": "poisson", "rate": 5.0},
          "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 20}}
    dep = {"model": "qwen3-30b-a3b", "device": "h100", "data_parallel": 2}

    def parse(**extra):
        return parse_scenario({"workload": wl, "deployment": {**dep, **extra}})
    assert parse().api_servers == 2 and parse().deployment["api_server_count"] == 2
    assert parse(vllm_version="0.14.1").api_servers == 1
    assert "api_server_count" not in parse(vllm_version="0.14.1").deployment
    assert parse(api_server_count=3, vllm_version="0.14.1").api_servers == 3
    assert parse_scenario({"workload": wl, "deployment": {"model": "llama-3.1-8b", "device": "h100"}}).api_servers == 1
    with pytest.raises(ScenarioError, match="deployment.api_server_count=0"):
        parse(api_server_count=0)
    with pytest.raises(ScenarioError, match="deployment.api_server_count=2: not supported with deployment.pd"):
        parse_scenario({"workload": wl, "deployment": {"model": "llama-3.1-8b", "device": "h100", "api_server_count": 2,
                                                       "pd": {"prefill_replicas": 1, "decode_replicas": 1}}})
    # the planner's vllm serve lines carry a count the scenario set (vLLM's default needs no flag)
    from scenarios.plan_report import deploy_commands
    c = {"replicas": 1, "tp": 1, "data_parallel": 2, "device": "h100-sxm", "router": "round_robin",
         "policy": "fcfs", "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    result = {"hf_model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "gpu_memory_utilization": 0.9, "target_rate": 10,
              "workload_means": {}, "model": "qwen3-30b-a3b", "search": {"confirm_requests": 8000}}
    for count, flag in ((None, False), (4, True)):
        serve = [x for x in deploy_commands({**result, "api_server_count": count}, c) if "vllm serve" in x]
        assert serve and all(("--api-server-count 4" in x) == flag for x in serve)

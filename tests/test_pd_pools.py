"""Disaggregated pools shaped engine by engine (deployment.pd's per-pool keys): each pool's own
scheduler limits, expert parallelism and data-parallel ranks, as a disaggregated vLLM deployment
runs them (and as the silicon sample's disaggregated rows record them)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.core.features import BatchFeatures
from scenarios.candidates import gpus_per_unit, label
from sim.scenario import ScenarioError, parse_scenario, run_scenario
from sim.specs import get_device, get_model, kv_cache_blocks


def dense(pd: dict, n: int = 4, prompt: int = 2000, output: int = 4) -> dict:
    return {"deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1,
                           "pd": {"prefill_replicas": 1, "decode_replicas": 1, **pd}},
            "cost_model": {"type": "analytic"},
            "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 64, "async_scheduling": False},
            "workload": {"num_requests": n, "arrival": {"type": "constant", "rate": 1e6},
                         "prompt_len": {"type": "fixed", "value": prompt},
                         "output_len": {"type": "fixed", "value": output},
                         "client": {"type": "engine_direct"}}}  # the pools' own timing, no API server


def test_a_prefill_pool_of_one_sequence_prefills_a_burst_one_prompt_per_step():
    # Four 2,000-token prompts arrive together. The scheduler section's budget (8192) would take
    # all four in one step; a prefill engine limited to one sequence takes them one by one, so the
    # k-th first token comes after k single-prompt steps (no CPU overlap: async scheduling off).
    sc = parse_scenario(dense({"prefill_max_num_seqs": 1, "prefill_max_num_batched_tokens": 4096}))
    pcfg, pcost = sc.pd["prefill"]
    assert (pcfg.max_num_seqs, pcfg.max_num_batched_tokens) == (1, 4096)
    assert sc.pd["decode"][0].max_num_seqs == 64  # the scheduler section's, where not given
    one = pcost.step_time(BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=2000,
                                        prefill_attn_pairs=2000 * 2001 // 2))
    table = run_scenario(sc).request_table
    # then the KV moves (bytes / 50 GB/s + 0.1 ms) and the decode engine's first step streams the
    # first token; the constant arrivals are a microsecond apart
    handoff = 2000 * 128 * 1024 / 50e9 + 1e-4 + sc.pd["decode"][1].step_time(
        BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=2000))
    assert np.sort(table["ttft_s"]) == pytest.approx([one + handoff, 2 * one + handoff, 3 * one + handoff,
                                                      4 * one + handoff], abs=1e-5)
    assert len(np.unique(np.round(table["first_token_s"], 9))) == 4
    # the scheduler section's pool takes the three that arrive during the first step in one step
    together = run_scenario(parse_scenario(dense({}))).request_table
    assert len(np.unique(np.round(together["first_token_s"], 9))) == 2


def test_a_decode_pool_caps_its_own_sequences():
    # Eight requests, a decode engine of 3 sequences: never more than 3 run there at once, and all finish
    sc = parse_scenario(dense({"decode_max_num_seqs": 3}, n=8, prompt=200, output=50))
    res = run_scenario(sc)
    steps = res.step_table
    decode = steps["replica"] == 1  # the decode replica follows the one prefill replica
    assert steps["num_running"][decode].max() == 3
    assert (res.request_table["finish_reason"] == "length").all()


def moe(pd: dict, n: int = 24) -> dict:
    return {"deployment": {"model": "qwen3-30b-a3b", "device": "h100-sxm", "tp": 1,
                           "pd": {"prefill_replicas": 1, "decode_replicas": 1, **pd}},
            "scheduler": {"max_num_seqs": 64},
            "workload": {"benchmark": {"concurrency": 8, "isl": 512, "osl": 32, "num_prompts": n}}}


def test_a_decode_engine_of_data_parallel_ranks_steps_them_together():
    sc = parse_scenario(moe({"prefill_tp": 2, "decode_tp": 1, "decode_data_parallel": 2,
                             "decode_expert_parallel": True}))
    dcfg, dcost = sc.pd["decode"]
    meta = dcost.describe()
    assert (meta["tp"], meta["data_parallel"], meta["expert_parallel"]) == (1, 2, True)
    assert sc.pd["prefill"][1].describe()["expert_parallel"] is False
    # each rank's pool as vLLM sizes one rank of tp 1 whose experts spread over 2 GPUs
    m, d = get_model("qwen3-30b-a3b"), get_device("h100-sxm")
    assert dcfg.num_gpu_blocks == kv_cache_blocks(m, d, 1, 16, 0.9, max_num_batched_tokens=8192, max_num_seqs=64,
                                                  data_parallel=2)
    res = run_scenario(sc)
    assert (res.request_table["finish_reason"] == "length").all()
    st = res.step_table
    ranks = {1: st["replica"] == 1, 2: st["replica"] == 2}  # decode ranks follow the prefill replica
    assert ranks[1].any() and ranks[2].any()
    # a step boundary of one rank is a step boundary of the other while both have work
    starts = {k: set(np.round(st["start_s"][v], 12)) for k, v in ranks.items()}
    both = starts[1] & starts[2]
    assert len(both) >= 0.5 * min(len(starts[1]), len(starts[2]))
    for k in (1, 2):
        ends = dict(zip(np.round(st["start_s"][ranks[k]], 12), np.round(st["end_s"][ranks[k]], 12)))
        other = dict(zip(np.round(st["start_s"][ranks[3 - k]], 12), np.round(st["end_s"][ranks[3 - k]], 12)))
        assert all(ends[s] == other[s] for s in both)  # and ends with it
    assert sc.deployment["pd"]["decode_data_parallel"] == 2


def test_a_prefill_pool_of_data_parallel_ranks_and_its_gpus():
    data = moe({"prefill_tp": 1, "prefill_data_parallel": 2, "prefill_expert_parallel": True, "decode_tp": 2})
    sc = parse_scenario(data)
    assert sc.pd["prefill"][1].describe()["data_parallel"] == 2
    res = run_scenario(sc)
    assert (res.request_table["finish_reason"] == "length").all()
    st = res.step_table
    prefill = {k: set(np.round(st["start_s"][(st["replica"] == k) & (st["num_prefill_reqs"] > 0)], 12))
               for k in (0, 1)}  # the two prefill ranks, each with prompts of its own
    assert prefill[0] and prefill[1]
    cand = {"tp": 1, "pd": data["deployment"]["pd"]}
    assert gpus_per_unit(cand) == 1 * 1 * 2 + 1 * 2 * 1
    assert "P1xtp1dp2+D1xtp2" in label({**cand, "device": "h100-sxm", "max_num_batched_tokens": 8192,
                                        "max_num_seqs": 64, "policy": "fcfs", "router": "round_robin"})


def test_per_pool_keys_are_checked_and_named():
    with pytest.raises(ScenarioError, match=r"deployment.pd.decode_data_parallel=2: llama-3.1-8b has no experts"):
        parse_scenario(dense({"decode_data_parallel": 2}))
    with pytest.raises(ScenarioError, match=r"deployment.pd.prefill_expert_parallel=True"):
        parse_scenario(dense({"prefill_expert_parallel": True}))
    with pytest.raises(ScenarioError, match=r"deployment.pd.prefill_max_num_seqs"):
        parse_scenario(dense({"prefill_max_num_seqs": 0}))
    data = moe({})
    data["deployment"]["data_parallel"] = 2
    with pytest.raises(ScenarioError, match=r"deployment.data_parallel=2: with deployment.pd.*decode_data_parallel"):
        parse_scenario(data)
    # a pool wider than a node needs the link between nodes, as an aggregated engine does
    with pytest.raises(ScenarioError, match=r"deployment.pd.decode_tp=8 x decode_data_parallel=2: spans more "
                                            r"than one node of 8 h100-sxm GPUs"):
        parse_scenario(moe({"decode_tp": 8, "decode_data_parallel": 2}))
    analytic = moe({"prefill_data_parallel": 2})
    analytic["cost_model"] = {"type": "analytic"}
    with pytest.raises(ScenarioError, match=r"deployment.pd.prefill_data_parallel=2: timed by cost_model.type "
                                            r"kernels only"):
        parse_scenario(analytic)


def test_pools_run_the_benchmarks_warm_up_and_client_as_one_engine_does():
    # 8 warm-up requests, then 16 measured: only those are reported, after the warm-up's responses,
    # and the client's request path (HTTP, tokenizing) is in their TTFT, as with aggregated replicas
    data = moe({"prefill_tp": 2, "decode_tp": 2}, n=16)
    data["workload"]["benchmark"]["warmup"] = 8
    res = run_scenario(parse_scenario(data))
    assert len(res.request_table["ttft_s"]) == 16
    assert res.summary["client"]["warmup_requests"] == 8
    assert res.request_table["arrival_s"].min() > 0  # sent when the warm-up was over
    agg = dict(data, deployment={"model": "qwen3-30b-a3b", "device": "h100-sxm", "tp": 2})
    assert run_scenario(parse_scenario(agg)).summary["client"]["warmup_requests"] == 8


def test_a_request_the_decode_engine_refuses_reports_no_token():
    # The decode engine holds fewer tokens than the prompt (the scheduler section allows it, the
    # prefill engines of 2 GPUs hold it): the client gets no token, and the record says what it asked
    data = dense({"prefill_tp": 2, "decode_tp": 1}, n=2, prompt=30000, output=8)
    data["deployment"]["device"] = "a10g"
    data["scheduler"]["max_model_len"] = 40000
    sc = parse_scenario(data)
    assert sc.pd["decode"][0].max_model_len < 30000 <= sc.pd["prefill"][0].max_model_len
    t = run_scenario(sc).request_table
    assert list(t["finish_reason"]) == ["rejected", "rejected"]
    assert list(t["num_output_tokens"]) == [0, 0] and list(t["num_requested_output_tokens"]) == [8, 8]
    assert np.isnan(t["ttft_s"]).all()


def test_each_pool_caps_a_hybrids_sequences_at_the_states_its_own_memory_holds():
    from sim.specs import memory_breakdown
    data = {"deployment": {"model": "qwen3-next-80b-a3b", "device": "h100-sxm", "tp": 4,
                           "pd": {"prefill_tp": 4, "decode_tp": 2, "decode_data_parallel": 2,
                                  "decode_max_num_seqs": 4096}},
            "workload": {"benchmark": {"concurrency": 4, "isl": 256, "osl": 8, "num_prompts": 8}}}
    sc = parse_scenario(data)
    m, d = get_model("qwen3-next-80b-a3b"), get_device("h100-sxm")
    held = memory_breakdown(m, d, 2, 0.9, 16, max_num_batched_tokens=8192, max_num_seqs=4096,
                            data_parallel=2)["linear_state_requests"]
    assert held < 4096 and sc.pd["decode"][0].max_num_seqs == held
    assert any(w.startswith("deployment.pd.decode_max_num_seqs=4096") for w in sc.warnings)
    # the prefill engines (tp 4, the scheduler section's 1024 sequences) hold theirs: no other note
    assert [w for w in sc.warnings if "linear-attention" in w] == [
        w for w in sc.warnings if w.startswith("deployment.pd.decode_max_num_seqs")]


def test_a_pools_own_budget_sizes_its_window_reserve():
    data = {"deployment": {"model": "gpt-oss-20b", "device": "h100-sxm", "tp": 1, "num_gpu_blocks": 3000,
                           "pd": {"prefill_max_num_batched_tokens": 65536}},
            "workload": {"benchmark": {"concurrency": 4, "isl": 256, "osl": 8, "num_prompts": 8}}}
    with pytest.raises(ScenarioError, match=r"deployment.pd.prefill_max_num_batched_tokens=65536 prefills"):
        parse_scenario(data)
    data["deployment"]["pd"] = {"prefill_max_num_batched_tokens": 4096}
    sc = parse_scenario(data)
    # a smaller chunk holds less of the window: the prefill engine's requests may be longer
    assert sc.pd["prefill"][0].max_model_len >= sc.pd["decode"][0].max_model_len


def test_the_planner_sizes_each_pools_engines_as_the_scenario_does():
    from scenarios.plan import prune_reason
    data = {"deployment": {"model": "Qwen/Qwen3-235B-A22B-FP8", "device": "h100-sxm", "tp": 2,
                           "expert_parallel": True},
            "workload": {"num_requests": 8, "arrival": {"type": "poisson", "rate": 1.0},
                         "prompt_len": {"type": "fixed", "value": 256},
                         "output_len": {"type": "fixed", "value": 8}}}
    cand = {"device": "h100-sxm", "tp": 2, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
            "policy": "fcfs", "router": "round_robin",
            "pd": {"prefill_tp": 4, "decode_tp": 2, "decode_data_parallel": 4, "decode_expert_parallel": True}}
    assert prune_reason(data, cand, 300) is None  # 2 x 4 GPUs hold the decode engine's experts
    alone = dict(cand, pd={"prefill_tp": 4, "decode_tp": 2})
    assert "leave no KV cache" in prune_reason(data, alone, 300)


def test_a_plans_serve_lines_carry_each_pools_engine():
    from scenarios.plan_report import deploy_commands
    result = {"hf_model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "gpu_memory_utilization": 0.9, "expert_parallel": False}
    c = {"device": "h100-sxm", "tp": 1, "replicas": 1, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
         "policy": "fcfs", "router": "round_robin",
         "pd": {"prefill_replicas": 2, "prefill_tp": 2, "prefill_max_num_seqs": 1,
                "prefill_max_num_batched_tokens": 4096, "decode_replicas": 1, "decode_tp": 1,
                "decode_data_parallel": 4, "decode_expert_parallel": True}}
    lines = deploy_commands(result, c)
    pre = [x for x in lines if "vllm serve" in x and "--port 80" in x]
    dec = [x for x in lines if "vllm serve" in x and "--port 81" in x]
    assert len(pre) == 2 and len(dec) == 1
    assert all("--tensor-parallel-size 2 --max-num-seqs 1 --max-num-batched-tokens 4096" in x for x in pre)
    assert not any("--data-parallel-size" in x or "--enable-expert-parallel" in x for x in pre)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 " in dec[0]  # one engine of 4 ranks of 1 GPU
    assert "--max-num-seqs 256 --max-num-batched-tokens 8192" in dec[0]
    assert "--data-parallel-size 4 --enable-expert-parallel" in dec[0]
    assert "# decode pool: 1 replica(s), tensor parallel 1 x data parallel 4" in lines


def test_a_pools_description_gives_its_own_limits():
    text = parse_scenario(dense({"prefill_max_num_seqs": 1, "prefill_max_num_batched_tokens": 4096})).describe()
    assert "1 prefill replica(s) (tp=1; 1 seqs, budget 4096) + 1 decode replica(s) (tp=1; 64 seqs)" in text


def _handoff_run(async_scheduling: bool, requests=None, decode_seqs: int = 8):
    """Requests through one prefill and one decode engine with constant step times (prefill
    steps 100 ms, decode steps 10 ms); by default two: a's long decode keeps the decode engine
    stepping when b's KV is handed over."""
    from engine.core import SchedulerConfig
    from sim.cost_model import FittedCostModel
    from sim.disagg import DisaggSimulation
    from sim.workload import RequestSpec, Workload

    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=2048, block_size=16,
                          num_gpu_blocks=400)
    dcfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=decode_seqs, max_model_len=2048,
                           block_size=16, num_gpu_blocks=400)
    pcost, dcost = FittedCostModel(intercept_s=0.1, per_token_s=0.0), FittedCostModel(intercept_s=0.01, per_token_s=0.0)
    pcost.async_scheduling = dcost.async_scheduling = async_scheduling
    pd = {"prefill_replicas": 1, "decode_replicas": 1, "kv_bytes_per_token": 1000,
          "link_bandwidth_gb_s": 0.005, "link_latency_s": 0.0035,  # 100 tokens: 20 ms + 3.5 ms
          "prefill": (cfg, pcost), "decode": (dcfg, dcost)}
    wl = Workload.from_requests(requests or [RequestSpec("a", 0.0, 100, 1000, ((0, 100),)),
                                             RequestSpec("b", 0.5036, 100, 3, ((1000, 100),))])
    return DisaggSimulation(wl, pd, keep_steps=True).run()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_decode_engine_starts_loading_the_kv_in_the_step_that_schedules_the_request(async_scheduling):
    # vLLM's KV connector pulls a request's KV in the worker when the step that first schedules
    # it runs: a busy decode engine schedules a request that reaches it during step n in step
    # n+1 (n+2 under async scheduling, whose step n+1 was scheduled before it came), and then
    # admits it when its KV has landed, as any arrival. An idle engine starts at once.
    res = _handoff_run(async_scheduling)
    table = res.requests.set_index("request_id")
    steps = res.step_table
    starts = np.asarray(steps["start_s"])[np.asarray(steps["replica"]) == 1]  # the decode engine
    dt = 100 * 1000 / 0.005e9 + 0.0035
    lag = 2 if async_scheduling else 1  # steps after the one running when a request arrives

    def boundary_after(t, k):
        """The start of the k-th decode step after the one running at t."""
        n = np.searchsorted(starts, t, side="right") - 1  # the step running at t
        return starts[n + k]

    # a: the decode engine is idle when its prefill ends at 0.1 s: the load starts at once and
    # its first token ends the first decode step
    assert table.loc["a", "ttft_s"] == pytest.approx(0.1 + dt + 0.01, abs=1e-9)
    # b: its prefill ends at 0.6036 s, just after a decode step of a's began
    handed = 0.5036 + 0.1
    load = boundary_after(handed, lag)
    first = boundary_after(load + dt, lag) + 0.01  # admitted like any arrival, then one step
    assert table.loc["b", "first_token_s"] == pytest.approx(first, abs=1e-9)
    assert res.summary["pd"]["wait_for_load_start_s"]["max"] == pytest.approx(load - handed, abs=1e-9)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hand_off_that_waited_for_room_loads_in_the_step_that_frees_it(async_scheduling):
    # A decode engine of two sequences runs a (long) and c (50 tokens); b's KV waits for room
    # until c finishes at the end of a step. vLLM's scheduler frees c's blocks after that step and
    # gives them to b in the next schedule() call: the load starts at that boundary, or a step
    # later under async scheduling (that step was scheduled while c's last one ran).
    from sim.workload import RequestSpec
    res = _handoff_run(async_scheduling, decode_seqs=2, requests=[
        RequestSpec("a", 0.0, 100, 1000, ((0, 100),)), RequestSpec("c", 0.0, 100, 50, ((500, 100),)),
        RequestSpec("b", 0.2, 100, 3, ((1000, 100),))])
    pd = res.summary["pd"]
    assert pd["wait_for_room_s"]["max"] > 0.2  # b waited for c
    assert pd["wait_for_load_start_s"]["max"] == pytest.approx(0.01 if async_scheduling else 0.0, abs=1e-9)
    assert (res.requests["finish_reason"] == "length").all()


def test_a_kv_load_waiting_on_an_engine_that_an_abort_empties_starts_then():
    # Async scheduling, 10 ms steps: a load asked for at 52 ms waits for the boundary at 70 ms
    # (the step starting at 60 ms was scheduled before it came). The only request's deadline
    # (55 ms) empties the engine at the 60 ms boundary, after that boundary kept the load
    # waiting: the idle engine starts it then instead of never.
    from engine.core import SchedulerConfig
    from sim.cost_model import FittedCostModel
    from sim.simulation import Simulation
    from sim.workload import RequestSpec, Workload

    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=2048, block_size=16,
                          num_gpu_blocks=400)
    cost = FittedCostModel(intercept_s=0.01)
    cost.async_scheduling = True
    sim = Simulation(Workload.from_requests([RequestSpec("r", 0.0, 100, 300, ((0, 100),), cancel_after_s=0.055)]),
                     cfg, cost, use_steady=False)
    started = []

    def ask():
        yield sim.env.timeout(0.052)
        yield sim.replicas[0].remote_kv_start()
        started.append(sim.env.now)

    sim.env.process(ask())
    res = sim.run()
    assert res.requests["finish_reason"][0] == "abort"
    sim.env.run(until=sim.env.now + 1.0)
    assert started == [pytest.approx(0.06)]
    with pytest.raises(RuntimeError, match="use_steady"):
        Simulation(Workload.from_requests([RequestSpec("s", 0.0, 10, 5, ((0, 10),))]), cfg, cost,
                   use_steady=True).replicas[0].remote_kv_start()

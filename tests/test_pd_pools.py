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
                         "output_len": {"type": "fixed", "value": output}}}


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
    with pytest.raises(ScenarioError, match="spans more than one node"):
        parse_scenario(moe({"decode_tp": 8, "decode_data_parallel": 2}))

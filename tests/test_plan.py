"""Capacity planner (scenarios/plan.py): memory accounting, steady-state probes and the search
against queues whose capacity is known (M/D/1, a deterministic queue), monotone and minimal
answers, ranking by cost then headroom, outputs, the cache, Ray = local, bad plan sections."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from scenarios.compose import at_rate, measure, set_field
from scenarios.plan import PlanError, memory_report, plan, prune_reason
from sim.specs import GiB, get_device, get_model, kv_cache_blocks

STEP_S = 0.02  # constant step time of the queueing tests: one request per step, capacity 50 req/s


def write_const_profile(tmp_path, step_s=STEP_S):
    prof = {"format": "servetwin-profile/1", "kind": "fitted", "metadata": {"source": "test: constant step"},
            "coefficients": {"intercept_s": step_s}, "residual_quantiles": {}}
    (tmp_path / "const.json").write_text(json.dumps(prof))


def queue_scenario(tmp_path, arrival="constant", target=30, slo=None, grid=None, rel_tol=0.02,
                   name="queue.yaml", extra_plan=None):
    """One request per step (16-token prompt, 1 output token, max_num_seqs 1): a single-server
    queue with deterministic service STEP_S."""
    write_const_profile(tmp_path)
    data = {
        "name": "queue", "seed": 0,
        "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1, "num_gpu_blocks": 64},
        "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 1},
        "cost_model": {"type": "fitted", "profile": "const.json"},
        "workload": {"num_requests": 200, "arrival": {"type": arrival, "rate": 10},
                     "prompt_len": {"type": "fixed", "value": 16}, "output_len": {"type": "fixed", "value": 1},
                     "client": {"type": "engine_direct"}},  # the queue alone: no API server's time
        "plan": {"target": {"rate": target},
                 "slo": slo or {"ttft_s": {"p99": 1.5 * STEP_S if arrival == "constant" else 0.2}},
                 "grid": grid or {"device": ["h100-sxm"]},
                 "search": {"seeds": 2, "rel_tol": rel_tol, "min_rate": 0.5, "min_requests": 500,
                            "confirm_requests": 1000, **(extra_plan or {})}},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------ memory accounting
def test_memory_llama8b_bf16_on_one_h100_matches_hand_calculation():
    m = memory_report(get_model("llama-3.1-8b"), get_device("h100-sxm"), tp=1, gpu_memory_utilization=0.9)
    # Hand count of Llama-3.1-8B: embeddings and LM head 2 x 128256 x 4096, per layer q/o 2 x 4096^2,
    # k/v 2 x 4096 x 1024, MLP 3 x 4096 x 14336, two norms 2 x 4096; final norm 4096.
    params = 2 * 128256 * 4096 + 32 * (2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert params == 8_030_261_248
    assert m["weight_bytes_per_gpu"] == 2 * params                       # about 16 GB in bf16
    assert abs(m["weight_bytes_per_gpu"] / 1e9 - 16.06) < 0.01
    assert m["kv_bytes_per_token"] == 128 * 1024                          # 2 x 32 layers x 8 heads x 128 x 2 B
    # CUDA reports 79.19 GiB of an H100 (vLLM's logs; nvidia-smi: 81559 MiB); vLLM's reserve (a recent release): activations of an 8192-token
    # dummy forward (gate_up out + SiLU: 8192 x 28672 x 2 B x 2; hidden states 4 x 8192 x 4096 x
    # 2 B), fp32 logits + probs of 1024 rows, 0.25 GiB non-torch on one GPU, 1.1 GiB of CUDA graphs.
    reserve = (8192 * 28672 * 2 * 2 + 4 * 8192 * 4096 * 2 + 1024 * 128256 * 4 * 2
               + int(0.25 * GiB) + int(1.1 * GiB))
    assert m["reserve_bytes"] == reserve
    # loaded with the weights: the rotary cos/sin cache, 131072 positions x 128 x 2 B
    rope = 131072 * 128 * 2
    assert m["loaded_bytes_per_gpu"] == 2 * params + rope
    kv = round(79.19 * 2**30) * 0.9 - 2 * params - rope - reserve
    assert m["kv_blocks"] == int(kv // (128 * 1024 * 16))
    assert m["kv_tokens"] == m["kv_blocks"] * 16
    # The simulator sizes its pool the same way (plus vLLM's null block).
    assert kv_cache_blocks(get_model("llama-3.1-8b"), get_device("h100-sxm"), 1, 16, 0.9) == m["kv_blocks"] + 1


def test_memory_reserve_follows_the_vllm_release():
    model, dev = get_model("qwen3-32b"), get_device("h100-sxm")
    forward = 8192 * 2 * 25600 * 2 * 2 + 4 * 8192 * 5120 * 2  # gate_up + SiLU, hidden states
    # Before 0.17 the sampler warm-up (sort-based top-k/top-p over 1024 rows of the 151,936-entry
    # vocabulary, 38.5 B each) is the peak by itself; no CUDA graphs are subtracted.
    old = memory_report(model, dev, 1, 0.9, vllm_version="0.16.0")
    assert 1024 * 151936 * 38.5 > forward
    # (and 0.13 GiB of non-torch memory on one GPU, as v0.16's logs print it)
    assert old["reserve_bytes"] == int(1024 * 151936 * 38.5) + int(0.13 * GiB)
    # 0.17-0.20: the forward's peak plus 8 B per sampler entry; 0.21 on: its CUDA-graph estimate too.
    mid = memory_report(model, dev, 1, 0.9, vllm_version="v0.19")
    assert mid["reserve_bytes"] == forward + 1024 * 151936 * 8 + int(0.25 * GiB)
    assert memory_report(model, dev, 1, 0.9)["reserve_bytes"] == mid["reserve_bytes"] + int(1.1 * GiB)
    # TP >= 2 holds NCCL and custom all-reduce buffers: 2.1 GiB of non-torch memory per GPU.
    tp2 = memory_report(model, dev, 2, 0.9, vllm_version="0.19")
    # (the MLP's activations split by TP, the hidden states whole on every GPU)
    assert tp2["reserve_bytes"] == (8192 * 25600 * 2 * 2 + 4 * 8192 * 5120 * 2 + 1024 * 151936 * 8
                                    + int(2.1 * GiB))
    # vLLM 0.16's own log for this deployment: "Available KV cache memory: 4.45 GiB"
    # (llm-d-benchmark config_explorer/empirical-vllm-memory-results.md); 6.5 GiB as 0.19 profiles it.
    assert old["kv_bytes_per_gpu"] / GiB == pytest.approx(4.45, rel=0.05)
    assert mid["kv_bytes_per_gpu"] / GiB > 1.4 * 4.45
    # Before 0.17, TP2 sets aside 0.55 GiB of non-torch memory for a dense model (v0.16's log of
    # Llama-3.3-70B FP8 TP2, whose pool it then matches within 5%) and 2.1 GiB for a mixture of experts.
    llama = get_model("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic")
    old_tp2 = memory_report(llama, dev, 2, 0.9, vllm_version="0.16")
    assert old_tp2["reserve_bytes"] == int(1024 * 128256 * 38.5) + int(0.55 * GiB)
    assert old_tp2["kv_bytes_per_gpu"] / GiB == pytest.approx(32.0, rel=0.05)
    oss = get_model("openai/gpt-oss-20b")
    assert memory_report(oss, dev, 2, 0.9, vllm_version="0.16")["reserve_bytes"] == (
        int(1024 * 201088 * 38.5) + int(2.1 * GiB))
    with pytest.raises(ValueError, match=r"deployment.vllm_version='latest'"):
        memory_report(model, dev, 1, 0.9, vllm_version="latest")


def test_moe_forward_reserve_against_vllm_019_logs():
    """A mixture of experts' profiling forward holds about 173 KB per token (two v0.19 logs); a log
    kept out of that figure, Llama-4-Scout bf16 at TP4, is then matched within 5%."""
    from sim.specs import MOE_FORWARD_BYTES_PER_TOKEN
    dev = get_device("h100-sxm")
    oss = get_model("openai/gpt-oss-20b")
    r = memory_report(oss, dev, 2, 0.9, vllm_version="0.19.0")
    # torch peak: the MoE forward (above the dense estimate here) plus fp32 logits + probs of 1024
    # rows of 201,088 entries; 2.1 GiB of non-torch memory at TP2
    assert r["reserve_bytes"] == MOE_FORWARD_BYTES_PER_TOKEN * 8192 + 1024 * 201088 * 8 + int(2.1 * GiB)
    # vLLM 0.19.0 logged "torch peak memory increase: 2.87GiB; non-torch forward increase memory: 2.07GiB"
    assert (r["reserve_bytes"] / GiB) == pytest.approx(2.87 + 2.07, abs=0.05)
    assert r["kv_bytes_per_gpu"] / GiB == pytest.approx(59.32, rel=0.05)
    # A dense model of the same shape keeps its own estimate: the term is the experts'.
    assert not get_model("qwen3-32b").is_moe
    scout = memory_report(get_model("meta-llama/Llama-4-Scout-17B-16E-Instruct"), dev, 4, 0.95, vllm_version="0.19.0")
    assert scout["kv_bytes_per_gpu"] / GiB == pytest.approx(16.75, rel=0.05)  # "Available KV cache memory: 16.75 GiB"


def test_memory_tp2_halves_weights_and_kv_per_token_per_gpu():
    m = memory_report(get_model("llama-3.1-8b"), get_device("h100-sxm"), tp=2)
    assert m["weight_bytes_per_gpu"] == 8_030_261_248 + 32 * 2 * 4096 + 4096  # norms replicated
    assert m["kv_bytes_per_token_per_gpu"] == 64 * 1024
    assert m["loaded_bytes_per_gpu"] == m["weight_bytes_per_gpu"] + 131072 * 128 * 2  # the rotary cache: whole
    assert m["kv_blocks"] == int((round(79.19 * 2**30) * 0.9 - m["loaded_bytes_per_gpu"] - m["reserve_bytes"])
                                 // (64 * 1024 * 16))


def test_prune_says_why_weights_or_kv_do_not_fit():
    base = {"deployment": {"model": "llama-3.1-70b"}, "cost_model": {"type": "analytic"},
            "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}
    cand = {"device": "h100-sxm", "tp": 1, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
            "policy": "fcfs", "router": "round_robin", "pd": None}
    why = prune_reason(base, cand, 110)
    assert why is not None and "model 141.1 GB" in why and "no KV cache" in why
    assert prune_reason(base, {**cand, "tp": 4}, 110) is None
    # 70B at tp=2 on H100: 70.6 GB of weights per GPU leave a small pool; a 200k-token request cannot fit.
    why = prune_reason(base, {**cand, "tp": 2}, 200_000)
    assert why is not None and "cannot hold the longest request (200000 tokens)" in why
    assert "tp=3 does not divide" in prune_reason(base, {**cand, "tp": 3}, 110)


# ------------------------------------------------------------------ steady-state probes
def _queue_data(tmp_path, arrival="poisson", max_num_seqs=1):
    write_const_profile(tmp_path)
    return {"name": "queue", "seed": 0,
            "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1, "num_gpu_blocks": 64},
            "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": max_num_seqs},
            "cost_model": {"type": "fitted", "profile": "const.json"},
            "workload": {"num_requests": 100, "arrival": {"type": arrival, "rate": 10},
                         "prompt_len": {"type": "fixed", "value": 16}, "output_len": {"type": "fixed", "value": 1},
                         "client": {"type": "engine_direct"}}}  # the queue alone: no API server's time


def test_a_probe_above_capacity_is_refused_as_unstable_whatever_its_slo(tmp_path):
    """Service 20 ms, one at a time: capacity 50 req/s. At 60 req/s the queue grows without end;
    with an SLO no queue could miss (p99 TTFT <= 10,000 s) the probe still fails, as unstable,
    and its window's served rate is the queue's capacity. At 30 req/s it passes."""
    from scenarios.probe import probe
    data = _queue_data(tmp_path)
    slo = {"percentiles": [["ttft_s", "p99", 1e4]], "attainment": None}
    search = {"seeds": [0, 1], "min_requests": 2000}
    over = probe(data, tmp_path, 60.0, 1, slo, search, 1.0)
    assert not over["ok"]
    v = over["runs"][-1]["violations"]
    assert [x["slo"] for x in v] == ["unstable"]
    assert over["runs"][-1]["stage"] == 2  # the prefix (from empty) met the SLO: the window decided
    assert v[0]["value"] == pytest.approx(1 / STEP_S, rel=0.03)  # served: the capacity
    ok = probe(data, tmp_path, 30.0, 1, slo, search, 1.0)
    assert ok["ok"] and [r["stage"] for r in ok["runs"]] == [2, 2]
    # The measured window: after the warm-up, before the cool-down, as the layout says.
    lay = ok["layout"]
    assert lay["measured"] == 2000 and lay["warmup"] >= 500 and lay["cooldown"] >= 50


def test_a_probe_that_misses_its_slo_early_stops_at_its_prefix(tmp_path):
    from scenarios.probe import probe
    data = _queue_data(tmp_path)
    slo = {"percentiles": [["ttft_s", "p99", 0.5 * STEP_S]], "attainment": None}  # below one step
    res = probe(data, tmp_path, 10.0, 1, slo, {"seeds": [0, 1]}, 1.0)
    assert not res["ok"] and len(res["runs"]) == 1
    run = res["runs"][0]
    # p99: 2,000 measured requests; the prefix is a quarter of them.
    assert run["stage"] == 1 and run["requests"] == 500 and res["layout"] is None


def test_md1_capacity_under_a_mean_ttft_slo_matches_theory(tmp_path):
    """Poisson arrivals, deterministic 20 ms service, FCFS, one server: M/D/1. Mean TTFT =
    D + rho D / (2 (1 - rho)) (Pollaczek-Khinchine). A mean TTFT SLO of 2D puts the capacity at
    rho = 2/3, 33.3 req/s; the plan's answer for one GPU must be within 5% of it."""
    data = _queue_data(tmp_path)
    data["plan"] = {"target": {"gpus": 1}, "slo": {"ttft_s": {"mean": 2 * STEP_S}},
                    "grid": {"device": ["h100-sxm"]},
                    "search": {"seeds": 2, "min_requests": 20000, "rel_tol": 0.01, "confirm_requests": 20000,
                               "alternatives": 0}}
    path = tmp_path / "md1.yaml"
    path.write_text(yaml.safe_dump(data))
    res = plan(path, workers=1, progress=False)
    w = res["winner"]
    rho = 2 / 3
    assert STEP_S + rho * STEP_S / (2 * (1 - rho)) == pytest.approx(2 * STEP_S)
    assert w["capacity_rps"] == pytest.approx(rho / STEP_S, rel=0.05)
    assert w["confirmation"]["pass"] and w["confirmation"]["requests"] >= 20000


def test_rate_search_brackets_the_capacity_of_a_deterministic_queue(tmp_path):
    """Constant arrivals, constant service 20 ms: TTFT is exactly 20 ms below 50 req/s, and above
    it the queue grows without end. The capacity interval of the winner brackets 50 req/s."""
    res = plan(queue_scenario(tmp_path, target=30, extra_plan={"refine_steps": 8}), workers=1, progress=False)
    c = res["winner"]
    lo, hi = c["rate_interval"]
    assert c["replicas"] == 1
    assert lo <= 1 / STEP_S <= hi and hi / lo <= 1.02 + 1e-9
    assert c["max_rate_per_replica"] == lo
    assert c["headroom"] == pytest.approx(lo / 30)
    assert c["predicted"]["p99_ttft_s"] == pytest.approx(STEP_S)


# ------------------------------------------------------------------ monotone, minimal answers
def test_more_traffic_never_needs_fewer_gpus_and_one_fewer_fails(tmp_path):
    gpus = []
    for target in (30, 70, 120, 170):
        res = plan(queue_scenario(tmp_path, target=target), workers=1, progress=False, target_rate=target)
        w = res["winner"]
        # Each replica serves up to 50 req/s of evenly spaced arrivals: ceil(target / 50) replicas.
        assert w["replicas"] == math.ceil(target / 50)
        assert w["predicted"]["p99_ttft_s"] <= 1.5 * STEP_S
        conf = w["confirmation"]
        assert conf["pass"] and conf["requests"] >= 1000
        if w["replicas"] > 1:
            assert conf["one_fewer"]["units"] == w["replicas"] - 1 and not conf["one_fewer"]["pass"]
        gpus.append(w["gpus"])
    assert gpus == sorted(gpus) and gpus[0] < gpus[-1]


def test_a_looser_slo_never_needs_more_gpus(tmp_path):
    path = queue_scenario(tmp_path, arrival="poisson", target=120, rel_tol=0.05)
    out = []
    for limit in (0.04, 0.08, 0.16, 0.32):
        res = plan(path, workers=1, progress=False, slo_override={"ttft_s": {"p99": limit}})
        out.append(res["winner"]["gpus"])
    assert out == sorted(out, reverse=True)
    assert out[0] > out[-1]


# ------------------------------------------------------------------ ranking, outputs, cache, Ray
def _ranked(res):
    return [(c["label"], c["status"], c["replicas"], c["max_rate_per_replica"], c["rate_interval"],
             c["cost_per_hour"], c["binding_slo"]) for c in res["candidates"]]


def test_ties_on_cost_break_on_headroom():
    """The issue's case: H200 TP8 x1 (4.16 req/s in all) and TP4 x2 (4.57) cost the same for a
    4.07 req/s target; the one with more headroom ranks first, whatever its rate per replica."""
    from scenarios.plan import rank_key
    from scenarios.search import State
    tp8 = State(key=0, bound=10.0, unit_cost=8 * 3.7, max_units=10, fail_n=0, pass_n=1, lo=4.16)
    tp4 = State(key=1, bound=10.0, unit_cost=4 * 3.7, max_units=10, fail_n=1, pass_n=2, lo=4.57)
    assert tp8.cost == pytest.approx(tp4.cost)
    assert sorted([tp8, tp4], key=rank_key) == [tp4, tp8]
    # Cost still comes first: a cheaper candidate with less headroom wins.
    tp4.pass_n, tp4.lo = 1, 4.10
    assert sorted([tp8, tp4], key=rank_key) == [tp4, tp8]


def test_ranking_by_cost_then_headroom_and_outputs(tmp_path, capsys):
    from scenarios.cli import main
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05,
                          grid={"device": ["h200", "h100-sxm", "a10g"], "max_num_seqs": [1, 2]},
                          extra_plan={"confirm_requests": 2000})
    out = tmp_path / "out"
    rc = main(["plan", str(path), "--out", str(out), "--workers", "1", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "plan.json").read_text())
    cands = res["candidates"]
    # Same step time on every device (the constant profile): the cheapest GPU wins, and of its two
    # equal-cost shapes the one running two requests per step (twice the capacity) ranks first.
    w = cands[0]
    assert w["device"] == "a10g" and w["status"] == "confirmed" and w["max_num_seqs"] == 2
    tie = next(c for c in cands if c["device"] == "a10g" and c["max_num_seqs"] == 1)
    if tie["cost_per_hour"] == w["cost_per_hour"]:
        assert w["headroom"] >= tie["headroom"]
    costs = [c["cost_per_hour"] for c in cands if c["status"] in ("confirmed", "estimated")]
    assert costs == sorted(costs)
    for key in ("device", "tp", "replicas", "gpus", "max_num_batched_tokens", "max_num_seqs", "policy",
                "max_rate_per_replica", "cost_per_hour", "headroom", "binding_slo", "predicted", "confirmation",
                "cost_model", "table_fallbacks", "probes"):
        assert key in w
    assert w["cost_per_hour"] == pytest.approx(w["gpus"] * 0.75)
    assert "p99_ttft_s" in w["predicted"] and "p99_tpot_s" in w["predicted"]
    conf = w["confirmation"]
    assert conf["pass"] and conf["requests"] >= 2000 and conf["simulated_s"] > 0 and len(conf["runs"]) == 2
    assert all(r["percentiles"]["ttft_s"]["p99"] <= 0.2 for r in conf["runs"])
    # Pasteable deploy lines: one vllm serve per replica on its own GPU and port.
    assert ("CUDA_VISIBLE_DEVICES=0 vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1 "
            "--max-num-seqs 2 --max-num-batched-tokens 64 --gpu-memory-utilization 0.9 --port 8000 &") in printed
    assert "servetwin serve --model ./Llama-3.1-8B-Instruct --port 8000" in printed
    assert "aiperf profile" in printed and "--request-rate 70" in printed and "won:" in printed
    assert (out / "plan.csv").read_text().splitlines()[0].startswith("rank,status,label,device,tp,replicas,gpus")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "vllm serve" in html and "fitted" in html
    assert res["pareto"] == []  # one-token outputs: no TPOT, so no per-user throughput to plot
    winner = yaml.safe_load((out / "winner.yaml").read_text())
    assert winner["deployment"]["replicas"] == w["replicas"] and winner["workload"]["arrival"]["rate"] == 70


def test_fixed_gpu_budget_gives_the_most_traffic(tmp_path):
    """Four GPUs of a queue with capacity 50 req/s each under constant arrivals: about 200 req/s,
    on four replicas; the next step up fails in the cluster."""
    path = queue_scenario(tmp_path, target=30, rel_tol=0.05, extra_plan={"confirm_requests": 2000})
    res = plan(path, workers=1, progress=False, target_gpus=4)
    w = res["winner"]
    assert res["mode"] == "gpus" and w["replicas"] == 4 and w["gpus"] == 4
    assert 4 / STEP_S / 1.06 <= w["capacity_rps"] <= 4 / STEP_S
    more = w["confirmation"]["one_step_more"]
    assert more["rate"] > 4 / STEP_S and not more["pass"]


def test_cache_rerun_only_simulates_new_candidates(tmp_path):
    out = tmp_path / "out"
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05, grid={"device": ["h100-sxm"]},
                          extra_plan={"confirm_requests": 1000})
    first = plan(path, out, workers=1, progress=False)
    assert first["simulated_by_kind"].get("probe_task", 0) >= 1
    again = plan(path, out, workers=1, progress=False)
    assert again["simulated_tasks"] == 0
    assert _ranked(again) == _ranked(first)


def test_cache_is_not_served_to_other_code(tmp_path, monkeypatch):
    """A cost-model or scheduler change must not be answered with results cached before it."""
    import scenarios.runner as runnermod
    out = tmp_path / "out"
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05, grid={"device": ["h100-sxm"]},
                          extra_plan={"confirm_requests": 1000})
    first = plan(path, out, workers=1, progress=False)
    monkeypatch.setattr(runnermod, "code_digest", lambda: "other-code")
    again = plan(path, out, workers=1, progress=False)
    assert again["simulated_tasks"] == first["simulated_tasks"] and _ranked(again) == _ranked(first)


def test_ray_run_equals_local_run(tmp_path):
    import ray
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05,
                          grid={"device": ["h100-sxm", "a100-80g"], "policy": ["fcfs", "priority"]},
                          extra_plan={"confirm_requests": 1000})
    local = plan(path, None, workers=2, progress=False)
    try:
        on_ray = plan(path, None, workers=2, progress=False, ray_address="local")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert _ranked(on_ray) == _ranked(local)
    assert on_ray["winner"]["label"] == local["winner"]["label"]


def test_runs_reused_across_max_num_seqs_are_identical_to_fresh_runs():
    """A run whose max_num_seqs never acted is the same run under any cap above its peak."""
    base = {"deployment": {"model": "llama-3.1-8b", "device": "h100-sxm"}, "cost_model": {"type": "analytic"},
            "scheduler": {"max_num_batched_tokens": 4096, "max_num_seqs": 1024},
            "workload": {"num_requests": 120, "arrival": {"type": "poisson", "rate": 8},
                         "prompt_len": {"type": "lognormal", "mean": 600, "sigma": 0.5},
                         "output_len": {"type": "lognormal", "mean": 100, "sigma": 0.5}}}
    big = measure(base, None, 3)
    assert big["max_in_system"] < 64
    small = measure(set_field(base, "scheduler.max_num_seqs", big["max_in_system"] + 1), None, 3)
    assert small == big
    # ...and a cap that does act changes the run.
    tight = measure(set_field(at_rate(base, 30), "scheduler.max_num_seqs", 2), None, 3)
    assert tight["ttft_s"]["p99"] > measure(at_rate(base, 30), None, 3)["ttft_s"]["p99"]


# ------------------------------------------------------------------ bad plan sections
@pytest.mark.parametrize("edit, field", [
    (lambda p: p["grid"].update(colour=["red"]), "plan.grid.colour"),
    (lambda p: p.update(budget=3), "plan.budget"),
    (lambda p: p["slo"].update(ttft_s={"p99": 0}), "plan.slo.ttft_s.p99=0"),
    (lambda p: p["slo"].update(tpot_s={"p99": -0.05}), "plan.slo.tpot_s.p99=-0.05"),
    (lambda p: p["slo"].update(ttft_s={"p100": 1.0}), "plan.slo.ttft_s.p100"),
    (lambda p: p["grid"].update(tp=[]), "plan.grid.tp=[]"),
    (lambda p: p["grid"].update(device=["tpu-v9"]), "plan.grid.device='tpu-v9'"),
    (lambda p: p["search"].update(seeds=0), "plan.search.seeds=0"),
    (lambda p: p["search"].update(requests=200), "plan.search.requests=200: probes are steady-state"),
    (lambda p: p["target"].update(rate=0), "plan.target.rate=0"),
    (lambda p: p["target"].update(gpus=8), "give exactly one of rate"),
    (lambda p: p["slo"].update(ttft_s={"avg": 1.0}), "plan.slo.ttft_s.avg"),
    (lambda p: p.pop("slo"), "plan.slo: required"),
])
def test_bad_plan_section_is_refused_naming_the_field(tmp_path, edit, field):
    path = queue_scenario(tmp_path)
    data = yaml.safe_load(path.read_text())
    edit(data["plan"])
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError) as e:
        plan(path, workers=1, progress=False)
    assert field in str(e.value)


def test_nothing_fits_is_refused(tmp_path):
    path = queue_scenario(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["deployment"]["model"] = "llama-3.1-70b"
    data["cost_model"] = {"type": "analytic"}
    data["plan"]["grid"] = {"device": ["a10g", "l40s"], "tp": [1]}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError) as e:
        plan(path, workers=1, progress=False)
    assert "plan.grid: nothing fits" in str(e.value) and "a10g tp1" in str(e.value)


def test_missing_plan_section_is_refused():
    with pytest.raises(PlanError, match="plan: required"):
        plan("scenarios/quickstart.yaml", workers=1, progress=False)


def test_target_rate_rescales_a_trace(tmp_path):
    """A trace's timestamps are scaled to the plan's rate (the planner's probes and cluster check)."""
    from sim.scenario import parse_scenario
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:00:{i // 10:02d}.{(i % 10) * 100000:07d},{100 + i},{10 + i % 7}" for i in range(41)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = {"deployment": {"model": "llama-3.1-8b"}, "cost_model": {"type": "analytic"},
            "workload": {"trace": {"path": "t.csv", "time_scale": 3.0}}}
    sc = parse_scenario(at_rate(data, 20.0), base_dir=tmp_path)
    d = sc.workload.describe()
    assert d["num_requests"] == 41 and d["mean_rate_rps"] == pytest.approx(20.0)
    assert list(sc.workload.prompt_len[:3]) == [100, 101, 102]


def test_an_unknown_model_is_one_error_naming_it(tmp_path):
    path = queue_scenario(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["deployment"]["model"] = "acme/NoSuchModel-13B"
    data["cost_model"] = {"type": "analytic"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError) as e:
        plan(path, workers=1, progress=False)
    assert "deployment.model" in str(e.value) and "acme/NoSuchModel-13B" in str(e.value)
    assert "nothing fits" not in str(e.value)


def test_tp_beyond_one_node_is_pruned_unless_the_interconnect_is_declared(tmp_path):
    base = {"deployment": {"model": "llama-3.1-70b"}, "cost_model": {"type": "analytic"},
            "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}
    cand = {"device": "h100-sxm", "tp": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
            "policy": "fcfs", "router": "round_robin", "pd": None}
    assert "spans more than one node of 8 h100-sxm GPUs" in prune_reason(base, cand, 110)
    base["deployment"]["interconnect"] = {"bandwidth_gb_s": 50}
    assert prune_reason(base, cand, 110) is None


def test_every_catalog_model_is_served_from_a_checkpoint_of_its_own_architecture():
    # A plan's vllm serve line names a Hugging Face repository (not a catalog name), which must load
    # as the architecture and weight format the plan timed; its fp8 checkpoint as the same in fp8
    from scenarios.candidates import FP8_HF_NAMES, hf_checkpoint
    from sim.specs import MODELS
    for name, m in MODELS.items():
        repo, quant = hf_checkpoint(name, None, m.weight_dtype)
        assert "/" in repo and quant is None, name
        served = get_model(repo)
        assert (served.name, served.weight_dtype, served.expert_dtype) == (name, m.weight_dtype, m.expert_dtype), repo
    for name, repo in FP8_HF_NAMES.items():
        assert get_model(repo).name == name and get_model(repo).weight_dtype in ("fp8", "fp8_block"), repo


def test_a_plan_timed_with_fp8_weights_is_served_from_an_fp8_checkpoint():
    # The serve line must load what the simulation timed: fp8 weights of a model whose own
    # checkpoint is bf16 come from its published fp8 checkpoint, else from vLLM's online fp8
    # quantization of the bf16 one; a checkpoint that is fp8 already, or bf16 timed as bf16, as is.
    from scenarios.candidates import hf_checkpoint
    from scenarios.plan_report import deploy_commands
    assert hf_checkpoint("qwen3-235b-a22b", "fp8_block", "bfloat16") == ("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", None)
    assert hf_checkpoint("llama-3.1-8b", "fp8", "bfloat16") == ("nvidia/Llama-3.1-8B-Instruct-FP8", None)
    assert hf_checkpoint("mistral-7b", "fp8", "bfloat16") == ("mistralai/Mistral-7B-Instruct-v0.3", "fp8")
    assert hf_checkpoint("qwen3-235b-a22b", None, "bfloat16") == ("Qwen/Qwen3-235B-A22B-Instruct-2507", None)
    assert hf_checkpoint("deepseek-v3", "fp8_block", "fp8_block") == ("deepseek-ai/DeepSeek-V3", None)
    c = {"replicas": 1, "tp": 2, "device": "h100-sxm", "router": "round_robin", "policy": "fcfs",
         "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    base = {"gpu_memory_utilization": 0.9, "target_rate": 10, "workload_means": {}, "model": "mistral-7b",
            "search": {"confirm_requests": 8000}}
    online = deploy_commands({**base, "hf_model": "mistralai/Mistral-7B-Instruct-v0.3", "serve_quantization": "fp8"}, c)
    plain = deploy_commands({**base, "hf_model": "mistralai/Mistral-7B-Instruct-v0.3", "serve_quantization": None}, c)
    assert [x for x in online if "vllm serve" in x][0].endswith("--quantization fp8 --port 8000 &")
    assert not any("--quantization" in x for x in plain)


def test_a_winner_that_fails_its_cluster_check_reopens_what_its_probes_ruled_out():
    """Candidate A ($3.70 a unit) passes its unit probe on one unit but its cluster check needs two
    ($7.40). Candidate B ($6 a unit) was ruled out as dearer than A's one unit while the search
    ran; against A's confirmed $7.40 it is searched after all, and one unit of it wins."""
    import math

    from scenarios.plan import PlanSpec, plan_rate
    from scenarios.search import State

    spec = PlanSpec(target_rate=20.0, target_gpus=None, slo=[], attainment=None, grid={}, prices={},
                    seeds=[0], min_requests=None, rel_tol=0.1, min_rate=0.05, refine_steps=0,
                    alternatives=1, confirm_requests=100, max_extra_replicas=4, stable_tol=0.05)
    a = State(key=0, bound=40.0, unit_cost=3.70, max_units=400)
    b = State(key=1, bound=50.0, unit_cost=6.00, max_units=400)
    for s in (a, b):
        s.fail_n = max(0, math.ceil(spec.target_rate / s.bound - 1e-9) - 1)
    probed, checked = [], []

    def run_probes(asks):
        probed.extend((s.key, n) for s, _rate, n in asks)
        return [{"ok": True} for _ in asks]          # every unit probe passes on one unit

    def run_confirms(asks):
        checked.extend((s.key, n) for s, _rate, n in asks)
        return [{"ok": not (s.key == 0 and n == 1)} for s, _rate, n in asks]  # A's one unit fails

    got = plan_rate([a, b], spec, run_probes, run_confirms, first_wave=1)
    assert (1, 1) in probed and b.pass_n == 1 and b.cost == 6.0   # B searched after A's check
    assert got["results"][1][1]["ok"] and (1, 1) in checked      # and its one unit confirmed
    assert got["results"][0][1]["ok"] is False and a.pass_n == 2  # A's failure kept in the results
    from scenarios.candidates import rank_key
    assert min([a, b], key=rank_key) is b


def test_the_capacity_bound_of_a_data_parallel_unit_covers_what_its_ranks_serve():
    # The bound is an upper bound on a unit's capacity; a unit of two data-parallel ranks serves
    # about twice one rank. Saturate the unit (every request at once) and compare its throughput.
    from scenarios.bounds import capacity_bound
    from sim.scenario import parse_scenario, run_scenario
    data = {"deployment": {"model": "qwen3-30b-a3b", "device": "h100-sxm", "tp": 1, "data_parallel": 2,
                           "expert_parallel": True},
            "scheduler": {"max_num_seqs": 64},
            "workload": {"num_requests": 600, "arrival": {"type": "poisson", "rate": 1e4},
                         "prompt_len": {"type": "fixed", "value": 256}, "output_len": {"type": "fixed", "value": 64}}}
    sc = parse_scenario(data)
    s = run_scenario(sc).summary
    served = s["requests"]["completed"] / s["duration_s"]
    bound = capacity_bound(sc, None)
    assert bound >= served
    one = parse_scenario({**data, "deployment": {**data["deployment"], "data_parallel": 1, "tp": 1,
                                                 "expert_parallel": False}})
    assert bound > 1.5 * capacity_bound(one, None)  # two ranks' worth

"""Capacity planner (scenarios/plan.py): memory accounting, the rate search against a queue whose
capacity is known, monotone answers, cluster checks, the cache, Ray = local, bad plan sections."""
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


def queue_scenario(tmp_path, arrival="constant", target=30, slo=None, grid=None, requests=200, rel_tol=0.02,
                   name="queue.yaml", extra_plan=None):
    """One request per step (16-token prompt, 1 output token, max_num_seqs 1): a single-server
    queue with deterministic service STEP_S."""
    write_const_profile(tmp_path)
    data = {
        "name": "queue", "seed": 0,
        "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1, "num_gpu_blocks": 64},
        "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 1},
        "cost_model": {"type": "fitted", "profile": "const.json"},
        "workload": {"num_requests": requests, "arrival": {"type": arrival, "rate": 10},
                     "prompt_len": {"type": "fixed", "value": 16}, "output_len": {"type": "fixed", "value": 1}},
        "plan": {"target": {"rate": target},
                 "slo": slo or {"ttft_s": {"p99": 1.5 * STEP_S if arrival == "constant" else 0.2}},
                 "grid": grid or {"device": ["h100-sxm"]},
                 "search": {"seeds": 2, "requests": requests, "rel_tol": rel_tol, "min_rate": 0.5,
                            "max_rate": 1000, **(extra_plan or {})}},
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
    # An H100 reports 81559 MiB; vLLM's reserve: activations of an 8192-token dummy forward
    # (gate_up out + SiLU: 8192 x 28672 x 2 B x 2; hidden states 4 x 8192 x 4096 x 2 B), fp32
    # logits + probs of 1024 rows, 0.6 GiB non-torch and 0.5 GiB of CUDA graphs.
    reserve = (8192 * 28672 * 2 * 2 + 4 * 8192 * 4096 * 2 + 1024 * 128256 * 4 * 2
               + int(0.6 * GiB) + int(0.5 * GiB))
    assert m["reserve_bytes"] == reserve
    kv = 81559 * 2**20 * 0.9 - 2 * params - reserve
    assert m["kv_blocks"] == int(kv // (128 * 1024 * 16))
    assert m["kv_tokens"] == m["kv_blocks"] * 16
    # The simulator sizes its pool the same way (plus vLLM's null block).
    assert kv_cache_blocks(get_model("llama-3.1-8b"), get_device("h100-sxm"), 1, 16, 0.9) == m["kv_blocks"] + 1


def test_memory_tp2_halves_weights_and_kv_per_token_per_gpu():
    m = memory_report(get_model("llama-3.1-8b"), get_device("h100-sxm"), tp=2)
    assert m["weight_bytes_per_gpu"] == 8_030_261_248 + 32 * 2 * 4096 + 4096  # norms replicated
    assert m["kv_bytes_per_token_per_gpu"] == 64 * 1024
    assert m["kv_blocks"] == int((81559 * 2**20 * 0.9 - m["weight_bytes_per_gpu"] - m["reserve_bytes"])
                                 // (64 * 1024 * 16))


def test_prune_says_why_weights_or_kv_do_not_fit():
    base = {"deployment": {"model": "llama-3.1-70b"}, "cost_model": {"type": "analytic"},
            "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}
    cand = {"device": "h100-sxm", "tp": 1, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
            "policy": "fcfs", "router": "round_robin", "pd": None}
    why = prune_reason(base, cand, 110)
    assert why is not None and "weights 141.1 GB" in why and "no KV cache" in why
    assert prune_reason(base, {**cand, "tp": 4}, 110) is None
    # 70B at tp=2 on H100: 70.6 GB of weights per GPU leave a small pool; a 200k-token request cannot fit.
    why = prune_reason(base, {**cand, "tp": 2}, 200_000)
    assert why is not None and "cannot hold the longest request (200000 tokens)" in why
    assert "tp=3 does not divide" in prune_reason(base, {**cand, "tp": 3}, 110)


# ------------------------------------------------------------------ the rate search
def test_rate_search_brackets_the_capacity_of_a_deterministic_queue(tmp_path):
    """Constant arrivals, constant service 20 ms: TTFT is exactly 20 ms below 50 req/s and grows
    by (i x (20 ms - 1/rate)) for the i-th request above it. With p99 TTFT <= 30 ms and 200
    requests, the threshold is where 197 x (0.02 - 1/r) = 0.01: r* = 50.13 req/s."""
    r_star = 1 / (STEP_S - 0.01 / 197)
    res = plan(queue_scenario(tmp_path), workers=1, progress=False)
    c = res["candidates"][0]
    lo, hi = c["rate_interval"]
    assert lo <= r_star <= hi
    assert hi / lo <= 1.02 + 1e-9
    assert c["max_rate_per_replica"] == lo
    assert c["binding_slo"] == "p99 ttft_s"
    # Every probe ran both seeds unless its first seed already failed.
    for p in c["probes"]:
        assert p["seeds"] == ([0, 1] if p["ok"] else [0])
        assert (p["rate"] <= lo) == p["ok"] or p["rate"] > r_star


def test_rate_search_on_poisson_arrivals_stays_below_capacity(tmp_path):
    """M/D/1: no rate at or above 1/service meets a p99 TTFT SLO; a loose one comes near it."""
    res = plan(queue_scenario(tmp_path, arrival="poisson", slo={"ttft_s": {"p99": 0.2}}), workers=1, progress=False)
    lo, hi = res["candidates"][0]["rate_interval"]
    assert 25 < lo < 50
    assert hi <= 1.02 * lo + 1e-9


# ------------------------------------------------------------------ monotone answers
def test_more_traffic_never_needs_fewer_gpus(tmp_path):
    gpus = []
    for target in (30, 70, 120, 170):
        res = plan(queue_scenario(tmp_path, target=target), workers=1, progress=False, target_rate=target)
        w = res["winner"]
        # Each replica serves up to 50 req/s of evenly spaced arrivals: ceil(target / 50) replicas.
        assert w["replicas"] == math.ceil(target / 50)
        assert w["predicted"]["p99_ttft_s"] <= 1.5 * STEP_S
        gpus.append(w["gpus"])
    assert gpus == sorted(gpus) and gpus[0] < gpus[-1]


def test_a_looser_slo_never_needs_more_gpus(tmp_path):
    path = queue_scenario(tmp_path, arrival="poisson", target=120, rel_tol=0.05)
    out = []
    for limit in (0.04, 0.08, 0.16, 0.32):
        res = plan(path, workers=1, progress=False, slo_override={"ttft_s": {"p99": limit}})
        w = res["winner"]
        out.append((w["gpus"], w["max_rate_per_replica"]))
    assert [g for g, _ in out] == sorted([g for g, _ in out], reverse=True)
    assert [r for _, r in out] == sorted(r for _, r in out)
    assert out[0][0] > out[-1][0]


# ------------------------------------------------------------------ ranking, outputs, cache, Ray
def _ranked(res):
    return [(c["label"], c["status"], c["replicas"], c["max_rate_per_replica"], c["rate_interval"],
             c["cost_per_hour"], c["binding_slo"]) for c in res["candidates"]]


def test_ranking_by_cost_and_outputs(tmp_path, capsys):
    from scenarios.cli import main
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05,
                          grid={"device": ["h200", "h100-sxm", "a10g"], "policy": ["fcfs", "priority"]})
    out = tmp_path / "out"
    rc = main(["plan", str(path), "--out", str(out), "--workers", "1", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "plan.json").read_text())
    cands = res["candidates"]
    # Same step time on every device (the constant profile): the cheapest GPU wins.
    assert cands[0]["device"] == "a10g" and cands[0]["status"] == "confirmed"
    costs = [c["cost_per_hour"] for c in cands if c["status"] == "confirmed"]
    assert costs == sorted(costs)
    for key in ("device", "tp", "replicas", "gpus", "max_num_batched_tokens", "max_num_seqs", "policy",
                "max_rate_per_replica", "cost_per_hour", "binding_slo", "predicted"):
        assert key in cands[0]
    w = cands[0]
    assert w["cost_per_hour"] == pytest.approx(w["gpus"] * 0.75)
    assert "p99_ttft_s" in w["predicted"] and "p99_tpot_s" in w["predicted"]
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1 --max-num-seqs 1 " \
           "--max-num-batched-tokens 64 --gpu-memory-utilization 0.9" in printed
    assert "servetwin serve" in printed and "won because" in printed
    assert (out / "plan.csv").read_text().splitlines()[0].startswith("rank,status,label,device,tp,replicas,gpus")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "vllm serve" in html


def test_cache_rerun_only_simulates_new_candidates(tmp_path):
    out = tmp_path / "out"
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05, grid={"device": ["h100-sxm"]})
    first = plan(path, out, workers=1, progress=False)
    assert first["simulated_by_kind"].get("search") == 1
    again = plan(path, out, workers=1, progress=False)
    assert again["simulated_tasks"] == 0
    assert _ranked(again) == _ranked(first)
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05, grid={"device": ["h100-sxm", "h200"]})
    more = plan(path, out, workers=1, progress=False)
    assert more["simulated_by_kind"].get("search") == 1  # only h200's rate search is new
    assert more["cached_tasks"] >= 1


def test_cache_is_not_served_to_other_code(tmp_path, monkeypatch):
    """A cost-model or scheduler change must not be answered with results cached before it."""
    import scenarios.plan as planmod
    out = tmp_path / "out"
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05, grid={"device": ["h100-sxm"]})
    first = plan(path, out, workers=1, progress=False)
    assert first["simulated_by_kind"].get("search") == 1
    monkeypatch.setattr(planmod, "code_digest", lambda: "other-code")
    again = plan(path, out, workers=1, progress=False)
    assert again["simulated_by_kind"].get("search") == 1 and _ranked(again) == _ranked(first)


def test_ray_run_equals_local_run(tmp_path):
    import ray
    path = queue_scenario(tmp_path, arrival="poisson", target=70, rel_tol=0.05,
                          grid={"device": ["h100-sxm", "a100-80g"], "policy": ["fcfs", "priority"]})
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
    (lambda p: p["search"].update(seeds=1), "plan.search.seeds=1"),
    (lambda p: p["target"].update(rate=0), "plan.target.rate=0"),
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
    from scenarios.schema import parse_scenario
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:00:{i // 10:02d}.{(i % 10) * 100000:07d},{100 + i},{10 + i % 7}" for i in range(41)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = {"deployment": {"model": "llama-3.1-8b"}, "cost_model": {"type": "analytic"},
            "workload": {"trace": {"path": "t.csv", "time_scale": 3.0}}}
    sc = parse_scenario(at_rate(data, 20.0), base_dir=tmp_path)
    d = sc.workload.describe()
    assert d["num_requests"] == 41 and d["mean_rate_rps"] == pytest.approx(20.0)
    assert list(sc.workload.prompt_len[:3]) == [100, 101, 102]

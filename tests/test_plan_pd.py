"""Disaggregated prefill/decode pools (sim/disagg.py) and P/D candidates in a plan."""
from __future__ import annotations

import pytest

from engine.core.features import BatchFeatures
from sim.scenario import ScenarioError, parse_scenario, run_scenario

KV_PER_TOKEN = 128 * 1024  # Llama-3.1-8B bf16


def pd_scenario(prompt, output, n=1, rate=1.0, bw=50.0, latency=1e-4, max_num_seqs=64, blocks=None,
                arrival="constant", **pd):
    dep = {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1,
           "pd": {"prefill_replicas": 1, "decode_replicas": 1, "link_bandwidth_gb_s": bw,
                  "link_latency_s": latency, **pd}}
    if blocks:
        dep["num_gpu_blocks"] = blocks
    return {"deployment": dep, "cost_model": {"type": "analytic"},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": max_num_seqs},
            "output": {"record_token_times": True},
            "workload": {"num_requests": n, "arrival": {"type": arrival, "rate": rate},
                         "prompt_len": {"type": "fixed", "value": prompt},
                         "output_len": {"type": "fixed", "value": output}}}


@pytest.mark.parametrize("prompt, bw", [(1000, 50.0), (4000, 50.0), (4000, 12.5)])
def test_kv_transfer_time_is_bytes_over_bandwidth_plus_latency(prompt, bw):
    sc = parse_scenario(pd_scenario(prompt, 4, bw=bw, latency=2e-4))
    res = run_scenario(sc)
    expected = prompt * KV_PER_TOKEN / (bw * 1e9) + 2e-4
    assert res.summary["pd"]["kv_transfer_s"]["mean"] == pytest.approx(expected, rel=1e-12)
    rec = res.records[0]
    assert rec.finish_reason == "length" and rec.num_output_tokens == 4
    assert len(rec.token_times_s) == 4
    # The client's first token needs the KV on the decode replica first, then one decode step
    # (vLLM's decode engine streams every token); with `first_token: prefill` the prefill's token
    # is sent and the transfer falls between the first two.
    prefill_token = run_scenario(parse_scenario(pd_scenario(prompt, 4, bw=bw, latency=2e-4, first_token="prefill")))
    p = prefill_token.records[0]
    assert rec.token_times_s[0] - p.token_times_s[0] > expected
    assert p.token_times_s[1] - p.token_times_s[0] > expected
    gap = rec.token_times_s[1] - rec.token_times_s[0]  # one decode step, no transfer
    assert gap == pytest.approx(p.token_times_s[2] - p.token_times_s[1], rel=1e-3) and gap < p.token_times_s[1] - p.token_times_s[0]


def test_transfer_grows_linearly_with_prompt_and_inversely_with_bandwidth():
    def t(prompt, bw):
        return run_scenario(parse_scenario(pd_scenario(prompt, 2, bw=bw, latency=0.0))).summary["pd"]["kv_transfer_s"]["mean"]
    assert t(4000, 50) == pytest.approx(4 * t(1000, 50))
    assert t(2000, 10) == pytest.approx(5 * t(2000, 50))


def test_full_decode_pool_stalls_transfers_and_loses_nothing():
    """30 requests at 200 req/s into a decode pool that runs 2 at a time."""
    sc = parse_scenario(pd_scenario(300, 40, n=30, rate=200.0, max_num_seqs=2))
    res = run_scenario(sc)
    s = res.summary
    assert s["requests"]["completed"] == 30 and s["requests"]["rejected"] == 0
    assert all(r.num_output_tokens == 40 for r in res.records)
    assert s["pd"]["never_transferred"] == 0
    assert s["pd"]["wait_for_room_s"]["max"] > 0.1  # transfers waited for room
    steps = res.steps
    decode = steps[steps["replica"] == 1]
    assert decode["num_running"].max() <= 2
    # Decoding is serialised two at a time: the last finish is at least 15 rounds of 39 decode steps in.
    assert max(r.finish_s for r in res.records) > 15 * 39 * 0.005


def test_decode_pool_short_of_kv_blocks_waits_and_finishes_everything():
    sc = parse_scenario(pd_scenario(200, 100, n=12, rate=100.0, blocks=48))
    res = run_scenario(sc)
    assert res.summary["requests"]["completed"] == 12
    assert all(r.num_output_tokens == 100 for r in res.records)
    assert res.summary["pd"]["wait_for_room_s"]["max"] > 0


def test_ttft_holds_prefill_transfer_and_the_decode_step_and_tpot_the_decode_steps():
    # One request alone: the client's first token is the decode engine's (vLLM's P/D, Dynamo), after
    # the prefill step, the transfer and one decode step over the arrived KV; its TPOT is the decode
    # pool's steps, which the aggregated engine's decode steps equal (same cost model, no prefill).
    agg = dict(pd_scenario(2000, 50))
    agg["deployment"] = {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1}
    a = run_scenario(parse_scenario(agg)).records[0]
    sc = parse_scenario(pd_scenario(2000, 50, bw=1.0))
    d = run_scenario(sc).records[0]
    transfer = 2000 * KV_PER_TOKEN / 1e9 + 1e-4
    step = sc.pd["decode"][1].step_time(BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=2000))
    assert d.first_token_s - d.arrival_s == pytest.approx(a.first_token_s - a.arrival_s + transfer + step, rel=1e-6)
    assert d.num_output_tokens == 50
    assert d.last_token_s - d.first_token_s == pytest.approx(a.last_token_s - a.first_token_s, rel=0.02)
    # a server that streams the prefill's token: TTFT is the prefill's, the transfer in TPOT
    p = run_scenario(parse_scenario(pd_scenario(2000, 50, bw=1.0, first_token="prefill"))).records[0]
    assert p.first_token_s - p.arrival_s == pytest.approx(a.first_token_s - a.arrival_s)  # same prefill step
    assert (p.last_token_s - p.first_token_s) - (a.last_token_s - a.first_token_s) > 0.9 * transfer


def test_pd_refuses_cancellation_and_bad_tp():
    data = pd_scenario(100, 10)
    data["workload"]["cancellation"] = {"deadline_s": 5}
    with pytest.raises(ScenarioError, match="workload.cancellation"):
        parse_scenario(data)
    data = pd_scenario(100, 10, decode_tp=3)
    with pytest.raises(ScenarioError, match="deployment.pd.decode_tp=3"):
        parse_scenario(data)
    data = pd_scenario(100, 10)
    data["deployment"]["pd"]["prefil_replicas"] = 2
    with pytest.raises(ScenarioError, match="deployment.pd.prefil_replicas"):
        parse_scenario(data)


def test_plan_evaluates_pd_candidates_as_units(tmp_path):
    import yaml

    from scenarios.plan import plan
    from scenarios.plan_report import deploy_commands
    data = pd_scenario(500, 50, n=100, rate=5.0, arrival="poisson")
    data["deployment"].pop("pd")
    data["output"] = {}
    data["plan"] = {"target": {"rate": 20}, "slo": {"ttft_s": {"p99": 0.5}, "tpot_s": {"p99": 0.05}},
                    "grid": {"pd": [None, {"prefill_replicas": 1, "decode_replicas": 2}]},
                    "search": {"seeds": 2, "min_requests": 300, "rel_tol": 0.2, "confirm_requests": 1000}}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data))
    res = plan(path, workers=1, progress=False)
    by = {c["label"]: c for c in res["candidates"]}
    unit = by["h100-sxm P1xtp1+D2xtp1 B2048 S64 fcfs"]
    assert unit["gpus_per_replica"] == 3
    if unit["gpus"] is not None:
        assert unit["gpus"] == 3 * unit["replicas"]
    assert res["winner"] is not None and res["winner"]["confirmation"]["pass"]
    cmds = deploy_commands(res, {**unit, "replicas": 2})
    text = "\n".join(cmds)
    assert "kv_transfer_config" not in text and "--kv-transfer-config" in text
    assert "# prefill pool: 2 replica(s), tensor parallel 1" in text
    assert "# decode pool: 4 replica(s), tensor parallel 1" in text
    assert sum(line.startswith("CUDA_VISIBLE_DEVICES=") for line in cmds) == 6


def test_pd_and_aggregated_pools_get_one_timing_composition():
    """Every pool's step time comes from one builder: with kernel tables (GPU time + CPU work,
    async scheduling by default) the prefill and decode pools time a step exactly as the
    aggregated replicas do, max(cpu, gpu), not the bare model's cpu + gpu."""
    from engine.core.features import BatchFeatures
    from sim.cpu_work import WithCpuWork
    data = pd_scenario(500, 50)
    data["cost_model"] = {"type": "kernels"}
    sc = parse_scenario(data)
    agg = parse_scenario({**data, "deployment": {k: v for k, v in data["deployment"].items() if k != "pd"}})
    f = BatchFeatures(num_reqs=3, num_decode_reqs=2, decode_context_tokens=900)
    f.add(400, 0)
    f.num_reqs = 3
    pre, dec = sc.pd["prefill"][1], sc.pd["decode"][1]
    for pool in (pre, dec):
        assert isinstance(pool, WithCpuWork) and pool.async_scheduling
        assert pool.step_time(f) == agg.cost_model.step_time(f)
    g, c = pre.gpu_time(f), pre.cpu_time(f)
    assert pre.step_time(f) == pytest.approx(max(g, c)) and max(g, c) < g + c
    # The decode pool prices an arrived prompt as one decode reading its KV, through the same
    # composition (its CPU work and async scheduling included).
    from sim.disagg import KVArrivedCost
    kv = KVArrivedCost(dec)
    d = BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=500)
    arrived = BatchFeatures(num_reqs=1)
    arrived.add(500, 0)
    assert kv.step_time(arrived) == pytest.approx(dec.step_time(d)) and kv.async_scheduling
    # ...and a scenario's own CPU work reaches every pool alike.
    data["scheduler"]["cpu_work"] = {"step_s": 0.05}
    sc = parse_scenario(data)
    assert sc.pd["prefill"][1].step_time(f) == pytest.approx(0.05 + 3 * 2e-5 + (400 + 2) * 5e-8)
    assert sc.pd["decode"][1].step_time(f) == sc.cost_model.step_time(f)


def test_pd_sizes_pools_not_replicas_and_simulate_reports_transfers(tmp_path, capsys):
    import yaml

    from scenarios.cli import main
    data = pd_scenario(500, 20, n=20, rate=10.0)
    data["deployment"]["replicas"] = 2
    with pytest.raises(ScenarioError, match="deployment.replicas=2: with deployment.pd"):
        parse_scenario(data)
    data["deployment"].pop("replicas")
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["simulate", str(path), "--out", str(tmp_path / "o"), "--no-progress", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "P/D: 1 prefill + 1 decode replicas; KV transfer mean 1.41 ms" in out  # 500 x 128 KiB / 50 GB/s + 0.1 ms

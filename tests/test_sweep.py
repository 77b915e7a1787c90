"""What-if sweeps (scenarios/sweep.py)."""
from __future__ import annotations

import json

import pytest
import yaml

from scenarios.sweep import SweepError, knee, parse_set, sweep


def test_parse_set_reads_values_as_yaml():
    assert parse_set(["scheduler.max_num_batched_tokens=512,2048", "scheduler.policy=fcfs,priority",
                      "scheduler.enable_prefix_caching=true"]) == {
        "scheduler.max_num_batched_tokens": [512, 2048], "scheduler.policy": ["fcfs", "priority"],
        "scheduler.enable_prefix_caching": [True]}
    # a release stays text: 0.10 is not the number 0.1
    assert parse_set(["deployment.vllm_version=0.10,0.15.1, 0.33"]) == {
        "deployment.vllm_version": ["0.10", "0.15.1", "0.33"]}
    from sim.scenario import ScenarioError
    with pytest.raises(ScenarioError, match="FIELD=V1,V2"):
        parse_set(["scheduler.max_num_seqs"])


def test_knee_interpolates_where_p99_ttft_crosses_the_slo():
    assert knee([2, 4, 8], [0.5, 0.8, 1.6], 1.0)["rate"] == pytest.approx(5.0)
    assert knee([2, 4, 8], [0.5, 0.8, 0.9], 1.0)["rate"] is None
    assert "above the SLO already" in knee([2, 4], [1.5, 2.0], 1.0)["note"]


def _queue(tmp_path):
    """Constant step of 20 ms, one request per step, evenly spaced arrivals: TTFT is 20 ms up to
    50 req/s and grows without bound past it."""
    prof = {"format": "servetwin-profile/1", "kind": "fitted", "metadata": {},
            "coefficients": {"intercept_s": 0.02}, "residual_quantiles": {}}
    (tmp_path / "const.json").write_text(json.dumps(prof))
    data = {"deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "num_gpu_blocks": 64},
            "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 1},
            "cost_model": {"type": "fitted", "profile": "const.json"},
            "workload": {"num_requests": 200, "arrival": {"type": "constant", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 16}, "output_len": {"type": "fixed", "value": 1},
                         "client": {"type": "engine_direct"}},  # the queue alone: no API server's time
            "slo": {"ttft_s": 0.03}}
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_knee_of_a_deterministic_queue_is_at_its_capacity(tmp_path):
    res = sweep(_queue(tmp_path), rates=[20, 40, 60, 80], seeds=2, workers=1, progress=False)
    (s,) = res["settings"]
    assert [p["p99_ttft_s"] for p in s["points"]][:2] == pytest.approx([0.02, 0.02])
    k = s["knee"]
    assert k["below"] == 40 and k["above"] == 60 and 40 < k["rate"] < 60


def test_grid_of_settings_and_outputs(tmp_path, capsys):
    from scenarios.cli import main
    out = tmp_path / "out"
    rc = main(["sweep", str(_queue(tmp_path)), "--set", "scheduler.max_num_seqs=1,2",
               "--set", "scheduler.policy=fcfs,priority", "--rates", "30,60", "--out", str(out),
               "--workers", "1", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "sweep.json").read_text())
    assert [s["setting"] for s in res["settings"]] == [
        "max_num_seqs=1, policy=fcfs", "max_num_seqs=1, policy=priority",
        "max_num_seqs=2, policy=fcfs", "max_num_seqs=2, policy=priority"]
    assert len(res["rows"]) == 8
    assert (out / "latency_vs_load.png").stat().st_size > 10_000
    assert (out / "sweep.csv").read_text().startswith("setting,")
    assert "knee, max_num_seqs=1, policy=fcfs: p99 TTFT leaves 0.03 s" in printed


def test_unknown_field_is_refused_naming_it(tmp_path):
    with pytest.raises(SweepError, match="scheduler.max_num_seqz"):
        sweep(_queue(tmp_path), ["scheduler.max_num_seqz=1,2"], rates=[10], workers=1, progress=False)
    with pytest.raises(SweepError, match="no rates"):
        sweep(_queue(tmp_path), workers=1, progress=False)


def test_budget_study_shows_the_budget_trade_off():
    """A larger token budget lowers TTFT (prefills finish in fewer steps) and raises the ITL tail
    (decode steps share the GPU with larger prefill chunks)."""
    res = sweep("scenarios/budget-study.yaml", rates=[8], seeds=2, requests=250, workers=1, progress=False)
    by = {s["values"]["scheduler.max_num_batched_tokens"]: s["points"][0] for s in res["settings"]}
    assert by[512]["p50_ttft_s"] > by[2048]["p50_ttft_s"] > by[8192]["p50_ttft_s"]
    assert by[512]["p99_itl_s"] < by[2048]["p99_itl_s"] < by[8192]["p99_itl_s"]


@pytest.mark.parametrize("name", ["capacity-chat-h100", "rag-long-prompt", "pd-vs-agg", "aiconfigurator-8b-h100",
                                  "policy-study", "pd-moe-qwen3-235b-h200",
                                  "budget-study"])
def test_example_scenarios_are_valid(name):
    from scenarios.compose import load_raw, strip
    from scenarios.plan import candidates, parse_plan
    from sim.scenario import parse_scenario
    data, base = load_raw(f"scenarios/{name}.yaml")
    parse_scenario(strip(data), base_dir=base)
    if "plan" in data:
        spec = parse_plan(data)
        assert len(candidates(data, spec)) >= 4
    else:
        assert data["sweep"]["rates"] and data["sweep"]["set"]

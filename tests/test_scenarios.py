"""Scenario files: validation errors name file, key and value; the CLI writes its outputs."""
import json
from pathlib import Path

import pytest
import yaml

from scenarios.cli import main
from sim.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "t", "workload": {"num_requests": 50, "arrival": {"type": "poisson", "rate": 20},
                                  "prompt_len": {"type": "fixed", "value": 100},
                                  "output_len": {"type": "fixed", "value": 20}}}


def write(tmp_path, data) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("patch,needle", [
    ({"scheduler": {"max_num_seqs": -4}}, "scheduler.max_num_seqs=-4"),
    ({"scheduler": {"max_num_sqs": 4}}, "scheduler.max_num_sqs=4: unknown key"),
    ({"scheduler": {"enable_prefix_caching": "yes"}}, "scheduler.enable_prefix_caching='yes'"),
    ({"deployment": {"device": "h900"}}, "deployment.device='h900'"),
    ({"deployment": {"tp": 3}}, "deployment.tp=3"),
    ({"deployment": {"replicas": 0}}, "deployment.replicas=0"),
    ({"cost_model": {"type": "magic"}}, "cost_model.type='magic'"),
    ({"cost_model": {"type": "fitted", "profile": "nope"}}, "cost_model.profile='nope'"),
    ({"slo": {"ttft_s": -1}}, "slo.ttft_s=-1"),
    ({"colour": "blue"}, "scenario.colour='blue': unknown key"),
    ({"deployment": {"model": "llama-3.1-70b", "device": "l40s"}}, "does not fit"),
])
def test_bad_scenarios_name_file_key_value(tmp_path, patch, needle):
    data = {**BASE, **patch}
    p = write(tmp_path, data)
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_workload_errors_are_scenario_errors(tmp_path):
    data = {**BASE, "workload": {**BASE["workload"], "arrival": {"type": "poisson", "rate": -3}}}
    with pytest.raises(ScenarioError, match=r"workload\.arrival\.rate=-3"):
        load_scenario(write(tmp_path, data))


def test_profile_must_match_deployment():
    with pytest.raises(ScenarioError, match="made for model='llama-3.1-8b'"):
        parse_scenario({**BASE, "deployment": {"model": "qwen2.5-7b"},
                        "cost_model": {"type": "fitted", "profile": "h100-sxm-llama-3.1-8b"}})


def test_kv_pool_from_memory_accounting():
    sc = parse_scenario({**BASE, "deployment": {"model": "qwen2.5-7b", "device": "a10g"}})
    assert sc.cost_model.kind == "analytic"  # no shipped profile nor kernel tables for this pair
    sc = parse_scenario({**BASE, "deployment": {"model": "qwen2.5-7b", "device": "a100-80g"},
                         "cost_model": {"type": "analytic"}})
    # vLLM's defaults on an A100: 2048 batched tokens and 256 sequences (8192 and 1024 from 70 GiB
    # up on any other GPU), and the reserve is profiled at them
    cfg = sc.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2048, 256)
    h100 = parse_scenario({**BASE, "deployment": {"model": "qwen2.5-7b", "device": "h100-sxm"},
                           "cost_model": {"type": "analytic"}}).scheduler_config
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    # 79.15 GiB (an 80 GB A100 as CUDA reports it) x 0.9 - 15.2 GB of weights - vLLM's profiled reserve (activations at 2048 tokens,
    # sampler over 256 rows, non-torch memory, CUDA graphs), over 28 layers x 4 kv heads x 128 x 2 x 2 B x 16.
    from sim.specs import activation_reserve_bytes
    per_block = 2 * 28 * 4 * 128 * 2 * 16
    model = sc.cost_model.model
    reserve = activation_reserve_bytes(model, sc.cost_model.device, 1, 2048, 256)
    assert 1 * 2**30 < reserve < 2 * 2**30
    assert reserve < activation_reserve_bytes(model, sc.cost_model.device, 1, 8192, 1024)
    # an explicit budget and sequence limit are what the reserve is profiled at
    big = parse_scenario({**BASE, "deployment": {"model": "qwen2.5-7b", "device": "a100-80g"},
                          "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 1024},
                          "cost_model": {"type": "analytic"}}).scheduler_config
    assert big.num_gpu_blocks < cfg.num_gpu_blocks
    rope = 32768 * 128 * 2  # the rotary cos/sin cache vLLM precomputes (max_position_embeddings x head_dim)
    expect = int((round(79.15 * 2**30) * 0.9 - model.weight_bytes - rope - reserve) // per_block) + 1
    assert sc.scheduler_config.num_gpu_blocks == expect


def test_quickstart_loads():
    sc = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    assert sc.name == "quickstart" and len(sc.workload) > 0


def test_cli_simulate_writes_outputs(tmp_path, capsys):
    p = write(tmp_path, {**BASE, "slo": {"ttft_s": 0.5}})
    out = tmp_path / "out"
    assert main(["simulate", str(p), "--out", str(out), "--seed", "3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT (ms)" in printed and "goodput" in printed
    s = json.loads((out / "summary.json").read_text())
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert set(s[key]) >= {"mean", "p50", "p90", "p95", "p99"}
    assert set(s["throughput"]) == {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s"}
    assert {"completed", "aborted", "preemptions"} <= set(s["requests"])
    assert s["requests"]["completed"] == 50
    assert {"goodput_requests_per_s", "simulated_s", "wall_s"} <= set(s)
    for f in ("requests.csv", "steps.csv", "latency_cdf.png", "kv_and_batch.png"):
        assert (out / f).stat().st_size > 0
    # Same seed, same results.
    out2 = tmp_path / "out2"
    main(["simulate", str(p), "--out", str(out2), "--seed", "3", "--no-progress", "--no-plots"])
    assert (out / "requests.csv").read_text() == (out2 / "requests.csv").read_text()


def test_cli_reports_bad_scenario(tmp_path, capsys):
    p = write(tmp_path, {**BASE, "scheduler": {"block_size": 0}})
    assert main(["simulate", str(p), "--no-progress"]) == 2
    assert "scheduler.block_size=0" in capsys.readouterr().err


def test_engine_commands_explain_a_missing_engine_install(monkeypatch, capsys):
    import builtins
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real_import(name, *args, **kwargs)

    import sys
    monkeypatch.delitem(sys.modules, "engine.llm_engine", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["generate", "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "engine extra" in capsys.readouterr().err

"""Profiles are checked when loaded; gpu_memory_utilization is honoured or refused; a profile used
outside what it measured warns; `servetwin simulate` gives an interval for every percentile."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from scenarios.cli import main as cli
from sim.scenario import ScenarioError, load_scenario
from sim.cost_model import FittedCostModel, load_profile
from sim.intervals import NoisyCostModel

GOOD = {"format": "servetwin-profile/1", "kind": "fitted",
        "metadata": {"model": "smollm2-135m", "device": "cpu-2core", "tp": 1, "block_size": 16,
                     "num_gpu_blocks": 300, "cv_group_bias": [-0.05, 0.0, 0.04],
                     "measured_ranges": {"num_tokens": [1, 512], "num_reqs": [1, 32],
                                         "mean_decode_context_tokens": [0, 900]}},
        "coefficients": {"intercept_s": 0.01, "per_req_s": 1e-4, "per_token_s": 2e-5, "hinges": [[256, 1e-5]]},
        "residual_quantiles": {f"p{q:02d}": (q - 50) / 250 for q in range(0, 101, 5)}}


def write(tmp_path, name, obj) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(p)


@pytest.mark.parametrize("patch,field", [
    ({"format": "servetwin-profile/0"}, "format"),
    ({"kind": "analytic"}, "kind"),
    ({"coefficients": None}, "coefficients"),
    ({"metadata": "x"}, "metadata"),
    ({"coefficients": {"intercept_s": -1.0}}, "coefficients.intercept_s"),
    ({"coefficients": {"intercept_s": "0.01"}}, "coefficients.intercept_s"),
    ({"coefficients": {"per_banana_s": 1.0}}, "coefficients.per_banana_s"),
    ({"coefficients": {"hinges": [[256]]}}, "coefficients.hinges"),
    ({"residual_quantiles": {"p50": "a"}}, "residual_quantiles"),
    ({"residual_quantiles_by_kind": {"mixed": {"p50": 0.0}}}, "residual_quantiles_by_kind.mixed"),
    ({"residual_quantiles_by_kind": {"decode": {"p50": None}}}, "residual_quantiles_by_kind.decode"),
    ({"noise_quantiles": {"p50": "a"}}, "noise_quantiles"),
    ({"noise_quantiles_by_kind": {"mixed": {"p50": 0.0}}}, "noise_quantiles_by_kind.mixed"),
])
def test_corrupt_profile_is_refused_naming_the_field(tmp_path, patch, field):
    prof = {**GOOD, **patch}
    with pytest.raises(ValueError) as e:
        load_profile(write(tmp_path, "p.json", prof))
    assert f"{field}=" in str(e.value)


def test_profile_that_is_not_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(write(tmp_path, "p.json", "{broken"))


def scenario(tmp_path, profile_path, **over) -> str:
    sc = {"name": "t", "deployment": {"model": "smollm2-135m", "device": "cpu-2core"},
          "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 32},
          "cost_model": {"type": "fitted", "profile": profile_path},
          "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 4},
                       "prompt_len": {"type": "uniform", "min": 16, "max": 200},
                       "output_len": {"type": "uniform", "min": 4, "max": 40}}}
    for k, v in over.items():
        sc[k] = {**sc.get(k, {}), **v}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(sc))
    return str(p)


def test_profile_for_another_model_is_refused(tmp_path):
    prof = write(tmp_path, "p.json", {**GOOD, "metadata": {**GOOD["metadata"], "model": "llama-3.1-8b"}})
    with pytest.raises(ScenarioError, match="cost_model.profile=.*model='llama-3.1-8b'"):
        load_scenario(scenario(tmp_path, prof))


def test_gpu_memory_utilization_honoured_or_refused(tmp_path):
    base = {"name": "u", "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm"},
            "cost_model": {"type": "fitted", "profile": "h100-sxm-llama-3.1-8b"},
            "workload": {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 64}, "output_len": {"type": "fixed", "value": 8}}}
    blocks = {}
    for util in (None, 0.9, 0.5):
        sc = json.loads(json.dumps(base))
        if util is not None:
            sc["deployment"]["gpu_memory_utilization"] = util
        p = tmp_path / f"u{util}.yaml"
        p.write_text(yaml.safe_dump(sc))
        blocks[util] = load_scenario(p).scheduler_config.num_gpu_blocks
    # Memory accounting: the KV pool is util x memory - weights - reserve, so halving util more
    # than halves it; 0.9 matches the profile's measured pool (made at 0.9).
    assert blocks[0.9] == blocks[None]
    assert blocks[0.5] < 0.5 * blocks[0.9]
    # A CPU profile's pool was measured on a machine without GPU memory accounting: refused.
    prof = write(tmp_path, "p.json", GOOD)
    with pytest.raises(ScenarioError, match="deployment.gpu_memory_utilization=0.5"):
        load_scenario(scenario(tmp_path, prof, deployment={"gpu_memory_utilization": 0.5}))


def test_profile_outside_its_measured_range_warns(tmp_path):
    prof = write(tmp_path, "p.json", GOOD)
    assert load_scenario(scenario(tmp_path, prof)).warnings == []
    sc = load_scenario(scenario(tmp_path, prof, scheduler={"max_num_batched_tokens": 8192, "max_num_seqs": 64}))
    text = " ".join(sc.warnings)
    assert "max_num_batched_tokens=8192" in text and "max_num_seqs=64" in text and len(sc.warnings) == 2


def test_noisy_cost_model_draws_the_residual_distribution():
    base = FittedCostModel.from_profile(GOOD)
    noisy = NoisyCostModel(base, seed=0)
    from engine.core.features import BatchFeatures
    f = BatchFeatures(num_reqs=4, num_decode_reqs=4, decode_context_tokens=400)
    ratio = np.array([noisy.step_time(f) for _ in range(20000)]) / base.step_time(f)
    # r = pred / measured - 1 is uniform on [-0.2, 0.2] here, so measured / pred = 1 / (1 + r):
    for q in (0.1, 0.5, 0.9):
        assert np.quantile(ratio, q) == pytest.approx(1 / (1 + (0.2 - 0.4 * q)), rel=0.01)


def test_one_extreme_step_in_the_sweep_does_not_fatten_the_simulated_tail():
    """2,000 steps within a few % of the fit and one twice as long (a pause): the profile's
    quantiles, drawn from by the simulator, reproduce the measured steps' p97 and p99 and mean.
    With the quantiles every 5% the outer 5% of draws spread evenly up to the one extreme step:
    p97 came out 1.4x where the steps had 1.05x."""
    from calibration.fit import _quantiles
    from engine.core.features import BatchFeatures
    rng = np.random.default_rng(1)
    ratio_measured = np.concatenate([1 + rng.normal(0, 0.02, 2000), [2.0]])  # measured / predicted
    prof = dict(GOOD, residual_quantiles=_quantiles(1 / ratio_measured - 1))  # pred / measured - 1
    base = FittedCostModel.from_profile(prof)
    noisy = NoisyCostModel(base, seed=0)
    f = BatchFeatures(num_reqs=4, num_decode_reqs=4, decode_context_tokens=400)
    drawn = np.array([noisy.step_time(f) for _ in range(40000)]) / base.step_time(f)
    for q in (0.5, 0.97, 0.985):
        assert np.quantile(drawn, q) == pytest.approx(np.quantile(ratio_measured, q), rel=0.01)
    assert np.mean(drawn > 1.2) < 0.011  # measured: 1 step in 2,001; every 5%: about 4%
    assert drawn.mean() == pytest.approx(ratio_measured.mean(), rel=0.005)


def test_noisy_cost_model_draws_each_kind_of_step_from_its_own_residuals(tmp_path):
    # Prefill steps: r uniform on [-0.05, 0.05]; decode steps: r uniform on [-0.3, 0.3].
    prof = {**GOOD, "residual_quantiles_by_kind": {
        "prefill": {f"p{q:02d}": (q - 50) / 1000 for q in range(0, 101, 5)},
        "decode": {f"p{q:02d}": (q - 50) * 0.006 for q in range(0, 101, 5)}}}
    base = FittedCostModel.from_profile(load_profile(write(tmp_path, "p.json", prof)))
    assert FittedCostModel.from_profile(base.to_profile()).residual_quantiles_by_kind == prof["residual_quantiles_by_kind"]
    noisy = NoisyCostModel(base, seed=1)
    from engine.core.features import BatchFeatures
    dec = BatchFeatures(num_reqs=4, num_decode_reqs=4, decode_context_tokens=400)
    pre = BatchFeatures(num_reqs=2, num_prefill_reqs=1, num_decode_reqs=1, num_prefill_tokens=200,
                        prefill_attn_pairs=20000, decode_context_tokens=100)
    for f, half in ((dec, 0.3), (pre, 0.05)):
        ratio = np.array([noisy.step_time(f) for _ in range(20000)]) / base.step_time(f)
        for q in (0.1, 0.5, 0.9):
            assert np.quantile(ratio, q) == pytest.approx(1 / (1 + half * (1 - 2 * q)), rel=0.01)
        # E[1 / (1 + r)] for r uniform on [-h, h] is ln((1 + h) / (1 - h)) / (2h).
        expect = np.log((1 + half) / (1 - half)) / (2 * half)
        assert noisy.mean_ratio(f) == pytest.approx(expect, rel=2e-3)
        assert ratio.mean() == pytest.approx(expect, rel=5e-3)
    # Without per-kind residuals both kinds draw from the pooled ones.
    pooled = NoisyCostModel(FittedCostModel.from_profile(GOOD), seed=1)
    assert pooled.mean_ratio(dec) == pooled.mean_ratio(pre) == pytest.approx(np.log(1.2 / 0.8) / 0.4, rel=2e-3)


def test_simulate_prints_and_saves_intervals(tmp_path, capsys):
    prof = write(tmp_path, "p.json", GOOD)
    out = tmp_path / "out"
    assert cli(["simulate", scenario(tmp_path, prof), "--out", str(out), "--no-plots", "--no-progress",
                "--replicates", "3"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["intervals"]["replicates"] == 3 and "residuals" in s["intervals"]["method"]
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        for st in ("p50", "p90", "p95", "p99"):
            lo, hi = s[k][f"{st}_interval"]
            assert lo <= s[k][st] <= hi, (k, st)  # the point run is one of the runs
    assert "90% int" in capsys.readouterr().out

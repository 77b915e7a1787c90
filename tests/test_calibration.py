"""Calibration: the fitter recovers known step-time models; the engine profiler makes a usable profile."""
import json

import numpy as np
import pytest

from calibration.fit import fit_cost_model
from calibration.synthetic_profile import random_batches
from engine.core import SchedulerConfig
from sim.cost_model import AnalyticCostModel, FittedCostModel, load_profile
from sim.simulation import Simulation
from sim.workload import build_workload


def test_fit_recovers_a_known_model():
    truth = FittedCostModel(intercept_s=0.004, per_req_s=2e-5, per_token_s=1e-6,
                            hinges=[(256.0, 3e-5)], per_prefill_pair_s=2e-9, per_decode_ctx_s=5e-8)
    batches = random_batches(1500, seed=1)
    rng = np.random.default_rng(0)
    rows = [b.as_dict() for b in batches]
    times = [truth.step_time(b) * (1 + rng.normal(0, 0.01)) for b in batches]  # 1% noise
    fit = fit_cost_model(rows, times, knots=[64, 256, 1024])
    pred = np.array([fit.step_time(b) for b in batches])
    true = np.array([truth.step_time(b) for b in batches])
    assert np.median(np.abs(pred / true - 1)) < 0.01
    assert fit.metadata["cv_mape"] < 0.02
    assert fit.per_decode_ctx_s == pytest.approx(5e-8, rel=0.1)
    assert fit.per_prefill_pair_s == pytest.approx(2e-9, rel=0.1)


def test_fit_approximates_the_analytic_roofline():
    analytic = AnalyticCostModel("llama-3.1-8b", "h100-sxm")
    batches = random_batches(2000, seed=2)
    fit = fit_cost_model([b.as_dict() for b in batches], [analytic.step_time(b) for b in batches])
    assert fit.metadata["cv_mape"] < 0.02  # the hinge basis captures the roofline's knee


def test_profile_engine_end_to_end(tmp_path):
    from calibration.profile_engine import make_profile, sweep
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=256, max_num_seqs=8,
                    num_gpu_blocks=256)
    steps = sweep(eng, batch_sizes=(1, 4), prompt_lens=(16, 48), decode_tokens=6, progress=False, mixed=6)
    assert len(steps) >= 20 and any(s.num_prefill_reqs and s.num_decode_reqs for s in steps)
    prof = make_profile(eng, steps, source="test")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    loaded = load_profile(path)
    assert loaded["metadata"]["model"] == "smollm2-135m" and loaded["metadata"]["num_gpu_blocks"] == 256
    # The profile drives a simulation of the same engine configuration.
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=2048, block_size=16,
                          num_gpu_blocks=256)
    wl = build_workload({"num_requests": 20, "arrival": {"type": "poisson", "rate": 2},
                         "prompt_len": {"type": "fixed", "value": 32},
                         "output_len": {"type": "fixed", "value": 8}}, seed=0)
    s = Simulation(wl, cfg, FittedCostModel.from_profile(loaded)).run().summary
    assert s["requests"]["completed"] == 20
    # A decode step of this tiny model on this CPU takes milliseconds to a few hundred.
    assert 0.001 < s["tpot_s"]["p50"] < 1.0

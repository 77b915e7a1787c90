"""Calibration: the fitter recovers known step-time models; the engine profiler makes a usable profile."""
import json
import re

import numpy as np
import pytest

from calibration.fit import fit_cost_model
from calibration.synthetic_profile import random_batches
from engine.core.features import BatchFeatures
from sim.cost_model import AnalyticCostModel, FittedCostModel, load_profile
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


def test_fit_recovers_a_concave_start_of_the_token_term():
    # A CPU step: one token runs matrix-vector kernels, two or more packed GEMMs, so the step
    # time jumps from 1 to 2 tokens and flattens after (the shape measured on this machine).
    # The hinge basis alone bends only up and misses it by far; the saturating terms recover it.
    truth = FittedCostModel(intercept_s=0.06, per_token_s=2e-4, saturations=[(2.0, 0.05), (8.0, 0.01)],
                            per_decode_ctx_s=1e-6)
    rng = np.random.default_rng(4)
    batches = []
    for n in list(rng.integers(1, 33, 1500)):
        batches.append(BatchFeatures(num_reqs=int(n), num_decode_reqs=int(n),
                                     decode_context_tokens=int(n) * int(rng.integers(16, 600))))
    rows = [b.as_dict() for b in batches]
    times = [truth.step_time(b) * (1 + rng.normal(0, 0.01)) for b in batches]
    true = np.array([truth.step_time(b) for b in batches])
    fit = fit_cost_model(rows, times, knots=[16])
    assert np.median(np.abs(np.array([fit.step_time(b) for b in batches]) / true - 1)) < 0.01
    assert dict(fit.saturations).get(2.0, 0) == pytest.approx(0.05, rel=0.1)
    convex_only = fit_cost_model(rows, times, knots=[16], caps=[])
    err = np.array([convex_only.step_time(b) for b in batches]) / true - 1
    assert np.mean(np.abs(err)) > 0.05  # what the old basis left: a systematic error by batch size


def test_fit_approximates_the_analytic_roofline():
    analytic = AnalyticCostModel("llama-3.1-8b", "h100-sxm")
    batches = random_batches(2000, seed=2)
    fit = fit_cost_model([b.as_dict() for b in batches], [analytic.step_time(b) for b in batches])
    assert fit.metadata["cv_mape"] < 0.02  # the hinge basis captures the roofline's knee


def _decode_and_prefill_groups(rng, per_group: int) -> tuple[list, list]:
    """Six sweep groups of per_group steps each: decode-only batches of 1-31 requests in the odd
    ones, one prefill chunk of 64-2047 tokens in the even ones."""
    batches, groups = [], []
    for g in range(6):
        for _ in range(per_group):
            if g % 2:
                n = int(rng.integers(1, 32))
                batches.append(BatchFeatures(num_reqs=n, num_decode_reqs=n,
                                             decode_context_tokens=n * int(rng.integers(16, 900))))
            else:
                batches.append(BatchFeatures(num_reqs=1, num_prefill_reqs=1,
                                             num_prefill_tokens=int(rng.integers(64, 2048))))
            groups.append(f"g{g}")
    return batches, groups


def test_fit_adds_up_to_the_measured_time_of_noisy_steps():
    """Steps scatter lognormally (sd 0.2) around a known model. A fit on relative error alone lands
    near truth x exp(-1.5 sd^2) (for one constant c: argmin sum((c / y - 1)^2) = sum(1/y) /
    sum(1/y^2) -> E[1/y] / E[1/y^2]), about 8% below the mean step, truth x exp(sd^2 / 2); the
    fitted profile, and the noisy simulator drawing from it, add up to the measured time instead,
    per kind of step, and to what the same steps take on average, truth x exp(sd^2 / 2)."""
    from calibration.fit import _solve_relative, design_matrix
    from sim.intervals import NoisyCostModel
    truth = FittedCostModel(intercept_s=0.004, per_req_s=2e-5, per_token_s=1e-6, per_decode_ctx_s=5e-8)
    rng = np.random.default_rng(21)
    batches, groups = _decode_and_prefill_groups(rng, 250)
    rows = [b.as_dict() for b in batches]
    true = np.array([truth.step_time(b) for b in batches])

    def draw():
        return true * np.exp(rng.normal(0, 0.2, len(true)))

    times = draw()
    fit = fit_cost_model(rows, list(times), groups=groups, knots=[64, 256, 1024])
    X = design_matrix(rows, [64, 256, 1024], [c for c in (2, 4, 8, 16, 32)])
    raw = X @ _solve_relative(X, times)
    assert raw.sum() / times.sum() == pytest.approx(np.exp(-2 * 0.2 ** 2), abs=0.02)  # the short fit
    assert fit.metadata["sum_scale"] == pytest.approx(times.sum() / raw.sum(), rel=1e-9)
    pred = np.array([fit.step_time(b) for b in batches])
    assert pred.sum() == pytest.approx(times.sum(), rel=1e-9)
    noisy = NoisyCostModel(fit, 0)
    expected = pred * np.array([noisy.mean_ratio(b) for b in batches])
    mean = true * np.exp(0.2 ** 2 / 2)
    prefill = np.array([b.num_prefill_reqs > 0 for b in batches])
    for kind in (prefill, ~prefill):
        assert expected[kind].sum() / times[kind].sum() == pytest.approx(1.0, abs=1e-6)
        assert expected[kind].sum() / mean[kind].sum() == pytest.approx(1.0, abs=0.02)
    # The fit keeps the model's shape: one factor on every coefficient, none negative.
    assert np.median(np.abs(pred / (true * np.exp(0.2 ** 2 / 2)) - 1)) < 0.03


def test_noise_makes_each_kind_of_step_add_up():
    """Decode-only steps scatter with a heavy slow tail (lognormal sd 0.35), steps with a prefill
    chunk barely (sd 0.03): one factor for the whole fit cannot make both kinds add up (the
    decode steps' mean is exp(0.35^2 / 2) = 6.3% above their typical step, the prefill steps'
    0.05%), so each kind's noise carries its own mean: the simulator's expected time of each kind
    adds up to the measured time of the fitted steps, and to their mean, truth x exp(sd^2 / 2),
    within 2%."""
    from sim.intervals import NoisyCostModel
    truth = FittedCostModel(intercept_s=0.004, per_req_s=2e-5, per_token_s=1e-6, per_decode_ctx_s=5e-8)
    rng = np.random.default_rng(8)
    batches, groups = _decode_and_prefill_groups(rng, 300)
    rows = [b.as_dict() for b in batches]
    true = np.array([truth.step_time(b) for b in batches])
    prefill = np.array([b.num_prefill_reqs > 0 for b in batches])
    sd = np.where(prefill, 0.03, 0.35)

    def draw():
        return true * np.exp(rng.normal(0, 1, len(true)) * sd)

    times = draw()
    fit = fit_cost_model(rows, list(times), groups=groups, knots=[64, 256, 1024])
    pred = np.array([fit.step_time(b) for b in batches])
    assert pred.sum() == pytest.approx(times.sum(), rel=1e-9)
    # The deterministic prediction, unbiased in total, is not per kind.
    off = [pred[k].sum() / times[k].sum() - 1 for k in (prefill, ~prefill)]
    assert max(abs(x) for x in off) > 0.02
    noisy = NoisyCostModel(fit, 0)
    expected = pred * np.array([noisy.mean_ratio(b) for b in batches])
    mean = true * np.exp(sd ** 2 / 2)
    for k, kind in ((prefill, "prefill"), (~prefill, "decode")):
        assert expected[k].sum() == pytest.approx(times[k].sum(), rel=1e-6)
        assert expected[k].sum() / mean[k].sum() == pytest.approx(1.0, abs=0.02)
        assert kind in fit.metadata["noise_sum_scale"]
    # ... and the steps drawn from it do too (the draws are the simulator's).
    drawn = np.array([noisy.step_time(b) for b in batches for _ in range(20)]).reshape(len(batches), 20).mean(axis=1)
    for k in (prefill, ~prefill):
        assert drawn[k].sum() / times[k].sum() == pytest.approx(1.0, abs=0.01)


def test_grouped_cv_flags_an_overfit_model():
    """Each sweep group covers its own token range and the truth is not in the basis (quadratic):
    random k-fold sees near-duplicates and looks fine; leaving a group out shows the error a new
    regime gets, and the blocked/grouped estimate is several times larger."""
    rng = np.random.default_rng(3)
    rows, times, groups = [], [], []
    for g, (lo, hi) in enumerate([(1, 40), (40, 120), (120, 400), (400, 1200), (1200, 4000)]):
        for _ in range(150):
            n = int(rng.integers(lo, hi))
            rows.append({"num_reqs": 1, "num_tokens": n, "num_prefill_reqs": 1, "prefill_attn_pairs": 0,
                         "prefill_context_tokens": 0, "decode_context_tokens": 0})
            times.append(1e-3 + 1e-9 * n * n * (1 + rng.normal(0, 0.01)))
            groups.append(f"g{g}")
    knots = [20, 60, 200, 600, 2000]
    grouped = fit_cost_model(rows, times, knots=knots, groups=groups)
    assert grouped.metadata["cv"].startswith("leave-one-group-out over 5")
    # Random k-fold, computed here independently of fit_cost_model.
    from calibration.fit import _solve, design_matrix
    X, y = design_matrix(rows, knots), np.asarray(times)
    idx = np.random.default_rng(0).permutation(len(y))
    err = []
    for f in range(5):
        test = idx[f::5]
        train = np.setdiff1d(idx, test)
        c = _solve(X[train], y[train])
        err.extend(np.abs(X[test] @ c / y[test] - 1))
    assert grouped.metadata["cv_mape"] > 3 * np.mean(err)
    assert grouped.metadata["cv_mape"] > 3 * grouped.metadata["fit_mape"]
    # The out-of-sample residual quantiles are monotone and span the held-out errors.
    q = [grouped.residual_quantiles[f"p{k:02d}"] for k in range(0, 101, 5)]
    assert q == sorted(q) and q[0] < 0 < q[-1]


def test_fit_keeps_residuals_per_kind_of_step():
    """Prefill steps scatter 2% around the truth, decode steps 20%: the per-kind out-of-sample
    residuals keep the two spreads apart, the pooled ones mix them."""
    truth = FittedCostModel(intercept_s=0.004, per_req_s=2e-5, per_token_s=1e-6, per_decode_ctx_s=5e-8)
    rng = np.random.default_rng(5)
    rows, times, groups = [], [], []
    for g in range(6):
        for _ in range(200):
            if g % 2:
                n = int(rng.integers(1, 32))
                b = BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * int(rng.integers(16, 900)))
                sd = 0.2
            else:
                b = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=int(rng.integers(64, 2048)))
                sd = 0.02
            rows.append(b.as_dict())
            times.append(truth.step_time(b) * float(np.exp(rng.normal(0, sd))))
            groups.append(f"g{g}")
    fit = fit_cost_model(rows, times, groups=groups)
    by_kind = fit.residual_quantiles_by_kind
    assert set(by_kind) == {"prefill", "decode"}

    def spread(q):
        return q["p90"] - q["p10"]

    # Independent expectation: the 10-90% spread of r = exp(-e) - 1, e ~ N(0, sd), is about 2.56 sd.
    assert spread(by_kind["prefill"]) == pytest.approx(2.56 * 0.02, rel=0.3)
    assert spread(by_kind["decode"]) == pytest.approx(2 * np.sinh(1.2816 * 0.2), rel=0.3)
    assert spread(by_kind["prefill"]) < spread(fit.residual_quantiles) < spread(by_kind["decode"])
    # A sweep with too few prefill steps keeps only the decode kind.
    few = fit_cost_model(rows[200:400] + rows[:10] + rows[600:800], times[200:400] + times[:10] + times[600:800],
                         groups=groups[200:400] + groups[:10] + groups[600:800])
    assert set(few.residual_quantiles_by_kind) == {"decode"}


def test_noise_quantiles_leave_out_each_regimes_own_error():
    """Each sweep group runs 10-20% off the model (a regime the fit gets wrong) and its steps
    scatter 3% around that: the out-of-sample residuals carry both, the noise quantiles only the
    3%, with mean ratio 1; the simulator's noisy steps draw from the noise."""
    from sim.intervals import NoisyCostModel
    truth = FittedCostModel(intercept_s=0.004, per_req_s=2e-5, per_token_s=1e-6, per_decode_ctx_s=5e-8)
    rng = np.random.default_rng(11)
    offsets = [0.85, 1.15, 0.9, 1.2, 0.8, 1.1, 0.88, 1.12]
    rows, times, groups = [], [], []
    for g, off in enumerate(offsets):
        for _ in range(120):
            n = int(rng.integers(1, 32))
            b = BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * int(rng.integers(16, 900)))
            rows.append(b.as_dict())
            times.append(truth.step_time(b) * off * float(np.exp(rng.normal(0, 0.03))))
            groups.append(f"g{g}")
    fit = fit_cost_model(rows, times, groups=groups)

    def spread(q):
        return q["p90"] - q["p10"]

    assert set(fit.noise_quantiles_by_kind) == {"decode"}
    # Independent expectation: the 10-90% spread of exp(-e) - 1, e ~ N(0, 0.03), is about 2.56 x 0.03.
    assert spread(fit.noise_quantiles) == pytest.approx(2.56 * 0.03, rel=0.25)
    assert spread(fit.residual_quantiles) > 3 * spread(fit.noise_quantiles)
    noisy = NoisyCostModel(fit, seed=0)
    assert noisy.source == "noise_quantiles"
    f = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8 * 400)
    assert noisy.mean_ratio(f) == pytest.approx(1.0, abs=0.005)
    ratios = np.array([noisy.step_time(f) for _ in range(4000)]) / fit.step_time(f)
    assert np.quantile(ratios, 0.9) - np.quantile(ratios, 0.1) == pytest.approx(2.56 * 0.03, rel=0.25)
    # The profile keeps them; a profile without them falls back to the residuals.
    back = FittedCostModel.from_profile(fit.to_profile())
    assert back.noise_quantiles == fit.noise_quantiles
    old = fit.to_profile()
    del old["noise_quantiles"], old["noise_quantiles_by_kind"]
    assert NoisyCostModel(FittedCostModel.from_profile(old), seed=0).source == "residual_quantiles"
    # Without groups there are no regimes to take out.
    assert fit_cost_model(rows, times).noise_quantiles == {}


def _hashed_blocks(eng) -> int:
    return sum(b.block_hash is not None for b in eng.scheduler.kv_cache_manager.block_pool.blocks)


def test_calibrate_and_validate_end_to_end(tmp_path, monkeypatch):
    """A tiny sweep and a tiny validation on the real engine: the profile says what it measured
    and how, and validation.json holds every row with its error, interval and spread. No
    assertion on how fast this machine is."""
    from calibration.calibrate import calibrate, sweep_groups
    from calibration.validate import validate
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=4,
                    num_gpu_blocks=128)
    groups = sweep_groups(4, eng.max_model_len, concurrency=(1, 4), bands={"short": (16, 40), "medium": (40, 100)},
                          requests_per_slot=1.0, min_requests=2)
    assert [g["name"] for g in groups] == ["c1-short", "c4-short", "c1-medium", "c4-medium"]
    prof = calibrate(eng, tmp_path / "p.json", groups=groups, progress=False)
    m = prof["metadata"]
    assert m["cv"] == "leave-one-group-out over 4 sweep groups"
    assert m["num_gpu_blocks"] == 128 and m["max_num_batched_tokens"] == 128 and m["model"] == "smollm2-135m"
    assert m["measured_ranges"]["num_reqs"][1] <= 4 and m["measured_ranges"]["num_tokens"][1] <= 128
    assert "step period" in m["timing"]
    steps = (tmp_path / "p.steps.csv").read_text().splitlines()
    assert len(steps) - 1 == m["num_samples"]
    # The groups ran in a shuffled order with the speed probe before each and after the last.
    assert sorted(m["group_order"]) == sorted(g["name"] for g in groups)
    assert len(m["speed_probe"]["probes_s"]) == len(groups) + 1
    assert len(m["speed_probe"]["compute"]["probes_s"]) == len(groups) + 1  # and the compute probe
    assert steps[0].endswith(",probe_s,compute_probe_s")
    assert loaded_ok(tmp_path / "p.json")
    # --refit: the same steps fitted again without the engine give the same profile.
    from calibration.calibrate import refit
    again = refit(tmp_path / "p.json", tmp_path / "q.json")
    assert again["coefficients"] == prof["coefficients"] and again["metadata"]["num_samples"] == m["num_samples"]
    assert (tmp_path / "q.steps.csv").read_text() == (tmp_path / "p.steps.csv").read_text()
    scen = {"workload": {"num_requests": 4, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "uniform", "min": 16, "max": 48},
                         "output_len": {"type": "uniform", "min": 4, "max": 8}}}
    import calibration.validate as val_mod
    drive_calls: list[int] = []  # hashed blocks in the engine's prefix cache as each run starts

    real_drive = val_mod.drive

    def spy(engine, arrivals, *a, **k):
        drive_calls.append(_hashed_blocks(engine))
        return real_drive(engine, arrivals, *a, **k)
    monkeypatch.setattr(val_mod, "drive", spy)
    # A request whose blocks stay cached after it (the closing probe emptied the cache).
    from calibration.driver import Arrival, drive
    from engine.core import SamplingParams
    drive(eng, [Arrival(0.0, "warm", list(range(100, 164)), SamplingParams(max_tokens=2, ignore_eos=True))])
    assert _hashed_blocks(eng) > 0
    rep = validate(eng, prof, scen, tmp_path / "val", loads=(0.5,), seeds=1, duration_s=1, min_requests=3,
                   progress=False)
    # The capacity burst and the run started as the simulator does: nothing cached.
    assert drive_calls == [0, 0]
    saved = json.loads((tmp_path / "val" / "validation.json").read_text())
    assert saved["summary"]["rows"] == rep["summary"]["rows"] == 15  # 5 metrics x p50/p90/p99
    from calibration.calibrate import host_cpu  # the machine, recorded on both sides
    assert saved["host_cpu"] == saved["profile_host_cpu"] == m["host_cpu"] == host_cpu()
    row = saved["loads"]["0.5"]["metrics"]["ttft_s.p90"]
    assert row["rel_error"] == pytest.approx(row["sim"] / row["engine"] - 1)
    assert row["interval"][0] <= row["sim"] <= row["interval"][1] and len(row["seed_rel_errors"]) == 1
    assert row["rank_error"] == pytest.approx(row["engine_rank_of_sim"] - 0.9, abs=1e-3)
    assert 0 <= saved["summary"]["median_abs_rank_error"] <= saved["summary"]["max_abs_rank_error"] <= 1
    assert saved["loads"]["0.5"]["step_time_mape"] >= 0 and "throughput_rel_error" in saved["loads"]["0.5"]
    assert (tmp_path / "val" / "cdf-load0.5.png").stat().st_size > 1000
    logged = (tmp_path / "val" / "engine-steps.csv").read_text().splitlines()
    assert logged[0].startswith("setting,load,seed,start_s,num_reqs") and len(logged) > 1
    # The simulator's side of the run was scaled by the probe measured before it.
    (run,) = saved["speed_probe"]["runs"]
    assert run["speed_factor"] == pytest.approx(np.sqrt(run["probe_before_s"] * run["probe_after_s"]) / m["speed_probe"]["median_s"], rel=1e-3)
    assert saved["speed_probe"]["profile_median_s"] == m["speed_probe"]["median_s"] and run["speed_factor"] > 0
    # ... raised to the exponent the profile's fit chose (one of the candidates, recorded with
    # the grouped-CV error of each).
    b = m["speed_probe"]["exponent"]
    assert saved["speed_probe"]["exponent"] == b and f"{b:g}" in m["speed_probe"]["exponent_cv_mape"]
    assert m["speed_probe"]["exponent_cv_mape"][f"{b:g}"] == min(m["speed_probe"]["exponent_cv_mape"].values())
    # One run: it is the validation's level, applied in full.
    assert saved["speed_probe"]["level_speed_factor"] == pytest.approx(run["speed_factor"], rel=1e-3)
    assert run["applied_speed_factor"] == pytest.approx(run["speed_factor"], rel=1e-3)
    first = dict(zip(logged[0].split(","), logged[1].split(",")))
    assert first["setting"] == "base"
    assert float(first["applied_speed_factor"]) == pytest.approx(run["applied_speed_factor"], rel=1e-3)
    assert run["compute_factor"] == pytest.approx(
        np.sqrt(run["compute_before_s"] * run["compute_after_s"]) / m["speed_probe"]["compute"]["median_s"], rel=1e-3)
    assert run["applied_compute_factor"] == pytest.approx(run["compute_factor"], rel=1e-3)
    assert float(first["applied_compute_factor"]) == pytest.approx(run["applied_compute_factor"], rel=1e-3)
    # The main table ran at the in-situ speed (the run's own decode-only steps); the same
    # workload at the probes' speed is reported beside it.
    assert saved["speed_model"] == "in_situ" and len(saved["in_situ_speed_runs"]) == 1
    for name in ("probes", "in_situ_all"):  # and with the whole step at the in-situ speed
        other = saved[name]
        assert other["summary"]["rows"] == 15
        assert set(other["loads"]["0.5"]["metrics"]) == set(saved["loads"]["0.5"]["metrics"])
    assert float(first["in_situ_speed_factor"]) > 0
    # --resimulate: the simulator's side again from the saved engine runs gives the same report.
    from calibration.validate import Setting, resimulate
    base = [Setting("base", {}, {}, dict(scen["workload"]))]
    again = resimulate(prof, base, tmp_path / "val", progress=False)
    assert again["loads"]["0.5"]["metrics"] == saved["loads"]["0.5"]["metrics"]
    with pytest.raises(ValueError, match="served the settings"):
        resimulate(prof, [Setting("other", {}, {}, {})], tmp_path / "val", progress=False)
    other_cal = json.loads(json.dumps(prof))  # another calibration: its own probes
    other_cal["metadata"]["speed_probe"]["median_s"] *= 2
    with pytest.raises(ValueError, match="speed probe's median"):
        resimulate(other_cal, base, tmp_path / "val", progress=False)
    # The in-situ speed is read from decode-only steps, so it cannot absorb an error in what a
    # prefill chunk costs: a profile whose prefill chunks cost five times as much reads TTFT far
    # too slow (five times: the prompts here are short, so a chunk is a small part of its step).
    from sim.cost_model import FittedCostModel
    real = FittedCostModel.from_profile

    def prefill_five_times(profile):
        model = real(profile)
        orig = model.step_time

        def step_time(f):
            rest = model._time(f.num_decode_reqs, f.num_decode_reqs, 0, 0, 0, f.decode_context_tokens)
            return orig(f) + (4 * (orig(f) - rest) if f.num_prefill_tokens else 0.0)
        model.step_time = step_time
        return model
    monkeypatch.setattr(FittedCostModel, "from_profile", staticmethod(prefill_five_times))
    wrong = resimulate(prof, base, tmp_path / "val", progress=False)
    assert wrong["loads"]["0.5"]["metrics"]["ttft_s.p50"]["rel_error"] > \
        saved["loads"]["0.5"]["metrics"]["ttft_s.p50"]["rel_error"] + 0.3
    assert wrong["loads"]["0.5"]["prefill_step_bias_in_situ"] > saved["loads"]["0.5"]["prefill_step_bias_in_situ"] + 0.3
    # Nor does it when it prices the whole step, prefill part included.
    assert wrong["loads"]["0.5"]["prefill_step_bias_in_situ_all"] > \
        saved["loads"]["0.5"]["prefill_step_bias_in_situ_all"] + 0.3
    assert wrong["in_situ_all"]["loads"]["0.5"]["metrics"]["ttft_s.p50"]["rel_error"] > \
        saved["in_situ_all"]["loads"]["0.5"]["metrics"]["ttft_s.p50"]["rel_error"] + 0.3
    # Both sides ran on one scheduler configuration: the engine's, with its KV pool.
    assert eng.scheduler_config.uncache_unscheduled_victims


def test_cold_prefix_cache_undoes_the_hits_a_rerun_would_get():
    """Every generated workload gives its first request the same synthetic ids, so a second run on
    the same engine hits the first run's blocks unless the cache is emptied, as validate does."""
    from calibration.driver import drive
    from calibration.validate import arrivals, cold_prefix_cache
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=4, num_gpu_blocks=64)
    spec = {"num_requests": 2, "arrival": {"type": "poisson", "rate": 1000},
            "prompt_len": {"type": "fixed", "value": 40}, "output_len": {"type": "fixed", "value": 2}}

    def first_cached(seed):
        res = drive(eng, arrivals(build_workload(spec, seed), eng.vocab_size))
        return res.records[0].num_cached_tokens
    assert first_cached(1) == 0
    assert first_cached(2) == 32  # another seed, the same ids: two full blocks of 16 hit
    cold_prefix_cache(eng)
    assert _hashed_blocks(eng) == 0 and first_cached(3) == 0


def test_in_situ_speed_by_hand():
    """The machine's speed at a moment: the decode-only steps within 5 s of it, their measured
    periods summed over their predicted ones (prefill steps never count); the nearest 5 where
    fewer."""
    from types import SimpleNamespace
    from calibration.validate import InSituSpeed

    from sim.cost_model import CostModel

    class Const(CostModel):
        residual_quantiles = {"p5": -0.0, "p95": 0.0}
        metadata: dict = {}

        def step_time(self, f):
            return 0.1

    def step(t, prefill=0):
        return SimpleNamespace(start_s=t, num_reqs=1, num_prefill_reqs=int(prefill > 0), num_prefill_tokens=prefill,
                               prefill_context_tokens=0, prefill_attn_pairs=0, num_decode_reqs=1 - int(prefill > 0),
                               decode_context_tokens=10)
    # Decode steps at 0..9 s take 0.1 s (speed 1), at 20..29 s 0.15 s (speed 1.5); a prefill step
    # at 10 s took 1 s (it must not count).
    steps = [step(float(t)) for t in range(10)] + [step(10.0, prefill=64)] + [step(float(t)) for t in range(20, 30)]
    periods = [0.1] * 10 + [1.0] + [0.15] * 10
    sp = InSituSpeed(steps, periods, Const(), fallback=7.0)
    assert sp.num_steps == 20
    assert sp(2.0) == pytest.approx(1.0)          # steps 0..7 in the window
    assert sp(25.0) == pytest.approx(1.5)         # steps 20..29
    assert sp(12.0) == pytest.approx(1.0)         # window [7, 17] has 3: the nearest 5 are 5..9
    assert sp(17.0) == pytest.approx(1.5)         # window [12, 22] has 3: the nearest 5 are 20..24
    assert sp(1000.0) == pytest.approx(1.5)       # past the end: the last value
    assert InSituSpeed([step(0.0, prefill=8)], [0.5], Const(), fallback=7.0)(3.0) == 7.0  # no decode step
    # A ratio of sums, not a median: one decode step 10x slow among ten counts in full (the
    # simulated steps then add up to the engine's time in the window).
    slow = [step(float(t)) for t in range(10)]
    sp = InSituSpeed(slow, [0.1] * 9 + [1.0], Const(), fallback=7.0)
    assert sp(5.0) == pytest.approx((0.9 + 1.0) / 1.0)     # window [0, 10]: all ten steps


def loaded_ok(path) -> bool:
    prof = load_profile(path)
    return FittedCostModel.from_profile(prof).step_time(random_batches(1, seed=0)[0]) > 0


def test_split_speed_by_hand():
    """A step's fitted time splits into the step without its prefill chunks and what they add;
    each part is scaled by its own probe's factor."""
    from calibration.probe import SplitSpeedModel, split_time
    from engine.core.features import BatchFeatures
    m = FittedCostModel(intercept_s=0.01, per_req_s=0.002, per_token_s=0.001, per_prefill_req_s=0.003,
                        per_prefill_pair_s=1e-6, per_decode_ctx_s=1e-5, residual_quantiles={"p5": 0, "p95": 0})
    f = BatchFeatures(num_reqs=3, num_prefill_reqs=1, num_prefill_tokens=100, prefill_attn_pairs=5050,
                      num_decode_reqs=2, decode_context_tokens=300)
    rest = 0.01 + 0.002 * 2 + 0.001 * 2 + 1e-5 * 300            # two decodes alone
    added = 0.002 + 0.001 * 100 + 0.003 + 1e-6 * 5050           # one more request, 100 tokens, its pairs
    assert split_time(m, f) == pytest.approx((rest, added))
    assert SplitSpeedModel(m, 1.5, 1.2).step_time(f) == pytest.approx(rest * 1.5 + added * 1.2)
    # Either factor may move with the simulated time (validate's in-situ speeds).
    now = [0.9]
    both = SplitSpeedModel(m, lambda: now[0], lambda: now[0])
    assert both.step_time(f) == pytest.approx((rest + added) * 0.9)
    now[0] = 1.3
    assert both.step_time(f) == pytest.approx((rest + added) * 1.3) and both.compute_factor == 1.3
    moving = [2.0]
    assert SplitSpeedModel(m, lambda: moving[0], 1.0).step_time(f) == pytest.approx(rest * 2.0 + added)
    # A prefill-only step: the rest is the per-step cost.
    g = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=50, prefill_attn_pairs=1275)
    assert split_time(m, g)[0] == pytest.approx(0.01)


def _random_step(rng, model) -> tuple[dict, float, float]:
    """A random batch (0-7 decodes, at most one prefill chunk) as a steps.csv feature row, with the
    model's time for it split into the step without its prefill chunk and what the chunk adds."""
    from calibration.probe import split_time
    dec = int(rng.integers(0, 8))
    pre = int(rng.integers(0, 2)) if dec else 1
    ptok = int(rng.integers(16, 200)) if pre else 0
    f = BatchFeatures(num_reqs=dec + pre, num_prefill_reqs=pre, num_prefill_tokens=ptok,
                      num_decode_reqs=dec, decode_context_tokens=dec * int(rng.integers(20, 300)))
    rest, add = split_time(model, f)
    return ({"num_reqs": f.num_reqs, "num_tokens": ptok + dec, "num_prefill_reqs": pre,
             "prefill_attn_pairs": 0, "prefill_context_tokens": 0,
             "decode_context_tokens": f.decode_context_tokens}, rest, add)


def test_two_speed_fit_undoes_a_compute_drift_the_decode_probe_misses():
    """Steps made by a known model on a machine whose decode speed and compute speed drift apart
    between groups: dividing whole periods by the decode probe leaves the prefill terms wrong;
    fit_two_speeds recovers the model at the median speeds."""
    from calibration.calibrate import fit_two_speeds
    from calibration.fit import fit_cost_model
    true = FittedCostModel(intercept_s=0.02, per_req_s=0.001, per_token_s=0.0005, per_prefill_req_s=0.002,
                           per_decode_ctx_s=1e-5)
    rng = np.random.default_rng(0)
    rows, periods, around, around_c, labels = [], [], [], [], []
    speeds = [(1.0, 1.0), (1.6, 1.1), (1.2, 1.0), (1.0, 1.3)]  # (decode, compute) factor per group
    for gi, (fd, fc) in enumerate(speeds):
        for _ in range(60):
            row, rest, add = _random_step(rng, true)
            rows.append(row)
            periods.append(rest * fd + add * fc)
            around.append(0.1 * fd)
            around_c.append(0.5 * fc)
            labels.append(f"g{gi}")
    probes, cprobes = [0.1 * fd for fd, _ in speeds], [0.5 * fc for _, fc in speeds]
    med, med_c = np.median(probes), np.median(cprobes)
    two = fit_two_speeds(rows, periods, around, around_c, med, med_c, groups=labels, knots=[], caps=[])
    one = fit_cost_model(rows, [t * med / a for t, a in zip(periods, around)], groups=labels, knots=[], caps=[])

    def err(m):  # worst relative error on the steps, against the true model at the median speeds
        out = []
        for r in rows:
            t = true._time(*(r[k] for k in ("num_reqs", "num_tokens", "num_prefill_reqs", "prefill_attn_pairs",
                                            "prefill_context_tokens", "decode_context_tokens")))
            dec = r["num_reqs"] - r["num_prefill_reqs"]
            rest = true._time(dec, dec, 0, 0, 0, r["decode_context_tokens"])
            want = rest * med / 0.1 + (t - rest) * med_c / 0.5
            got = m._time(*(r[k] for k in ("num_reqs", "num_tokens", "num_prefill_reqs", "prefill_attn_pairs",
                                           "prefill_context_tokens", "decode_context_tokens")))
            out.append(abs(got / want - 1))
        return max(out)
    assert err(two) < 0.02 < err(one)


@pytest.mark.parametrize("follows", [0.0, 0.5, 1.0])
def test_probe_exponent_is_how_much_the_steps_follow_the_probe(follows):
    """Steps of a known model in groups whose machine speed is (probe factor) ** follows: 1, the
    probe reads the speed exactly; 0, the probe's readings are its own scatter (the steps do not
    move with them); 0.5, between. The grouped cross-validation picks that exponent back, and the
    fit at it recovers the model at the median speed."""
    from calibration.calibrate import fit_probe_exponent
    true = FittedCostModel(intercept_s=0.02, per_req_s=0.001, per_token_s=0.0005, per_prefill_req_s=0.002,
                           per_decode_ctx_s=1e-5)
    rng = np.random.default_rng(1)
    probe_factor = [1.0, 1.3, 0.85, 1.15, 0.9, 1.05]   # per group; the median probe is 1.025 of 0.1 s
    rows, periods, around, around_c, labels = [], [], [], [], []
    for gi, q in enumerate(probe_factor):
        speed = q ** follows
        for _ in range(40):
            row, rest, add = _random_step(rng, true)
            rows.append(row)
            periods.append((rest + add) * speed)
            around.append(0.1 * q)
            around_c.append(0.5 * q)
            labels.append(f"g{gi}")
    med = float(np.median([0.1 * q for q in probe_factor]))
    model, b, table = fit_probe_exponent(rows, periods, around, around_c, med, 5 * med, groups=labels,
                                         knots=[], caps=[])
    assert b == follows and set(table) == {f"{i / 10:g}" for i in range(11)}
    assert table[f"{follows:g}"] == min(table.values()) < 1e-6 < max(table.values())
    at_median = (med / 0.1) ** follows  # the machine's speed when the probe reads its median
    for r in rows[::7]:
        args = [r[k] for k in ("num_reqs", "num_tokens", "num_prefill_reqs", "prefill_attn_pairs",
                               "prefill_context_tokens", "decode_context_tokens")]
        assert model._time(*args) == pytest.approx(true._time(*args) * at_median, rel=1e-6)


def test_rank_in_the_engine_sample_by_hand():
    """rank_in inverts numpy's 'linear' percentile: in 1..5, 3 is the median and 2.5 sits at
    3/8; a flat stretch of a bimodal sample (the ITL plateau) makes p90 jump while the rank of a
    value inside the gap moves by less than a point."""
    from calibration.validate import _pct, rank_in
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert rank_in(v, 3.0) == pytest.approx(0.5) and rank_in(v, 2.5) == pytest.approx(0.375)
    assert rank_in(v, 0.0) == 0.0 and rank_in(v, 9.0) == 1.0 and rank_in(np.array([1.0]), 1.0) is None
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, 1000)
    assert rank_in(x, _pct(x, "p90")) == pytest.approx(0.9)
    gaps = np.concatenate([np.full(899, 60.0), np.linspace(150, 600, 101)])  # 89.9% short gaps
    p90 = _pct(gaps, "p90")
    assert p90 > 150 and rank_in(gaps, 60.0 + 0.5 * (p90 - 60)) == pytest.approx(0.899, abs=1e-3)


def test_a_profile_from_another_cpu_is_flagged():
    from calibration.calibrate import host_cpu
    from calibration.validate import other_host
    here = host_cpu()
    assert here.endswith(" cpus)") and other_host({"host_cpu": here}) is None
    assert other_host({}) is None  # a profile that does not say where it was measured
    msg = other_host({"host_cpu": "Some CPU (cpu family 25, model 1, stepping 1, 2 cpus)"}, here="Another CPU (2 cpus)")
    assert "Some CPU" in msg and "Another CPU" in msg and "recalibrate" in msg


def test_applied_speed_factors_by_hand():
    """validate applies the validation's level (geometric mean of the runs' probe factors) in
    full and each run's deviation from it to the profile's exponent."""
    from calibration.validate import applied_factors
    level, got = applied_factors([0.8, 1.25], 0.5)           # level sqrt(0.8 x 1.25) = 1
    assert level == pytest.approx(1.0) and got == pytest.approx([0.8 ** 0.5, 1.25 ** 0.5])
    level, got = applied_factors([0.9, 0.9 * 1.21], 0.5)     # level 0.9 x 1.1 = 0.99
    assert level == pytest.approx(0.99) and got == pytest.approx([0.99 / 1.1 ** 0.5, 0.99 * 1.1 ** 0.5])
    assert applied_factors([0.7, 1.3, 1.1], 1.0)[1] == pytest.approx([0.7, 1.3, 1.1])  # exponent 1: raw
    level, got = applied_factors([0.7, 1.3, 1.1], 0.0)       # exponent 0: every run at the level
    assert got == pytest.approx([level] * 3) and applied_factors([], 0.4) == (1.0, [])


def test_speed_probe_drift_range_by_hand():
    from calibration.probe import drift_range
    probes = [0.1, 0.1, 0.12, 0.08, 0.1]
    lo, hi = drift_range(probes)                 # ratios 1.0, 1.2, 0.667, 1.25
    assert lo == pytest.approx(np.quantile([1.0, 1.2, 0.08 / 0.12, 1.25], 0.05))
    assert hi == pytest.approx(np.quantile([1.0, 1.2, 0.08 / 0.12, 1.25], 0.95))
    assert drift_range([0.1, 0.2]) == (1.0, 1.0)


def test_validate_flags_runs_at_a_speed_the_calibration_never_saw(capsys):
    """Probes of 0.08-0.125 s around a median of 0.1: factors 0.8-1.25 were measured; a run at
    0.6 (the machine much faster than at calibration) or 1.3 is flagged, one at 1.0 is not."""
    from calibration.validate import print_table, speed_extrapolation
    ref = {"median_s": 0.1, "probes_s": [0.08, 0.1, 0.125],
           "compute": {"median_s": 1.0, "probes_s": [0.9, 1.0, 1.1]}}
    runs = [{"load": 0.3, "seed": 0, "speed_factor": 1.0, "compute_factor": 1.05},
            {"load": 0.9, "seed": 0, "speed_factor": 0.6, "compute_factor": 0.85},
            {"load": 0.3, "seed": 1, "speed_factor": 1.3, "compute_factor": 1.0}]
    out = speed_extrapolation(runs, ref)
    assert out["calibrated_range"] == [0.8, 1.25] and out["compute_calibrated_range"] == [0.9, 1.1]
    assert out["runs_outside"] == ["load 0.9 seed 0", "load 0.3 seed 1"]
    assert out["runs_outside_compute"] == ["load 0.9 seed 0"]
    report = {"loads": {}, "speed_probe": {"runs": runs, **out},
              "summary": {"signed_mean_error": 0.0, "median_abs_error": 0.0, "interval_coverage": 1.0, "rows": 0}}
    print_table(report)
    assert "2 of 3 runs met the machine at a decode speed the profile never measured" in capsys.readouterr().out


def test_sweep_divides_each_group_by_the_speed_around_it(tmp_path):
    """A machine that ran slower around the second group: with the probes saying so, each group's
    periods enter the fit at the median speed (steps.csv keeps the raw period and the probe)."""
    import csv as _csv
    from calibration.calibrate import run_sweep, sweep_groups
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=64, max_num_seqs=2, num_gpu_blocks=64)
    groups = sweep_groups(2, eng.max_model_len, concurrency=(1,), bands={"a": (16, 24), "b": (24, 32)},
                          requests_per_slot=1.0, min_requests=2)
    scripted = iter([1.0, 2.0, 2.0])               # probes: before a, between, after b
    rows, times, labels, interrupted, probes = run_sweep(eng, groups, 0, tmp_path / "s.csv", False,
                                                         probe=lambda _e: next(scripted))
    assert probes == [1.0, 2.0, 2.0] and not interrupted
    with open(tmp_path / "s.csv") as f:
        logged = list(_csv.DictReader(f))
    assert len(logged) == len(times) and [r["group"] for r in logged] == labels
    # median probe 2.0: group a ran at sqrt(1*2) = 1.41 (factor 0.71), group b at sqrt(2*2) = 2 (1.0)
    probe_s = {"c1-a": np.sqrt(2.0), "c1-b": 2.0}
    for r, t in zip(logged, times):
        assert float(r["probe_s"]) == pytest.approx(probe_s[r["group"]])
        assert t == pytest.approx(float(r["period_s"]) * 2.0 / probe_s[r["group"]])


def test_probes_keep_their_shape_under_any_setting():
    """A 128-token budget and two sequences must not change the references: the compute probe is
    still one prefill-only step of COMPUTE_PROMPT tokens (not cut in two, which once read the
    machine as twice as fast) and the speed probe still decodes PROBE_REQUESTS requests at once.
    The engine serves with its own setting again afterwards."""
    from calibration.probe import COMPUTE_PROMPT, PROBE_REQUESTS, compute_probe, speed_probe
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=2,
                    num_gpu_blocks=128, max_model_len=512)
    before = eng.scheduler_config
    n0 = len(eng.step_log)
    assert compute_probe(eng) > 0
    pre = [s for s in eng.step_log[n0:] if s.num_prefill_reqs]
    assert pre and all(s.num_prefill_tokens == COMPUTE_PROMPT and s.num_decode_reqs == 0 for s in pre)
    n1 = len(eng.step_log)
    assert speed_probe(eng) > 0
    assert max(s.num_decode_reqs for s in eng.step_log[n1:]) == PROBE_REQUESTS
    assert eng.scheduler_config is before and eng.max_model_len == 512
    assert eng.scheduler_config.max_num_batched_tokens == 128 and eng.scheduler.config.max_num_seqs == 2


def test_reconfigure_serves_with_new_knobs_over_the_same_pool():
    from engine.core import SamplingParams
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=4, num_gpu_blocks=64)
    cfg = eng.reconfigure(max_num_batched_tokens=32, max_num_seqs=1, policy="priority")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.num_gpu_blocks) == (32, 1, 64)
    assert eng.scheduler.config is cfg and cfg.uncache_unscheduled_victims
    eng.add_request("a", list(range(100, 180)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert eng.step_log[-1].num_prefill_tokens == 32  # the new budget chunks the 80-token prompt
    with pytest.raises(RuntimeError, match="still running"):
        eng.reconfigure(max_num_seqs=2)
    with pytest.raises(ValueError, match="uncache_unscheduled_victims=False"):
        eng.abort_request("a") or eng.reconfigure(uncache_unscheduled_victims=False)
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds"):
        eng.reconfigure(max_model_len=5000)
    assert eng.reconfigure(num_gpu_blocks=32).num_gpu_blocks == 32 and eng.runner.num_blocks == 32


def _tiny_scenario(tmp_path, **sched):
    import yaml
    data = {"name": "tiny", "deployment": {"model": "smollm2-135m", "device": "cpu-2core", "num_gpu_blocks": 128},
            "scheduler": {"max_num_batched_tokens": 128, "max_num_seqs": 4, **sched},
            "workload": {"num_requests": 4, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "uniform", "min": 16, "max": 48},
                         "output_len": {"type": "uniform", "min": 4, "max": 8}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_reads_settings_through_the_scenario_schema(tmp_path):
    """Every setting reaches the engine and the simulator through the schema: unknown fields and
    values are refused naming them, and so is what one engine replica cannot run."""
    from calibration.validate import ValidateError, load_settings
    path = _tiny_scenario(tmp_path)
    base, small = load_settings(path, ["scheduler.max_num_batched_tokens=32"], None)
    assert base.knobs["max_num_batched_tokens"] == 128 and small.knobs["max_num_batched_tokens"] == 32
    assert small.values == {"scheduler.max_num_batched_tokens": 32} and small.knobs["num_gpu_blocks"] == 128
    pol, = load_settings(_tiny_scenario(tmp_path, policy="priority", enable_prefix_caching=False), None, None)
    assert pol.knobs["policy"] == "priority" and pol.knobs["enable_prefix_caching"] is False
    for items, field in ((["scheduler.colour=1"], "scheduler.colour"),
                         (["scheduler.policy=lifo"], "scheduler.policy='lifo'"),
                         (["scheduler.async_scheduling=true"], "scheduler.async_scheduling=True: not supported"),
                         (["deployment.replicas=2"], "deployment.replicas=2: not supported"),
                         (["deployment.api_server_count=2"], "deployment.api_server_count=2: not supported"),
                         (["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs=0"),
                         (["workload.client.type=http"], "workload.client={'type': 'http'}: not supported")):
        with pytest.raises(ValidateError, match=re.escape(field)):
            load_settings(path, items, None)
    # The engine is driven without an API server: so is the simulator's side of every setting.
    from calibration.validate import engine_direct
    from sim.clients import ENGINE_DIRECT
    from sim.workload import build_workload
    assert base.workload["client"] == small.workload["client"] == {"type": "engine_direct"}
    assert build_workload(base.workload, 0).client == ENGINE_DIRECT
    assert engine_direct({"num_requests": 3})["client"] == {"type": "engine_direct"}


def test_what_if_validation_runs_every_setting_at_the_base_rates(tmp_path):
    """A base and a what-if setting (budget 128 -> 32) through the real engine and the simulator:
    each side records the scheduler it ran with, both settings run at the same absolute rate,
    and the report has each setting's table and the changes from the base side by side."""
    from calibration.calibrate import calibrate, sweep_groups
    from calibration.validate import load_settings, validate
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=4, num_gpu_blocks=128)
    groups = sweep_groups(4, eng.max_model_len, concurrency=(1, 4), bands={"short": (16, 40)},
                          requests_per_slot=1.0, min_requests=2)
    prof = calibrate(eng, tmp_path / "p.json", groups=groups, progress=False, probe=False)
    found = load_settings(_tiny_scenario(tmp_path), ["scheduler.max_num_batched_tokens=32"], None)
    rep = validate(eng, prof, found, tmp_path / "val", loads=(0.4, 0.5), seeds=1, duration_s=1, min_requests=3,
                   progress=False)
    saved = json.loads((tmp_path / "val" / "validation.json").read_text())
    wi = saved["what_if"]
    assert [s["label"] for s in wi["settings"]] == ["base", "max_num_batched_tokens=32"]
    for s, budget in zip(wi["settings"], (128, 32)):
        assert s["settings"]["engine"]["max_num_batched_tokens"] == budget
        assert s["settings"]["sim"] == s["settings"]["engine"]
        assert s["loads"]["0.5"]["rate_requests_per_s"] == pytest.approx(0.5 * saved["capacity_requests_per_s"])
    assert saved["settings"]["engine"]["max_num_batched_tokens"] == 128  # the base, at the top level too
    d = next(x for x in wi["deltas"] if x["metric"] == "ttft_s.p50")
    assert d["setting"] == "max_num_batched_tokens=32" and d["sim_interval"][0] <= d["sim"] <= d["sim_interval"][1]
    # the summary counts the p50/p90 changes at loads neither setting saturates (which loads do
    # depends on the machine's speed during the capacity bursts: a busy machine saturated the
    # 0.5 load of the small budget once)
    counted = [x for x in wi["deltas"] if x["metric"].endswith(("p50", "p90")) and not x.get("saturated")]
    assert wi["summary"]["p50_p90_deltas"] == len(counted)
    assert wi["summary"]["within_10pp"] == sum(x["within_10pp"] for x in counted)
    # ... and the same count for every speed model's simulations; the main one's is the summary.
    assert set(wi["summary_by_speed"]) == {"in_situ", "probes", "in_situ_all"}
    assert wi["summary_by_speed"]["in_situ"] == wi["summary"]
    assert all(o["p50_p90_deltas"] == len(counted) for o in wi["summary_by_speed"].values())
    assert (tmp_path / "val" / "whatif-deltas.png").stat().st_size > 1000
    assert (tmp_path / "val" / "cdf-max-num-batched-tokens-32-load0.4.png").exists()
    assert {d["load"] for d in wi["deltas"]} == {0.4, 0.5}
    assert rep["what_if"]["settings"][1]["summary"]["rows"] >= 0
    # The engine ran the small budget's runs with its prefills cut to 32 tokens.
    steps = (tmp_path / "val" / "engine-steps.csv").read_text().splitlines()
    cols = steps[0].split(",")
    small = [dict(zip(cols, r.split(","))) for r in steps[1:] if r.startswith("max_num_batched_tokens=32")]
    assert small and max(int(r["num_prefill_tokens"]) + int(r["num_decode_reqs"]) for r in small) <= 32


def test_sweep_covers_other_settings_and_gives_the_engine_back(tmp_path):
    """The default sweep adds groups past the engine's max_num_seqs and at small and large
    budgets (where the KV pool holds them); a group runs under its own knobs and the engine
    serves with its own setting afterwards."""
    from calibration.calibrate import BUDGET_GROUPS, run_sweep, setting_of, sweep_groups
    from engine.llm_engine import LLMEngine
    names = [g["name"] for g in sweep_groups(32, 8192, num_gpu_blocks=1456)]
    assert {"c64-short", "c64-medium", "c128-short", "b64-c4-medium", "b2048-c16-long"} <= set(names)
    assert "c128-medium" not in names  # 128 x 20 blocks do not fit in 1,456
    assert len([n for n in names if n.startswith("b")]) == len(BUDGET_GROUPS)
    assert setting_of({"knobs": {"max_num_batched_tokens": 64, "max_num_seqs": 32}}) == "budget 64"
    eng = LLMEngine(model="default", device="cpu", max_num_batched_tokens=128, max_num_seqs=2, num_gpu_blocks=64)
    groups = [{"name": "b32-c2-x", "concurrency": 2, "prompt": (60, 80), "requests": 2,
               "knobs": {"max_num_batched_tokens": 32, "max_num_seqs": 2}}]
    rows, *_ = run_sweep(eng, groups, 0, tmp_path / "s.csv", False)
    assert rows and max(r["num_tokens"] for r in rows) <= 32
    assert eng.scheduler_config.max_num_batched_tokens == 128

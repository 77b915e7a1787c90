"""Which machine speed should time the prefill part of a validation's steps? Read from saved engine
runs, no engine and no simulation:

    .venv/bin/python bench/prefill_speed_models.py --profile P.json DIR [DIR ...]

DIR is a `servetwin validate --out` directory (its engine-runs.pkl); P.json the profile those runs
were validated with. For every run, the steps that carry a prefill chunk are priced the way
`validate` prices them (calibration.probe.SplitSpeedModel): the decode part at the run's in-situ
speed (calibration.validate.InSituSpeed), the prefill part at each candidate speed, times the
noise mean the simulator draws for the step (NoisyCostModel.mean_ratio). Each run's bias is the
sum of those expected times over the sum of the measured periods, minus 1.

Candidates for the prefill part:
- `probes`: the compute probes around the run (what `validate` does).
- `in_situ`: the run's in-situ decode speed at the step's moment.
- `one`: the profile's own speed.
- `in_situ_x_ratio`: in situ times the validation's compute-to-decode probe level ratio.
- `geomean`: the geometric mean of probes and in situ.

A speed that tracks the machine leaves a small spread (std) of the per-run bias. Its mean is then
what the profile itself gets wrong about these steps. Prints JSON: per run and per candidate,
then mean, std and mean absolute value (all in percent)."""
from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import numpy as np

from calibration.probe import SplitSpeedModel
from calibration.validate import ENGINE_RUNS, InSituSpeed, applied_factors, step_features
from sim.cost_model import FittedCostModel, load_profile
from sim.intervals import NoisyCostModel

CANDIDATES = ("probes", "in_situ", "one", "in_situ_x_ratio", "geomean")


def run_biases(base: FittedCostModel, saved: dict) -> list[dict]:
    noisy = NoisyCostModel(base, 0)
    done = saved["done"]
    exponent = float((saved.get("speed_probe") or {}).get("exponent", 1.0))
    level, applied = applied_factors([x.speed for x in done], exponent)
    level_c, applied_c = applied_factors([x.compute for x in done], exponent)
    out = []
    for er, scale, cscale in zip(done, applied, applied_c):
        res = er.result
        speed = InSituSpeed(res.steps, res.periods_s, base, fallback=scale)
        expected = dict.fromkeys(CANDIDATES, 0.0)
        measured = 0.0
        for s, p in zip(res.steps, res.periods_s):
            if p is None or s.num_prefill_tokens == 0:
                continue
            f = step_features(s)
            m, d = noisy.mean_ratio(f), speed(s.start_s)
            for name, x in (("probes", cscale), ("in_situ", d), ("one", 1.0),
                            ("in_situ_x_ratio", d * level_c / level), ("geomean", (cscale * d) ** 0.5)):
                expected[name] += SplitSpeedModel(base, d, x).step_time(f) * m
            measured += p
        if measured > 0:
            out.append({"setting": saved["labels"][er.setting], "load": er.load, "seed": er.seed,
                        **{k: round(100 * (v / measured - 1), 2) for k, v in expected.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    base = FittedCostModel.from_profile(load_profile(a.profile))
    runs = []
    for d in a.dirs:
        with open(Path(d) / ENGINE_RUNS, "rb") as f:
            runs += [{"dir": d, **r} for r in run_biases(base, pickle.load(f))]
    summary = {}
    for k in CANDIDATES:
        v = np.array([r[k] for r in runs])
        summary[k] = {"mean_pct": round(float(v.mean()), 2), "std_pct": round(float(v.std()), 2),
                      "mean_abs_pct": round(float(np.abs(v).mean()), 2)}
    print(json.dumps({"runs": len(runs), "summary": summary, "per_run": runs}, indent=1))


if __name__ == "__main__":
    main()

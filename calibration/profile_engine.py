"""Profile the real engine's steps and fit a cost-model profile from them.

The engine logs every step's batch features (engine.core.batch_features) and times; this drives
it through a sweep of batch shapes (prefill chunks of several lengths on empty and cached
context, decode batches of several sizes and context lengths, and mixes of both) with the shared
scheduler deciding every step, then fits calibration.fit.fit_cost_model to the measured step
times (wall time of the step: scheduling, input preparation, forward, sampling).

    python -m calibration.profile_engine --device cpu --out sim/profiles/cpu-smollm2-135m.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from calibration.fit import fit_cost_model
from engine.core import SamplingParams
from sim.cost_model import today


def sweep(engine, batch_sizes=(1, 4, 16, 32), prompt_lens=(16, 128, 512), decode_tokens=24,
          seed: int = 0, progress: bool = True, mixed: int = 0) -> list:
    """Run request groups through the engine; return its step log (one StepRecord per step)."""
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    groups = [(b, p) for p in prompt_lens for b in batch_sizes
              if b * (p + decode_tokens) < (engine.num_gpu_blocks - 1) * engine.block_size]
    it = groups
    if progress:
        from tqdm import tqdm
        it = tqdm(groups, desc="profiling", unit="group")
    start = len(engine.step_log)
    k = 0
    for b, p in it:
        sp = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0)
        # Staggered arrivals give mixed steps (a prefill chunk beside running decodes).
        for i in range(b):
            ids = rng.integers(100, vocab - 100, p).tolist()
            engine.add_request(f"prof-{k}", ids, sp)
            k += 1
            if i % 4 == 3:
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    # A mixed phase: random lengths arriving a few at a time, so steps of every composition a
    # served workload produces (decodes of many context lengths beside prefill chunks) are seen.
    for i in range(mixed):
        ids = rng.integers(100, vocab - 100, int(rng.integers(16, max(prompt_lens) + 1))).tolist()
        engine.add_request(f"prof-mix-{i}", ids, SamplingParams(
            max_tokens=int(rng.integers(8, 2 * decode_tokens + 1)), ignore_eos=True, temperature=0))
        for _ in range(int(rng.integers(0, 6))):
            if engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return engine.step_log[start:]


def torch_device_name(device) -> str:
    """e.g. 'h100-sxm' for 'NVIDIA H100 80GB HBM3' (the catalog's names), else the CUDA name."""
    import torch
    name = torch.cuda.get_device_name(device).lower()
    for key, ours in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g"), ("l40s", "l40s"),
                      ("a10g", "a10g")):
        if key in name:
            return ours
    return name.replace(" ", "-")


def make_profile(engine, steps, source: str, warmup: int = 3) -> dict:
    rows, times = [], []
    for s in steps[warmup:]:
        rows.append({k: getattr(s, k) for k in ("num_reqs", "num_tokens", "num_prefill_reqs",
                                                "prefill_attn_pairs", "prefill_context_tokens",
                                                "decode_context_tokens")})
        times.append(s.end_s - s.start_s)
    cfg = engine.model.config
    meta = {
        # Names as in sim/specs.py's catalogs, so scenarios can pick the profile by deployment.
        "device": (torch_device_name(engine.device) if engine.device.type != "cpu"
                   else f"cpu-{os.cpu_count()}core"),
        "model": "smollm2-135m" if engine.model_name == "default" else engine.model_name,
        "cpu": platform.processor() or platform.machine(),
        "dtype": str(engine.dtype).replace("torch.", ""), "tp": 1,
        "block_size": engine.block_size, "num_gpu_blocks": engine.num_gpu_blocks,
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "model_shape": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                        "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads},
        "engine_version": "servetwin-0.1", "date": today(), "source": source,
    }
    return fit_cost_model(rows, times, metadata=meta).to_profile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=2048)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--mixed", type=int, default=120, help="requests in the random mixed phase")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from engine.llm_engine import LLMEngine
    eng = LLMEngine(model=a.model, device=a.device, max_num_batched_tokens=a.max_num_batched_tokens,
                    max_num_seqs=a.max_num_seqs, num_gpu_blocks=a.num_gpu_blocks)
    t0 = time.perf_counter()
    steps = sweep(eng, a.batch_sizes, a.prompt_lens, a.decode_tokens, mixed=a.mixed)
    prof = make_profile(eng, steps, source=f"measured: calibration.profile_engine, {len(steps)} steps "
                                           f"in {time.perf_counter() - t0:.0f} s")
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
    m = prof["metadata"]
    print(json.dumps({"profile": a.out, "steps": m["num_samples"], "fit_mape": round(m["fit_mape"], 4),
                      "cv_mape": round(m["cv_mape"], 4), "cv_p95_abs_rel_error": round(m["cv_p95_abs_rel_error"], 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

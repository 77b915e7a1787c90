"""Output tokens/s of ServeTwin (continuous batching, paged KV) vs transformers generate() with
static batches, on the same requests in the same process. Prints one JSON object.

Workload: N requests (default 64) with random token-id prompts of 32-512 tokens and output lengths
of 16-256 tokens (seeded). Both sides decode greedily and produce exactly the requested lengths:
ServeTwin with min_tokens = max_tokens = length; transformers in left-padded static batches of
`--batch-size` requests, each batch generating max(length) tokens with min_new_tokens =
max_new_tokens (a static batch runs until its longest member is done; the tokens past a request's
length are padding work and are not counted). Each batch size runs twice: in request order, and
length-sorted (by output then prompt length, an oracle no server has, so the strongest static
baseline); `speedup` is against the best of all of them. The default batch sizes are 8, 16 and
64 (= max_num_seqs, every request in one batch). Throughput = requested output tokens / wall
time of the whole workload; model loading is excluded, a short warm-up is not timed. Each run's
result is also printed to stderr as soon as it finishes, so a run cut short keeps its numbers.

    python bench/engine_throughput.py                      # 64 requests, a few minutes on 2 cores
    python bench/engine_throughput.py --num-requests 16    # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Ordinary tokens only (the first few ids of the default vocabulary are special tokens).
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def run_servetwin(llm, work) -> dict:
    from engine import SamplingParams

    eng = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=m, min_tokens=m) for _, m in work]
    n_steps = len(eng.step_log)
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - t
    steps = eng.step_log[n_steps:]
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == [m for _, m in work], "ServeTwin produced wrong output lengths"
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(sum(got) / elapsed, 2),
        "num_steps": len(steps),
        "num_preemptions": sum(r.num_preempted for r in steps),
        "forward_s": round(sum(r.forward_s for r in steps), 3),
        "schedule_s": round(sum(r.schedule_s for r in steps), 3),
        "prepare_s": round(sum(r.prepare_s for r in steps), 3),
        "sample_detok_s": round(sum(r.sample_s for r in steps), 3),
        "max_batch_reqs": max(r.num_reqs for r in steps),
        "mean_decode_batch": round(sum(r.num_decode_reqs for r in steps) / max(1, len(steps)), 1),
        "_outputs": [o.outputs[0].token_ids for o in outs],
    }


@torch.inference_mode()
def run_transformers(hf, work, batch_size: int, pad_id: int, sort: bool = False) -> dict:
    order = sorted(range(len(work)), key=lambda i: (work[i][1], len(work[i][0]))) if sort else list(range(len(work)))
    t = time.perf_counter()
    outputs: list[list[int] | None] = [None] * len(work)
    generated = 0
    for i in range(0, len(work), batch_size):
        idx = order[i:i + batch_size]
        batch = [work[k] for k in idx]
        width = max(len(p) for p, _ in batch)
        new = max(m for _, m in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad_id)
        generated += out[:, width:].numel()
        for j, (k, (_, m)) in enumerate(zip(idx, batch)):
            outputs[k] = out[j, width:width + m].tolist()
    elapsed = time.perf_counter() - t
    useful = sum(m for _, m in work)
    return {"batch_size": batch_size, "length_sorted": sort, "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(useful / elapsed, 2),
            "generated_tokens_incl_padding_rows": generated, "_outputs": outputs}


def prefix_agreement(a: list[list[int]], b: list[list[int]], k: int = 8) -> float:
    """Fraction of requests whose first k greedy tokens agree (padding changes numerics slightly)."""
    return round(sum(x[:k] == y[:k] for x, y in zip(a, b)) / max(1, len(a)), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--batch-size", type=int, nargs="+", default=[8, 16, 64],
                    help="transformers static batch sizes; each runs in request order and length-sorted; "
                         "`speedup` is vs the fastest")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.model.loader import resolve_model

    llm = LLM(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.llm_engine
    work = make_workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len),
                         eng.vocab_size)
    llm.generate([work[0][0][:32]] * 2, SamplingParams(temperature=0, max_tokens=4, min_tokens=4))  # warm-up
    ours = run_servetwin(llm, work)
    # Each finished run goes to stderr at once: a run cut short keeps what it measured.
    print(json.dumps({"servetwin": {k: v for k, v in ours.items() if not k.startswith("_")}}),
          file=sys.stderr, flush=True)

    result: dict = {
        "bench": "engine_throughput",
        "model": args.model, "device": args.device, "dtype": str(eng.dtype).replace("torch.", ""),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "num_requests": len(work),
        "prompt_tokens": {"min": min(len(p) for p, _ in work), "max": max(len(p) for p, _ in work),
                          "total": sum(len(p) for p, _ in work)},
        "output_tokens": {"min": min(m for _, m in work), "max": max(m for _, m in work),
                          "total": sum(m for _, m in work)},
        "servetwin": {k: v for k, v in ours.items() if not k.startswith("_")}
        | {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
           "num_gpu_blocks": eng.num_gpu_blocks},
    }
    if not args.skip_transformers:
        hf_dtype = eng.dtype
        hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=hf_dtype,
                                                  local_files_only=True).to(args.device).eval()
        pad = eng.eos_token_id if eng.eos_token_id is not None else 0
        with torch.inference_mode():  # warm-up
            x = torch.tensor([work[0][0][:32]])
            hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=4, min_new_tokens=4,
                        do_sample=False, pad_token_id=pad)
        runs = []
        for bs in args.batch_size:
            for sort in (False, True):
                r = run_transformers(hf, work, bs, pad, sort)
                r["greedy_first8_agreement"] = prefix_agreement(ours["_outputs"], r["_outputs"])
                r["servetwin_speedup"] = round(ours["output_tokens_per_s"] / r["output_tokens_per_s"], 2)
                runs.append({k: v for k, v in r.items() if not k.startswith("_")})
                print(json.dumps({"transformers": runs[-1]}), file=sys.stderr, flush=True)
        best = max(runs, key=lambda r: r["output_tokens_per_s"])
        result["transformers"] = runs if len(runs) > 1 else runs[0]
        result["speedup"] = round(ours["output_tokens_per_s"] / best["output_tokens_per_s"], 2)
        result["speedup_vs"] = (f"transformers static batch {best['batch_size']}"
                                + (", length-sorted" if best["length_sorted"] else ", request order"))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

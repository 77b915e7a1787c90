"""`servetwin generate`: one completion from the real engine, printed to stdout.

    servetwin generate --prompt "What is the capital of France?" --chat --max-tokens 32

The lead CLI (scenarios/cli.py) wires it in with `add_generate_args(subparsers)`; `args.func`
is set to `run_generate`.
"""
from __future__ import annotations

import argparse
import sys
import time


def add_generate_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate a completion with the real engine",
                              description="Generate one completion with the ServeTwin engine.")
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a local HF directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    p.add_argument("--stats", action="store_true", help="print timing and finish reason to stderr")
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, stop=list(args.stop))
        t0 = time.perf_counter()
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
                  num_gpu_blocks=args.num_gpu_blocks)
        t1 = time.perf_counter()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            out = llm.chat(messages, params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"servetwin generate: error: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text)
    if args.stats:
        n = len(c.token_ids)
        print(f"[{n} tokens in {t2 - t1:.2f}s ({n / max(t2 - t1, 1e-9):.1f} tok/s), load {t1 - t0:.1f}s, "
              f"finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.cli")
    add_generate_args(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

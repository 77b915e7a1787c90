"""lm-evaluation-harness against `servetwin serve`: its loglikelihoods equal transformers'.

Starts `servetwin serve` (default model, CPU), writes a small multiple-choice task (a task YAML
over a local JSON file: nothing is downloaded) and runs lm-eval's `local-completions` model on it,
as users score a served model: every choice is one loglikelihood request (`echo: true,
logprobs: 1, max_tokens: 0` on /v1/completions, the prompt sent as token ids). Then scores every
(context, continuation) pair that lm-eval logged with transformers' own forward of the same
checkpoint (float32, the tokens split as lm-eval splits them) and compares: the largest absolute
difference of a loglikelihood, and whether each is-greedy flag and each document's chosen answer
agree. Prints JSON; exit status 1 when a difference exceeds --tol (1e-3).

lm-eval lives in its own virtualenv (it pins its own dependencies; torch first, the CPU wheel):

    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install "lm-eval[api]" transformers
    python bench/lm_eval_check.py --venv VENV [--docs 12] [--tol 1e-3]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.server_clients import free_port, wait_up  # noqa: E402

# Small multiple-choice documents of our own: a context, 3-4 answers (lm-eval puts its target
# delimiter, a space, before each), the right one's index.
DOCS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "apples"], 0),
    ("The opposite of hot is", ["cold", "warm", "blue"], 0),
    ("A week has seven", ["days", "hours", "years"], 0),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("Cats are animals that often say", ["meow", "moo", "quack"], 0),
    ("Two plus two equals", ["four", "five", "seven"], 0),
    ("The color of the clear sky on a sunny day is", ["blue", "green", "red"], 0),
    ("In the morning many people drink a cup of", ["coffee", "gravel", "paint"], 0),
    ("A person who writes books is called an", ["author", "engine", "ocean"], 0),
    ("The largest planet in our solar system is", ["Jupiter", "Mars", "Mercury"], 0),
    ("Bees make", ["honey", "steel", "glass"], 0),
    ("Question: What do you use to write on paper?\nAnswer:", ["a pen", "a spoon", "a shoe"], 0),
    ("Question: Which month comes after January?\nAnswer:", ["February", "March", "December"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", ["eight", "six", "four"], 0),
    ("Question: What do plants need to grow?\nAnswer:", ["sunlight", "plastic", "noise"], 0),
]

TASK_YAML = """task: servetwin_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def split_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into tokens: trailing spaces of the
    context move to the continuation, the whole is encoded once and cut at the context's length."""
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return whole[:len(ctx)], whole[len(ctx):]


def reference(model_dir: str, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, every continuation token greedy) per pair,
    from transformers' forward of the checkpoint in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for context, continuation in pairs:
            ctx, cont = split_pair(tok, context, continuation)
            ids = torch.tensor([ctx + cont])
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            rows = lp[len(ctx) - 1:len(ctx) + len(cont) - 1]
            target = torch.tensor(cont)
            out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("LM_EVAL_VENV", "venvs/lm-eval")),
                    help="the lm-eval virtualenv (or LM_EVAL_VENV)")
    ap.add_argument("--docs", type=int, default=len(DOCS), help=f"how many documents (at most {len(DOCS)})")
    ap.add_argument("--tol", type=float, default=1e-3)
    a = ap.parse_args()
    lm_eval = a.venv / "bin" / "lm_eval"
    if not lm_eval.exists():
        print(json.dumps({"skipped": f"no {lm_eval}; see this script's docstring"}))
        return 2
    from engine.model.loader import resolve_model
    model_dir = str(resolve_model("default"))
    work = Path(tempfile.mkdtemp(prefix="servetwin-lm-eval-"))
    data = work / "docs.json"
    data.write_text("\n".join(json.dumps({"context": c, "choices": ch, "label": y})
                              for c, ch, y in DOCS[:a.docs]) + "\n")
    (work / "tasks").mkdir()
    (work / "tasks" / "servetwin_mc.yaml").write_text(TASK_YAML.format(data=data))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servetwin = Path(sys.executable).parent / "servetwin"
    srv = subprocess.Popen([str(servetwin), "serve", "--port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, srv)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.perf_counter()
        run = subprocess.run(
            [str(lm_eval), "--model", "local-completions", "--tasks", "servetwin_mc",
             "--include_path", str(work / "tasks"),
             "--model_args", f"model=default,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                             f"tokenizer={model_dir},num_concurrent=1,max_retries=1",
             "--output_path", str(work / "out"), "--log_samples", "--batch_size", "1"],
            capture_output=True, text=True, env=env, timeout=1800)
        lm_eval_s = time.perf_counter() - t0
    finally:
        srv.terminate()
        srv.wait(30)
    if run.returncode != 0:
        print(json.dumps({"error": "lm_eval failed", "stderr_tail": run.stderr[-3000:]}, indent=1))
        return 1
    samples = [json.loads(line) for f in glob.glob(str(work / "out" / "**" / "samples_servetwin_mc_*.jsonl"),
                                                   recursive=True) for line in open(f)]
    pairs, served = [], []
    samples.sort(key=lambda s: s["doc_id"])
    for s in samples:
        # arguments: {"gen_args_I": {"arg_0": context, "arg_1": continuation}}; resps: [[[ll, greedy]]]
        # as strings (lm-eval 0.4.x's log format)
        args = s["arguments"]
        args = [args[f"gen_args_{i}"] for i in range(len(args))] if isinstance(args, dict) else args
        for arg, resp in zip(args, s["resps"]):
            context, continuation = (arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else arg
            pairs.append((context, continuation))
            ll, greedy = resp[0] if isinstance(resp[0], (list, tuple)) else resp
            served.append((float(ll), str(greedy) == "True"))
    ref = reference(model_dir, pairs)
    diffs = [abs(s[0] - r[0]) for s, r in zip(served, ref)]
    chosen_same = 0
    k = 0
    for s in samples:
        n = len(s["resps"])
        pick = lambda xs: max(range(n), key=lambda i: xs[k + i][0])  # noqa: E731
        chosen_same += pick(served) == pick(ref)
        k += n
    res = {"documents": len(samples), "loglikelihood_requests": len(pairs),
           "max_abs_diff": max(diffs) if diffs else math.nan,
           "median_abs_diff": sorted(diffs)[len(diffs) // 2] if diffs else math.nan,
           "within_tol": all(d <= a.tol for d in diffs), "tol": a.tol,
           "is_greedy_agree": sum(s[1] == r[1] for s, r in zip(served, ref)),
           "chosen_answer_agree": chosen_same,
           "lm_eval_acc": next((v for f in glob.glob(str(work / "out" / "**" / "results_*.json"), recursive=True)
                                for v in [json.load(open(f))["results"]["servetwin_mc"].get("acc,none")]), None),
           "lm_eval_s": round(lm_eval_s, 1),
           "pairs": [{"context": c, "continuation": x, "served": s[0], "transformers": r[0]}
                     for (c, x), s, r in list(zip(pairs, served, ref))[:6]]}
    print(json.dumps(res, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if res["within_tol"] and diffs else 1


if __name__ == "__main__":
    sys.exit(main())

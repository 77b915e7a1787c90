"""Real load generators against `servetwin serve`: does the server's request log see the TTFT its
clients see?

Starts `servetwin serve` (default model, CPU) with a request log, runs guidellm and aiperf against
it (streaming chat, synthetic prompts, fixed concurrency and, with --rate, fixed request rates), and matches every request the client
measured with the server's log row: guidellm by the response id, aiperf by the X-Request-Id it
sends (the server makes it the response id). Prints JSON per client and concurrency: requests
matched, median client TTFT, median server TTFT, and the median and p90 of the per-request
difference (client - server), in ms.

Each tool lives in its own virtualenv (they pin different dependencies):

    python3 -m venv VENVS/guidellm && VENVS/guidellm/bin/pip install guidellm
    python3 -m venv VENVS/aiperf && VENVS/aiperf/bin/pip install aiperf
    python bench/server_clients.py --venvs VENVS [--concurrency 1 8] [--rate 1] [--requests 32]
                                   [--warmup 8] [--aiperf-workers 4]

On a 2-core machine aiperf starts one worker process (its rule: min(concurrency, 0.75 x CPUs - 1)),
which parses every stream's chunks in turn; `--aiperf-workers` gives it a few, as it would start on
a client machine with more cores.

A tool whose venv is missing is skipped with a note in the output.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, srv: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until the server at `url` answers /health, or a RuntimeError when it died or took too long."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or srv.poll() is not None:
            raise RuntimeError("servetwin serve did not start")
        time.sleep(0.5)


def server_ttft_s(log: Path) -> dict[str, float]:
    with open(log) as f:
        return {r["request_id"]: float(r["first_token_s"]) - float(r["arrival_s"])
                for r in csv.DictReader(f) if r["first_token_s"]}


def run_guidellm(venv: Path, url: str, model_dir: str, load: tuple[str, float], n: int, isl: int, osl: int,
                 out: Path, warmup: int = 0) -> dict[str, float]:
    kind, value = load
    path = out / f"guidellm-{kind}{value:g}.json"
    profile = (f"kind=concurrent,streams={int(value)}" if kind == "concurrency"
               else f"kind=constant,rate={value:g}")
    total = n + 2 * warmup
    if warmup:  # guidellm takes its phases as a fraction of the requests: int(fraction * total) == warmup
        frac = (warmup + 0.5) / total
        profile += f",warmup={frac:.6f},cooldown={frac:.6f}"
    cmd = [str(venv / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={total}",
           "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
           "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={path}",
           "--disable-console"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    reqs = json.loads(path.read_text())["benchmarks"][0]["requests"]["successful"]
    return {r["response_id"]: r["time_to_first_token_ms"] / 1e3 for r in reqs}


def run_aiperf(venv: Path, url: str, model_dir: str, load: tuple[str, float], n: int, isl: int, osl: int,
               out: Path, warmup: int = 0, workers: int | None = None) -> dict[str, float]:
    kind, value = load
    art = out / f"aiperf-{kind}{value:g}"
    how = (["--concurrency", str(int(value))] if kind == "concurrency"
           else ["--request-rate", f"{value:g}", "--request-rate-mode", "constant"])
    cmd = [str(venv / "bin" / "aiperf"), "profile", "--model", "default", "--tokenizer", model_dir,
           "--url", url, "--endpoint-type", "chat", "--streaming", *how,
           "--request-count", str(n), "--synthetic-input-tokens-mean", str(isl),
           "--output-tokens-mean", str(osl), "--artifact-dir", str(art), "--ui-type", "none"]
    if workers:
        cmd += ["--workers-max", str(workers)]
    if warmup:
        cmd += ["--warmup-request-count", str(warmup)]
    subprocess.run(cmd, check=True, capture_output=True)
    got = {}
    for line in (art / "profile_export.jsonl").read_text().splitlines():
        rec = json.loads(line)
        ttft = rec["metrics"].get("time_to_first_token")
        if ttft is not None:
            got["chatcmpl-" + rec["metadata"]["x_request_id"]] = ttft["value"] / 1e3
    return got


def compare(client: dict[str, float], server: dict[str, float]) -> dict:
    ids = [k for k in client if k in server]
    if not ids:
        return {"matched": 0}
    diff = sorted((client[k] - server[k]) * 1e3 for k in ids)
    return {"matched": len(ids), "of": len(client),
            "client_ttft_ms_p50": round(statistics.median(client[k] * 1e3 for k in ids), 1),
            "server_ttft_ms_p50": round(statistics.median(server[k] * 1e3 for k in ids), 1),
            "diff_ms_p50": round(statistics.median(diff), 2),
            "diff_ms_p90": round(diff[int(0.9 * (len(diff) - 1))], 2),
            "diff_ms_max": round(diff[-1], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venvs", default=os.environ.get("SERVETWIN_CLIENT_VENVS", "venvs"), type=Path,
                    help="folder holding the guidellm/ and aiperf/ venvs (or SERVETWIN_CLIENT_VENVS)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--aiperf-workers", type=int, default=None,
                    help="aiperf --workers-max (default: aiperf's own choice, one worker on 2 cores, which "
                         "parses every stream's chunks in one process)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="warm-up requests each tool runs first (guidellm also as many cool-down requests "
                         "last): phases the tools leave out of their own summaries. Every request the tools "
                         "list, these included, is still matched and compared")
    ap.add_argument("--rate", type=float, nargs="*", default=[],
                    help="also fixed-rate runs at these request rates (req/s, constant intervals)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine.model.loader import resolve_model
    model_dir = str(resolve_model("default"))
    out = Path(tempfile.mkdtemp(prefix="servetwin-clients-"))
    log = out / "requests.csv"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servetwin = Path(sys.executable).parent / "servetwin"
    srv = subprocess.Popen([str(servetwin), "serve", "--port", str(port), "--request-log", str(log)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict = {"isl": a.isl, "osl": a.osl, "requests": a.requests, "warmup": a.warmup,
                     "aiperf_workers": a.aiperf_workers, "runs": []}
    try:
        wait_up(url, srv)
        for tool, fn in (("guidellm", run_guidellm), ("aiperf", run_aiperf)):
            venv = a.venvs / tool
            if not (venv / "bin" / tool).exists():
                results["runs"].append({"client": tool, "skipped": f"no {venv}/bin/{tool}; see this script's docstring"})
                continue
            loads = [("concurrency", c) for c in a.concurrency] + [("rate", r) for r in a.rate]
            for kind, value in loads:
                extra = {"warmup": a.warmup}
                if tool == "aiperf":
                    extra["workers"] = a.aiperf_workers
                client = fn(venv, url, model_dir, (kind, value), a.requests, a.isl, a.osl, out, **extra)
                results["runs"].append({"client": tool, kind: value, **compare(client, server_ttft_s(log))})
    finally:
        srv.terminate()
        srv.wait(30)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

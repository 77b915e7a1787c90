"""Fuzz the OpenAI-compatible server: many random and malformed request bodies, with a
well-formed greedy request after every `--check-every`, whose answer must equal a reference.

Starts `servetwin serve`'s app in this process on the default model (CPU) unless --url is given.
Prints JSON: the number of requests, responses by status, 500s, wrong answers, whether the engine
loop is alive at the end, and the wall time.

    python bench/server_fuzz.py [--requests 10000] [--concurrency 4] [--seed 0] [--url URL]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz_bodies import MODEL, fuzz_body  # noqa: E402

CHECK = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 5, "temperature": 0}


def start_server():
    import uvicorn

    from engine.llm_engine import LLMEngine
    from engine.server.app import create_app

    engine = LLMEngine(model=MODEL, device="cpu", max_num_batched_tokens=512, max_num_seqs=32,
                       num_gpu_blocks=400, max_model_len=1024)
    app = create_app(engine, model_name=MODEL, max_waiting=1000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", (server, thread), app


async def fuzz(url: str, n: int, concurrency: int, seed: int, check_every: int, timeout_s: float) -> dict:
    from tqdm import tqdm

    statuses: dict[int, int] = {}
    bad: list[str] = []
    timeouts: list[str] = []
    wrong = 0
    async with httpx.AsyncClient(timeout=timeout_s) as c:
        ref = (await c.post(url + "/v1/completions", json=CHECK)).json()["choices"][0]["text"]
        todo = list(range(n))
        bar = tqdm(total=n, desc="fuzz", file=sys.stderr)

        async def worker(w: int):
            nonlocal wrong
            rng = random.Random(seed * 1000 + w)
            while todo:
                i = todo.pop()
                if i % check_every == check_every - 1:
                    r = await c.post(url + "/v1/completions", json=CHECK)
                    if r.status_code != 200 or r.json()["choices"][0]["text"] != ref:
                        wrong += 1
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                else:
                    path = "/v1/chat/completions" if rng.random() < 0.4 else "/v1/completions"
                    body = fuzz_body(rng)
                    try:
                        r = await c.post(url + path, content=body, headers={"content-type": "application/json"})
                    except httpx.TimeoutException:
                        timeouts.append(body.decode("utf-8", "replace")[:300])
                    else:
                        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                        if r.status_code >= 500 and len(bad) < 10:
                            bad.append(f"{r.status_code} {r.text[:300]}")
                bar.update(1)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        bar.close()
        health = (await c.get(url + "/health")).status_code
    return {"statuses": dict(sorted(statuses.items())), "responses_500": sum(v for k, v in statuses.items()
                                                                               if k >= 500),
            "wrong_answers": wrong, "timeouts": len(timeouts), "timed_out_bodies": timeouts[:5],
            "health_status": health, "first_5xx": bad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="a request unanswered this long is a failure")
    ap.add_argument("--url", default=None, help="fuzz a running server instead of starting one")
    a = ap.parse_args()
    server = app = None
    url = a.url
    if url is None:
        url, server, app = start_server()
    t = time.perf_counter()
    try:
        res = asyncio.run(fuzz(url, a.requests, a.concurrency, a.seed, a.check_every, a.timeout_s))
        res = {"requests": a.requests, "concurrency": a.concurrency, "seed": a.seed, **res,
               "wall_s": round(time.perf_counter() - t, 1)}
        if app is not None:
            aeng = app.state.async_engine
            res["engine_loop_alive"] = aeng.alive
            res["engine_step_failures"] = aeng.total_failed_steps
        print(json.dumps(res, indent=2), flush=True)
    finally:
        if server is not None:  # uvicorn's shutdown stops the engine loop (lifespan)
            server[0].should_exit = True
            server[1].join(30)
    ok = (res["responses_500"] == 0 and res["wrong_answers"] == 0 and res["timeouts"] == 0
          and res["health_status"] == 200)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

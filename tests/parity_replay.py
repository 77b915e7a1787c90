"""Replay of recorded vLLM 0.33 scheduler decisions (protocol: ../shared/parity/README.md)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from engine.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

HERE = Path(__file__).parent
SHARED = HERE.parent.parent / "shared" / "parity" / "vllm-0.33-scheduler-decisions.json"
BUNDLED = HERE / "data" / "vllm-0.33-scheduler-decisions.json.gz"


def load_fixtures(path: Path | None = None) -> list[dict]:
    """The shared file when present (it is the source), else the copy bundled with the tests."""
    path = path or (SHARED if SHARED.exists() else BUNDLED)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["fixtures"]


def make_scheduler(config: dict) -> Scheduler:
    c = config
    return Scheduler(SchedulerConfig(
        max_num_batched_tokens=c["max_num_batched_tokens"], max_num_seqs=c["max_num_seqs"],
        max_model_len=c["max_model_len"], block_size=c["block_size"],
        num_gpu_blocks=c["num_gpu_blocks"], enable_chunked_prefill=True,
        long_prefill_token_threshold=c["long_prefill_token_threshold"],
        enable_prefix_caching=c["enable_prefix_caching"], policy=c["policy"]))


def replay(fixture: dict, check_invariants: bool = False) -> list[dict]:
    """Run the fixture's events through our scheduler; return one record per step."""
    s = make_scheduler(fixture["config"])
    events = sorted(fixture["events"], key=lambda e: e["step"])  # stable: file order within a step
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(e["step"], []).append(e)
    num_adds = 0
    records = []
    for k in range(len(fixture["steps"])):
        for e in by_step.get(k, ()):
            if e["op"] == "add":
                s.add_request(Request(
                    request_id=e["id"], prompt_token_ids=e["prompt_tokens"],
                    sampling_params=SamplingParams(max_tokens=e["max_tokens"], ignore_eos=True),
                    arrival_time=k + num_adds * 1e-6, priority=e["priority"], eos_token_id=None))
                num_adds += 1
            else:
                s.finish_requests([e["id"]], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        sampled = {rid: ([7] if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens else [])
                   for rid in out.num_scheduled_tokens}
        outs = s.update_from_output(out, sampled)
        if check_invariants:
            s.check_invariants()
        records.append({
            "scheduled": dict(out.num_scheduled_tokens),
            "preempted": sorted(out.preempted_req_ids),
            "finished": sorted(o.request_id for o in outs if o.finish_reason in ("stop", "length")),
            "free_blocks": s.kv_cache_manager.num_free_blocks,
        })
    return records


def first_mismatch(fixture: dict, records: list[dict]) -> str | None:
    for k, (want, got) in enumerate(zip(fixture["steps"], records)):
        w = {"scheduled": want["scheduled"], "preempted": sorted(want["preempted"]),
             "finished": sorted(want["finished"]), "free_blocks": want["free_blocks"]}
        if w != got:
            return f"step {k}: want {w}\n         got  {got}"
    return None

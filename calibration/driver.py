"""The loop that calibration and validation run the real engine in.

It is the server's engine loop without HTTP: admit the requests that have arrived, take one step,
hand out the outputs, and sleep only when there is nothing to run. Requests arrive at given
times (open loop, in real time) or when earlier ones finish (closed loop, `refill`).

What the simulator advances its clock by is a step's *period*: from the start of one step to the
start of the next, which includes everything the loop does between them (stop checks,
detokenization and output handling inside `LLMEngine.step`, then admitting new requests and
handing out outputs here). The driver knows which steps were followed by another without an
idle wait, so their periods can be measured; a step followed by idleness has no period.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.core import SamplingParams
from engine.core.records import RequestRecord, StepRecord


@dataclass(slots=True)
class Arrival:
    at_s: float                    # seconds since the run began
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str = ""                # the sweep group (calibration), copied to the steps it causes
    priority: int = 0              # for the priority policy (lower first)


@dataclass
class DriveResult:
    records: list[RequestRecord]   # on the run's clock (0 = start of the run)
    steps: list[StepRecord]        # on the run's clock
    periods_s: list[float | None]  # per step: start to next start, None where idleness followed
    groups: list[str] = field(default_factory=list)  # per step: group of the newest admitted request


def drive(engine, arrivals: Iterable[Arrival], refill: Callable[[str, float], list[Arrival]] | None = None,
          on_finish: Callable[[str], None] | None = None) -> DriveResult:
    """Run `arrivals` (and whatever `refill(finished_request_id, now_s)` adds) to completion."""
    log = engine.step_log
    first = len(log)
    pending = deque(sorted(arrivals, key=lambda a: a.at_s))
    ids: list[str] = []
    step_group: list[str] = []
    follows: set[int] = set()      # log indices whose next logged step came without idleness
    prev: int | None = None
    group = pending[0].group if pending else ""
    t0 = engine.now()
    while pending or engine.has_unfinished_requests():
        now = engine.now() - t0
        while pending and pending[0].at_s <= now:
            a = pending.popleft()
            engine.add_request(a.request_id, a.prompt_token_ids, a.params, arrival_time=t0 + a.at_s,
                               priority=a.priority)
            ids.append(a.request_id)
            group = a.group
        if engine.has_unfinished_requests():
            n = len(log)
            outputs = engine.step()
            if len(log) > n:
                if prev is not None:
                    follows.add(prev)
                prev = len(log) - 1
                step_group.append(group)
            for o in outputs:
                if o.finished:
                    if on_finish is not None:
                        on_finish(o.request_id)
                    if refill is not None:
                        t = engine.now() - t0
                        for a in refill(o.request_id, t):
                            a.at_s = t
                            pending.appendleft(a)
        else:
            prev = None  # idle: the next step does not continue the last one
            time.sleep(max(0.0, min(0.05, pending[0].at_s - now)))
    steps = log[first:]
    periods = [log[i + 1].start_s - log[i].start_s if i in follows else None
               for i in range(first, len(log))]
    records = [engine.request_records.pop(r) for r in ids]
    return DriveResult([_shift_record(r, t0) for r in records], [_shift_step(s, t0) for s in steps],
                       periods, step_group)


def _shift_record(r: RequestRecord, t0: float) -> RequestRecord:
    for f in ("arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s"):
        v = getattr(r, f)
        if v is not None:
            setattr(r, f, v - t0)
    r.token_times_s = [x - t0 for x in (r.token_times_s or [])]
    return r


def _shift_step(s: StepRecord, t0: float) -> StepRecord:
    s.start_s -= t0
    s.end_s -= t0
    return s


def warm_up(engine, n: int = 3) -> None:
    """A few throw-away requests: the first forwards of a process are slow (allocator, kernels)."""
    for i in range(n):
        engine.add_request(f"warm-{i}", [100 + i] * 64, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.request_records.pop(f"warm-{i}", None)

"""Per-request and per-step records: the same fields whether a real engine or the simulator
produced them, so one metrics module (sim.metrics) summarises both and a served workload can be
compared with its simulation row by row.

Times are seconds on the driver's clock: wall time since the engine started, or SimPy's env.now.
A token's time is the end of the step that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    # max_tokens as the client asked (-1: not given, "as many as fit"); the engine core runs a
    # request whose prompt + max_tokens exceeds max_model_len with fewer (engine.core.admission),
    # so num_output_tokens < this with finish_reason "length" marks a truncated request.
    num_requested_output_tokens: int = -1
    first_scheduled_s: float | None = None   # start of the first step that scheduled it
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None            # time it left the system (finished or aborted)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0               # prefix-cache hits at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None         # "stop", "length", "abort", "rejected"
    replica: int = 0
    # Every output token's time, when the driver keeps them (the engine always does; the
    # simulator on request, since ITL can be summarised without them).
    token_times_s: list[float] | None = None

    COLUMNS = ()  # filled below

    def as_row(self) -> dict:
        return {c: getattr(self, c) for c in RequestRecord.COLUMNS}


RequestRecord.COLUMNS = tuple(f.name for f in fields(RequestRecord) if f.name != "token_times_s")


@dataclass(slots=True)
class StepRecord:
    """One engine step (num_steps == 1), or a run of num_steps simulated steps taken at once by
    FastForwardScheduler.advance() between two outside events.

    For a run, the feature columns (num_reqs .. num_preempted) and the time columns
    (schedule_s .. sample_s, forward_s) are SUMS over its steps; num_running, num_waiting and
    kv_usage are as after its last step. So summing any feature column over a table gives the
    same total whether the simulator ran fast or step by step, and a table holds one row per
    run, not per step (memory bounded by the outside events, not by the steps)."""

    step: int                      # index of the first step
    start_s: float
    end_s: float
    num_steps: int = 1
    num_reqs: int = 0
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    prefill_context_tokens: int = 0
    prefill_attn_pairs: int = 0
    num_decode_reqs: int = 0
    decode_context_tokens: int = 0
    num_tokens: int = 0
    num_preempted: int = 0
    num_running: int = 0           # after the step
    num_waiting: int = 0           # after the step
    kv_usage: float = 0.0          # fraction of usable blocks referenced, after the step
    schedule_s: float = 0.0        # engine: scheduler CPU time
    prepare_s: float = 0.0         # engine: input preparation
    forward_s: float = 0.0         # engine: model forward (CUDA events on GPU); sim: predicted
    sample_s: float = 0.0          # engine: sampling + detokenize
    replica: int = 0
    extra: dict = field(default_factory=dict)

    def as_row(self) -> dict:
        d = {c: getattr(self, c) for c in STEP_COLUMNS}
        if self.extra:
            d.update(self.extra)
        return d


STEP_COLUMNS = tuple(f.name for f in fields(StepRecord) if f.name != "extra")

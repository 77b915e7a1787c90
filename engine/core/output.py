"""What crosses the scheduler/runner seam: ids, token counts and block-id deltas, never tensors."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.features import BatchFeatures
from engine.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first admission, or resumption after preemption.

    For a resumed request `output_token_ids` holds the tokens generated before it was preempted
    (they are recomputed as part of its prompt) and `block_ids` is its whole new block list.
    """

    req_id: str
    prompt_token_ids: Sequence[int]  # a list, or a range or tuple (the simulator's synthetic prompts)
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # before this step (prefix-cache hits for a new request)
    eos_token_id: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests that stayed running: parallel lists, only the blocks added this step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_resumed_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData | None  # None from the fast path (FastForwardScheduler.advance)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    # Finished (stopped or aborted) since the previous schedule(): the runner drops their state.
    finished_req_ids: set[str]
    # Requests whose computed tokens reach their known tokens this step, in schedule order:
    # they sample a token (decodes and final prefill chunks); the others are mid-prompt chunks.
    # None when the output was not built by schedule().
    sampling_req_ids: list[str] | None = None
    # Batch features of this step (engine.core.features), gathered while scheduling.
    features: "BatchFeatures | None" = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineCoreOutput:
    """Per-request result of update_from_output()."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # None, "stop", "length" or "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def batch_features(out: SchedulerOutput, requests: dict | None = None) -> BatchFeatures:
    """Features of the step `out` describes.

    schedule() gathers them while it decides (out.features); for an output built some other
    way they are recomputed from `requests` (scheduler.requests, after schedule() and before
    update_from_output(), which forgets finished requests).
    """
    if out.features is not None:
        return out.features
    return features_from_requests(out, requests)


def features_from_requests(out: SchedulerOutput, requests: dict) -> BatchFeatures:
    """The same features from the requests' state. schedule() has already advanced
    num_computed_tokens, so the context before the step is num_computed_tokens - n."""
    f = BatchFeatures(num_preempted=len(out.preempted_req_ids))
    for rid, n in out.num_scheduled_tokens.items():
        f.add(n, requests[rid].num_computed_tokens - n)
    f.num_reqs = len(out.num_scheduled_tokens)
    return f

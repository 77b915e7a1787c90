"""A request as the scheduler sees it: token ids, counters and a status. No tensors, no clock."""
from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished (as in vLLM)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASON.get(status)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
_PREEMPTED = int(RequestStatus.PREEMPTED)


class Request:
    """One generation request.

    `num_tokens` = prompt + outputs so far; `num_computed_tokens` = tokens whose KV is (or, after
    `schedule()`, will be) in the cache. The scheduler's only per-step decision is how far to move
    the second towards the first.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority",
        "eos_token_id", "cache_salt", "status", "num_prompt_tokens", "all_token_ids",
        "output_token_ids", "num_tokens", "num_computed_tokens", "max_tokens", "stop_reason",
        "num_preemptions", "num_cached_tokens", "block_hashes", "stop_ids", "token_limit",
        "driver_state", "unique_from",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # Not copied: the caller hands the sequence over (a list, or a range or tuple, as the
        # simulator's synthetic prompts are); all_token_ids below is the growing list.
        self.prompt_token_ids = (prompt_token_ids if isinstance(prompt_token_ids, (list, range, tuple))
                                 else list(prompt_token_ids))
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = arrival_time
        self.priority = priority
        self.eos_token_id = eos_token_id
        # Extra key mixed into the first block hash: requests with different salts never share
        # prefix-cache blocks (vLLM's cache_salt).
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        # Resolved by the scheduler on add (None in SamplingParams means "up to max_model_len").
        self.max_tokens = self.sampling_params.max_tokens
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prefix-cache hits at first admission (-1 until admitted).
        self.num_cached_tokens = -1
        # Chained hashes of the full blocks of all_token_ids, filled lazily by the KV manager.
        self.block_hashes: list[int] = []
        # Set by the scheduler on add, so the per-token stop check is two comparisons:
        # token ids that stop the request (EOS unless ignore_eos, plus stop_token_ids) or None,
        # and num_tokens at which it is length-capped (min of max_model_len, prompt + max_tokens).
        self.stop_ids: frozenset[int] | None = None
        self.token_limit = 0
        # Opaque per-request state of the driver (engine or simulator); the scheduler never reads it.
        self.driver_state: object = None
        # A driver's promise (the simulator's synthetic prompts): no other request's token ids
        # agree with this one's up to position unique_from, so no other request can ever hit a
        # block reaching past it. The KV manager caches such blocks without hashing them (until
        # a preemption, after which the request itself may hit them), and keys them by the
        # request id, not by their tokens, whose values past unique_from then do not matter.
        # None: no promise.
        self.unique_from: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, "
                f"outputs={self.num_output_tokens})")

"""Waiting-queue policies. A what-if policy is a small class here, not an edit of `schedule()`.

A policy decides two things: the order in which waiting requests are admitted, and which running
request is preempted when the KV pool is full (`victim_key`; None means "the last admitted",
vLLM's FCFS rule). Policies with a `victim_key` also get vLLM's PRIORITY preemption semantics:
a victim that was already scheduled in this step is un-scheduled and its tokens refunded.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from engine.core.request import Request


class WaitingQueue:
    """Interface every policy implements."""

    # key(request) -> comparable; the running request with the LARGEST key is preempted first.
    victim_key: Callable[[Request], object] | None = None

    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(WaitingQueue):
    """Arrival order; preempted requests go back to the front."""

    victim_key = None

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(id(r) for r in requests)
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class HeapQueue(WaitingQueue):
    """A heap ordered by `key(request)` (smaller first); preempted requests are simply re-pushed."""

    @staticmethod
    def key(r: Request):
        raise NotImplementedError

    def __init__(self) -> None:
        # Entries are (key, request_id, request): ids are unique, so Requests are never compared.
        self._heap: list[tuple] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), request.request_id, request))

    prepend_request = add_request

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(id(r) for r in requests)
        self._heap = [e for e in self._heap if id(e[-1]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap))


class PriorityQueue(HeapQueue):
    """vLLM's PRIORITY policy: (priority, arrival_time, request_id), lower first; the victim is the
    running request that ranks last."""

    @staticmethod
    def key(r: Request):
        return (r.priority, r.arrival_time)

    @staticmethod
    def victim_key(r: Request):
        # vLLM compares (priority, arrival_time); the request id settles exact ties the way the
        # waiting heap does, so the best-ranked request is never the victim and always
        # progresses (two equal requests could otherwise preempt each other for ever).
        return (r.priority, r.arrival_time, r.request_id)


class ShortestPromptFirstQueue(HeapQueue):
    """What-if policy: admit the shortest prompt first (ties by arrival). Preemption stays FCFS."""

    victim_key = None

    @staticmethod
    def key(r: Request):
        return (r.num_prompt_tokens, r.arrival_time)


POLICIES: dict[str, type[WaitingQueue]] = {
    "fcfs": FCFSQueue,
    "priority": PriorityQueue,
    "shortest_prompt_first": ShortestPromptFirstQueue,
}


def register_policy(name: str, cls: type[WaitingQueue]) -> None:
    POLICIES[name] = cls


def make_queue(policy: str | type[WaitingQueue]) -> WaitingQueue:
    if isinstance(policy, str):
        try:
            return POLICIES[policy]()
        except KeyError:
            raise ValueError(
                f"SchedulerConfig.policy={policy!r}: unknown policy; known: {sorted(POLICIES)}") from None
    if isinstance(policy, type) and issubclass(policy, WaitingQueue):
        return policy()
    raise ValueError(f"SchedulerConfig.policy={policy!r}: expected a policy name or a WaitingQueue subclass")

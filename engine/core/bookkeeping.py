"""Request bookkeeping, written once for every driver of the scheduler (engine.llm_engine.LLMEngine
and sim.replica.Replica): request records, token times, inter-token latency (ITL) and client
cancellation. The drivers differ in what they run (a forward pass or a cost model) and in their
clock (wall time or SimPy's), not in how a record is kept.

    scheduled   the first step that scheduled a request: first_scheduled_s, prefix-cache hits
    preempted   one more preemption
    token       n new tokens at the end of a step: first/last token time, output count, token
                times (when kept), ITL, and whether the client hangs up now (cancel_tokens)
    end_step    closes a step: its end time and how many of its tokens continued a run
    finish      finish reason and time (stop, length, abort, error, rejected)

ITL without keeping every token time: a token whose request also got a token in the previous step
has the gap step_ends[s] - step_ends[s - 1]; the book counts those per step (step_cont) and keeps
the other gaps (after a preemption, or a step in which the request got no token) explicitly.
`itl_sample()` returns the weighted sample, equal to the gaps of every request's token times.

The lazy_* methods keep the same books for the steps FastForwardScheduler.advance() takes at once, where
requests decode lazily (engine.core.fast_forward): such a request's tokens are written back from the
step ends when something happens to it.
"""
from __future__ import annotations

from engine.core.records import RequestRecord


class Entry:
    """Bookkeeping state of one live request, next to its record."""

    __slots__ = ("record", "last_step", "cancel_tokens", "lazy_from")

    def __init__(self, record: RequestRecord, cancel_tokens: int | None = None) -> None:
        self.record = record
        self.last_step = -2               # index of the step of its latest token
        self.cancel_tokens = cancel_tokens  # the client hangs up after this many output tokens
        self.lazy_from = -1               # first step it decodes lazily in advance(); -1: not lazy


class Book:
    __slots__ = ("keep_token_times", "step_ends", "step_cont", "other_gaps", "_cont")

    def __init__(self, keep_token_times: bool) -> None:
        self.keep_token_times = keep_token_times
        self.step_ends: list[float] = []
        self.step_cont: list[int] = []
        self.other_gaps: list[float] = []
        self._cont = 0

    @property
    def num_steps(self) -> int:
        """Steps closed so far: the index of the step in progress."""
        return len(self.step_ends)

    # -------------------------------------------------------------- records
    def open(self, record: RequestRecord, requested_output_tokens: int | None) -> RequestRecord:
        record.num_requested_output_tokens = -1 if requested_output_tokens is None else requested_output_tokens
        if self.keep_token_times:
            record.token_times_s = []
        return record

    @staticmethod
    def scheduled(record: RequestRecord, start_s: float, num_cached_tokens: int) -> None:
        record.first_scheduled_s = start_s
        record.num_cached_tokens = num_cached_tokens

    @staticmethod
    def preempted(record: RequestRecord) -> None:
        record.num_preemptions += 1

    def token(self, e: Entry, step: int, end_s: float, n: int = 1) -> bool:
        """n tokens of e at the end of step `step`; True if its client hangs up now."""
        if n <= 0:
            return False
        rec = e.record
        if rec.first_token_s is None:
            rec.first_token_s = end_s
        elif e.last_step == step - 1:
            self._cont += 1
        else:
            self.other_gaps.append(end_s - rec.last_token_s)
        if n > 1:  # several tokens in one step (gaps of zero between them)
            self.other_gaps.extend([0.0] * (n - 1))
        if self.keep_token_times:
            rec.token_times_s.extend([end_s] * n)
        rec.last_token_s = end_s
        rec.num_output_tokens += n
        e.last_step = step
        return e.cancel_tokens is not None and rec.num_output_tokens >= e.cancel_tokens

    def end_step(self, end_s: float) -> None:
        self.step_ends.append(end_s)
        self.step_cont.append(self._cont)
        self._cont = 0

    @staticmethod
    def finish(record: RequestRecord, reason: str, t: float) -> None:
        record.finish_reason = reason
        record.finish_s = t

    # ---------------------------------------------------------------- lazy
    def lazy_steps(self, ends: list[float], num_decodes: list[int]) -> None:
        """Close the steps advance() took: their ends, and their decodes as continued tokens."""
        self.step_ends.extend(ends)
        self.step_cont.extend(num_decodes)

    def lazy_enter(self, entries, step0: int) -> list[Entry]:
        """Entries that decode lazily from step0 on; returns those that got no token in the step
        before (their first lazy token is not a continued one: see lazy_late)."""
        for e in entries:
            e.lazy_from = step0
        return [e for e in entries if e.last_step != step0 - 1]

    def lazy_late(self, late: list[Entry], step0: int) -> None:
        """The first lazy token (step0) of entries that got no token in the step before: counted
        in the step's decodes, but its gap is explicit, or it is the request's first token."""
        if not late:
            return
        end = self.step_ends[step0]
        for e in late:
            rec = e.record
            if rec.first_token_s is None:
                # A prompt whose last chunk was one token: this is its first token (its time
                # joins token_times_s through the lazy slice).
                rec.first_token_s = end
            else:
                self.other_gaps.append(end - rec.last_token_s)
        self.step_cont[step0] -= len(late)

    def lazy_first_token(self, e: Entry, step: int, num_output_tokens: int) -> None:
        """A request's first token after its prompt (or after a preemption) in a lazy run; it
        decodes lazily from the next step."""
        end = self.step_ends[step]
        rec = e.record
        if rec.first_token_s is None:
            rec.first_token_s = end
        else:  # a resumed request
            self.other_gaps.append(end - rec.last_token_s)
        if self.keep_token_times:
            rec.token_times_s.append(end)
        rec.last_token_s = end
        rec.num_output_tokens = num_output_tokens
        e.last_step = step
        e.lazy_from = step + 1

    def lazy_sync(self, e: Entry, last: int, num_output_tokens: int) -> None:
        """Write back e's lazy tokens (one per step from lazy_from through `last`)."""
        if e.lazy_from < 0:
            return
        if e.lazy_from <= last:
            rec = e.record
            if self.keep_token_times:
                rec.token_times_s.extend(self.step_ends[e.lazy_from:last + 1])
            rec.num_output_tokens = num_output_tokens
            rec.last_token_s = self.step_ends[last]
            e.last_step = last
        e.lazy_from = -1

    # ------------------------------------------------------------------ ITL
    def itl_sample(self):
        """(values, weights) of every inter-token gap the book has seen."""
        import numpy as np
        ends = np.asarray(self.step_ends)
        w = np.asarray(self.step_cont[1:], dtype=np.int64)
        vals = np.diff(ends) if len(ends) > 1 else np.empty(0)
        keep = w > 0
        other = np.asarray(self.other_gaps)
        return (np.concatenate([vals[keep], other]),
                np.concatenate([w[keep], np.ones(len(other), dtype=np.int64)]))

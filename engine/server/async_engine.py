"""The engine loop on its own thread, fed through a queue, so HTTP work never stalls a step.

    HTTP handlers (asyncio loop)                 engine thread
    ---------------------------                  -------------
    tokenize, validate  --- ("add", ...) --->    engine.add_tokenized_request (arrival = HTTP receipt)
    async for out in stream  <-- outputs ----    engine.step() -> deliver to each request's queue
    disconnect / timeout --- ("abort", id) -->   engine.abort_request (KV blocks freed at once)
    /reset_prefix_cache  --- ("call", fn) --->   fn(engine), result handed back
    /sleep, /wake_up     --- ("call", fn) --->   no step while asleep (sleep_level > 0)

Only the engine thread touches the LLMEngine (scheduler, runner, detokenizer). Outputs are handed
to the event loop with call_soon_threadsafe.

One HTTP request may be several engine requests (n > 1, several prompts): a Group. Its requests
share one asyncio queue of (index, output) items and are added in one command, so either all of
them are queued or none is.

No request can stop the loop. A request the engine refuses (ValueError) is answered with that
error. If a step raises, the requests it scheduled fail (finish reason "error") and the loop goes
on; only MAX_CONSECUTIVE_STEP_FAILURES failing steps in a row (a broken device, not a request)
stop it, and then every waiting handler is answered.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams

logger = logging.getLogger("servetwin.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDead(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """The engine failed while running this request (not the client's fault)."""


def _not_first_token(out) -> bool:
    return len(out.outputs[0].token_ids) > 1


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


@dataclass(slots=True)
class Child:
    """One engine request of an HTTP request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    prompt_embeds: object = None  # engine.prompt_embeds.PromptEmbeds: vectors for some prompt positions


@dataclass
class Group:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float
    children: list[Child]
    index: dict[str, int] = field(default_factory=dict)  # request id -> position in children
    stream: bool = False  # its chunks are streamed: the log waits for the first one's hand-over
    closed: bool = False  # its consumer has stopped reading (set under AsyncEngine._log_lock)

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed
            pass


class AsyncEngine:
    def __init__(self, engine, metrics=None, request_log=None, request_timeout_s: float = 600.0,
                 keep_step_log: int = 2000) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_log = request_log
        self.request_timeout_s = request_timeout_s
        self.keep_step_log = keep_step_log
        self._cmds: queue.Queue = queue.Queue()
        self._groups: dict[str, Group] = {}        # live request id -> its group
        self._deadlines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._pending_lock = threading.Lock()
        self.num_pending_adds = 0  # engine requests queued as "add" commands, not yet seen
        # len(scheduler.waiting) as the engine thread last saw it (after each command and step),
        # kept with num_pending_adds under _pending_lock: the HTTP side reads a consistent pair.
        self._num_sched_waiting = 0
        self.num_failed_steps = 0    # in a row
        self.total_failed_steps = 0
        # A streamed request's log row takes its first token time from the moment its first
        # chunk was handed to the connection (the event loop) and the rest at finish (the engine
        # thread), in either order: request id -> that moment, for requests not finished yet,
        # and request id -> finished record, for streamed requests whose first chunk is not out
        # yet (the event loop was held up past the request's last step). Both, and the log
        # writes, under _log_lock.
        self._log_lock = threading.Lock()
        self._first_sent: dict[str, float] = {}
        self._unsent: dict[str, object] = {}
        # vLLM's sleep mode (/sleep, /wake_up): while above 0 the loop takes no step; requests
        # wait (running ones keep their KV blocks) and go on after wake_up. Set on the engine
        # thread, read by the HTTP side.
        self.sleep_level = 0

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)
        for rid in list(self._unsent):  # rows still waiting for a first chunk: as stepped
            self._write_unsent(rid)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -------------------------------------------------------------- requests
    def num_waiting(self) -> int:
        """Requests queued but not running: those the scheduler held waiting at the engine
        thread's last step or command, plus those submitted since. A request scheduled in the
        step now running still counts until that step ends (it errs towards refusing), and no
        request is ever counted nowhere: the engine thread moves a request from pending to
        the scheduler's waiting queue and updates both counts under one lock."""
        with self._pending_lock:
            return self._num_sched_waiting + self.num_pending_adds

    def _sync_waiting(self, added: int = 0) -> None:
        """Engine thread: `added` pending requests have been handed to the scheduler (or
        refused); record the scheduler's waiting queue as it is now."""
        with self._pending_lock:
            self.num_pending_adds -= added
            self._num_sched_waiting = len(self.engine.scheduler.waiting)

    def submit(self, children: list[Child], arrival_s: float | None = None, stream: bool = False) -> Group:
        """Queue an HTTP request's engine requests now (so they count as waiting at once);
        `arrival_s` is on the engine clock (engine.now()), stamped when the HTTP request was
        received; `stream`: the caller streams the outputs and calls first_token_sent() as each
        request's first chunk goes out. Consume the outputs with `outputs()`. Call from the
        event loop."""
        if not self.alive:
            raise EngineDead(f"engine loop is not running: {self.error!r}")
        group = Group(asyncio.get_running_loop(), asyncio.Queue(),
                      time.monotonic() + self.request_timeout_s, children,
                      {c.request_id: i for i, c in enumerate(children)}, stream)
        with self._pending_lock:
            self.num_pending_adds += len(children)
        self._cmds.put(("add", group, arrival_s))
        if not self.alive:  # it died meanwhile: answer what it will never see
            self._fail_queued(EngineDead(f"engine loop is not running: {self.error!r}"))
        return group

    async def outputs(self, group: Group):
        """Yield (index, cumulative RequestOutput) of a group's requests until all finished.

        An engine refusal (ValueError), a failed request (RequestFailed) or a dead engine
        (EngineDead) is raised. If the consumer stops early (client gone), the unfinished
        requests are aborted in the engine.
        """
        unfinished = {c.request_id for c in group.children}
        try:
            while unfinished:
                item = await group.queue.get()
                if isinstance(item, BaseException):
                    raise item
                i, out = item
                if out.finished:
                    unfinished.discard(out.request_id)
                yield i, out
        finally:
            for rid in unfinished:
                self.abort(rid, group)
            if group.stream:  # a stream that ends before a first chunk went out: log as stepped
                with self._log_lock:
                    group.closed = True
                for c in group.children:
                    self._write_unsent(c.request_id)

    def first_token_sent(self, request_id: str) -> None:
        """A streamed request's first token has just been handed to the client's connection
        (call from the event loop). The request log's first token time becomes this moment, the
        time the client waits for, rather than the end of the step that produced it: the hand-
        over to the event loop and the SSE formatting of a step's other streams lie between.
        If the request has finished meanwhile, its row is written now."""
        t = self.engine.now()
        with self._log_lock:
            rec = self._unsent.pop(request_id, None)
            if rec is None:
                self._first_sent.setdefault(request_id, t)
                return
            self._write(rec, t)

    def _write_unsent(self, request_id: str) -> None:
        with self._log_lock:
            rec = self._unsent.pop(request_id, None)
            self._first_sent.pop(request_id, None)
            if rec is not None:
                self._write(rec, None)

    def abort(self, request_id: str, group: Group | None = None) -> None:
        """Abort a request (of `group`, if given: a refused group's id may belong to another
        live request, which must not be touched)."""
        self._cmds.put(("abort", request_id, group))

    async def sleep(self, level: int) -> None:
        """vLLM's sleep: no step runs until wake_up(). The prefix cache is emptied if no request
        holds KV blocks, as vLLM discards the KV cache when it sleeps; the weights stay loaded at
        every level (vLLM offloads them at level 1 and drops them at level 2 to free device
        memory, which this server does not)."""
        def fall_asleep(eng):
            self.sleep_level = level
            eng.reset_prefix_cache()
        await self.call(fall_asleep)

    async def wake_up(self) -> None:
        def wake(_eng):
            self.sleep_level = 0
        await self.call(wake)

    async def call(self, fn):
        """Run fn(engine) on the engine thread, between steps; return its result."""
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("call", fn, fut))
        return await fut

    # ------------------------------------------------------------ engine side
    def _deliver(self, rid: str, out, batch: dict | None = None) -> None:
        """Hand an output to its group's consumer; with `batch` ({loop: [(group, item)]}), only
        collect it, for _flush to hand over all of a step's outputs in one event-loop wake-up."""
        g = self._groups.get(rid)
        if g is None:
            return
        if out.finished:
            del self._groups[rid]
        if batch is None:
            g.put((g.index[rid], out))
        else:
            batch.setdefault(g.loop, []).append((g.queue, (g.index[rid], out)))

    @staticmethod
    def _flush(batch: dict) -> None:
        for loop, items in batch.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed
                pass

    def _fail(self, rid: str, exc: BaseException) -> None:
        g = self._groups.pop(rid, None)
        if g is not None:
            g.put(exc)

    def _handle(self, cmd) -> None:
        eng = self.engine
        kind = cmd[0]
        if kind == "add":
            _, group, arrival = cmd
            added: list[str] = []
            try:
                for c in group.children:
                    eng.add_tokenized_request(c.request_id, c.prompt_token_ids, c.params, c.prompt_text,
                                              arrival_time=arrival, priority=c.priority,
                                              cache_salt=c.cache_salt, prompt_embeds=c.prompt_embeds)
                    added.append(c.request_id)
            except Exception as e:  # refused (ValueError) or broken: none of the group stays queued
                eng.abort_request(added)
                self._sync_waiting(len(group.children))
                for rid in added:
                    eng.request_records.pop(rid, None)
                if not isinstance(e, ValueError):
                    logger.exception("adding request %s failed", group.children[0].request_id)
                    e = RequestFailed(f"the engine could not queue this request: {e!r}")
                group.put(e)
                return
            self._sync_waiting(len(group.children))
            for rid in added:
                self._groups[rid] = group
                heapq.heappush(self._deadlines, (group.deadline, rid))
        elif kind == "abort":
            _, rid, group = cmd
            if group is None or self._groups.get(rid) is group:
                self._abort(rid)
                self._sync_waiting()
        elif kind == "call":
            _, fn, fut = cmd
            try:
                result, exc = fn(eng), None
            except Exception as e:  # handed back to the caller
                result, exc = None, e
            loop = fut.get_loop()

            def settle(f=fut, r=result, x=exc):
                if not f.done():
                    f.set_exception(x) if x is not None else f.set_result(r)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass

    def _finish_record(self, rid: str) -> None:
        """The request has finished (or been aborted or failed): write its log row, or, for a
        streamed request whose first chunk has not been handed to its connection yet, keep it
        until first_token_sent() (or the end of its stream) writes it."""
        rec = self.engine.request_records.pop(rid, None)
        g = self._groups.get(rid)
        with self._log_lock:
            sent = self._first_sent.pop(rid, None)
            if rec is None or self.request_log is None:
                return
            if sent is None and rec.first_token_s is not None and g is not None and g.stream and not g.closed:
                self._unsent[rid] = rec
                return
            self._write(rec, sent)

    def _write(self, rec, sent: float | None) -> None:
        """Write a log row; `sent`: when its first chunk was handed to the connection (under
        _log_lock)."""
        if sent is not None and rec.first_token_s is not None and sent > rec.first_token_s:
            rec.first_token_s = sent
            times = rec.token_times_s or []
            for k, t in enumerate(times):  # tokens stepped before it reached the client came with it
                if t >= sent:
                    break
                times[k] = sent
            # all of them, and the end, when the request finished before its first chunk went out
            if rec.last_token_s is not None and rec.last_token_s < sent:
                rec.last_token_s = sent
            if rec.finish_s is not None and rec.finish_s < sent:
                rec.finish_s = sent
        self.request_log.write(rec)

    def _abort(self, rid: str, timed_out: bool = False) -> None:
        eng = self.engine
        partial = eng.partial_output(rid)  # a timed-out request still answers with it
        if partial is None:
            self._groups.pop(rid, None)
            return
        eng.abort_request([rid])
        if self.metrics is not None:
            self.metrics.on_abort(rid, eng)
        self._finish_record(rid)
        if timed_out:
            self._deliver(rid, partial)
        else:
            self._groups.pop(rid, None)

    def _step(self) -> None:
        eng = self.engine
        before = eng.scheduler.num_preemptions
        try:
            outputs = eng.step()
        except Exception as e:
            self._sync_waiting()
            self.num_failed_steps += 1
            self.total_failed_steps += 1
            if self.num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            failed = eng.fail_step()
            logger.exception("engine step failed; its %d requests fail, the loop goes on", len(failed))
            err = RequestFailed(f"the engine failed while running this request: {e!r}")
            for rid in failed:
                self._finish_record(rid)
                if self.metrics is not None:
                    self.metrics.on_abort(rid, eng, reason="error")
                self._fail(rid, err)
            return
        self._sync_waiting()
        self.num_failed_steps = 0
        batch: dict = {}
        # First tokens first: the event loop wakes their streams before the others', so a new
        # request's first chunk is not written behind every running stream's (TTFT as sent).
        outputs.sort(key=_not_first_token)
        for o in outputs:  # clients before metrics (the log row first: a client may read it next)
            if o.finished:
                self._finish_record(o.request_id)
            self._deliver(o.request_id, o, batch)
        self._flush(batch)  # one wake-up of the event loop per step, not one per stream
        if self.metrics is not None:
            self.metrics.on_step(eng, outputs, eng.scheduler.num_preemptions - before)
        if len(eng.step_log) > 2 * self.keep_step_log:
            del eng.step_log[:-self.keep_step_log]

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                busy = eng.has_unfinished_requests() and not self.sleep_level
                try:
                    cmd = self._cmds.get(block=not busy, timeout=None if busy else 0.5)
                    self._handle(cmd)
                    while True:
                        self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, rid = heapq.heappop(self._deadlines)
                    if rid in self._groups:
                        logger.info("request %s timed out after %.0f s: aborted", rid, self.request_timeout_s)
                        self._abort(rid, timed_out=True)
                        self._sync_waiting()
                if self.sleep_level:
                    continue
                if not eng.has_unfinished_requests():
                    if self.metrics is not None:  # idle: gauges say so
                        self.metrics.refresh(eng)
                    self._first_sent.clear()  # a stamp that raced its request's finish
                    continue
                self._step()
        except BaseException as e:  # keep the server up to report it; fail every stream
            self.error = e
            logger.exception("engine loop died")
            dead = EngineDead(f"engine loop died: {e!r}")
            for rid in list(self._groups):
                self._fail(rid, dead)
            self._fail_queued(dead)

    def _fail_queued(self, exc: BaseException) -> None:
        """Answer requests still in the command queue (the engine will never see them)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                with self._pending_lock:
                    self.num_pending_adds -= len(cmd[1].children)
                cmd[1].put(exc)
            elif cmd[0] == "call":
                fut = cmd[2]
                try:
                    fut.get_loop().call_soon_threadsafe(
                        lambda f=fut: f.done() or f.set_exception(exc))
                except RuntimeError:
                    pass

"""The engine loop on its own thread, fed through a queue, so HTTP work never stalls a step.

    HTTP handlers (asyncio loop)                 engine thread
    ---------------------------                  -------------
    tokenize, validate  --- ("add", ...) --->    engine.add_request
    async for out in stream  <-- outputs ----    engine.step() -> deliver to each request's queue
    disconnect / timeout --- ("abort", id) -->   engine.abort_request (KV blocks freed at once)

Only the engine thread touches the LLMEngine (scheduler, runner, detokenizer). Outputs are handed
to the event loop with call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import queue
import threading
import time
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams

logger = logging.getLogger("servetwin.server")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float


class EngineDead(RuntimeError):
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
        self._streams: dict[str, _Stream] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._pending_lock = threading.Lock()
        self.num_pending_adds = 0  # queued "add" commands not yet seen by the engine thread

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -------------------------------------------------------------- requests
    def num_waiting(self) -> int:
        """Requests queued but not running (read from the HTTP side: approximate, by design)."""
        return len(self.engine.scheduler.waiting) + self.num_pending_adds

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt_text: str | None = None, priority: int = 0) -> "_Stream":
        """Queue a request for the engine now (so it counts as waiting at once); consume its
        outputs with `outputs()`. Call from the event loop."""
        if not self.alive:
            raise EngineDead(f"engine loop is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(),
                         time.monotonic() + self.request_timeout_s)
        with self._pending_lock:
            self.num_pending_adds += 1
        self._cmds.put(("add", request_id, prompt_token_ids, params, prompt_text, priority, stream))
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt_text: str | None = None, priority: int = 0):
        """submit() and outputs() in one (the request is queued on the first iteration)."""
        stream = self.submit(request_id, prompt_token_ids, params, prompt_text, priority)
        async for out in self.outputs(request_id, stream):
            yield out

    async def outputs(self, request_id: str, stream: "_Stream"):
        """Yield the engine's cumulative RequestOutputs for one request until it finishes.

        If the consumer stops early (client gone), the request is aborted in the engine.
        """
        q = stream.queue
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # ------------------------------------------------------------ engine side
    def _deliver(self, rid: str, item) -> None:
        s = self._streams.get(rid)
        if s is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[rid]
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed
            pass

    def _handle(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, rid, ids, params, text, priority, stream = cmd
            with self._pending_lock:
                self.num_pending_adds -= 1
            self._streams[rid] = stream
            try:
                eng.add_request(rid, ids, params, priority=priority)
            except ValueError as e:
                self._deliver(rid, e)
                return
            live = eng._live.get(rid)
            if live is not None and text is not None:
                live.prompt = text
            heapq.heappush(self._deadlines, (stream.deadline, rid))
        elif cmd[0] == "abort":
            self._abort(cmd[1])

    def _abort(self, rid: str) -> None:
        eng = self.engine
        live = eng._live.get(rid)
        if live is None:
            self._streams.pop(rid, None)
            return
        # What it produced so far (a timed-out request still answers with it).
        text, token_ids = live.detok.get_text(True), list(live.output_token_ids)
        eng.abort_request([rid])
        rec = eng.request_records.pop(rid, None)
        if self.metrics is not None:
            self.metrics.on_abort(rid)
        if rec is not None and self.request_log is not None:
            self.request_log.write(rec)
        s = self._streams.pop(rid, None)
        if s is not None:  # a timeout: tell the waiting handler the request ended
            from engine.llm_engine import CompletionOutput, RequestOutput
            out = RequestOutput(rid, live.prompt, live.prompt_token_ids,
                                [CompletionOutput(0, text, token_ids, "abort", None)], True, rec)
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, out)
            except RuntimeError:
                pass

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                busy = eng.has_unfinished_requests()
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
                    if rid in eng._live:
                        logger.info("request %s timed out after %.0f s: aborted", rid, self.request_timeout_s)
                        self._abort(rid)
                if not eng.has_unfinished_requests():
                    continue
                before = eng.scheduler.num_preemptions
                outputs = eng.step()
                if self.metrics is not None:
                    self.metrics.on_step(eng, outputs, eng.scheduler.num_preemptions - before)
                for o in outputs:
                    if o.finished:
                        rec = eng.request_records.pop(o.request_id, None)
                        if rec is not None and self.request_log is not None:
                            self.request_log.write(rec)
                    self._deliver(o.request_id, o)
                if len(eng.step_log) > 2 * self.keep_step_log:
                    del eng.step_log[:-self.keep_step_log]
        except BaseException as e:  # keep the server up to report it; fail every stream
            self.error = e
            logger.exception("engine loop died")
            dead = EngineDead(f"engine loop died: {e!r}")
            for rid in list(self._streams):
                self._deliver(rid, dead)
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
                    self.num_pending_adds -= 1
                stream = cmd[-1]
                try:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                except RuntimeError:
                    pass

"""The engine loop: one thread owns the `Engine` and steps it continuously; HTTP handlers
(on the asyncio event loop) talk to it only through thread-safe commands and per-request
streams.

    loop = EngineLoop(engine, max_waiting=64, metrics=metrics)
    loop.start()
    stream = loop.submit(prompt_ids, SamplingParams(...), timeout=600)   # may raise QueueFull
    async for event in stream:          # TokenEvents, the last one carries finish_reason
        ...
    stream.cancel()                     # client gone: the slot is freed at the next step boundary

Requests join and leave between engine steps: a command (submit / cancel) is applied before
the next step; a finished or cancelled request's slot is free for the one waiting next. The
engine never sees the asyncio loop: each step's events are handed over with
`call_soon_threadsafe`, one batch per request per step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any

from dsjax.engine import Engine, SamplingParams, TokenEvent

log = logging.getLogger("dsjax.serving")


class QueueFull(Exception):
    """More requests in flight than slots + the waiting queue hold."""


class EngineFailed(Exception):
    """The engine loop stopped on an internal error; the server cannot generate."""


class Draining(Exception):
    """The server is shutting down: requests in flight finish, new ones are refused."""


@dataclasses.dataclass
class Finished:
    """The end of a stream that did not end with a token: a cancel from the server side
    (deadline) or an engine failure."""

    reason: str  # "timeout" | "shutdown" | "error"
    error: BaseException | None = None


class RequestStream:
    """One request's events, consumed on the asyncio loop that submitted it.

    Iterating yields lists of TokenEvents (all a step produced for this request); the
    iteration ends after the event carrying a finish_reason, or raises EngineFailed. A
    deadline ends it with `finish_reason == "timeout"` (no final TokenEvent)."""

    def __init__(self, loop: "EngineLoop", request_id: str, prompt_tokens: int, aloop: asyncio.AbstractEventLoop):
        self._loop, self.request_id, self.prompt_tokens = loop, request_id, prompt_tokens
        self._aloop = aloop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason: str | None = None
        self.tokens = 0  # delivered so far

    def _put(self, item) -> None:  # loop thread
        self._aloop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[TokenEvent]:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Finished):
            self.finish_reason = item.reason
            if item.error is not None:
                raise EngineFailed(str(item.error)) from item.error
            raise StopAsyncIteration
        self.tokens += len(item)
        if item[-1].finish_reason is not None:
            self.finish_reason = item[-1].finish_reason
        return item

    def cancel(self) -> None:
        """Stop generating for this request (idempotent; a finished request is left alone)."""
        self._loop.cancel(self.request_id)


@dataclasses.dataclass(eq=False)
class _Entry:
    stream: RequestStream
    submitted: float
    deadline: float | None
    last_token: float | None = None
    started: bool = False  # left the waiting queue (has a slot)


class EngineLoop:
    """Runs `engine.step()` in its own thread while there is work, else waits for commands.

    max_waiting bounds the requests that do not yet have a slot: `submit` raises QueueFull
    when max_slots + max_waiting requests are in flight. metrics (a `serving.metrics.Metrics`)
    is told about tokens, latencies and occupancy as they happen."""

    def __init__(self, engine: Engine, *, max_waiting: int = 64, metrics: Any = None, poll_seconds: float = 0.05):
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self.poll_seconds = poll_seconds
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}  # loop thread only
        self._lock = threading.Lock()
        self._in_flight = 0  # guarded by _lock: submitted and not yet finished
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.running = 0  # requests holding a slot (written by the loop thread, read anywhere)
        self.waiting = 0
        self.draining = False  # set by drain(): submit refuses

    # ------------------------------------------------------------------ any thread
    @property
    def capacity(self) -> int:
        return self.engine.max_slots + self.max_waiting

    def submit(self, prompt: list[int], params: SamplingParams, *, timeout: float | None = None,
               constraint: Any = None) -> RequestStream:
        """Queue a request (checked by the engine's own rules first: ValueError names the
        problem). Call from the asyncio loop that will consume the stream."""
        if self.failure is not None:
            raise EngineFailed(f"the engine stopped on an internal error: {self.failure}")
        if self.draining:
            raise Draining("the server is shutting down")
        self.engine.validate(prompt, params)
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests in flight (max_slots {self.engine.max_slots} "
                                f"+ queue {self.max_waiting})")
            self._in_flight += 1
        request_id = f"srv-{next(self._ids)}"
        stream = RequestStream(self, request_id, len(prompt), asyncio.get_running_loop())
        now = time.monotonic()
        entry = _Entry(stream, now, now + timeout if timeout else None)
        self._commands.put(("add", request_id, list(prompt), params, constraint, entry))
        return stream

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def drain(self, timeout: float) -> int:
        """Graceful shutdown: refuse new requests, let those in flight finish for up to
        `timeout` seconds, then stop the rest (their streams end with reason "shutdown",
        which the APIs answer as a length finish). Returns how many were stopped."""
        self.draining = True
        deadline = time.monotonic() + max(timeout, 0.0)
        while self.in_flight and time.monotonic() < deadline and self.alive:
            time.sleep(0.02)
        left = self.in_flight
        if left and self.alive:
            done = threading.Event()
            self._commands.put(("end_all", "shutdown", done))
            done.wait(10)
        return left

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="dsjax-engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_work()
                self._apply_commands(block=not busy)
                self._expire()
                if self.engine.has_work():
                    events = self.engine.step()
                    self._deliver(events)
                self._observe()
        except BaseException as exc:  # an engine bug: fail every stream, keep the process up
            log.exception("engine loop stopped")
            self.failure = exc
            for entry in self._entries.values():
                entry.stream._put(Finished("error", exc))
            self._entries.clear()
            self._drain_after_failure()

    def _drain_after_failure(self) -> None:
        while not self._stop.is_set():
            try:
                command = self._commands.get(timeout=self.poll_seconds)
            except queue.Empty:
                continue
            if command[0] == "add":
                command[-1].stream._put(Finished("error", self.failure))
                self._release()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.poll_seconds) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, constraint, entry = command
                kw = {"constraint": constraint} if constraint is not None else {}
                try:
                    self.engine.add_request(prompt, params, request_id=request_id, **kw)
                except (ValueError, TypeError) as exc:  # checked at submit already; never take the loop down
                    entry.stream._put(Finished("error", exc))
                    self._release()
                else:
                    self._entries[request_id] = entry
                    if self.metrics is not None:
                        self.metrics.prompt_tokens.inc(len(prompt))
            elif kind == "cancel":
                self._end(command[1], None)
            elif kind == "end_all":
                for request_id in list(self._entries):
                    self._end(request_id, command[1])
                command[2].set()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _end(self, request_id: str, reason: str | None) -> None:
        """Cancel a request that is still running (reason: what its stream is told)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self.engine.cancel(request_id)
        self.engine.forget(request_id)
        if reason is not None:
            entry.stream._put(Finished(reason))
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, e in self._entries.items() if e.deadline is not None and now > e.deadline]:
            log.warning("request %s ran past its deadline; stopped", request_id)
            self._end(request_id, "timeout")

    def _deliver(self, events: list[TokenEvent]) -> None:
        by_request: dict[str, list[TokenEvent]] = collections.defaultdict(list)
        for event in events:
            by_request[event.request_id].append(event)
        now = time.monotonic()
        for request_id, batch in by_request.items():
            entry = self._entries.get(request_id)
            if entry is None:  # cancelled meanwhile
                continue
            if self.metrics is not None:
                self.metrics.observe_tokens(len(batch), now - entry.submitted if entry.last_token is None else None,
                                            None if entry.last_token is None else (now - entry.last_token) / len(batch))
            entry.last_token = now
            entry.stream._put(batch)
            if batch[-1].finish_reason is not None:
                del self._entries[request_id]
                self.engine.forget(request_id)
                self._release()
                if self.metrics is not None:
                    self.metrics.e2e.observe(now - entry.submitted)

    def _observe(self) -> None:
        owners = [r for r in self.engine.slot_owner if r is not None]
        self.running = len(owners)
        self.waiting = len(self.engine.waiting)
        if self.metrics is not None:
            self.metrics.observe_engine(self)

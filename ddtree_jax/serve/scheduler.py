"""The scheduler: one thread that owns the slots and moves requests through them.

Its loop: admit the requests waiting for free slots (prefilled together, up to the slots'
max_prefill at a time; first tokens streamed; one jitted insert), dispatch one chunk of device
steps over the active slots, and while it runs hand each request its tokens from the previous
chunk (as text, with stop strings applied) and free the slots of finished or cancelled requests
(the last active request moves into the hole, so the active ones stay packed at the front).
With `overlap` one chunk is always in flight while requests are active, so the device does not
wait for the host's streaming; the price is a chunk of slot time per request: one that ended in
chunk k has run (as a done row, or its extra tokens dropped) in chunk k + 1, and its slot is free
from chunk k + 2. Worth it where the device and the host work in parallel (a GPU) and the host's
work per chunk is not small against the chunk; on a CPU, whose cores run both, it is not
(docs/decisions/0044-serving-bursts-and-overlap.md). Without it each chunk's report is read
before the next chunk is dispatched. Requests
wait in a bounded queue; `submit` refuses when it is full or the scheduler is closing.

The thread talks to the HTTP side only through `Handle`s: events go out on an asyncio queue of
the handler's event loop, and `Handle.cancel()` (a disconnect) is seen at the next chunk.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Sequence

from ddtree_jax.serve.slots import PendingChunk, PrefillRequest, SlotBatch
from ddtree_jax.serve.text import TextStream
from ddtree_jax.speculative.sampling import Sampling

log = logging.getLogger("ddtree_jax.serve")
BATCHINGS = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation, validated: prompt + max_new fits the context, settings within the server's."""

    prompt_ids: tuple[int, ...]
    max_new: int
    sampling: Sampling
    seed: int
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Finish:
    reason: str  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    steps: int = 0  # device steps the request took after its prefill
    message: str | None = None  # for "error" / "cancelled"


class QueueFull(Exception):
    pass


class Closed(Exception):
    pass


class Handle:
    """A submitted request as the HTTP handler sees it: events to read, cancel() to drop it."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.finished = False  # its Finish was emitted (a chunk in flight may still carry its row)
        self.submitted = time.monotonic()
        self._loop = loop

    def cancel(self) -> None:
        """Drop the request: its slot is freed at the next chunk boundary."""
        self.cancelled = True

    def _emit(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is gone (server stopping): nobody listens
            pass


@dataclasses.dataclass(eq=False)  # compared by identity
class _Active:
    handle: Handle
    text: TextStream
    stop_set: frozenset
    steps: int = 0
    tokens: int = 0  # completion tokens counted so far
    first_token_at: float | None = None


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched chunk and the requests in slots 0 .. n-1 when it was dispatched."""

    pending: PendingChunk
    rows: tuple[_Active, ...]
    dispatched: float


class Scheduler:
    """Continuous batching over a SlotBatch. metrics: an object with the hooks of
    ddtree_jax.serve.metrics.Metrics, or None."""

    def __init__(self, slots: SlotBatch, tokenizer, *, max_queue: int = 64, metrics=None, overlap: bool = True,
                 batching: str = "continuous"):
        """batching "static": the baseline continuous batching is measured against, through the same
        HTTP stack and loop - waiting requests are admitted only when every slot is free, so a batch
        runs until its longest request ends."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
        self.slots = slots
        self.overlap = overlap
        self.batching = batching
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: collections.deque[Handle] = collections.deque()
        self._cond = threading.Condition()
        self._active: list[_Active] = []
        self._in_flight: _InFlight | None = None
        self._last_report = 0.0  # when the last chunk's report reached the host
        self._closing = False
        self._stopping = False
        self._deadline: float | None = None  # drain(): cancel what is left at this time
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the loop, if it died
        self._eos = frozenset(int(t) for t in slots.engine.stop_ids)

    # ---- the HTTP side ---------------------------------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        handle = Handle(request, loop)
        with self._cond:
            if self._closing or self.error is not None:
                raise Closed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._queue.append(handle)
            self._cond.notify()
        self._gauges()
        return handle

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddtree-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Refuse new requests; the queued and active ones go on."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def drain(self, seconds: float) -> None:
        """Refuse new requests; the queued and active ones may finish for `seconds`, then the rest
        are cancelled (their handlers get Finish("cancelled"))."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + seconds
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, cancel every queued and active one, and end the thread."""
        with self._cond:
            self._closing = self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._queue and not self._active and self._in_flight is None:
                        self._cond.wait(0.5)
                    if self._stopping:
                        break
                    overdue = self._deadline is not None and time.monotonic() >= self._deadline
                if overdue:
                    self._cancel_all("the server is shutting down")
                    continue
                self._admit()
                launched = self._launch() if self._active else None
                if not self.overlap and launched is not None:
                    self._collect(launched)
                    launched = None
                if self._in_flight is not None:
                    self._collect(self._in_flight)
                self._in_flight = launched
        except BaseException as e:  # a device or internal failure: every request learns of it
            self.error = e
            log.exception("the scheduler stopped")
        finally:
            with self._cond:
                self._closing = True
                left, self._queue = list(self._queue), collections.deque()
            reason = "cancelled" if self.error is None else "error"
            message = "the server is shutting down" if self.error is None else f"internal error: {self.error}"
            for a in self._active:
                self._finish(a, reason, message)
            self._active = []
            for h in left:
                self._emit_finish(h, reason, message)
            self._gauges()

    def _cancel_all(self, message: str) -> None:
        self._in_flight = None  # its tokens are not streamed: every request ends here
        with self._cond:
            left, self._queue = list(self._queue), collections.deque()
        for h in left:
            self._emit_finish(h, "cancelled", message)
        for r in reversed(range(len(self._active))):
            self._finish(self._active[r], "cancelled", message)
            self.slots.move(r, r)
        self._active = []
        self._gauges()

    def _pop(self) -> Handle | None:
        with self._cond:
            return self._queue.popleft() if self._queue else None

    def _admit(self) -> None:
        """Every request waiting now, up to the free slots: those that arrived during the last chunk
        or prefill are prefilled together, in the calls SlotBatch.prefill_groups makes of them."""
        taken = []
        if self.batching == "static" and (self._active or self._in_flight is not None):
            return  # the batch runs to its end first
        while len(self._active) + len(taken) < self.slots.max_batch:
            handle = self._pop()
            if handle is None:
                break
            req = handle.request
            if handle.cancelled:
                self._emit_finish(handle, "cancelled", "the client went away")
            elif problem := self.slots.problem(len(req.prompt_ids), req.max_new):
                self._emit_finish(handle, "error", problem)  # a request the validation should have refused
            else:
                taken.append(handle)
        try:
            for group in self.slots.prefill_groups([len(h.request.prompt_ids) for h in taken]):
                self._prefill([taken[i] for i in group])
        except BaseException as e:  # the loop stops: the requests taken off the queue learn of it too
            active = {id(a.handle) for a in self._active}  # (_run's exit ends these)
            for h in taken:
                if not h.finished and id(h) not in active:
                    self._emit_finish(h, "error", f"internal error: {e}")
            raise
        self._gauges()

    def _prefill(self, handles: list[Handle]) -> None:
        """Prefill these requests together, stream their first tokens, and put those that go on in
        the next free slots."""
        t0 = time.monotonic()
        pre = self.slots.prefill_many([PrefillRequest(h.request.prompt_ids, h.request.sampling, h.request.seed,
                                                      h.request.max_new, h.request.stop_ids) for h in handles])
        if self.metrics:
            self.metrics.on_prefill(time.monotonic() - t0, [len(h.request.prompt_ids) for h in handles],
                                    [t0 - h.submitted for h in handles])
        slots = []
        for h, first, done in zip(handles, pre.first, pre.done):
            stops = self._eos | frozenset(h.request.stop_ids)
            a = _Active(h, TextStream(self.tokenizer, h.request.stop), stops)
            reason = self._consume(a, [first], done)
            if reason:
                self._finish(a, reason)
                slots.append(None)
            else:
                slots.append(len(self._active))
                self._active.append(a)
        self.slots.insert(pre, slots)

    def _launch(self) -> _InFlight:
        pending = self.slots.launch(len(self._active))
        return _InFlight(pending, tuple(self._active), time.monotonic())

    def _collect(self, chunk: _InFlight) -> None:
        """Stream a finished chunk's tokens to its requests (slot r: chunk.rows[r]) and free the
        slots of those that ended; a request that ended before (in the previous chunk) is skipped."""
        report = chunk.pending.result()
        now = time.monotonic()
        seconds = now - max(chunk.dispatched, self._last_report)  # its device time, when chunks queue
        self._last_report = now
        ended = []
        steps_run = 0
        for r, a in enumerate(chunk.rows):
            new = int(report.n_new[r])
            if new > report.tokens.shape[1]:
                raise RuntimeError(
                    f"slot {r} made {new} tokens in a chunk, more than the window {report.tokens.shape[1]}")
            steps = int(report.steps[r]) - a.steps
            steps_run = max(steps_run, steps)
            a.steps += steps
            if self.metrics:  # the steps a row ran after its request ended (its tokens dropped) count too
                self.metrics.on_steps(steps, 0 if a.handle.finished else new)
            if a.handle.finished:
                continue
            tokens = report.tokens[r, :new].tolist()
            if a.handle.cancelled:
                ended.append((a, "cancelled"))
                continue
            reason = self._consume(a, tokens, bool(report.done[r]))
            if reason:
                ended.append((a, reason))
        if self.metrics:
            self.metrics.on_chunk(seconds, steps_run, self.slots.rows_for(len(chunk.rows)), len(chunk.rows))
            if report.choice_steps is not None:  # budget "auto": what each step chose
                self.metrics.on_choices(self.slots.choice_names, report.choice_steps, report.choice_rows,
                                        report.choice_predicted, report.choice_accepted, report.choice_scored)
        for a, reason in ended:
            self._finish(a, reason, "the client went away" if reason == "cancelled" else None)
        slots = sorted((self._active.index(a) for a, _ in ended), reverse=True)
        for r in slots:
            last = len(self._active) - 1
            self.slots.move(last, r)  # the last active request fills the hole (or frees it)
            self._active[r] = self._active[last]
            self._active.pop()
        self._gauges()

    def _consume(self, a: _Active, tokens: Sequence[int], device_done: bool) -> str | None:
        """Hand the request its new tokens; the finish reason when they end it."""
        if tokens and a.first_token_at is None:
            a.first_token_at = time.monotonic()
        reason = None
        taken = []
        for i, t in enumerate(tokens):
            a.tokens += 1
            taken.append(t)
            if device_done and i == len(tokens) - 1 and t in a.stop_set:
                reason = "stop"  # a stop token ends the text without being part of it
                break
            if a.text.add(t):
                reason = "stop"  # a stop string
                break
        if reason is None and device_done:
            reason = "length"
        text = a.text.ready(final=reason is not None)
        if text or taken:
            a.handle._emit(Delta(text, taken))
        return reason

    def _finish(self, a: _Active, reason: str, message: str | None = None) -> None:
        self._emit_finish(a.handle, reason, message, a.tokens, a.steps, a.first_token_at)

    def _emit_finish(self, handle: Handle, reason: str, message: str | None = None, tokens: int = 0, steps: int = 0,
                     first_token_at: float | None = None) -> None:
        handle.finished = True
        handle._emit(Finish(reason, len(handle.request.prompt_ids), tokens, steps, message))
        if self.metrics:
            ttft = None if first_token_at is None else first_token_at - handle.submitted
            self.metrics.on_finish(reason, tokens, steps, ttft, time.monotonic() - handle.submitted)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.on_load(len(self._queue), len(self._active))

"""Slots: at most n_slots generations run at once, each `Engine.stream` in its own thread, bridged to
asyncio; the rest wait in a FIFO queue. Leaving the event iterator early cancels the generation.

On CUDA the slots take turns step by step: the engine's CUDA graphs give wrong tokens when two threads
run steps at the same time (seen on an H200), and all of them queue on one stream anyway."""
import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flashdraft.engine.engine import Completion, Delta, Engine, Request
from flashdraft.server.metrics import Metrics


class ShuttingDown(Exception):
    """A generation refused or cut short because the server is shutting down (a 503 to the client)."""

_END = object()


@dataclass
class Job:
    """One generation in a slot."""
    request: Request
    task: int
    n_decoded: int = 0
    has_new_line: bool = False
    started_at: float = field(default_factory=time.perf_counter)
    first_delta_at: float | None = None

    @property
    def slot(self) -> int | None:
        """The engine's cache slot holding the prompt (None until the engine has taken one)."""
        return self.request.slot


class TurnLock:
    """A FIFO lock: a thread that releases it and asks again waits behind the others."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next_ticket = self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


@dataclass
class Scheduler:
    engine: Engine
    metrics: Metrics = field(default_factory=Metrics)
    take_turns: bool | None = None  # one engine step at a time over all slots; default: on CUDA

    def __post_init__(self) -> None:
        self.closing = False  # set by close(): running generations end, new ones are refused
        self._threads: set[threading.Thread] = set()
        self.jobs: list[Job] = []  # running, in no particular order (each knows its engine slot)
        self._free = asyncio.Semaphore(self.engine.n_slots)
        self._task_ids = itertools.count()
        if self.take_turns is None:
            self.take_turns = self.engine.device.startswith("cuda")
        self._step_turns = TurnLock() if self.take_turns else contextlib.nullcontext()

    @property
    def free_slots(self) -> int:
        return self.engine.n_slots - len(self.jobs)

    @property
    def slots(self) -> list[Job | None]:
        """The job in each engine slot (None: free), numbered as the engine's cache slots."""
        out: list[Job | None] = [None] * self.engine.n_slots
        for job in self.jobs:
            if job.slot is not None:
                out[job.slot] = job
        return out

    async def run(self, req: Request) -> AsyncIterator[tuple[Job, Delta | Completion]]:
        """Yield (job, event) for each engine event. Use under `contextlib.aclosing` so that a client
        that goes away cancels its generation at once."""
        self.metrics.requests_deferred += 1
        try:
            await self._free.acquire()
        finally:
            self.metrics.requests_deferred -= 1
        if self.closing:  # also while waiting for a slot: the cancelled generations free theirs at once
            self._free.release()
            raise ShuttingDown()
        job = Job(req, next(self._task_ids))
        self.jobs.append(job)
        self.metrics.requests_processing += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down)
                req.cancel.set()

        def work() -> None:
            stream = self.engine.stream(req)
            try:
                while True:
                    with self._step_turns:
                        event = next(stream, None)
                    if event is None:
                        break
                    if isinstance(event, Completion):  # counted even when nobody waits for it any more
                        loop.call_soon_threadsafe(self.metrics.record, event)
                    post(event)  # after req.cancel the engine ends within a step, with its Completion
            except BaseException as e:  # handed to the request's coroutine
                post(e)
            finally:
                with self._step_turns:
                    stream.close()  # returns the engine slot
                try:
                    loop.call_soon_threadsafe(self._release, job)
                except RuntimeError:
                    pass
                post(_END)

        thread = threading.Thread(target=work, name=f"task-{job.task}", daemon=True)
        self._threads = {t for t in self._threads if t.is_alive()} | {thread}  # on the event loop only
        thread.start()
        try:
            while (item := await events.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                if self.closing and isinstance(item, Completion) and item.finish_reason == "cancelled":
                    raise ShuttingDown()  # cut short by the shutdown: not a result
                if isinstance(item, Delta):
                    job.first_delta_at = job.first_delta_at or time.perf_counter()
                    job.n_decoded += len(item.token_ids)
                    job.has_new_line = job.has_new_line or "\n" in item.text
                yield job, item
        finally:
            req.cancel.set()

    def close(self) -> None:
        """Shut down: every running generation is cancelled (it ends within a step) and no new one starts.
        Safe from a signal handler."""
        self.closing = True
        for job in list(self.jobs):
            job.request.cancel.set()

    def join(self, timeout: float) -> bool:
        """Wait for the slot threads to return their engine slots; False if some are still running."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _release(self, job: Job) -> None:
        self.jobs.remove(job)
        self.metrics.requests_processing -= 1
        self._free.release()

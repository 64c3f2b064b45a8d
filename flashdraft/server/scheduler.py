"""Slots: at most n_slots generations run at once, each `Engine.stream` in its own thread, bridged to
asyncio; the rest wait in a FIFO queue. Leaving the event iterator early cancels the generation."""
import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flashdraft.engine.engine import Completion, Delta, Engine, Request
from flashdraft.server.metrics import Metrics

_END = object()


@dataclass
class Job:
    """One generation in a slot."""
    request: Request
    slot: int
    task: int
    n_decoded: int = 0
    has_new_line: bool = False
    started_at: float = field(default_factory=time.perf_counter)
    first_delta_at: float | None = None


@dataclass
class Scheduler:
    engine: Engine
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        self.slots: list[Job | None] = [None] * self.engine.n_slots
        self._free = asyncio.Semaphore(self.engine.n_slots)
        self._task_ids = itertools.count()

    @property
    def free_slots(self) -> int:
        return self.slots.count(None)

    async def run(self, req: Request) -> AsyncIterator[tuple[Job, Delta | Completion]]:
        """Yield (job, event) for each engine event. Use under `contextlib.aclosing` so that a client
        that goes away cancels its generation at once."""
        self.metrics.requests_deferred += 1
        try:
            await self._free.acquire()
        finally:
            self.metrics.requests_deferred -= 1
        job = Job(req, self.slots.index(None), next(self._task_ids))
        self.slots[job.slot] = job
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
                for event in stream:
                    if isinstance(event, Completion):  # counted even when nobody waits for it any more
                        loop.call_soon_threadsafe(self.metrics.record, event)
                    post(event)
                    if req.cancel.is_set():
                        break
            except BaseException as e:  # handed to the request's coroutine
                post(e)
            finally:
                stream.close()  # returns the engine slot
                try:
                    loop.call_soon_threadsafe(self._release, job)
                except RuntimeError:
                    pass
                post(_END)

        threading.Thread(target=work, name=f"slot-{job.slot}", daemon=True).start()
        try:
            while (item := await events.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Delta):
                    job.first_delta_at = job.first_delta_at or time.perf_counter()
                    job.n_decoded += len(item.token_ids)
                    job.has_new_line = job.has_new_line or "\n" in item.text
                yield job, item
        finally:
            req.cancel.set()

    def _release(self, job: Job) -> None:
        self.slots[job.slot] = None
        self.metrics.requests_processing -= 1
        self._free.release()

"""Slots: at most n_slots generations run at once in the engine's loop (engine.Engine.step: one step over every
running slot), their events bridged to asyncio; the rest wait in a FIFO queue. Leaving the event iterator early
cancels the generation."""
import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flashdraft.engine.engine import Completion, Delta, Engine, Request
from flashdraft.server.metrics import Metrics


class ShuttingDown(Exception):
    """A generation refused or cut short because the server is shutting down (a 503 to the client)."""


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


@dataclass
class Scheduler:
    engine: Engine
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        self.closing = False  # set by close(): running generations end, new ones are refused
        self.jobs: list[Job] = []  # running, in no particular order (each knows its engine slot)
        self._free = asyncio.Semaphore(self.engine.n_slots)
        self._task_ids = itertools.count()

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

        def post(item) -> None:  # on the engine's thread
            try:
                if isinstance(item, Completion):  # counted even when nobody waits for it any more
                    loop.call_soon_threadsafe(self.metrics.record, item)
                loop.call_soon_threadsafe(events.put_nowait, item)
                if isinstance(item, (Completion, BaseException)):  # the last event: the slot is back
                    loop.call_soon_threadsafe(self._release, job)
            except RuntimeError:  # the event loop is gone (server shutting down)
                req.cancel.set()

        try:
            self.engine.submit(req, post)
        except BaseException:
            self._release(job)
            raise
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                if self.closing and isinstance(item, Completion) and item.finish_reason == "cancelled":
                    raise ShuttingDown()  # cut short by the shutdown: not a result
                if isinstance(item, Delta):
                    job.first_delta_at = job.first_delta_at or time.perf_counter()
                    job.n_decoded += len(item.token_ids)
                    job.has_new_line = job.has_new_line or "\n" in item.text
                yield job, item
                if isinstance(item, Completion):
                    return
        finally:
            req.cancel.set()

    def close(self) -> None:
        """Shut down: every running generation is cancelled (it ends within a step) and no new one starts.
        Safe from a signal handler."""
        self.closing = True
        for job in list(self.jobs):
            job.request.cancel.set()

    def join(self, timeout: float) -> bool:
        """Wait for the engine to return every slot; False if some generation is still running."""
        return self.engine.idle(timeout)

    def _release(self, job: Job) -> None:
        if job not in self.jobs:
            return
        self.jobs.remove(job)
        self.metrics.requests_processing -= 1
        self._free.release()

"""Server-sent events: the SSE line, a streamed response that notices a client going away, and waiting on work
until the client disconnects."""
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flashdraft.server.protocol import ApiError, internal_error
from flashdraft.server.scheduler import ShuttingDown

SHUTTING_DOWN = ApiError(503, "the server is shutting down")

log = logging.getLogger("flashdraft.server")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """SSE response that notices a client going away even while nothing is being sent, and then
    closes its event iterator (which cancels the generation and frees the slot)."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streaming = asyncio.ensure_future(stream())
        watching = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await streaming
            await self.events.aclose()


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """The result of `work`, or None when the client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for t in (task, watching):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def openai_error_events(error: ApiError) -> list[bytes]:
    """An error as the OpenAI routes' streams end with it; shutting down, they end as a finished one would, so
    clients stop waiting."""
    return [sse(error.body())] + ([b"data: [DONE]\n\n"] if error is SHUTTING_DOWN else [])


async def guarded(chunks: AsyncIterator[bytes],
                  error_events: Callable[[ApiError], list[bytes]] = openai_error_events) -> AsyncIterator[bytes]:
    """An error after the response started can only be reported as more events: `error_events` writes them (the
    OpenAI shape by default); an unexpected exception is reported by its kind (protocol.internal_error)."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except ShuttingDown:
        error = SHUTTING_DOWN
    except ApiError as e:
        error = e
    except Exception as e:
        log.exception("generation failed")
        error = internal_error(e)
    else:
        return
    for event in error_events(error):
        yield event

"""The ASGI gate in front of every route: API key, body size limit, and a JSON error for anything unexpected."""
import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdraft.server.protocol import ApiError, internal_error
from flashdraft.server.state import ServerState

log = logging.getLogger("flashdraft.server")

PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/", "/index.html"}


class Gate:
    """API key, body size limit (413) and a 500 envelope for anything unexpected, as plain ASGI so that
    it neither buffers streamed responses nor lets an exception reach the server loop."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.state.settings
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if s.api_key and method != "OPTIONS" and not is_public(path) and not authorized(headers, s.api_key):
            return await send_error(send, ApiError(401, "Invalid API Key"), path)
        if method in ("POST", "PUT", "PATCH"):
            body, too_large = await read_body(receive, s.max_body_bytes)
            if too_large:
                return await send_error(send, ApiError(413, f"the request body is larger than the "
                                                             f"{s.max_body_bytes} byte limit"), path)
            receive = replay(body, receive)
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:
            log.exception("%s %s failed", method, path)
            if not started:
                await send_error(send, internal_error(e), path)


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/webui/")


def authorized(headers: dict[str, str], key: str) -> bool:
    auth = headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks), size > limit


def replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return wrapped


async def send_error(send: Send, error: ApiError, path: str) -> None:
    log.warning("%s %d %s", path, error.status, error.message)
    await JSONResponse(error.body(), status_code=error.status)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def error_response(error: ApiError, path: str) -> JSONResponse:
    if error.status != 503:  # clients poll /health while the model loads
        log.warning("%s %d %s", path, error.status, error.message)
    return JSONResponse(error.body(), status_code=error.status)

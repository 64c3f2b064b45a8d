"""The server's state (settings, the engine once loaded, the scheduler), shared by the routes through
`request.app.state.server`, and reading a request's JSON body."""
import json
import math
import time
from pathlib import Path

from fastapi import Request

from flashdraft.engine.engine import Engine
from flashdraft.server import protocol as P
from flashdraft.server.protocol import ApiError
from flashdraft.server.scheduler import Scheduler
from flashdraft.server.settings import Settings

VERSION = "0.1.0"
BUILD_INFO = f"flashdraft {VERSION}"
FINGERPRINT = f"flashdraft-{VERSION}"


class ServerState:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.started = time.time()

    def ready(self, engine: Engine) -> None:
        s = self.settings
        s.n_slots, s.ctx_size = engine.n_slots, engine.ctx_size * engine.n_slots
        if engine.draft is None:
            s.speculative = False
        self.scheduler = Scheduler(engine)
        self.engine = engine

    def require(self) -> tuple[Engine, Scheduler]:
        if self.load_error is not None:
            raise ApiError(500, f"the model failed to load: {self.load_error}")
        if self.engine is None or self.scheduler is None:
            raise ApiError(503, "Loading model")
        return self.engine, self.scheduler

    @property
    def model_name(self) -> str:
        if self.settings.alias:
            return self.settings.alias
        return Path(self.engine.model_path if self.engine else self.settings.model).name


def server_state(request: Request) -> ServerState:
    return request.app.state.server


MAX_DEPTH = 256  # nesting of arrays and objects a request may have (a JSON schema takes two a level)


def check_values(body) -> None:
    """Reject what JSON parsing lets through but nothing downstream can use, naming the field: NaN and the
    infinities (Python reads them), lone UTF-16 surrogates in strings (not encodable), deep nesting."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        name = path or "the request body"
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels (at '{name}')")
        if isinstance(value, float) and not math.isfinite(value):
            raise ApiError(400, f"'{name}' must be a finite number, got {value}")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"'{name}' holds a lone UTF-16 surrogate: not valid Unicode text") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii():
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, f"a key in '{name}' holds a lone UTF-16 surrogate") from None
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack += [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]


async def read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON in the request body: {e}") from None
    check_values(body)
    return P.require_object(body)

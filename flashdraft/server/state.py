"""The server's state (settings, the engine once loaded, the scheduler), shared by the routes through
`request.app.state.server`, and reading a request's JSON body."""
import asyncio
import json
import math
import time
from pathlib import Path

from fastapi import Request

from flashdraft.engine.engine import Engine
from flashdraft.server import protocol as P
from flashdraft.server.budgets import Preparation, check_budgets
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
        if self.engine.stopped is not None:
            raise ApiError(500, str(self.engine.stopped))
        return self.engine, self.scheduler

    @property
    def model_name(self) -> str:
        if self.settings.alias:
            return self.settings.alias
        return Path(self.engine.model_path if self.engine else self.settings.model).name


def server_state(request: Request) -> ServerState:
    return request.app.state.server


MAX_DEPTH = 256  # nesting of arrays and objects a request may have (a JSON schema takes two a level)


def _path(keys: list) -> str:
    out = ""
    for key in keys:
        if key is None:
            continue
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out or "the request body"


def unencodable(text: str) -> bool:
    """Whether a string holds a lone UTF-16 surrogate (JSON's escapes let one through; UTF-8 cannot encode it)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_values(body) -> None:
    """Reject what JSON parsing lets through but nothing downstream can use, naming the field: NaN and the
    infinities (Python reads them), lone UTF-16 surrogates in strings (not encodable), deep nesting.

    Time and memory linear in the body: the containers being walked are a stack of iterators and the path of
    keys to them; a field's name is formatted only for the error."""
    keys: list = []  # the keys (or indices) from the body down to the container iters[-1] walks
    iters: list = []

    def bad(value, key) -> None:  # None when `value` is fine; pushes a container to walk
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ApiError(400, f"'{_path(keys + [key])}' must be a finite number, got {value}")
        elif isinstance(value, str):
            if unencodable(value):
                raise ApiError(400, f"'{_path(keys + [key])}' holds a lone UTF-16 surrogate: not valid Unicode text")
        elif isinstance(value, dict | list):
            if len(iters) > MAX_DEPTH or (len(iters) == MAX_DEPTH and value):  # its items would be too deep
                raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels (at "
                                    f"'{_path(keys + [key])}')")
            if isinstance(value, dict) and any(unencodable(k) for k in value):
                raise ApiError(400, f"a key in '{_path(keys + [key])}' holds a lone UTF-16 surrogate")
            if value:
                if iters:
                    keys.append(key)
                iters.append(iter(value.items()) if isinstance(value, dict) else enumerate(value))

    bad(body, None)
    while iters:
        depth = len(iters)
        for key, value in iters[-1]:
            if isinstance(value, int) or value is None:
                continue
            bad(value, key)
            if len(iters) > depth:
                break  # walk the container just pushed first
        else:
            iters.pop()
            if keys and len(keys) >= len(iters):
                keys.pop()


def parse_json(raw: bytes) -> dict:
    """The request body parsed, checked (check_values) and its budgets checked (budgets.py): work that grows
    with the body, so the routes run it off the event loop."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON in the request body: {e}") from None
    check_values(body)
    body = P.require_object(body)
    check_budgets(body)
    return body


async def read_json(request: Request, prep: Preparation | None = None) -> dict:
    """The body, parsed off the event loop when large (within `prep`'s deadline, when given)."""
    raw = await request.body()
    if len(raw) < 4096:  # small: not worth a thread
        return parse_json(raw)
    if prep is not None:
        return await prep.run("parsing the JSON body", parse_json, raw)
    return await asyncio.to_thread(parse_json, raw)

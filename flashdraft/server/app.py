"""The HTTP API over one Engine: the app, its error handlers and middleware, and the web page. Routes live in
routes_info.py and routes_generate.py; they reach the server's state through `request.app.state.server`."""
import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from flashdraft.engine.engine import Engine
from flashdraft.server import routes_anthropic, routes_generate, routes_info
from flashdraft.server.gate import Gate, error_response
from flashdraft.server.protocol import ApiError
from flashdraft.server.scheduler import ShuttingDown
from flashdraft.server.settings import Settings
from flashdraft.server.state import ServerState
from flashdraft.server.streaming import SHUTTING_DOWN

log = logging.getLogger("flashdraft.server")

WEBUI_DIR = Path(__file__).parent / "webui"


def create_app(engine_or_loader: Engine | Callable[[], Engine], settings: Settings) -> FastAPI:
    """The app over a loaded Engine, or over a loader that runs in a background thread at startup
    (`/health` answers 503 until it returns)."""
    state = ServerState(settings)
    loader = None
    if isinstance(engine_or_loader, Engine):
        state.ready(engine_or_loader)
    else:
        loader = engine_or_loader

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if loader is not None and state.engine is None:
            loop = asyncio.get_running_loop()

            def load() -> None:
                try:
                    engine = loader()
                except Exception as e:
                    log.error("loading the model failed: %s", e)
                    state.load_error = str(e)
                    return
                loop.call_soon_threadsafe(state.ready, engine)

            threading.Thread(target=load, name="load-model", daemon=True).start()
        yield

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(ShuttingDown)
    async def shutting_down(request: Request, e: ShuttingDown) -> JSONResponse:
        return error_response(SHUTTING_DOWN, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = "File Not Found" if e.status_code == 404 else str(e.detail)
        return error_response(ApiError(e.status_code, message), request.url.path)

    app.include_router(routes_info.router)
    app.include_router(routes_generate.router)
    app.include_router(routes_anthropic.router)

    # ---- the web page

    if settings.webui and (WEBUI_DIR / "index.html").is_file():
        app.mount("/webui", StaticFiles(directory=WEBUI_DIR), name="webui")

        @app.api_route("/", methods=["GET", "HEAD"])
        @app.api_route("/index.html", methods=["GET", "HEAD"])
        async def index() -> FileResponse:
            return FileResponse(WEBUI_DIR / "index.html")

    app.add_middleware(Gate, state=state)
    app.add_middleware(routes_anthropic.AnthropicErrors)  # outside the gate: its errors too
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    return app

"""The HTTP API over one Engine: OpenAI routes, llama.cpp's native routes, metrics and the web page."""
import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdraft.engine.engine import Completion, Delta, Engine
from flashdraft.engine.engine import Request as EngineRequest
from flashdraft.formats.chat import chat_ids
from flashdraft.server import protocol as P
from flashdraft.server.protocol import ApiError
from flashdraft.server.reasoning import ThinkSplitter, prompt_opens_thinking, split_reasoning
from flashdraft.server.scheduler import Job, Scheduler
from flashdraft.server.settings import Settings

log = logging.getLogger("flashdraft.server")

VERSION = "0.1.0"
BUILD_INFO = f"flashdraft {VERSION}"
FINGERPRINT = f"flashdraft-{VERSION}"
WEBUI_DIR = Path(__file__).parent / "webui"
PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/", "/index.html"}


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
                await send_error(send, ApiError(500, f"internal server error: {type(e).__name__}: {e}"), path)


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


async def read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON in the request body: {e}") from None
    return P.require_object(body)


def log_completion(path: str, job: Job, c: Completion) -> None:
    t = c.timings.to_dict()
    line = (f"{path} slot {job.slot} task {job.task} | prompt {t['prompt_n']} tok, "
            f"{t['prompt_per_second']:.1f} tok/s | generated {t['predicted_n']} tok, "
            f"{t['predicted_per_second']:.1f} tok/s")
    if c.spec.draft_steps:
        s = c.speculative_summary()
        line += (f" | acceptance length {s['mean_acceptance_length']:.2f}, rate {s['acceptance_rate']:.1%} "
                 f"({s['draft_n_accepted']}/{s['draft_n']})")
    log.info("%s | %s", line, c.finish_reason)


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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = "File Not Found" if e.status_code == 404 else str(e.detail)
        return error_response(ApiError(e.status_code, message), request.url.path)

    # ---- status and information

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict:
        state.require()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        engine, _ = state.require()
        cfg = engine.target.cfg
        n_params = sum(p.numel() for p in engine.target.parameters())
        size = sum(p.numel() * p.element_size() for p in engine.target.parameters())
        meta = {"vocab_type": 2, "n_vocab": cfg.vocab_size, "n_ctx_train": cfg.max_position_embeddings,
                "n_embd": cfg.hidden_size, "n_params": n_params, "size": size}
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": int(state.started), "owned_by": "llamacpp",
                                            "meta": meta}]}

    @app.get("/props")
    async def props() -> dict:
        engine, scheduler = state.require()
        s = state.settings
        spec = engine.draft is not None and s.speculative
        return {
            "default_generation_settings": {
                "n_ctx": engine.ctx_size,
                "params": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                           "n_predict": s.n_predict, "seed": s.seed}},
            "total_slots": engine.n_slots,
            "model_path": engine.model_path,
            "model_alias": state.model_name,
            "draft_model_path": engine.draft_path,
            "speculative": {"type": "dflash" if spec else "none",
                            "block_size": engine.draft_block if spec else None,
                            "draft_window": engine.draft_window if spec else None},
            "reasoning": s.reasoning,
            "chat_template": engine.tokenizer.chat_template,
            "modalities": {"vision": False, "audio": False},
            "build_info": BUILD_INFO,
        }

    @app.get("/slots")
    async def slots(request: Request) -> list[dict]:
        engine, scheduler = state.require()
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and scheduler.free_slots == 0:
            raise ApiError(503, "no slot available")
        defaults = P.sampling_params({}, state.settings, ())
        out = []
        spec = engine.draft is not None and state.settings.speculative
        for i, job in enumerate(scheduler.slots):
            p = job.request.params if job else defaults
            n_decoded = job.n_decoded if job else 0
            out.append({"id": i, "id_task": job.task if job else -1, "n_ctx": engine.ctx_size,
                        "speculative": spec, "is_processing": job is not None,
                        "params": P.generation_settings(p, engine.ctx_size, spec),
                        "next_token": {"has_next_token": job is not None,
                                       "has_new_line": job.has_new_line if job else False,
                                       "n_remain": max(p.max_tokens - n_decoded, 0) if job else 0,
                                       "n_decoded": n_decoded}})
        return out

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.settings.metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        _, scheduler = state.require()
        return PlainTextResponse(scheduler.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        engine, _ = state.require()
        body = await read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' is required and must be a string")
        ids = engine.tokenizer.encode(content, add_special=P.get_bool(body, "add_special", False))
        if P.get_bool(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": engine.tokenizer.decode([t], skip_special=False)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        engine, _ = state.require()
        body = await read_json(request)
        tokens = body.get("tokens")
        if not P.is_token_list(tokens):
            raise ApiError(400, "'tokens' is required and must be an array of token ids")
        P.check_token_ids(tokens, engine.target.cfg.vocab_size, "'tokens'")
        return {"content": engine.tokenizer.decode(tokens, skip_special=False)}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        engine, _ = state.require()
        body = await read_json(request)
        return {"prompt": engine.tokenizer.decode(chat_prompt_ids(engine, body), skip_special=False)}

    # ---- generation

    def chat_prompt_ids(engine: Engine, body: dict) -> list[int]:
        messages = P.parse_messages(body)
        extra = dict(P.get_object(body, "chat_template_kwargs"))
        if isinstance(body.get("tools"), list) and body["tools"]:
            extra.setdefault("tools", body["tools"])
        try:
            return chat_ids(engine.tokenizer, messages, state.settings.reasoning, extra)
        except Exception as e:  # template errors (e.g. raise_exception in the template) are the request's
            raise ApiError(400, f"the chat template failed on these messages: {e}") from None

    def engine_request(ids: list[int], body: dict, limit_names: tuple[str, ...]) -> EngineRequest:
        engine, _ = state.require()
        params = P.sampling_params(body, state.settings, limit_names)
        try:
            params.validate()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        P.check_fits(ids, engine.ctx_size)
        return EngineRequest(prompt_ids=ids, params=params, speculative=state.settings.speculative)

    async def generate(request: Request, req: EngineRequest) -> tuple[Job, Completion] | None:
        async def run() -> tuple[Job, Completion]:
            async with contextlib.aclosing(stream_events(request, req)) as events:
                async for job, event in events:
                    if isinstance(event, Completion):
                        return job, event
            raise RuntimeError("generation ended without a result")
        return await until_disconnect(request, run())

    async def stream_events(request: Request, req: EngineRequest) -> AsyncIterator[tuple[Job, Delta | Completion]]:
        _, scheduler = state.require()
        completed = False
        try:
            async with contextlib.aclosing(scheduler.run(req)) as events:
                async for job, event in events:
                    if isinstance(event, Completion):
                        completed = True
                        log_completion(request.url.path, job, event)
                    yield job, event
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:
                log.info("%s | cancelled: the client went away", request.url.path)
            raise

    async def guarded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """An error after the response started can only be reported as one more event."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except Exception as e:
            log.exception("generation failed")
            yield sse(ApiError(500, f"{type(e).__name__}: {e}").body())

    def openai_stream(request: Request, req: EngineRequest, env: P.Envelope, body: dict,
                      content: Callable[[Delta | Completion], Iterable[dict]], finish: Callable[[str], dict],
                      opening: dict | None = None, per_token: bool = False) -> EventStream:
        """The streamed response of the OpenAI routes: `opening`, then the chunks `content` makes of each event
        (with running `timings` when `per_token`), the `finish` chunk with the finish reason and, when
        stream_options.include_usage asks for it, a usage-only chunk (all chunks before it carry `usage: null`).
        The final chunk carries llama.cpp's `timings` and `speculative`; `data: [DONE]` ends the stream."""
        include_usage = P.get_bool(P.get_object(body, "stream_options"), "include_usage", False)
        extra_fields = {"usage": None} if include_usage else {}

        async def chunks() -> AsyncIterator[bytes]:
            if opening is not None:
                yield sse(opening | extra_fields)
            async for job, event in stream_events(request, req):
                for chunk in content(event):
                    chunk = chunk | extra_fields
                    yield sse(chunk | {"timings": P.running_timings(job)} if per_token and isinstance(event, Delta)
                              else chunk)
                if isinstance(event, Completion):
                    last = finish(event.finish_reason) | extra_fields
                    if include_usage:
                        yield sse(last)
                        last = env.make([], usage=P.usage(event))
                    yield sse(P.add_stats(last, event))
            yield b"data: [DONE]\n\n"
        return EventStream(guarded(chunks()))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        engine, _ = state.require()
        ids = chat_prompt_ids(engine, body)
        req = engine_request(ids, body, ("max_completion_tokens", "max_tokens", "n_predict"))
        env = P.Envelope("chatcmpl-", "chat.completion.chunk", state.model_name, FINGERPRINT)
        split = P.reasoning_format(body, state.settings.reasoning_format) != "none"
        thinking_open = split and prompt_opens_thinking(engine.tokenizer.decode(ids[-16:], skip_special=False))
        if not P.get_bool(body, "stream", False):
            done = await generate(request, req)
            if done is None:
                return Response(status_code=499)
            reasoning, content = split_reasoning(done[1].text, thinking_open) if split else ("", done[1].text)
            return JSONResponse(P.chat_response(env, done[1], content, reasoning))
        splitter = ThinkSplitter(thinking_open) if split else None

        def deltas(event: Delta | Completion) -> Iterator[dict]:
            """Reasoning and content chunks of what the splitter lets out; at the end, all it still holds."""
            final = isinstance(event, Completion)
            text = "" if final else event.text
            reasoning, content = ("", text) if splitter is None else splitter.push(text)
            if final and splitter is not None:
                r, c = splitter.flush()
                reasoning, content = reasoning + r, content + c
            for key, value in (("reasoning_content", reasoning), ("content", content)):
                if value:
                    yield P.chat_chunk(env, {key: value})

        return openai_stream(request, req, env, body, deltas, lambda reason: P.chat_chunk(env, {}, reason),
                             opening=P.chat_chunk(env, {"role": "assistant", "content": ""}),
                             per_token=P.get_bool(body, "timings_per_token", False))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        engine, _ = state.require()
        ids = P.prompt_ids(body, engine.tokenizer, engine.target.cfg.vocab_size)
        req = engine_request(ids, body, ("max_tokens", "n_predict"))
        env = P.Envelope("cmpl-", "text_completion", state.model_name, FINGERPRINT)
        if not P.get_bool(body, "stream", False):
            done = await generate(request, req)
            return JSONResponse(P.text_response(env, done[1])) if done else Response(status_code=499)

        def pieces(event: Delta | Completion) -> Iterator[dict]:
            if isinstance(event, Delta) and event.text:
                yield P.text_chunk(env, event.text)

        return openai_stream(request, req, env, body, pieces, lambda reason: P.text_chunk(env, "", reason))

    @app.post("/completion")
    @app.post("/completions")
    async def native_completion(request: Request) -> Response:
        """llama.cpp's own completion API (not OpenAI's), as llama-server serves it on both paths."""
        body = await read_json(request)
        engine, _ = state.require()
        ids = P.prompt_ids(body, engine.tokenizer, engine.target.cfg.vocab_size)
        req = engine_request(ids, body, ("n_predict", "max_tokens"))
        return_tokens = P.get_bool(body, "return_tokens", False)
        per_token = P.get_bool(body, "timings_per_token", False)
        settings = P.generation_settings(req.params, engine.ctx_size, req.speculative)
        prompt_text = engine.tokenizer.decode(ids, skip_special=False)
        if not P.get_bool(body, "stream", False):
            done = await generate(request, req)
            if done is None:
                return Response(status_code=499)
            job, c = done
            return JSONResponse(P.native_final(c, job.slot, state.model_name, settings, prompt_text, True,
                                               return_tokens))

        async def chunks() -> AsyncIterator[bytes]:
            async for job, event in stream_events(request, req):
                if isinstance(event, Delta):
                    if event.text:
                        chunk = P.native_chunk(event.text, event.token_ids if return_tokens else [], job.slot,
                                               job.n_decoded, len(ids))
                        yield sse(chunk | {"timings": P.running_timings(job)} if per_token else chunk)
                    continue
                yield sse(P.native_final(event, job.slot, state.model_name, settings, prompt_text, False,
                                         return_tokens))
        return EventStream(guarded(chunks()))

    # ---- the web page

    if settings.webui and (WEBUI_DIR / "index.html").is_file():
        app.mount("/webui", StaticFiles(directory=WEBUI_DIR), name="webui")

        @app.get("/")
        @app.get("/index.html")
        async def index() -> FileResponse:
            return FileResponse(WEBUI_DIR / "index.html")

    app.add_middleware(Gate, state=state)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    return app

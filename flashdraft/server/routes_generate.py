"""Generation routes: OpenAI's chat and text completions, llama.cpp's native completion, and the chat template."""
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flashdraft.draft import registry
from flashdraft.engine.engine import Completion, Delta, Engine
from flashdraft.engine.engine import Request as EngineRequest
from flashdraft.formats.chat import chat_ids
from flashdraft.formats.tokenizer import TooManyTokens
from flashdraft.server import protocol as P
from flashdraft.server.budgets import Preparation
from flashdraft.server.protocol import ApiError
from flashdraft.server.reasoning import ThinkSplitter, prompt_opens_thinking, split_reasoning
from flashdraft.server.scheduler import Job
from flashdraft.server.state import FINGERPRINT, ServerState, read_json, server_state
from flashdraft.server.streaming import EventStream, guarded, sse, until_disconnect
from flashdraft.server.structured import request_grammar
from flashdraft.server.tools import CallStream, ToolError, ToolPlan, template_messages, tool_plan

log = logging.getLogger("flashdraft.server")
router = APIRouter()


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


TEMPLATE_RESERVED = ("messages", "add_generation_prompt")  # chat_ids passes these itself
# the steps of a request's preparation, as a 503 past its deadline names them (budgets.Preparation)
CHECKING_TOOLS = "checking the tools and compiling the tool-call grammar"
RENDERING = "rendering the chat template and tokenizing the prompt"
TOKENIZING = "tokenizing the prompt"
COMPILING = "compiling the output constraint and reading the sampling fields"


def tools_of(engine: Engine, body: dict) -> ToolPlan | None:
    """The request's tools as the server handles them (None: none, or tool_choice "none"); 400s for bad ones."""
    try:
        return tool_plan(engine.tokenizer.chat_template, body)
    except ToolError as e:
        raise ApiError(400, str(e)) from None


def chat_prompt_ids(state: ServerState, engine: Engine, body: dict, limit: int | None,
                    plan: ToolPlan | None) -> list[int]:
    """`plan`: tools_of(engine, body): the tools go to the template when there is one."""
    messages = P.parse_messages(body)
    extra = dict(P.get_object(body, "chat_template_kwargs"))
    if plan is not None:
        extra.setdefault("tools", body["tools"])
    messages = template_messages(messages)
    for name in TEMPLATE_RESERVED:
        if name in extra:
            raise ApiError(400, f"chat_template_kwargs.{name} is set by the server, not by the request")
    try:
        return chat_ids(engine.tokenizer, messages, state.settings.reasoning, extra, limit=limit)
    except TooManyTokens as e:
        raise P.too_long(e) from None
    except jinja2.TemplateError as e:  # the template's own errors (raise_exception, undefined names)
        raise ApiError(400, f"the chat template failed on these messages: {e}") from None
    except ValueError as e:  # ours: no template, a prefill the template changed
        raise ApiError(400, str(e)) from None
    except Exception as e:  # anything else the template did with the request's values: no Python names out
        log.warning("chat template: %r", e)
        raise ApiError(400, "the chat template could not render these messages (a value of an unexpected "
                            "type?)") from None

def engine_request(state: ServerState, ids: list[int], body: dict, limit_names: tuple[str, ...],
                   top_logprobs: int | None, plan: ToolPlan | None = None) -> EngineRequest:
    """The engine's request for a body (its grammar compiled, its logit_bias texts tokenized): the routes call
    it off the event loop."""
    engine, _ = state.require()
    P.check_supported(body)
    grammar = request_grammar(engine.tokenizer, body, None if plan is None else plan.grammar)
    params = P.sampling_params(body, state.settings, limit_names, engine.tokenizer, engine.target.cfg.vocab_size,
                               top_logprobs)
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    P.check_fits(ids, engine.ctx_size)
    n_max = P.draft_n_max(body, engine.draft_block - 1 if engine.draft is not None else None)
    wanted = P.speculation_type(body, registry.spec_type_names(engine.draft.name)
                                if engine.draft is not None and state.settings.speculative else ())
    return EngineRequest(prompt_ids=ids, params=params,
                         speculative=state.settings.speculative and n_max != 0 and wanted,
                         cache_prompt=P.get_bool(body, "cache_prompt", True), grammar=grammar, draft_n_max=n_max)



async def generate(request: Request, req: EngineRequest) -> tuple[Job, Completion] | None:
    async def run() -> tuple[Job, Completion]:
        async with contextlib.aclosing(stream_events(request, req)) as events:
            async for job, event in events:
                if isinstance(event, Completion):
                    return job, event
        raise RuntimeError("generation ended without a result")
    return await until_disconnect(request, run())

async def stream_events(request: Request, req: EngineRequest) -> AsyncIterator[tuple[Job, Delta | Completion]]:
    _, scheduler = server_state(request).require()
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


@router.post("/apply-template")
async def apply_template(request: Request) -> dict:
    state = server_state(request)
    engine, _ = state.require()
    prep = Preparation()
    body = await read_json(request, prep)
    plan = await prep.run(CHECKING_TOOLS, tools_of, engine, body)
    ids = await prep.run(RENDERING, chat_prompt_ids, state, engine, body, None, plan)
    return {"prompt": await prep.run("detokenizing the prompt", engine.tokenizer.decode, ids, skip_special=False)}

@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    prep = Preparation()
    body = await read_json(request, prep)
    engine, _ = state.require()
    plan = await prep.run(CHECKING_TOOLS, tools_of, engine, body)
    ids = await prep.run(RENDERING, chat_prompt_ids, state, engine, body, engine.ctx_size, plan)  # may be large
    req = await prep.run(COMPILING, engine_request, state, ids, body,
                         ("max_completion_tokens", "max_tokens", "n_predict"), P.chat_logprobs_count(body), plan)
    env = P.Envelope("chatcmpl-", "chat.completion.chunk", state.model_name, FINGERPRINT)
    split = P.reasoning_format(body, state.settings.reasoning_format) != "none"
    thinking_open = split and prompt_opens_thinking(engine.tokenizer.decode(ids[-16:], skip_special=False))
    with_logprobs = req.params.logprobs is not None
    if not P.get_bool(body, "stream", False):
        done = await generate(request, req)
        if done is None:
            return Response(status_code=499)
        c = done[1]
        reasoning, content = split_reasoning(c.text, thinking_open) if split else ("", c.text)
        logprobs = P.chat_logprobs(engine.tokenizer, c.logprobs) if with_logprobs else None
        calls = []
        if plan is not None:
            content, calls = plan.parse(content)
        return JSONResponse(P.chat_response(env, c, content, reasoning, logprobs, calls))
    splitter = ThinkSplitter(thinking_open) if split else None
    pending: list = []  # logprobs of tokens whose text the splitter still holds
    calls_out: list[dict] = []  # the calls sent (their finish reason is "tool_calls")
    call_stream = CallStream(plan) if plan is not None else None

    def deltas(event: Delta | Completion) -> Iterator[dict]:
        """Reasoning and content chunks of what the splitter lets out; at the end, all it still holds. The
        logprobs of the tokens so far ride on the first chunk out (a chunk of their own at the end)."""
        final = isinstance(event, Completion)
        text = "" if final else event.text
        if not final:
            pending.extend(event.logprobs)
        reasoning, content = ("", text) if splitter is None else splitter.push(text)
        if final and splitter is not None:
            r, c = splitter.flush()
            reasoning, content = reasoning + r, content + c
        tool_parts = []
        if call_stream is not None:  # content goes out only up to where a tool call may begin
            content = call_stream.push(content)
            if final:
                rest, calls = call_stream.finish()
                content += rest
                calls_out.extend(P.openai_calls(calls))
                tool_parts = [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls_out)]
        parts = [{key: value} for key, value in (("reasoning_content", reasoning), ("content", content)) if value]
        parts += tool_parts
        if final and pending and not parts:
            parts = [{}]
        for delta in parts:
            logprobs = P.chat_logprobs(engine.tokenizer, pending) if with_logprobs and pending else None
            pending.clear()
            yield P.chat_chunk(env, delta, logprobs=logprobs)

    return openai_stream(request, req, env, body, deltas,
                         lambda reason: P.chat_chunk(env, {}, "tool_calls" if calls_out else reason),
                         opening=P.chat_chunk(env, {"role": "assistant", "content": ""}),
                         per_token=P.get_bool(body, "timings_per_token", False))

@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = server_state(request)
    prep = Preparation()
    body = await read_json(request, prep)
    engine, _ = state.require()
    ids = await prep.run(TOKENIZING, P.prompt_ids, body, engine.tokenizer, engine.target.cfg.vocab_size,
                         engine.ctx_size)
    req = await prep.run(COMPILING, engine_request, state, ids, body, ("max_tokens", "n_predict"),
                         P.text_logprobs_count(body))
    env = P.Envelope("cmpl-", "text_completion", state.model_name, FINGERPRINT)
    with_logprobs = req.params.logprobs is not None
    if not P.get_bool(body, "stream", False):
        done = await generate(request, req)
        if done is None:
            return Response(status_code=499)
        c = done[1]
        logprobs = P.text_logprobs(engine.tokenizer, c.logprobs) if with_logprobs else None
        return JSONResponse(P.text_response(env, c, logprobs))
    offsets = P.TextOffsets(engine.tokenizer)

    def pieces(event: Delta | Completion) -> Iterator[dict]:
        if isinstance(event, Delta) and (event.text or event.logprobs):
            logprobs = P.text_logprobs(engine.tokenizer, event.logprobs, offsets) if with_logprobs else None
            yield P.text_chunk(env, event.text, logprobs=logprobs)

    return openai_stream(request, req, env, body, pieces, lambda reason: P.text_chunk(env, "", reason))

@router.post("/completion")
@router.post("/completions")
async def native_completion(request: Request) -> Response:
    """llama.cpp's own completion API (not OpenAI's), as llama-server serves it on both paths."""
    state = server_state(request)
    prep = Preparation()
    body = await read_json(request, prep)
    engine, _ = state.require()
    ids = await prep.run(TOKENIZING, P.prompt_ids, body, engine.tokenizer, engine.target.cfg.vocab_size,
                         engine.ctx_size)
    req = await prep.run(COMPILING, engine_request, state, ids, body, ("n_predict", "max_tokens"),
                         P.native_probs_count(body))
    with_probs = req.params.logprobs is not None
    return_tokens = P.get_bool(body, "return_tokens", False)
    per_token = P.get_bool(body, "timings_per_token", False)
    settings = P.generation_settings(req.params, engine.ctx_size, req.speculative)
    prompt_text = await prep.run("detokenizing the prompt", engine.tokenizer.decode, ids, skip_special=False)
    if not P.get_bool(body, "stream", False):
        done = await generate(request, req)
        if done is None:
            return Response(status_code=499)
        job, c = done
        probs = P.native_probs(engine.tokenizer, c.logprobs) if with_probs else None
        return JSONResponse(P.native_final(c, job.slot, state.model_name, settings, prompt_text, True,
                                           return_tokens, probs))

    async def chunks() -> AsyncIterator[bytes]:
        async for job, event in stream_events(request, req):
            if isinstance(event, Delta):
                if event.text or event.logprobs or (return_tokens and event.token_ids):
                    probs = P.native_probs(engine.tokenizer, event.logprobs) if with_probs else None
                    chunk = P.native_chunk(event.text, event.token_ids if return_tokens else [], job.slot,
                                           job.n_decoded, len(ids), probs)
                    yield sse(chunk | {"timings": P.running_timings(job)} if per_token else chunk)
                continue
            yield sse(P.native_final(event, job.slot, state.model_name, settings, prompt_text, False,
                                     return_tokens))
    return EventStream(guarded(chunks()))

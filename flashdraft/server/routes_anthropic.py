"""Anthropic's Messages API (`POST /v1/messages`), what several coding agents speak, as llama-server serves it: the
request is turned into the chat route's (system prompt, text blocks, `tool_use` / `tool_result` blocks, tools with
their `input_schema`, `tool_choice` auto / any / tool / none) and the answer back into content blocks, streamed as
Anthropic's named events; `/v1/messages/count_tokens` counts a request's prompt. Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, an `event: error` once a stream has started), which its SDKs
turn into their own exceptions."""
import json
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdraft.engine.engine import Completion, Delta
from flashdraft.server import protocol as P
from flashdraft.server.budgets import Preparation
from flashdraft.server.protocol import ApiError
from flashdraft.server.routes_generate import (CHECKING_TOOLS, COMPILING, RENDERING, chat_prompt_ids, engine_request,
                                               generate, stream_events, tools_of)
from flashdraft.server.state import read_json, server_state
from flashdraft.server.streaming import EventStream, guarded
from flashdraft.server.tools import CallStream

router = APIRouter()
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """An error as Anthropic's API answers it (its SDKs pick the exception by the HTTP status)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class AnthropicErrors:
    """ASGI middleware: every error answer on the Messages paths, from whichever layer made it (the gate's 401 and
    413, a route's 400, a 404 or 405, a 500), rewritten from the OpenAI shape into Anthropic's. Only error answers
    are held back (they are small); streams and answers below 400 pass through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            return await self.app(scope, receive, send)
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status = start["status"]
            body = json.dumps(error_body(status, _error_message(status, b"".join(chunks)))).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                      b"content-type")]
            await send(start | {"headers": headers + [(b"content-type", b"application/json"),
                                                      (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, rewriting_send)


def _error_message(status: int, raw: bytes) -> str:
    """The message of an error body in the OpenAI shape (or its text, or the status's phrase)."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    text = raw.decode("utf-8", "replace").strip()
    if text:
        return text
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"error {status}"


def error_events(error: ApiError) -> list[bytes]:
    """An error after a stream started: Anthropic's `error` event."""
    return [event("error", error_body(error.status, error.message))]


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of content blocks")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: only text blocks are supported here")
        parts.append(block["text"])
    return "".join(parts)


def chat_body(body: dict) -> dict:
    """The OpenAI chat request that a Messages request stands for."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise ApiError(400, "'max_tokens' is required (an integer)")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ApiError(400, "'messages' must be a non-empty array")
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be \"user\" or \"assistant\"")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of content blocks")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": str(block.get("id", f"toolu_{i}_{j}")), "type": "function", "function": {
                    "name": str(block.get("name")), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content", "")
                messages.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                                 "content": _text(result, f"messages[{i}].content[{j}].content")})
            else:
                raise ApiError(400, f"messages[{i}].content[{j}]: a {kind!r} block is not supported here")
        if text or calls:
            messages.append({"role": m["role"], "content": "".join(text) or None} |
                            ({"tool_calls": calls} if calls else {}))
    out = {"messages": messages, "max_tokens": body["max_tokens"], "stream": P.get_bool(body, "stream", False)}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
            raise ApiError(400, "'tools' must be an array of {\"name\", \"input_schema\"} objects")
        out["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema") or {"type": "object"}}}
                        for t in tools]
        choice = body.get("tool_choice") or {"type": "auto"}
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise ApiError(400, "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                              else "required" if kind == "any" else kind)
        out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    return out


def blocks(content: str, calls: list[dict]) -> list[dict]:
    out = [{"type": "text", "text": content}] if content else []
    for call in calls:
        out.append({"type": "tool_use", "id": "toolu_" + P.new_id("")[:24], "name": call["name"],
                    "input": json.loads(call["arguments"])})
    return out


def stop_of(c: Completion, calls: list[dict]) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if c.stop_word is not None:
        return "stop_sequence", c.stop_word
    return STOP_REASONS.get(c.finish_reason, "end_turn"), None


def message(model: str, content: list[dict], stop: tuple[str, str | None], c: Completion | None) -> dict:
    usage = {"input_tokens": len(c.prompt_ids) if c else 0, "output_tokens": len(c.token_ids) if c else 0,
             "cache_read_input_tokens": c.timings.cache_n if c else 0}
    return {"id": P.new_id("msg_")[:28], "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


READING = "reading the Messages request"


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data | {'type': name}, ensure_ascii=False)}\n\n".encode()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    """The prompt's token count as the Messages route would render it (agents call this to budget context)."""
    state = server_state(request)
    prep = Preparation()
    raw = await read_json(request, prep)
    engine, _ = state.require()
    body = await prep.run(READING, chat_body, {"max_tokens": 1} | raw)
    plan = await prep.run(CHECKING_TOOLS, tools_of, engine, body)
    ids = await prep.run(RENDERING, chat_prompt_ids, state, engine, body, None, plan)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state = server_state(request)
    prep = Preparation()
    raw = await read_json(request, prep)
    engine, _ = state.require()
    body = await prep.run(READING, chat_body, raw)  # grows with the messages
    plan = await prep.run(CHECKING_TOOLS, tools_of, engine, body)
    ids = await prep.run(RENDERING, chat_prompt_ids, state, engine, body, engine.ctx_size, plan)
    req = await prep.run(COMPILING, engine_request, state, ids, body, ("max_tokens",), None, plan)
    if not body["stream"]:
        done = await generate(request, req)
        if done is None:
            return Response(status_code=499)
        c = done[1]
        content, calls = plan.parse(c.text) if plan is not None else (c.text, [])
        return JSONResponse(message(state.model_name, blocks(content, calls), stop_of(c, calls), c))

    call_stream = CallStream(plan) if plan is not None else None

    async def chunks() -> AsyncIterator[bytes]:
        yield event("message_start", {"message": message(state.model_name, [], (None, None), None)})
        index, open_text = 0, False

        def text_events(text: str) -> list[bytes]:
            nonlocal open_text
            if not text:
                return []
            start = [] if open_text else [event("content_block_start", {"index": index, "content_block": {
                "type": "text", "text": ""}})]
            open_text = True
            return start + [event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                     "text": text}})]

        async for _, item in stream_events(request, req):
            if isinstance(item, Delta):
                for chunk in text_events(item.text if call_stream is None else call_stream.push(item.text)):
                    yield chunk
                continue
            c: Completion = item
            rest, calls = call_stream.finish() if call_stream is not None else ("", [])
            for chunk in text_events(rest):
                yield chunk
            if open_text:
                yield event("content_block_stop", {"index": index})
                index += 1
            for block in blocks("", calls):
                yield event("content_block_start", {"index": index, "content_block": block | {"input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield event("content_block_stop", {"index": index})
                index += 1
            reason, word = stop_of(c, calls)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": word},
                                          "usage": {"output_tokens": len(c.token_ids)}})
            yield event("message_stop", {})
    return EventStream(guarded(chunks(), error_events))

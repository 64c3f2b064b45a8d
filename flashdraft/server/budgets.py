"""Size budgets for the request fields whose cost grows with their size (grammar and schema compilation, the
tokenization of logit_bias texts, the stop-string automaton, tool schemas), checked before any of that work
starts: a 400 naming the field, decided in time bounded by the budget itself, never by the body; and the deadline
on a request's preparation (Preparation), the work after those checks, which runs in worker threads.

The limits keep each compilation well under a second. Measured with llguidance on a small vocabulary (2 CPU
cores): a GBNF grammar of N alternatives compiles in ~0.1 s at 4k (39 KB), ~0.4 s at 16k (165 KB), ~1.5 s at 32k
(341 KB), growing about quadratically; a JSON schema of 1k properties (46 KB) in ~0.04 s, 4k (190 KB) in ~0.65 s.
On SmolLM2's and Qwen2.5's real vocabularies every field at its limit, in the costliest shapes found, is prepared
in at most 0.41 s (benchmarks/request_budgets.py; docs/PERF.md, "2026-12-06, 2-core CPU: request budgets on a
real vocabulary").
"""
import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flashdraft.server.protocol import ApiError

log = logging.getLogger("flashdraft.server")
T = TypeVar("T")

GRAMMAR_CHARS = 64 * 1024  # a GBNF or Lark grammar's text
SCHEMA_CHARS = 128 * 1024  # a JSON schema (json_schema, response_format, the tool-call schema) as JSON text
STOP_COUNT = 1024  # stop strings
STOP_CHARS = 64 * 1024  # their total length
LOGIT_BIAS_ENTRIES = 1 << 18  # more than any vocabulary has tokens
LOGIT_BIAS_TEXT_CHARS = 1024  # one text key of llama.cpp's array form (it is tokenized)
LOGIT_BIAS_TEXTS_CHARS = 64 * 1024  # all of them together
TOOLS_COUNT = 128  # OpenAI's limit
TOOLS_CHARS = 256 * 1024  # the tools as JSON text (rendered into the prompt; their schemas may be compiled)
PREPARE_SECONDS = 30.0  # the deadline on a request's preparation, all of its steps together


class Preparation:
    """A request's preparation (parsing and checking its body, rendering the chat template, tokenizing, compiling
    its grammar): each step runs in a worker thread, so the event loop (/health, the other requests' streams)
    never waits for it, and all steps together within PREPARE_SECONDS. A request past the deadline is answered at
    once with a 503 naming the step that was running.

    A thread cannot be cancelled: the step that missed the deadline runs on to its end and its result is dropped.
    What bounds that leftover work is the budgets above, checked before any step starts (each step's cost is
    bounded by them: about a second at most on 2 CPU cores, docs/PERF.md), so the deadline is reached only when
    the machine is far slower or busier than that, and what a late step still holds is a worker thread for about
    as long again."""

    def __init__(self):
        self.seconds = PREPARE_SECONDS
        self.ends = time.monotonic() + self.seconds

    async def run(self, what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker thread; `what` names the step in the error if the deadline passes."""
        left = self.ends - time.monotonic()
        if left <= 0:
            raise self.late(what)
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), left)
        except TimeoutError:
            raise self.late(what) from None

    def late(self, what: str) -> ApiError:
        log.warning("request preparation past its deadline of %g s while %s", self.seconds, what)
        return ApiError(503, f"the request's preparation took longer than {self.seconds:g} s: {what} did not finish "
                             "in time (the server is busy, or the request is very large)", type="timeout_error")


def json_size_over(value, limit: int) -> bool:
    """Whether `value` as JSON text is longer than about `limit` characters, stopping as soon as it is (the
    cost is bounded by `limit`, not by the value)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, dict):
            total += 2 + 4 * len(v) + sum(len(k) for k in v if isinstance(k, str))
            if total > limit:
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            total += 2 + 2 * len(v)
            if total > limit:
                return True
            stack.extend(v)
        else:
            total += 5
        if total > limit:
            return True
    return False


def _too_big(field: str, what: str, limit: int) -> ApiError:
    return ApiError(400, f"'{field}' is too large: {what} (at most {limit:,})")


def _check_stop(body: dict, field: str) -> None:
    stop = body.get(field)
    if not isinstance(stop, list):
        if isinstance(stop, str) and len(stop) > STOP_CHARS:
            raise _too_big(field, f"{len(stop):,} characters", STOP_CHARS)
        return
    if len(stop) > STOP_COUNT:
        raise _too_big(field, f"{len(stop):,} stop strings", STOP_COUNT)
    total = sum(len(s) for s in stop if isinstance(s, str))
    if total > STOP_CHARS:
        raise _too_big(field, f"{total:,} characters of stop strings", STOP_CHARS)


def _check_logit_bias(body: dict) -> None:
    value = body.get("logit_bias")
    if not isinstance(value, dict | list):
        return
    if len(value) > LOGIT_BIAS_ENTRIES:
        raise _too_big("logit_bias", f"{len(value):,} entries", LOGIT_BIAS_ENTRIES)
    if isinstance(value, list):
        total = 0
        for pair in value:
            if isinstance(pair, list) and pair and isinstance(pair[0], str):
                n = len(pair[0])
                if n > LOGIT_BIAS_TEXT_CHARS:
                    raise _too_big("logit_bias", f"a text key of {n:,} characters", LOGIT_BIAS_TEXT_CHARS)
                total += n
        if total > LOGIT_BIAS_TEXTS_CHARS:
            raise _too_big("logit_bias", f"{total:,} characters of text keys", LOGIT_BIAS_TEXTS_CHARS)


def _check_schema(value, field: str) -> None:
    if isinstance(value, dict | list) and json_size_over(value, SCHEMA_CHARS):
        raise _too_big(field, "a JSON schema of more characters than allowed", SCHEMA_CHARS)


def check_budgets(body) -> None:
    """400 for a field over its budget (see the limits above); the fields' other checks come later."""
    if not isinstance(body, dict):
        return
    grammar = body.get("grammar")
    if isinstance(grammar, str) and len(grammar) > GRAMMAR_CHARS:
        raise _too_big("grammar", f"{len(grammar):,} characters", GRAMMAR_CHARS)
    _check_schema(body.get("json_schema"), "json_schema")
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        _check_schema(fmt.get("schema"), "response_format.schema")
        spec = fmt.get("json_schema")
        if isinstance(spec, dict):
            _check_schema(spec.get("schema"), "response_format.json_schema.schema")
    _check_stop(body, "stop")
    _check_stop(body, "stop_sequences")  # the Anthropic route's name
    _check_logit_bias(body)
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > TOOLS_COUNT:
            raise _too_big("tools", f"{len(tools):,} tools", TOOLS_COUNT)
        if json_size_over(tools, TOOLS_CHARS):
            raise _too_big("tools", "tool definitions of more characters than allowed", TOOLS_CHARS)

"""Request validation and response shapes for the OpenAI and llama.cpp APIs."""
import re
import secrets
import string
import time
from typing import Any

from flashdraft.engine.engine import Completion, Timings, TokenLogprob
from flashdraft.engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, llama_top
from flashdraft.formats.tokenizer import IncrementalDetokenizer, TooManyTokens
from flashdraft.server.scheduler import Job
from flashdraft.server.settings import Settings

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}


def internal_error(e: Exception) -> ApiError:
    """What a client is told of an unexpected failure: the engine's own request errors in their words, anything else
    by its kind only, since its message can hold internals (allocator state, paths); the log has the traceback."""
    from flashdraft.engine.sampling import NoTokenToSample
    if isinstance(e, NoTokenToSample):
        return ApiError(500, str(e))
    if type(e).__name__ == "OutOfMemoryError":
        return ApiError(500, "the request ran out of GPU memory (lower --ctx-size or --parallel)")
    return ApiError(500, f"internal server error ({type(e).__name__}); the server's log has the details")


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def get_number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {_type_name(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None \
            else f"<= {hi}"
        raise ApiError(400, f"'{name}' must be {bounds}, got {_short(value)}")
    return as_float(value, name)


def as_float(value: int | float, name: str) -> float:
    """A JSON number as a float; an integer too large for a double (JSON allows any) is a 400 naming `name`."""
    try:
        return float(value)
    except OverflowError:
        raise ApiError(400, f"'{name}' is too large for a number (a double's range)") from None


def get_int(body: dict, name: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_type_name(value)}")
    if lo is not None and value < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {_short(value)}")
    if hi is not None and value > hi:
        raise ApiError(400, f"'{name}' must be <= {hi}, got {_short(value)}")
    return value


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {_type_name(value)}")
    return value


def get_object(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be an object, got {_type_name(value)}")
    return value


def get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ApiError(400, "'stop' must be a string or an array of strings")


def max_tokens(body: dict, names: tuple[str, ...], settings: Settings) -> int:
    """The first of `names` present; -1 (llama.cpp's n_predict) means up to the end of the context."""
    for name in names:
        if body.get(name) is not None:
            value = get_int(body, name, None, lo=-1)
            return settings.slot_ctx if value == -1 else value
    return settings.slot_ctx if settings.n_predict < 0 else settings.n_predict


def sampling_params(body: dict, settings: Settings, token_limit_names: tuple[str, ...], tokenizer,
                    vocab_size: int, top_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields over the server's defaults; `top_logprobs` is what the route read from
    its own logprobs field (see chat_logprobs_count, text_logprobs_count, native_probs_count)."""
    if get_int(body, "n", 1) != 1:
        raise ApiError(400, "only n=1 is supported")
    top_k, top_p = llama_top(get_int(body, "top_k", settings.top_k),
                             get_number(body, "top_p", settings.top_p, 0.0, 1.0))
    seed = get_int(body, "seed", settings.seed)
    if seed is not None and not -1 <= seed < 2 ** 32:  # llama.cpp's seed is a uint32; -1: random
        raise ApiError(400, f"'seed' must be between -1 and {2 ** 32 - 1}, got {_short(seed)}")
    params = SamplingParams(
        temperature=get_number(body, "temperature", settings.temperature, lo=0.0),
        top_k=top_k,
        top_p=top_p,
        min_p=get_number(body, "min_p", settings.min_p, 0.0, 1.0),
        seed=seed if seed is not None and seed >= 0 else None,
        max_tokens=max_tokens(body, token_limit_names, settings),
        stop=get_stop(body),
        ignore_eos=get_bool(body, "ignore_eos", False),
        logit_bias=logit_bias(body, tokenizer, vocab_size),
        repeat_penalty=get_number(body, "repeat_penalty", settings.repeat_penalty),
        presence_penalty=get_number(body, "presence_penalty", settings.presence_penalty),
        frequency_penalty=get_number(body, "frequency_penalty", settings.frequency_penalty),
        repeat_last_n=get_int(body, "repeat_last_n", settings.repeat_last_n),
        logprobs=top_logprobs,
    )
    return params


def draft_n_max(body: dict, most: int | None) -> int | None:
    """llama.cpp's per-request `speculative.n_max` (the most tokens a step drafts; 0: no speculation for this
    request), clamped to the draft's block less its anchor (`most`; None: no draft, nothing to clamp), and
    `speculative.n_min` and `speculative.p_min`, checked and accepted (the draft always fills its block, and the
    adaptive verify width decides how much of it a step checks)."""
    n_max = get_int(body, "speculative.n_max", None, 0, 2 ** 31 - 1)
    get_number(body, "speculative.p_min", 0.0, 0.0, 1.0)
    n_min = get_int(body, "speculative.n_min", None, 0, 2 ** 31 - 1)
    if n_min is not None and n_max is not None and n_min > n_max:
        raise ApiError(400, f"'speculative.n_min' ({n_min}) must not exceed 'speculative.n_max' ({n_max})")
    return n_max if n_max is None or most is None else min(n_max, most)


def speculation_type(body: dict, drafting: tuple[str, ...]) -> bool:
    """Per-request `speculative.type` (llama.cpp's --spec-type names): "none" turns speculation off for this
    request; one of `drafting` (the names of the server's drafter: its --spec-type and aliases) keeps it on; any
    other is refused naming the field. Absent: on. Returns whether the request may speculate."""
    value = body.get("speculative.type")
    if value is None:
        return True
    if not isinstance(value, str):
        raise ApiError(400, f"'speculative.type' must be a string, got {_type_name(value)}")
    if value == "none":
        return False
    if value in drafting:
        return True
    served = f"this server drafts with {drafting[0]}" if drafting else "this server has no drafter"
    raise ApiError(400, f"'speculative.type' {_short(value)} is not available: {served} (\"none\" turns it off)")


def logit_bias(body: dict, tokenizer, vocab_size: int) -> dict[int, float]:
    """OpenAI's `{"token id": bias}` or llama.cpp's `[[token id or text, bias], ...]`; a bias of `false` bans the
    token (-inf), a text biases each of its tokens."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias or an array of [token, bias] pairs")
    out: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ApiError(400, f"'logit_bias' values must be numbers or false, got {_type_name(bias)} for "
                                f"{_short(key)}")
        elif not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # compared before float(): a huge integer overflows it
            raise ApiError(400, f"'logit_bias' values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g} "
                                f"(false bans the token), got {_short(bias)} for {_short(key)}")
        if isinstance(key, str) and TOKEN_ID.fullmatch(key):
            if len(key.lstrip("-")) > 18:  # no id of any vocabulary; int() of thousands of digits is refused
                raise ApiError(400, f"'logit_bias' has token ids outside the vocabulary (size {vocab_size}): "
                                    f"{_short(key)}")
            ids = [int(key)]
        elif isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and isinstance(value, list):
            ids = tokenizer.encode(key, add_special=False)
        else:
            raise ApiError(400, f"'logit_bias' keys must be token ids (ASCII decimal integers), got {_short(key)}")
        check_token_ids(ids, vocab_size, "'logit_bias'")
        out.update(dict.fromkeys(ids, float(bias)))
    if sum(b == float("-inf") for b in out.values()) >= vocab_size:
        raise ApiError(400, "'logit_bias' bans every token of the vocabulary: nothing could be sampled")
    return out


TOKEN_ID = re.compile(r"-?[0-9]+")  # ASCII only: str.isdigit() also takes "²" and "٥", which int() refuses or reads


def _short(value: Any, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters (a key may be megabytes; an integer may have thousands of digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** limit:
        return f"an integer of more than {limit} digits"
    text = repr(value[:limit + 1] if isinstance(value, str) else value)
    return text if len(text) <= limit else text[:limit] + "..."


def chat_logprobs_count(body: dict) -> int | None:
    """OpenAI chat: `logprobs: true` with `top_logprobs` alternatives per token."""
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if not get_bool(body, "logprobs", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def text_logprobs_count(body: dict) -> int | None:
    """OpenAI completions: `logprobs: N` alternatives per token (false or null: none)."""
    return None if body.get("logprobs") is False else get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)


def native_probs_count(body: dict) -> int | None:
    """llama.cpp: `n_probs: N` > 0 adds completion_probabilities with N alternatives per token."""
    if get_bool(body, "post_sampling_probs", False):
        raise ApiError(400, "'post_sampling_probs' is not supported yet")
    value = get_int(body, "n_probs", 0, lo=0)
    if value > MAX_LOGPROBS:
        raise ApiError(400, f"'n_probs' (the number of top log-probabilities) must be between 0 and {MAX_LOGPROBS}, "
                            f"got {value}")
    return value or None


LOGPROB_FLOOR = -9999.0  # OpenAI's value for a token the model gives no chance (JSON has no -inf)


def _piece(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _items(tokenizer, entries: list[TokenLogprob], with_id: bool) -> list[dict]:
    """One {token, bytes, logprob, top_logprobs} object per entry (and its id, as llama.cpp's)."""
    def item(token: int, lp: float) -> dict:
        text, raw = _piece(tokenizer, token)
        return ({"id": token} if with_id else {}) | {"token": text, "bytes": raw, "logprob": _lp(lp)}
    return [item(t, lp) | {"top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat's `logprobs` object of a response or a chunk."""
    return {"content": _items(tokenizer, entries, with_id=False)}


class TextOffsets:
    """Where each token's text starts in the whole output (OpenAI's text_offset), over one detokenizer of every
    token so far: a stream's chunks carry their tokens' offsets whatever text is still held back."""

    def __init__(self, tokenizer):
        self.detok, self.at = IncrementalDetokenizer(tokenizer), 0

    def of(self, tokens: list[int]) -> list[int]:
        out = []
        for t in tokens:
            out.append(self.at)
            self.at += len(self.detok.push(t))
        return out


def text_logprobs(tokenizer, entries: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict:
    """OpenAI completions' `logprobs` object; text_offset from `offsets` (a stream's, kept across its chunks;
    None: these entries are the whole output)."""
    tokens = [_piece(tokenizer, t)[0] for t, _, _ in entries]
    starts = (offsets or TextOffsets(tokenizer)).of([t for t, _, _ in entries])
    return {"tokens": tokens, "token_logprobs": [_lp(lp) for _, lp, _ in entries],
            "top_logprobs": [{_piece(tokenizer, i)[0]: _lp(v) for i, v in top} for _, _, top in entries],
            "text_offset": starts}


def native_probs(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    """llama.cpp's `completion_probabilities` (n_probs)."""
    return _items(tokenizer, entries, with_id=True)


def message_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{index}].content[{j}].text must be a string, got "
                                        f"{_type_name(part.get('text'))}")
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise ApiError(400, f"messages[{index}]: only text content is supported, got a {kind!r} part")
        return "\n".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or an array of content parts")


# Fields of OpenAI's and llama.cpp's APIs that change what a caller gets back and are not implemented yet: a 400
# naming the field, never a 200 that silently breaks the caller's contract.
UNSUPPORTED_FIELDS = ("best_of", "suffix", "echo", "mirostat")
NEUTRAL_VALUES = {"echo": False, "mirostat": 0, "best_of": 1}


def check_supported(body: dict) -> None:
    """400 for a field that asks for something not implemented (its neutral value, e.g. `echo: false`, passes)."""
    for name in UNSUPPORTED_FIELDS:
        value = body.get(name)
        neutral = NEUTRAL_VALUES.get(name)
        if value is None or (neutral is not None and value == neutral
                             and isinstance(value, bool) == isinstance(neutral, bool)):
            continue
        raise ApiError(400, f"'{name}' is not supported yet")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object, got {_type_name(m)}")
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}].role must be a string")
        out.append({**m, "content": message_text(m.get("content"), i)})
    return out


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompt_ids(body: dict, tokenizer, vocab_size: int, limit: int) -> list[int]:
    """`prompt` as a string, token ids, or an array holding one of those (one prompt per request); a string
    that cannot fit in `limit` tokens is rejected before it is tokenized."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or is_token_list(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, add_special=True, limit=limit)
        except TooManyTokens as e:
            raise too_long(e) from None
    elif is_token_list(prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_token_list(p) for p in prompt):
        raise ApiError(400, "only one prompt per request is supported ('prompt' must be a string or token ids)")
    elif isinstance(prompt, list):
        bad = next(p for p in prompt if not (isinstance(p, int) and not isinstance(p, bool)))
        raise ApiError(400, f"'prompt' as an array must hold integer token ids, got {_type_name(bad)}")
    else:
        raise ApiError(400, f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}")
    check_token_ids(ids, vocab_size, "prompt")
    return ids


def check_token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{what} has token ids outside the vocabulary (size {vocab_size}): "
                            f"[{', '.join(_short(t) for t in bad[:5])}]")


def check_fits(ids: list[int], slot_ctx: int) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty")
    if len(ids) >= slot_ctx:
        raise context_exceeded(str(len(ids)), len(ids), slot_ctx)


def context_exceeded(count: str, n_prompt: int, slot_ctx: int) -> ApiError:
    return ApiError(400, f"the request exceeds the available context size: the prompt has {count} tokens and a "
                         f"slot holds {slot_ctx}, try increasing it (--ctx-size)",
                    "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=slot_ctx)


def too_long(e: TooManyTokens) -> ApiError:
    """A text rejected before it was tokenized: it cannot fit, whatever its exact token count."""
    return context_exceeded(f"at least {e.at_least}", e.at_least, e.limit)


def openai_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls {"name", "arguments"} as OpenAI's tool_calls entries."""
    return [{"id": new_id("call_")[:29], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def new_id(prefix: str) -> str:
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(32))


def usage(c: Completion) -> dict:
    return {"completion_tokens": len(c.token_ids), "prompt_tokens": len(c.prompt_ids),
            "total_tokens": len(c.token_ids) + len(c.prompt_ids),
            "prompt_tokens_details": {"cached_tokens": c.timings.cache_n}}


def add_stats(obj: dict, c: Completion) -> dict:
    """llama.cpp's `timings`, and our per-request `speculative` summary when drafting ran."""
    obj["timings"] = c.timings.to_dict()
    if c.spec.draft_steps:
        obj["speculative"] = c.speculative_summary()
    return obj


class Envelope:
    """The fields every OpenAI response and chunk of one request share."""

    def __init__(self, prefix: str, obj: str, model: str, fingerprint: str):
        self.id, self.object, self.model, self.fingerprint = new_id(prefix), obj, model, fingerprint
        self.created = int(time.time())

    def make(self, choices: list[dict], obj: str | None = None, **extra: Any) -> dict:
        return {"choices": choices, "created": self.created, "id": self.id, "model": self.model,
                "system_fingerprint": self.fingerprint, "object": obj or self.object, **extra}


def chat_response(env: Envelope, c: Completion, content: str, reasoning: str, logprobs: dict | None = None,
                  calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content or (None if calls else "")}
    message |= ({"reasoning_content": reasoning} if reasoning else {}) | ({"tool_calls": openai_calls(calls)}
                                                                          if calls else {})
    finish = "tool_calls" if calls else c.finish_reason
    choice = {"finish_reason": finish, "index": 0, "message": message, "logprobs": logprobs}
    return add_stats(env.make([choice], "chat.completion", usage=usage(c)), c)


def reasoning_format(body: dict, default: str) -> str:
    value = body.get("reasoning_format")
    if value is None:
        return default
    if value not in REASONING_FORMATS:
        raise ApiError(400, f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, got {value!r}")
    return value


def running_timings(job: Job) -> dict:
    """llama.cpp's `timings` so far (`timings_per_token`); the last chunk carries the engine's exact ones."""
    now = time.perf_counter()
    first = job.first_delta_at or now
    return Timings(prompt_n=len(job.request.prompt_ids), prompt_ms=1e3 * (first - job.started_at),
                   predicted_n=job.n_decoded, predicted_ms=1e3 * (now - first)).to_dict()


def chat_chunk(env: Envelope, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return env.make([{"finish_reason": finish_reason, "index": 0, "delta": delta, "logprobs": logprobs}])


def text_response(env: Envelope, c: Completion, logprobs: dict | None = None) -> dict:
    choice = {"text": c.text, "index": 0, "logprobs": logprobs, "finish_reason": c.finish_reason}
    return add_stats(env.make([choice], "text_completion", usage=usage(c)), c)


def text_chunk(env: Envelope, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return env.make([{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}])


def stop_type(c: Completion) -> str:
    if c.finish_reason == "length":
        return "limit"
    if c.finish_reason == "stop":
        return "word" if c.stop_word is not None else "eos"
    return "none"


def native_chunk(text: str, tokens: list[int], slot: int, n_predicted: int, n_prompt: int,
                 probs: list[dict] | None = None) -> dict:
    return {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot,
            "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt} | (
        {"completion_probabilities": probs} if probs is not None else {})


def native_final(c: Completion, slot: int, model: str, settings: dict, prompt: str, with_text: bool,
                 return_tokens: bool, probs: list[dict] | None = None) -> dict:
    # a stream's final event carries no tokens (its chunks did), as llama-server's
    obj = {"index": 0, "content": c.text if with_text else "", "tokens": c.token_ids if return_tokens and with_text
           else [],
           "id_slot": slot, "stop": True, "model": model, "tokens_predicted": len(c.token_ids),
           "tokens_evaluated": len(c.prompt_ids), "generation_settings": settings, "prompt": prompt,
           "has_new_line": "\n" in c.text, "truncated": False, "stop_type": stop_type(c),
           "stopping_word": c.stop_word or "", "tokens_cached": len(c.prompt_ids) + len(c.token_ids)}
    if probs is not None:
        obj["completion_probabilities"] = probs
    return add_stats(obj, c)


def generation_settings(p: SamplingParams, slot_ctx: int, speculative: bool) -> dict:
    return {"n_ctx": slot_ctx, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "seed": -1 if p.seed is None else p.seed, "n_predict": p.max_tokens,
            "stop": p.stop, "ignore_eos": p.ignore_eos, "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "n_probs": p.logprobs or 0,
            "logit_bias": [[t, False if b == float("-inf") else b] for t, b in p.logit_bias.items()],
            "speculative": speculative}

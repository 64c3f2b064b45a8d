"""Over HTTP: any OpenAI-compatible server, streaming `/v1/chat/completions` with SSE."""
import json
import sys
import time
from urllib.parse import urlparse

import httpx

from flashdraft.bench.results import BenchAborted, RequestFailed, System, Turn


def base_url(url: str) -> str:
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    for suffix in ("/v1/chat/completions", "/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


def label(url: str, taken: set[str]) -> str:
    name = urlparse(base_url(url)).netloc or url
    n, out = 2, name
    while out in taken:
        out, n = f"{name}#{n}", n + 1
    return out


def error_message(response: httpx.Response) -> str:
    response.read()
    try:
        err = response.json().get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return response.text[:300]


def probe(client: httpx.Client, url: str, wait: float = 600.0) -> str | None:
    """The served model's id, after waiting for a server that is still loading its model (503 on /health)."""
    root = base_url(url)
    deadline, told = time.monotonic() + wait, False
    while True:
        try:
            health = client.get(root + "/health", timeout=10)
            if health.status_code != 503 or time.monotonic() > deadline:
                r = client.get(root + "/v1/models", timeout=10)
                break
        except httpx.TransportError as e:
            raise BenchAborted(f"cannot reach {root} ({type(e).__name__}: {e}); is the server running and is "
                               "the URL right?") from e
        if not told:
            print(f"waiting for {root} to load its model", file=sys.stderr)
            told = True
        time.sleep(0.5)
    if r.status_code != 200:
        return None
    try:
        data = r.json().get("data") or []
        return data[0].get("id") if data else None
    except (ValueError, AttributeError):
        return None


def request_body(messages: list[dict], model: str | None, max_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, min_p: float | None, seed: int | None,
                 reasoning: str | None) -> dict:
    body: dict = dict(model=model or "default", messages=messages, max_tokens=max_tokens, temperature=temperature,
                      stream=True, stream_options={"include_usage": True})
    for key, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p), ("seed", seed)):
        if value is not None:
            body[key] = value
    if reasoning in ("on", "off"):
        body["chat_template_kwargs"] = {"enable_thinking": reasoning == "on"}
    return body


def stream_chat(client: httpx.Client, url: str, body: dict, timeout: float) -> Turn:
    """Send one streaming request and time it on the client; read the server's `timings` from the last
    chunk that has them."""
    endpoint = base_url(url) + "/v1/chat/completions"
    content, reasoning, chunks = [], [], 0
    usage, timings, speculative, finish, done = None, None, None, "", False
    t0 = time.perf_counter()
    t_first = t_last = None
    try:
        with client.stream("POST", endpoint, json=body, timeout=httpx.Timeout(timeout, connect=10)) as r:
            if r.status_code >= 400:
                msg = f"{endpoint} answered HTTP {r.status_code}: {error_message(r)}"
                if r.status_code >= 500:
                    raise BenchAborted(msg)
                raise RequestFailed(msg)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise BenchAborted(f"{endpoint} sent a stream line that is not JSON: {data[:200]!r}") from None
                if "error" in chunk:
                    err = chunk["error"]
                    raise BenchAborted(f"{endpoint} reported an error mid-stream: "
                                       f"{err.get('message', err) if isinstance(err, dict) else err}")
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or ""
                    think = delta.get("reasoning_content") or ""
                    if piece or think:
                        content.append(piece)
                        reasoning.append(think)
                        chunks += 1
                        t_first = t_first or now
                        t_last = now
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                speculative = chunk.get("speculative") or speculative
    except httpx.TransportError as e:
        raise BenchAborted(f"{endpoint} failed ({type(e).__name__}: {e or 'connection closed'}); "
                           "the server is unreachable or died mid-run") from e
    if not done and not finish:
        raise BenchAborted(f"{endpoint} closed the stream before the end of the answer; the server died mid-run?")
    t_end = time.perf_counter()
    t_first = t_first or t_end
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    client_m = dict(tokens=tokens, ttft_ms=1e3 * (t_first - t0), decode_ms=1e3 * ((t_last or t_end) - t_first),
                    total_ms=1e3 * (t_end - t0), chunks=chunks)
    turn = Turn(text="".join(content), tokens=tokens, decode_ms=client_m["decode_ms"], ttft_ms=client_m["ttft_ms"],
                prompt_tokens=int((usage or {}).get("prompt_tokens", 0)), finish_reason=finish, source="client",
                timings=timings, client=client_m)
    if "".join(reasoning):
        turn.text = "".join(reasoning) + "\n\n" + turn.text
    if timings and timings.get("predicted_ms") is not None and timings.get("predicted_n") is not None:
        turn.tokens, turn.decode_ms, turn.source = int(timings["predicted_n"]), float(timings["predicted_ms"]), "server"
    if timings:
        turn.draft_n = int(timings.get("draft_n", 0))
        turn.draft_n_accepted = int(timings.get("draft_n_accepted", 0))
        turn.verify_steps = int(timings.get("draft_rounds", 0))
    if isinstance(speculative, dict):
        turn.verify_steps = int(speculative.get("verify_steps", turn.verify_steps))
        turn.acceptance_histogram = list(speculative.get("acceptance_histogram") or [])
    return turn


def server_systems(urls: list[str], model: str | None, max_tokens: int, temperature: float,
                   top_k: int | None, top_p: float | None, min_p: float | None, seed: int | None,
                   reasoning: str | None, timeout: float = 600.0,
                   client: httpx.Client | None = None) -> list[System]:
    """One system per URL (the first is the baseline); every URL is probed first."""
    client = client or httpx.Client()
    systems, taken = [], set()
    for url in urls:
        served = probe(client, url, timeout)
        name = label(url, taken)
        taken.add(name)

        def generate(messages: list[dict], url=url, served=served) -> Turn:
            body = request_body(messages, model or served, max_tokens, temperature, top_k, top_p, min_p, seed,
                                reasoning)
            return stream_chat(client, url, body, timeout)
        systems.append(System(name, generate))
    return systems

"""Requests whose work grows with their size: a budget checked first (a 400 naming the field, in about a
second), the work off the event loop (/health answers meanwhile), each grammar compiled once, and stop strings
matched by an automaton whose cost per token does not grow with their number."""
import json
import random
import threading
import time

import httpx
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)
from test_server_constraints import tools_url  # noqa: F401  (a server whose template takes tools)

from flashdraft.engine import grammar as G
from flashdraft.engine.engine import StopStrings
from flashdraft.server.app import create_app

HEALTH_LIMIT = 1.0  # seconds /health may take while a big request is handled
ANSWER_LIMIT = 3.0  # seconds an oversized request may take to be refused


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=512), settings())) as url:
        yield url


def post_raw(url: str, path: str, body: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=timeout)


class HealthPoller:
    """Polls /health from a thread while a request is in flight; `worst` is the slowest answer (a timeout or a
    failure counts as infinitely slow)."""

    def __init__(self, url: str):
        self.url, self.worst, self.polls = url, 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=HEALTH_LIMIT) as client:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.perf_counter() - t if ok else float("inf"))
                self.polls += 1
                time.sleep(0.02)

    def __enter__(self) -> "HealthPoller":
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def gbnf(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))


HUGE = {  # name: (path, body, words of the 400's message); each froze the whole server before
    "gbnf grammar of 60k alternatives": (
        "/completion", lambda: json.dumps({"prompt": "hi", "n_predict": 1, "grammar": gbnf(60_000)}),
        ("'grammar'", "too large")),
    "json schema of 20k properties": (
        "/v1/chat/completions", lambda: json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}}}}),
        ("response_format.json_schema.schema", "too large")),
    "millions of small values": (
        "/completion", lambda: '{"prompt": "hi", "n_predict": 1, "x": [' + "0," * 5_000_000 + 'NaN]}',
        ("'x[5000000]'", "finite")),
    "long text key in logit_bias array form": (
        "/completion", lambda: json.dumps({"prompt": "hi", "n_predict": 1,
                                           "logit_bias": [["the quick brown fox " * 150_000, -1]]}),
        ("'logit_bias'", "too large")),
    "thousands of stop strings": (
        "/completion", lambda: json.dumps({"prompt": "hi", "n_predict": 8, "stop": [f"s{i}" for i in range(5000)]}),
        ("'stop'", "too large")),
    "tools of a huge schema (a template without tools)": (
        "/v1/chat/completions", lambda: json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}}}]}),
        ("'tools'", "too large")),
    "stop_sequences on the Anthropic route": (
        "/v1/messages", lambda: json.dumps({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                           "stop_sequences": ["x" * 100] * 2000}),
        ("'stop_sequences'", "too large")),
}


@pytest.mark.parametrize("case", list(HUGE))
def test_oversized_request_is_a_quick_400_and_health_answers_meanwhile(url, case):
    path, make, words = HUGE[case]
    body = make()
    with HealthPoller(url) as poller:
        t = time.perf_counter()
        r = post_raw(url, path, body)
        took = time.perf_counter() - t
    assert poller.polls and poller.worst < HEALTH_LIMIT, f"/health took {poller.worst:.2f} s at worst"
    assert_400(r, *words)
    assert took < ANSWER_LIMIT, f"refused after {took:.1f} s"


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"content": "the quick brown fox " * 100_000, "with_pieces": True}),
    ("/detokenize", {"tokens": [100, 200, 300] * 1_000_000}),
])
def test_big_tokenize_and_detokenize_leave_health_answering(url, path, body):
    with HealthPoller(url) as poller:
        r = post_raw(url, path, json.dumps(body))
    assert r.status_code == 200, r.text[:300]
    assert poller.worst < HEALTH_LIMIT, f"/health took {poller.worst:.2f} s at worst"


def test_a_grammar_within_the_budget_is_served(url):
    body = json.dumps({"prompt": "hi", "n_predict": 1, "grammar": gbnf(4000)})
    with HealthPoller(url) as poller:
        r = post_raw(url, "/completion", body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["content"].startswith("w")
    assert poller.worst < HEALTH_LIMIT


def test_each_grammar_is_compiled_once(url, monkeypatch):
    calls = []
    real = G.lark_source
    monkeypatch.setattr(G, "lark_source", lambda grammar: calls.append(grammar.kind) or real(grammar))
    r = post_raw(url, "/completion", json.dumps({"prompt": "hi", "n_predict": 2, "grammar": 'root ::= "ab" | "cd"'}))
    assert r.status_code == 200, r.text
    assert r.json()["content"] in ("ab", "cd")
    assert calls == ["gbnf"]


def test_many_stop_strings_within_the_budget_stop_where_they_should(url):
    """1000 stop strings: the answer is cut where the one that occurs begins, as with that string alone."""
    base = {"prompt": "The quick brown fox", "n_predict": 24, "temperature": 0}
    free = post_raw(url, "/completion", json.dumps(base)).json()["content"]
    assert len(free) > 8
    stop = free[5:8]
    alone = post_raw(url, "/completion", json.dumps(base | {"stop": [stop]})).json()
    decoys = [f"\x01never{i}" for i in range(999)]
    t = time.perf_counter()
    many = post_raw(url, "/completion", json.dumps(base | {"stop": decoys + [stop]})).json()
    assert time.perf_counter() - t < 10
    assert many["content"] == alone["content"] == free[:free.find(stop)]
    assert many["stopping_word"] == stop and many["stop_type"] == "word"


# The helpers the engine used before, slicing every stop string at every token: the reference.
def old_stop_hit(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


def old_held_back(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé😀"])
def test_stop_automaton_matches_the_old_helpers(alphabet):
    rng = random.Random(len(alphabet))
    hits = 0
    for _ in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 8))]
        matcher, text = StopStrings(stops), ""
        for _ in range(rng.randint(1, 15)):
            piece = "".join(rng.choice(alphabet + "x") for _ in range(rng.randint(0, 5)))
            text += piece
            expected = old_stop_hit(text, stops)
            assert matcher.push(piece) == expected, (stops, text)
            if expected is not None:
                hits += 1
                break
            assert matcher.held == old_held_back(text, stops), (stops, text)
    assert hits > 500


def test_stop_automaton_cost_does_not_grow_with_the_stop_list():
    def per_piece(n: int) -> float:
        matcher = StopStrings([f"stop word number {i}" for i in range(n)])
        t = time.perf_counter()
        for _ in range(2000):
            matcher.push("token ")
        return (time.perf_counter() - t) / 2000
    assert per_piece(1000) < 20 * per_piece(1) + 50e-6


def tool(name: str, n_properties: int) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n_properties)}}}}


@pytest.mark.parametrize("tools,words", [
    ([tool(f"f{i}", 1) for i in range(200)], ("'tools'", "200 tools")),
    ([tool("f", 20_000)], ("'tools'", "too large")),
    ([tool(f"f{i}", 1500) for i in range(4)], ("'tools'", "too large", "JSON schema")),  # the call grammar's size
])
def test_oversized_tools_are_a_quick_400(tools_url, tools, words):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "required",
                       "tools": tools})
    with HealthPoller(tools_url) as poller:
        t = time.perf_counter()
        r = post_raw(tools_url, "/v1/chat/completions", body)
        took = time.perf_counter() - t
    assert poller.worst < HEALTH_LIMIT, f"/health took {poller.worst:.2f} s at worst"
    assert_400(r, *words)
    assert took < ANSWER_LIMIT, f"refused after {took:.1f} s"


def test_tools_within_the_budget_are_served(tools_url):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "tool_choice": "required",
                       "tools": [tool(f"f{i}", 3) for i in range(3)]})
    r = post_raw(tools_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]

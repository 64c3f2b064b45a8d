"""The deadline on a request's preparation (budgets.Preparation): a step made artificially slow (template
rendering, tokenization, grammar compilation) gets a 503 naming it once the deadline passes, /health answers
within a second meanwhile, and the server serves the next request (the slow step, which a thread cannot stop,
runs on in the background and its result is dropped)."""
import threading
import time

import httpx
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture shared by the whole run)
from test_server_budgets import HEALTH_LIMIT, HealthPoller

from flashdraft.server import budgets, routes_generate, structured
from flashdraft.server.app import create_app

DEADLINE = 0.5  # seconds
SLOW = 2.5  # seconds each slowed step takes


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=512), settings())) as url:
        yield url


def slowed(fn, started: threading.Event):
    def slow(*args, **kwargs):
        started.set()
        time.sleep(SLOW)
        return fn(*args, **kwargs)
    return slow


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CASES = {  # name: (module, attribute slowed, path, body, words of the 503's message)
    "chat template": (routes_generate, "chat_ids", "/v1/chat/completions", CHAT, ("chat template",)),
    "prompt tokenization": (routes_generate.P, "prompt_ids", "/completion", {"prompt": "hi", "n_predict": 2},
                            ("tokenizing the prompt",)),
    "grammar compilation": (structured, "check", "/completion",
                            {"prompt": "hi", "n_predict": 2, "grammar": 'root ::= "a"'}, ("compiling",)),
    "Messages route": (routes_generate, "chat_ids", "/v1/messages",
                       {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                       ("chat template",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_preparation_past_its_deadline_is_a_503_naming_the_step(url, monkeypatch, case):
    module, name, path, body, words = CASES[case]
    started = threading.Event()
    monkeypatch.setattr(budgets, "PREPARE_SECONDS", DEADLINE, raising=False)
    monkeypatch.setattr(module, name, slowed(getattr(module, name), started))
    with HealthPoller(url) as poller:
        t = time.perf_counter()
        r = httpx.post(url + path, json=body, timeout=60)
        took = time.perf_counter() - t
    assert started.is_set()
    assert r.status_code == 503, (r.status_code, r.text[:300])
    error = r.json()["error"]
    message = error["message"]
    assert all(w in message for w in words) and f"{DEADLINE:g} s" in message, message
    if path == "/v1/messages":
        assert r.json()["type"] == "error"  # Anthropic's shape
    assert took < SLOW - 0.5, f"answered after {took:.1f} s: the deadline did not cut the wait"
    assert poller.polls and poller.worst < HEALTH_LIMIT, f"/health took {poller.worst:.2f} s at worst"
    monkeypatch.undo()
    time.sleep(SLOW)  # the slow step ends in its thread; the server serves on
    ok = httpx.post(url + path, json=body, timeout=60)
    assert ok.status_code == 200, ok.text[:300]


def test_a_preparation_within_the_deadline_is_served(url, monkeypatch):
    started = threading.Event()
    monkeypatch.setattr(budgets, "PREPARE_SECONDS", SLOW + 5, raising=False)
    monkeypatch.setattr(routes_generate, "chat_ids", slowed(routes_generate.chat_ids, started))
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert started.is_set() and r.status_code == 200, r.text[:300]

"""Bad values a hostile or careless client sends: each a 400 naming what is wrong, the server serving on."""
import json
import os
import sys

import httpx
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: the session fixture)

from flashdraft.server.app import create_app


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=512), settings())) as url:
        yield url


def post_raw(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": %s}'),
    ("/completion", '{"prompt": "hi", "n_predict": 2, "temperature": %s}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_p": %s}'),
])
def test_non_finite_numbers_are_a_400_naming_the_field(url, literal, path, body):
    r = post_raw(url, path, body % literal)
    assert_400(r, "finite", "temperature" if "temperature" in body else "top_p")


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", '{"content": "ab\\ud800c"}', "content"),
    ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("/completion", '{"prompt": "hi", "n_predict": 2, "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
     "messages[0].content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(url, path, body, field):
    assert_400(post_raw(url, path, body), f"'{field}'", "surrogate")
    assert httpx.get(url + "/slots", timeout=30).status_code == 200  # and nothing else broke


@pytest.mark.parametrize("seed", ["18446744073709551616", "1e30", "-2", "4294967296"])
def test_seeds_outside_uint32_are_a_400(url, seed):
    assert_400(post_raw(url, "/completion", '{"prompt": "hi", "n_predict": 2, "temperature": 1, "seed": %s}' % seed),
               "'seed'", "4294967295")


def test_largest_seed_is_served(url):
    r = post_raw(url, "/completion", '{"prompt": "hi", "n_predict": 2, "temperature": 1, "seed": 4294967295}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("depth", [300, 100_000])
def test_deep_nesting_is_a_400(url, depth):
    body = '{"prompt": "hi", "x": ' + "[" * depth + "]" * depth + "}"
    assert_400(post_raw(url, "/completion", body), "nested deeper")


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/models", "/"])
def test_head_is_answered_where_get_is(url, path):
    assert httpx.head(url + path, timeout=30).status_code == 200


@pytest.mark.parametrize("field,value", [("best_of", 2), ("suffix", '"x"'), ("echo", "true"), ("mirostat", 2)])
def test_fields_not_supported_are_a_400_naming_them(url, field, value):
    body = '{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field, value)
    assert_400(post_raw(url, "/v1/completions", body), f"'{field}'", "not supported")


@pytest.mark.parametrize("field,value", [("grammar", '"root ::= x"'), ("response_format", '{"type": "yaml"}'),
                                         ("json_schema", '"not a schema"')])
def test_bad_output_constraints_are_a_400_naming_them(url, field, value):
    body = '{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field, value)
    assert_400(post_raw(url, "/v1/completions", body), field)


def test_neutral_values_of_those_fields_are_served(url):
    body = ('{"prompt": "hi", "max_tokens": 2, "echo": false, "presence_penalty": 0.0, "frequency_penalty": 0, '
            '"repeat_penalty": 1.0, "logprobs": false, "response_format": {"type": "text"}}')
    assert post_raw(url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("prompt,words", [("[1.0, 2.0]", ("integer token ids", "a number")),
                                          ("[true]", ("integer token ids", "a boolean")),
                                          ('["a", "b"]', ("only one prompt",))])
def test_prompt_array_messages_say_what_is_wrong(url, prompt, words):
    assert_400(post_raw(url, "/v1/completions", '{"prompt": %s, "max_tokens": 2}' % prompt), *words)



@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_with_streams_in_flight_ends_them_and_exits_0(models, sig):  # noqa: F811
    """Two streams running when the signal comes: each ends with an error event and [DONE], the process exits
    0 with no traceback (before: a CancelledError traceback per stream, then exit 134)."""
    import signal
    import subprocess
    import threading

    from test_server import REPO, free_port
    from tiny import wait_healthy
    target, draft = models
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "-md", str(draft), "--port", str(port),
           "--device", "cpu", "-c", "8192", "-np", "2", "--no-webui"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    bodies: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    bodies[i].append(line)
                    started[i].set()

    try:
        wait_healthy(proc, url)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        proc.send_signal(getattr(signal, sig))
        for t in threads:
            t.join(60)
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "terminate called" not in log, log[-3000:]
    for lines in bodies:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error


def test_a_text_part_that_is_not_a_string_says_so(url):
    """Before: 'only text content is supported, got a 'text' part', for a text part whose text is a number."""
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": 5}]}], "max_tokens": 2}, timeout=60)
    assert_400(r, "messages[0].content[1].text must be a string", "an integer")


def test_slow_headers_trickled_bodies_and_silent_connections_are_closed(models):  # noqa: F811
    """--timeout-headers / --timeout: a connection that sends nothing, headers trickled a line at a time, and a
    body trickled a byte at a time are closed in time; a whole request is answered (before: all stayed open)."""
    import socket
    import subprocess
    import time

    from test_server import REPO, free_port
    from tiny import interrupt, wait_healthy
    target, _ = models
    port = free_port()
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "--port", str(port), "--device", "cpu",
           "-c", "512", "--no-webui", "--timeout-headers", "1.5", "--timeout", "3"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def seconds_open(first: bytes, trickle: bytes = b"", limit: float = 10) -> tuple[float, bytes]:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(first)
            s.settimeout(0.25)
            t = time.monotonic()
            while time.monotonic() - t < limit:
                try:
                    return time.monotonic() - t, s.recv(1000)
                except socket.timeout:
                    if trickle:
                        s.sendall(trickle)
                except ConnectionResetError:
                    return time.monotonic() - t, b""
            return limit, b"still open"

    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        waited, got = seconds_open(b"")
        assert got == b"" and 1.0 < waited < 3, (waited, got)
        waited, got = seconds_open(b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n")
        assert got == b"" and waited < 3, (waited, got)
        body_head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"content\": \""
        waited, got = seconds_open(body_head, b"a")
        assert got == b"" and 2.5 < waited < 5.5, (waited, got)
        waited, got = seconds_open(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200"), got
    finally:
        interrupt(proc, 30)


def test_a_final_assistant_message_is_continued(url):
    """As llama-server: the last assistant message is a prefill the answer continues (before: closed by the
    template and a new assistant turn opened after it)."""
    user = {"role": "user", "content": "Name a colour."}
    opened = httpx.post(url + "/apply-template", json={"messages": [user]}, timeout=60).json()["prompt"]
    prefilled = httpx.post(url + "/apply-template", json={"messages": [
        user, {"role": "assistant", "content": "The colour is"}]}, timeout=60).json()["prompt"]
    assert prefilled == opened + "The colour is", (opened, prefilled)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [user, {"role": "assistant", "content": "The"}],
                                                        "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        httpx.post(url + "/tokenize", json={"content": opened + "The"}, timeout=60).json()["tokens"])


@pytest.mark.parametrize("name", ["add_generation_prompt", "messages"])
def test_template_kwargs_the_server_sets_are_a_400_without_python_names(url, name):
    """Before: 'the chat template failed on these messages: flashdraft.formats.tokenizer.Tokenizer.
    apply_chat_template() got multiple values for keyword argument ...'."""
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                        "chat_template_kwargs": {name: False}}, timeout=60)
    assert_400(r, f"chat_template_kwargs.{name}")
    assert "flashdraft." not in r.text and "()" not in r.text


def test_text_that_cannot_fit_is_rejected_before_it_is_tokenized(url):
    """15 MB in one message: the answer comes from the length bound (no exact token count), not a tokenization."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox jumps " * 1_500_000}]}),
                       ("/v1/completions", {"prompt": "fox jumps " * 1_500_000})):
        r = httpx.post(url + path, json=body, timeout=60)
        assert_400(r, "exceeds the available context size", "at least")
        assert r.json()["error"]["type"] == "exceed_context_size_error"


def test_long_tokenization_leaves_the_server_answering(url):
    """A 2 MB /tokenize (seconds of work) runs while /health keeps answering at once: the tokenizer lets go of
    the interpreter while it works (before: every other request waited for it)."""
    import threading
    import time
    done = threading.Event()
    took: list[float] = []

    def tokenize() -> None:
        t0 = time.perf_counter()
        r = httpx.post(url + "/tokenize", json={"content": "fox jumps over " * 150_000}, timeout=120)
        took.append(time.perf_counter() - t0)
        assert r.status_code == 200
        done.set()

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.3)  # the body is sent and tokenizing
    latencies = []
    while not done.is_set():
        t0 = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join()
    assert took[0] > 1.0 and len(latencies) > 5, (took, latencies)  # the test saw a long tokenization
    assert max(latencies) < 0.5, latencies

"""Soak (slow): `flashdraft serve` on the CPU under 8 concurrent clients sending a mix of good and bad requests,
some hanging up mid-stream, for FLASHDRAFT_SOAK_SECONDS (default 30 minutes), then SIGTERM with streams in
flight. Zero 5xx, zero tracebacks, the server's memory flat within 10% after warm-up, every good answer equal
to the answer it got alone.

The server keeps its K/V quantized (q4_0 keys, q5_0 values: a target with 32-value heads) on 4 slots with
speculation, so the good answers are greedy and seeded answers checked under concurrency and prompt-cache hits
(second turns whose first turn a slot holds) with a quantized cache. Besides the malformed requests, the bad ones
are each field at its limit's other side (grammar, schema, stop strings, logit_bias, tools), bad tool
definitions, schemas no value matches (a $ref cycle); numeric extremes in every sampling field must answer a 4xx
or a 200 with every token asked for, never a 5xx."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import REPO, free_port
from tiny import wait_healthy

DURATION = float(os.environ.get("FLASHDRAFT_SOAK_SECONDS", 1800))
CLIENTS = 8

GOOD = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0,
                              "max_tokens": 48}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "The quick brown fox"}],
                              "temperature": 0.9, "seed": 11, "max_tokens": 40, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "story"}], "temperature": 0,
                              "max_tokens": 30, "logprobs": True, "top_logprobs": 2, "repeat_penalty": 1.3}),
    ("/v1/completions", {"prompt": "Speculative decoding", "temperature": 0, "max_tokens": 64,
                         "ignore_eos": True, "stop": ["zz"]}),
    ("/v1/completions", {"prompt": [5, 9, 33, 71], "temperature": 0, "max_tokens": 32, "logprobs": 3,
                         "logit_bias": {"7": -100}, "ignore_eos": True}),
    ("/completion", {"prompt": "0123456789", "n_predict": 50, "temperature": 0.7, "seed": 3,
                     "frequency_penalty": 0.5, "ignore_eos": True}),
    ("/completion", {"prompt": "jumps over the lazy dog.", "n_predict": 20, "temperature": 0, "n_probs": 2}),
    # a second turn: its first turn (GOOD[0]'s prompt) is often in a slot's prompt cache, quantized
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"},
                                           {"role": "assistant", "content": "return a + b"},
                                           {"role": "user", "content": "and sub?"}], "temperature": 0,
                              "max_tokens": 32, "ignore_eos": True}),
    ("/completion", {"prompt": "hi", "n_predict": 6, "temperature": 0, "grammar": 'root ::= ("yes" | "no") "."'}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a person"}], "temperature": 0,
                              "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "p", "schema": {"type": "object", "properties": {
                                      "name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}}),
]
BAD = [  # raw bodies: each must be a 4xx
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", '{"messages": []}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": -5}'),
    ("/v1/completions", '{"prompt": [1.5], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"abc": 1}}'),
    ("/completion", '{"prompt": "hi", "seed": 1e30}'),
    ("/completion", '{"prompt": "hi", "n_predict": 2, "x": ' + "[" * 500 + "]" * 500 + "}"),
    ("/completion", '{"prompt": "hi", "mirostat": 2}'),
    ("/completion", '{"prompt": "hi", "temperature": "hot"}'),
    ("/completion", "not json"),
    ("/completion", '{"prompt": "' + "fox " * 200_000 + '"}'),
    ("/tokenize", '{"content": 5}'),
    ("/detokenize", '{"tokens": [99999999]}'),
    # each field past its budget (budgets.py), decided before any of its work
    ("/completion", json.dumps({"prompt": "hi", "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(9000))})),
    ("/completion", json.dumps({"prompt": "hi", "json_schema": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(6000)}}})),
    ("/completion", json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(2000)]})),
    ("/completion", json.dumps({"prompt": "hi", "logit_bias": [["fox " * 300, 1.0]]})),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                   for i in range(200)]})),
    # bad tools (the tiny template takes none: the tools are checked first) and schemas no value matches
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                             '"function": {"name": "<|im_end|>"}}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "retrieval", '
                             '"function": {"name": "f"}}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                             '"function": {"name": "f", "parameters": {"$defs": {"a": {"$ref": "#/$defs/a"}}, '
                             '"$ref": "#/$defs/a"}}}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
                             '"json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": '
                             '"#/$defs/a"}}, "$ref": "#/$defs/a"}}}}'),
    ("/completion", json.dumps({"prompt": "hi", "grammar": "root ::= a\na ::= a"})),
    ("/completion", '{"prompt": "hi", "logit_bias": {"\u00b2": 5}}'),
]
# every finite double class in every sampling field: a 4xx naming it, or a 200 with every token asked for
EXTREMES = [5e-324, -5e-324, 1e-39, 1e-45, 1e38, -1e38, 1e308, -1e308, -0.0, 2 ** 53 + 1, 2 ** 63, 10 ** 30]
FIELDS = ["temperature", "top_p", "min_p", "top_k", "repeat_penalty", "presence_penalty", "frequency_penalty",
          "repeat_last_n", "seed"]


def extreme(rng: random.Random) -> str:
    field, value = rng.choice(FIELDS), rng.choice(EXTREMES)
    if rng.random() < 0.3:  # or as a logit bias
        return json.dumps({"prompt": [5, 17, 42], "n_predict": 3, "ignore_eos": True, "logit_bias": {"9": value}})
    return json.dumps({"prompt": [5, 17, 42], "n_predict": 3, "ignore_eos": True, "repeat_penalty": 1.1,
                       "frequency_penalty": 0.1, field: value})


@pytest.fixture(scope="module")
def soak_models(tmp_path_factory):
    """A tiny target with 32-value heads (the block KV types' size) and its DFlash draft."""
    from tiny import make_draft, make_target
    root = tmp_path_factory.mktemp("soak")
    target = make_target(root / "target", heads=2, kv_heads=1)
    return target, make_draft(root / "draft", target)


def answer(url: str, path: str, body: dict, stream: bool) -> str:
    """The text of a good request, streamed or not (non-200 and error events fail the caller)."""
    if not stream:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        obj = r.json()
        return obj["content"] if path == "/completion" else (
            obj["choices"][0]["message"]["content"] if "chat" in path else obj["choices"][0]["text"])
    text = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, (path, r.status_code)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if path == "/completion":
                text.append(obj.get("content", ""))
            elif obj.get("choices"):
                choice = obj["choices"][0]
                text.append((choice.get("delta") or {}).get("content") or "" if "chat" in path else choice["text"])
    return "".join(text)


def hang_up(url: str, path: str, body: dict, rng: random.Random) -> None:
    with httpx.stream("POST", url + path, json={**body, "stream": True, "max_tokens": 400, "n_predict": 400,
                                                "ignore_eos": True}, timeout=300) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= rng.randint(1, 6):
                break


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_soak(soak_models):
    target, draft = soak_models
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "-md", str(draft), "--port", str(port),
           "--device", "cpu", "-c", "8192", "-np", "4", "--no-webui", "--metrics", "-ctk", "q4_0", "-ctv", "q5_0"]
    log_path = REPO / ".soak.log" if os.environ.get("FLASHDRAFT_SOAK_KEEP_LOG") else None
    log = open(log_path, "w+") if log_path else __import__("tempfile").TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    failures: list[str] = []
    counts = {"good": 0, "bad": 0, "extreme": 0, "hang_up": 0}
    memory: list[tuple[float, int]] = []
    try:
        wait_healthy(proc, url, timeout=300)
        solo = {(i, s): answer(url, p, b, s) for i, (p, b) in enumerate(GOOD) for s in (False, True)}
        assert all(solo[(i, False)] == solo[(i, True)] for i in range(len(GOOD))), solo
        t_start = time.time()
        deadline = t_start + DURATION
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < deadline and len(failures) < 20:
                kind = rng.choices(["good", "bad", "extreme", "hang_up"], [6, 3, 1, 1])[0]
                try:
                    if kind == "good":
                        i, stream = rng.randrange(len(GOOD)), rng.random() < 0.5
                        got = answer(url, *GOOD[i], stream)
                        if got != solo[(i, stream)]:
                            failures.append(f"good request {i} (stream={stream}) answered differently: {got!r}")
                    elif kind == "bad":
                        path, body = rng.choice(BAD)
                        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"},
                                       timeout=300)
                        if not 400 <= r.status_code < 500:
                            failures.append(f"bad request to {path} got {r.status_code}: {r.text[:200]}")
                    elif kind == "extreme":
                        body = extreme(rng)
                        r = httpx.post(url + "/completion", content=body, headers={"Content-Type": "application/json"},
                                       timeout=300)
                        whole = r.status_code == 200 and r.json()["tokens_predicted"] == 3
                        if not (400 <= r.status_code < 500 or whole):
                            failures.append(f"extreme {body} got {r.status_code}: {r.text[:200]}")
                    else:
                        hang_up(url, *GOOD[rng.randrange(len(GOOD))], rng)
                except Exception as e:  # noqa: BLE001  (any client-side failure is a finding)
                    failures.append(f"{kind}: {type(e).__name__}: {e}"[:500])
                with lock:
                    counts[kind] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            memory.append((time.time() - t_start, rss_kib(proc.pid)))
            time.sleep(min(10.0, DURATION / 30))
        for t in threads:
            t.join()
        metrics = httpx.get(url + "/metrics", timeout=60).text
        # the end: SIGTERM while two streams run
        streams = [threading.Thread(target=lambda: hang_up(url, *GOOD[0], random.Random(0)), daemon=True)
                   for _ in range(2)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    print(f"\nsoak: {DURATION:.0f} s, {counts}, server RSS MiB (s): "
          + ", ".join(f"{t:.0f}:{m / 1024:.0f}" for t, m in memory[::max(1, len(memory) // 12)]))
    assert not failures, failures[:10]
    assert proc.returncode == 0, text[-3000:]
    server_errors = [line for line in text.splitlines() if re.match(r"\S+ 5\d\d ", line)]  # "PATH STATUS message"
    assert "Traceback" not in text and not server_errors, (server_errors[:5], text[-3000:])
    assert all(counts.values()), counts
    assert "llamacpp:requests_processing" in metrics
    warm = [m for t, m in memory if t >= DURATION * 0.2]  # after warm-up
    assert max(warm) <= 1.10 * min(warm), memory

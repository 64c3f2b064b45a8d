"""`flashdraft bench --url` against small stand-in OpenAI-compatible servers (fast, no model)."""
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flashdraft.bench.main import main

WORDS = "def add(a, b):\n    return a + b\n".split(" ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Streams a fixed answer; optionally with llama.cpp `timings`, a different text, or dying after n requests."""

    def __init__(self, timings: bool = True, draft: bool = False, text: list[str] | None = None,
                 die_after: int | None = None, status: int = 200):
        self.timings, self.draft, self.text = timings, draft, text or WORDS
        self.die_after, self.status, self.requests, self.bodies = die_after, status, 0, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps({"data": [{"id": "fake-model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                fake.requests += 1
                if fake.status != 200:
                    self.send_response(fake.status)
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": {"code": fake.status, "message": "boom",
                                                           "type": "server_error"}}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                dying = fake.die_after is not None and fake.requests > fake.die_after
                pieces = fake.text[: body["max_tokens"]]
                for i, w in enumerate(pieces):
                    if dying and i == 2:
                        return
                    self.send({"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
                self.send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                last = {"choices": [], "usage": {"completion_tokens": len(pieces), "prompt_tokens": 7,
                                                 "total_tokens": 7 + len(pieces)}}
                if fake.timings:
                    t = {"prompt_n": 7, "prompt_ms": 5.0, "predicted_n": len(pieces),
                         "predicted_ms": 100.0 if not fake.draft else 40.0, "cache_n": 0}
                    if fake.draft:
                        t.update(draft_n=30, draft_n_accepted=12)
                        last["speculative"] = {"verify_steps": 6, "acceptance_histogram": [0, 2, 2, 2]}
                    last["timings"] = t
                self.send(last)
                self.wfile.write(b"data: [DONE]\n\n")

            def send(self, obj):
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        s = FakeServer(**kw)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def bench(capsys, *args):
    rc = main(["--max-tokens", "8", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_two_servers_table_json_png(servers, tmp_path, capsys):
    base, spec = servers(), servers(draft=True)
    rc, out, err = bench(capsys, "--url", base.url, "--url", spec.url, "--json", "--out", str(tmp_path), "--runs", "2")
    assert rc == 0, err
    s = json.loads(out)
    assert s["timing_source"] == "server"
    overall = s["comparisons"][0]["rows"][-1]
    assert overall["kind"] == "overall" and overall["prompts"] == 3 and overall["runs"] == 2
    assert overall["base_tps"] == pytest.approx(1e3 * 8 / 100) and overall["tps"] == pytest.approx(1e3 * 8 / 40)
    assert overall["speedup"] == pytest.approx(2.5) and overall["mean_speedup"] == pytest.approx(2.5)
    assert overall["mean_acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert overall["acceptance_rate"] == pytest.approx(0.4) and overall["equal"]
    assert s["comparisons"][0]["acceptance_histogram"] == [0, 12, 12, 12]
    for f in ("responses.jsonl", "summary.json", "table.csv", "chart.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert len((tmp_path / "responses.jsonl").read_text().splitlines()) == 3 * 2 * 2
    body = base.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert body["temperature"] == 0 and body["chat_template_kwargs"] == {"enable_thinking": False}


def test_table_text_and_client_timing(servers, capsys):
    base, spec = servers(timings=False), servers(timings=True, draft=True)
    rc, out, err = bench(capsys, "--url", base.url, "--url", spec.url, "--warmup", "0")
    assert rc == 0, err
    assert "from client timings" in out  # one server lacks `timings`, so all are measured on the client
    assert "speedup (Σtok/Σtime)" in out and "speedup (mean of prompts)" in out and "OVERALL 3 prompts" in out
    assert "task-store" in out and "MISMATCH" not in out


def test_mismatch_flagged(servers, capsys):
    base, spec = servers(), servers(draft=True, text=WORDS[:3] + ["oops"] + WORDS[4:])
    rc, out, err = bench(capsys, "--url", base.url, "--url", spec.url, "--warmup", "0")
    assert rc == 0
    assert "MISMATCH" in out
    assert "WARNING: MISMATCH at temperature 0" in err and "character" in err


def test_unreachable_url(servers, tmp_path, capsys):
    base = servers()
    dead = f"http://127.0.0.1:{free_port()}"
    rc, out, err = bench(capsys, "--url", base.url, "--url", dead, "--out", str(tmp_path))
    assert rc == 1
    assert f"cannot reach {dead}" in err and "is the server running" in err
    assert (tmp_path / "summary.json").exists() and (tmp_path / "responses.jsonl").exists()


def test_server_dies_mid_run(servers, tmp_path, capsys):
    base, spec = servers(), servers(draft=True, die_after=2)  # warm-up + 1 prompt, then it dies
    rc, out, err = bench(capsys, "--url", base.url, "--url", spec.url, "--out", str(tmp_path), "--json")
    assert rc == 1
    assert "closed the stream before the end" in err and "stopped after 3 answers" in err
    s = json.loads(out)
    assert s["aborted"] and s["comparisons"][0]["rows"][-1]["prompts"] == 1
    assert len((tmp_path / "responses.jsonl").read_text().splitlines()) == 3
    assert (tmp_path / "chart.png").exists() and (tmp_path / "table.csv").exists()


def test_server_error_status(servers, tmp_path, capsys):
    base, bad = servers(), servers(status=500)
    rc, out, err = bench(capsys, "--url", base.url, "--url", bad.url, "--warmup", "0", "--out", str(tmp_path))
    assert rc == 1 and "HTTP 500: boom" in err
    assert len((tmp_path / "responses.jsonl").read_text().splitlines()) == 1


def test_three_servers_two_comparisons(servers, capsys):
    a, b, c = servers(), servers(draft=True), servers(draft=True)
    rc, out, err = bench(capsys, "--url", a.url, "--url", b.url, "--url", c.url, "--warmup", "0", "--json",
                         "--num-prompts", "1")
    assert rc == 0, err
    s = json.loads(out)
    assert [x["system"] for x in s["comparisons"]] == s["systems"][1:] and len(s["systems"]) == 3
    assert all(x["baseline"] == s["systems"][0] for x in s["comparisons"])

"""`flashdraft bench --url` against real `flashdraft serve` processes on tiny random models."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flashdraft.bench.main import main
from test_bench_http import free_port

REPO = Path(__file__).resolve().parents[1]


def start_server(target: Path, draft: Path | None, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "--port", str(port),
           "--device", "cpu", "-c", "512", "--no-webui"] + (["-md", str(draft)] if draft else [])
    if draft:  # every step verifies: the tiny random draft accepts next to nothing, and the adaptive width would stop
        cmd.append("--no-spec-dm-adaptive")  # speculating within a request's first steps (no histogram to report)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"flashdraft serve exited early:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail(f"flashdraft serve at {url} not ready in {timeout} s:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny import make_draft, make_target
    root = tmp_path_factory.mktemp("bench-serve")
    target = make_target(root / "target")
    return root, target, make_draft(root / "draft", target)


@pytest.fixture
def servers(models):
    """Start servers (name -> draft or None); they are stopped after the test."""
    root, target, draft = models
    procs: dict = {}

    def start(**names):
        for name, with_draft in names.items():
            procs[name] = start_server(target, draft if with_draft else None, root / f"{name}.log")
        for name in names:
            wait_ready(*procs[name], root / f"{name}.log")
        return {name: procs[name][1] for name in names}
    yield start, procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_compare_two_servers(servers, tmp_path, capsys):
    start, _ = servers
    urls = start(base=False, dflash=True)
    rc = main(["--url", urls["base"], "--url", urls["dflash"], "--max-tokens", "12", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "decode tok/s from server timings" in out and "OVERALL 3 prompts" in out
    assert "acceptance length histogram" in out and "MISMATCH" not in out
    s = json.loads((tmp_path / "summary.json").read_text())
    comp = s["comparisons"][0]
    overall = comp["rows"][-1]
    assert overall["kind"] == "overall" and overall["equal"] and overall["verify_steps"] > 0
    assert sum(comp["acceptance_histogram"]) == overall["verify_steps"]
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(x)["turns"][0]["timings"]["predicted_n"] for x in lines)

    rc = main(["--url", urls["base"], "--url", urls["dflash"], "--max-tokens", "4", "--num-prompts", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["comparisons"][0]["rows"][-1]["prompts"] == 1
    dead = f"http://127.0.0.1:{free_port()}"
    rc = main(["--url", urls["base"], "--url", dead, "--out", str(tmp_path / "dead")])
    out, err = capsys.readouterr()
    assert rc == 1 and f"cannot reach {dead}" in err
    assert (tmp_path / "dead" / "summary.json").is_file()


@pytest.mark.slow
def test_server_dies_mid_run(servers, tmp_path, capsys):
    start, procs = servers
    urls = start(base=False, victim=False)
    victim = procs["victim"][0]
    done: dict = {}
    args = ["--url", urls["base"], "--url", urls["victim"], "--max-tokens", "48", "--runs", "5", "--warmup", "0",
            "--out", str(tmp_path)]
    thread = threading.Thread(target=lambda: done.update(rc=main(args)))
    thread.start()
    responses = tmp_path / "responses.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and thread.is_alive():
        if responses.is_file() and len(responses.read_text().splitlines()) >= 2:
            victim.kill()
            break
        time.sleep(0.05)
    thread.join(120)
    out, err = capsys.readouterr()
    assert done.get("rc") == 1, err
    assert "unreachable or died mid-run" in err or "closed the stream" in err
    assert "reporting what was gathered" in err
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["aborted"] and s["comparisons"][0]["rows"][-1]["prompts"] >= 1
    assert len(responses.read_text().splitlines()) >= 2 and (tmp_path / "chart.png").is_file()

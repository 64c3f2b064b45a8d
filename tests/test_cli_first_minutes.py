"""A llama.cpp user's first minutes: -t/-tb, the draft only when asked for, named drafts, and every mistake as
one clear line (exit 1, no traceback, nothing about listening before the checks)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tiny import interrupt, make_draft, make_target, wait_healthy

REPO = Path(__file__).resolve().parents[1]


def flashdraft(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashdraft.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "terminate" not in result.stderr, result.stderr
    assert "listening" not in result.stderr + result.stdout
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-minutes")
    target = make_target(root / "target")
    return target, make_draft(root / "draft", target)


# --- the command itself -----------------------------------------------------------------------------------------

def test_help_lists_the_subcommands():
    out = flashdraft("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for cmd in ("generate", "serve", "bench", "pull", "train-draft", "make-data"):
        assert any(line.split()[:1] == [cmd] and len(line.split()) > 1 for line in lines), (cmd, out.stdout)
    assert "--version" in out.stdout


def test_version():
    out = flashdraft("--version")
    assert out.returncode == 0 and out.stdout.strip() == "flashdraft 0.1.0", (out.stdout, out.stderr)


def test_unknown_command_is_one_line():
    out = flashdraft("sreve")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "sreve" in out.stderr


# --- threads ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["-t", "1"], ["--threads", "1"], ["-tb", "1"], ["-t", "1", "-tb", "1"],
                                   ["--threads", "1", "--threads-batch", "1"]])
def test_thread_flags_parse_for_serve_generate_and_bench(flags):
    from flashdraft.bench.main import parse_args
    from flashdraft.cli import generate_parser
    from flashdraft.server.main import parse_settings

    want_t = 1 if {"-t", "--threads"} & set(flags) else None
    want_tb = 1 if {"-tb", "--threads-batch"} & set(flags) else None
    s = parse_settings(["-m", "x", *flags])[0]
    assert (s.threads, s.threads_batch) == (want_t, want_tb)
    g = generate_parser().parse_args(["-m", "x", "--prompt", "hi", *flags])
    assert (g.threads, g.threads_batch) == (want_t, want_tb)
    b = parse_args(flags)
    assert (b.threads, b.threads_batch) == (want_t, want_tb)


def test_default_threads_do_not_oversubscribe():
    from flashdraft.args import default_threads, thread_env
    n = default_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    env = {}
    assert thread_env(["serve", "-m", "x"], env) == n and env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(n)
    env = {}
    thread_env(["serve", "-m", "x", "-t", "3"], env)
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    env = {"OMP_NUM_THREADS": "7"}  # the user's own setting stays, and is the count
    assert thread_env(["serve", "-m", "x"], env) == 7
    assert env["OMP_NUM_THREADS"] == "7" and env["MKL_NUM_THREADS"] == "7"


def test_waiting_threads_sleep_unless_the_user_says():
    from flashdraft.args import thread_env
    env = {}
    thread_env(["bench"], env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    for own in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(own)
        thread_env(["bench"], env)
        assert env.get("OMP_WAIT_POLICY") == own.get("OMP_WAIT_POLICY")


def test_busy_cpus_leaves_out_this_process(monkeypatch):
    from flashdraft import args as A
    ticks = iter([(100, 1000), (100 + 45, 1000 + 50)])  # 2 CPUs over 0.25 s = 50 ticks, 45 of them busy
    own = iter([10.0, 10.0 + 0.25 * 0.8])  # this process used 0.8 of a CPU meanwhile
    monkeypatch.setattr(A, "_cpu_jiffies", lambda cpus: next(ticks))
    monkeypatch.setattr(A.os, "times", lambda: (next(own), 0.0))
    monkeypatch.setattr(A.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(A.time, "sleep", lambda s: None)
    assert A.busy_cpus() == pytest.approx(45 / 50 * 2 - 0.8)


@pytest.mark.parametrize("busy, logical, physical, want", [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (1.0, 2, 2, 1), (2.0, 2, 2, 1), (1.4, 2, 2, 1), (None, 2, 2, 2),
    (2.0, 8, 4, 3), (0.0, 8, 4, 4), (7.9, 8, 4, 1),
])
def test_default_threads_leave_out_busy_cores(monkeypatch, busy, logical, physical, want):
    from flashdraft import args as A
    monkeypatch.setattr(A, "busy_cpus", lambda window=A.LOAD_WINDOW_S: busy)
    monkeypatch.setattr(A, "default_threads", lambda: physical)
    monkeypatch.setattr(A.os, "sched_getaffinity", lambda pid: set(range(logical)))
    assert A.free_threads() == want
    env = {}
    assert A.thread_env(["bench"], env, load_aware=True) == want and env["OMP_NUM_THREADS"] == str(want)
    assert A.thread_env(["bench"], {}, load_aware=False) == physical


def test_busy_cpus_sees_a_busy_loop():
    from flashdraft.args import busy_cpus
    before = busy_cpus(0.5)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        during = busy_cpus(0.5)
    finally:
        hog.kill()
        hog.wait()
    assert before is not None and during is not None
    assert 0 <= before <= len(os.sched_getaffinity(0)) + 0.1
    assert during >= 0.5, (before, during)  # the loop holds a CPU (or its share of one, beside other work)


def test_omp_num_threads_is_the_default_count():
    out = subprocess.run([sys.executable, "-c", "from flashdraft.args import thread_env, set_threads; "
                          "thread_env(['generate'], load_aware=True); import torch; print(set_threads(None), "
                          "torch.get_num_threads())"], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split() == ["1", "1"], out.stderr


def test_threads_reach_torch():
    out = subprocess.run([sys.executable, "-c", "import sys; from flashdraft.args import thread_env, set_threads; "
                          "thread_env(sys.argv[1:]); import torch; set_threads(3); "
                          "print(torch.get_num_threads(), torch.get_num_interop_threads())", "-t", "3"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ,
                                                                                     "OMP_NUM_THREADS": ""})
    assert out.stdout.split() == ["3", "1"], out.stderr


# --- the draft only when asked for, and by name ---------------------------------------------------------------

def test_named_draft_resolves_to_the_shipped_one():
    from flashdraft.formats import named
    shipped = named.SHIPPED_DRAFTS / "smollm2-135m"
    assert (shipped / "config.json").is_file()
    assert named.resolve_draft("smollm2-135m") == str(shipped)
    assert named.resolve_draft(None) is None
    assert named.resolve_draft("some/folder") == "some/folder"


def test_pull_list_names_models_and_drafts():
    out = flashdraft("pull", "--list")
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "draft" in out.stdout.lower()
    assert "-md smollm2-135m" in out.stdout


class Loaded(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """Engine.load stops with the config it was given: what the command asked for, without loading anything."""
    from flashdraft.engine.engine import Engine
    seen = []

    def load(config):
        seen.append(config)
        raise Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    return seen


@pytest.mark.parametrize("extra, want", [([], None), (["-md", "smollm2-135m"], "shipped"),
                                         (["--no-spec", "-md", "smollm2-135m"], None)])
def test_generate_draft_only_when_asked(captured, extra, want):
    from flashdraft import cli
    from flashdraft.formats.named import SHIPPED_DRAFTS
    with pytest.raises(Loaded):
        cli.main(["generate", "-m", "smollm2-135m", "--prompt", "hi", "--device", "cpu", *extra])
    assert captured[0].draft == (str(SHIPPED_DRAFTS / "smollm2-135m") if want else None)


@pytest.mark.parametrize("extra, want", [([], None), (["--spec-draft-model", "smollm2-135m"], "shipped"),
                                         (["-md", "smollm2-135m", "--spec-type", "none"], None)])
def test_serve_draft_only_when_asked(captured, caplog, extra, want):
    from flashdraft.formats.named import SHIPPED_DRAFTS, model_path
    from flashdraft.server.main import load_engine, parse_settings
    for model in ("smollm2-135m", str(model_path("smollm2-135m"))):
        captured.clear()
        with caplog.at_level("INFO", logger="flashdraft.server"), pytest.raises(Loaded):
            load_engine(parse_settings(["-m", model, "--device", "cpu", *extra])[0])
        assert captured[0].draft == (str(SHIPPED_DRAFTS / "smollm2-135m") if want else None)
        assert ("no draft: plain decoding" in caplog.text) == (not want), caplog.text
        caplog.clear()


def test_bench_keeps_the_shipped_draft_by_default():
    from flashdraft.bench.main import parse_args, resolve_pair
    from flashdraft.formats.named import SHIPPED_DRAFTS
    assert resolve_pair(parse_args([])) == ("smollm2-135m", str(SHIPPED_DRAFTS / "smollm2-135m"), ["dflash"])
    assert resolve_pair(parse_args(["-md", "smollm2-135m"]))[1] == str(SHIPPED_DRAFTS / "smollm2-135m")


@pytest.mark.slow  # loads the real SmolLM2 GGUF on the CPU
def test_serve_named_model_has_no_draft(smollm2_gguf):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "-m", "smollm2-135m", "--port",
                             str(port), "--device", "cpu", "-c", "512"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=300)
        props = httpx.get(url + "/props").json()
        assert props["speculative"]["type"] == "none" and props["draft_model_path"] is None
    finally:
        log = interrupt(proc, 60)
    assert "no draft: plain decoding" in log


# --- mistakes: one line, exit 1 -----------------------------------------------------------------------------------

def test_serve_missing_model_file(tmp_path):
    one_line_error(flashdraft("serve", "-m", str(tmp_path / "missing.gguf"), "--port", str(free_port())),
                   "missing.gguf")


def test_serve_port_in_use(tiny_pair):
    target, _ = tiny_pair
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_error(flashdraft("serve", "-m", str(target), "--port", str(port), "--device", "cpu"), str(port))


def test_serve_mismatched_draft_exits_1(tmp_path, tiny_pair):
    """The load fails in the background: one error line, then exit 1 (not an abort at teardown), every time."""
    target, _ = tiny_pair
    other = make_target(tmp_path / "other", vocab_size=256)
    draft = make_draft(tmp_path / "draft", other)
    for _ in range(3):
        out = flashdraft("serve", "-m", str(target), "-md", str(draft), "--port", str(free_port()), "--device", "cpu",
                         "--log-prefix")
        assert out.returncode == 1, (out.returncode, out.stderr)
        assert "Traceback" not in out.stderr and "terminate" not in out.stderr, out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("E ")]
        assert len(errors) == 1 and "vocab" in errors[0], out.stderr


def test_bench_missing_model_blames_the_file(tmp_path):
    line = one_line_error(flashdraft("bench", "-m", str(tmp_path / "missing.gguf")), "missing.gguf")
    assert "no DFlash draft" not in line and "-md" not in line, line


def test_generate_missing_model_file(tmp_path):
    one_line_error(flashdraft("generate", "-m", str(tmp_path / "missing.gguf"), "--prompt", "hi"), "missing.gguf")


def test_failed_load_ends_the_loading_thread_before_exit(monkeypatch):
    """The cause of the abort: the loading thread sets the server to exit, then still runs (it logs, its exception
    unwinds and frees what was loaded); a daemon thread caught inside torch's C++ code at interpreter exit aborts
    the process. serve() returns only once that thread has ended."""
    import threading
    import time

    from flashdraft.server import app as app_module
    from flashdraft.server import main as server_main
    from flashdraft.server.settings import Settings

    def fail(settings):
        raise ValueError("the draft's vocabulary does not match the target's")

    slow = app_module.log.error

    def slow_error(*args):  # a slow unwind, as freeing a loaded model on a busy machine
        time.sleep(2)
        slow(*args)

    monkeypatch.setattr(server_main, "load_engine", fail)
    monkeypatch.setattr(app_module.log, "error", slow_error)
    assert server_main.serve(Settings(model="x", port=free_port(), webui=False)) == 1
    assert not [t for t in threading.enumerate() if t.name == "load-model" and t.is_alive()]


ABORT = """
import sys
import torch
from flashdraft.server import app as A, main as M
from flashdraft.server.settings import Settings

def fail(settings):
    raise ValueError("the draft does not fit the target")

error = A.log.error

def busy(*args):  # the loading thread is still inside torch's C++ code when the server has shut down
    x = torch.randn(1500, 1500)
    for _ in range(40):
        x = (x @ x).clamp(-1, 1)
    error(*args)

M.load_engine, A.log.error = fail, busy
sys.exit(M.serve(Settings(model="x", port=int(sys.argv[1]), webui=False)))
"""


def test_failed_load_exits_1_not_an_abort(tmp_path):
    script = tmp_path / "abort.py"
    script.write_text(ABORT)
    out = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 1 and "terminate called" not in out.stderr, (out.returncode, out.stderr)
    assert "the draft does not fit the target" in out.stderr

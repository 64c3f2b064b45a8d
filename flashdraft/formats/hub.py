"""Models from the Hugging Face Hub: `-hf user/model[:quant]` for the target and `-hfd` for the draft, as llama.cpp
has them. The files go into the Hugging Face cache (huggingface_hub's hf_hub_download, with its progress bars), so
llama.cpp, transformers and flashdraft share one copy; HF_HUB_OFFLINE=1 (or --offline) uses the cache only.

A quant tag picks a GGUF file of the repository as llama.cpp's common_download_get_hf_plan does:
- the tag, case-insensitive, followed by "." or "-" anywhere in the file's path (`:q8_0` finds model-Q8_0.gguf);
  without a tag Q4_K_M, then Q8_0, then the first GGUF file;
- files that are not a model are passed over: mmproj, imatrix and the sidecars (mtp-, eagle3-, dflash-,
  dspark-); for -hfd a DFlash sidecar (a file named dflash-...) is taken first, as llama.cpp's draft repos
  ship them, else a GGUF file as for -hf;
- a model split in parts (NAME-00001-of-00003.gguf) is found by its first part, and all its parts download;
- a tag that matches nothing is an error naming the tags the repository has.
A repository without GGUF files but with a config.json (an HF folder of safetensors, as z-lab publishes DFlash
drafts) is downloaded as a folder; it has no quants.

huggingface_hub is imported only here, and only when -hf is used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
# words in a GGUF file's name that make it something other than a model (llama.cpp's gguf_filename_is_model)
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DRAFT_SIDECAR = "dflash-"
# the files of an HF folder that loading reads
FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Split:
    prefix: str  # the path without .gguf and without the -00001-of-00003 part (its tag included)
    tag: str  # upper case: Q4_K_M, F16, ... ("" when the name has none)
    index: int
    count: int


def split_info(path: str) -> Split | None:
    """llama.cpp's get_gguf_split_info: the tag and split position a GGUF file's name carries (None: not .gguf)."""
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path[:-len(".gguf")], 1, 1
    if m := _SPLIT.match(prefix):
        prefix, index, count = m[1], int(m[2]), int(m[3])
    tag = m[1].upper() if (m := _TAG.search(prefix)) else ""
    return Split(prefix, tag, index, count)


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(word in name for word in NOT_A_MODEL)


def _first_part(path: str) -> bool:
    s = split_info(path)
    return s is not None and (s.count <= 1 or s.index == 1)


def find_best(files: list[str], tag: str, candidates=is_model_file) -> str | None:
    """The file a tag names among `files` (in listing order), as llama.cpp's find_best_model; None: no match."""
    for t in ([tag] if tag else DEFAULT_TAGS):
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            if candidates(f) and pattern.search(f) and _first_part(f):
                return f
    if not tag:  # no tag asked: the first model file
        return next((f for f in files if candidates(f) and _first_part(f)), None)
    return None


def split_parts(files: list[str], primary: str) -> list[str]:
    """Every part of a split model, from its first part (just the file when it is not split)."""
    s = split_info(primary)
    if s is None or s.count <= 1:
        return [primary]
    parts = [f for f in files if (o := split_info(f)) and o.count == s.count and o.prefix == s.prefix]
    return sorted(parts, key=lambda f: split_info(f).index)


def quant_tags(files: list[str], candidates=is_model_file) -> list[str]:
    """The quant tags of the model files, sorted."""
    return sorted({s.tag for f in files if candidates(f) and (s := split_info(f)) and s.tag})


def split_repo_tag(spec: str, option: str = "-hf") -> tuple[str, str]:
    """user/model[:quant] -> (user/model, quant or "")."""
    parts = spec.split(":")
    repo, tag = parts[0], parts[-1] if len(parts) > 1 else ""
    names = repo.split("/")
    if len(names) != 2 or not all(names) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise ValueError(f"{option} {spec!r}: expected <user>/<model>[:quant], e.g. "
                         f"ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF:Q8_0")
    return repo, tag


@dataclass(frozen=True)
class Plan:
    repo: str
    files: list[str]  # what to download, the one to load first; a folder repo: the whole folder
    folder: bool = False


def plan(spec: str, files: list[str], draft: bool = False, file: str | None = None, option: str = "-hf",
         cached: bool = False) -> Plan:
    """What to download for `spec` from a repository holding `files` (a pure function of the listing)."""
    repo, tag = split_repo_tag(spec, option)
    where = "in the Hugging Face cache" if cached else ""
    files = sorted(files)
    ggufs = [f for f in files if f.endswith(".gguf")]
    if file:
        if file not in files:
            raise FileNotFoundError(f"{option} {repo}: no file {file!r} {where or 'in the repository'} "
                                    f"(GGUF files: {', '.join(ggufs) or 'none'})")
        return Plan(repo, split_parts(files, file))
    if not ggufs and "config.json" in files:
        if tag:
            raise ValueError(f"{option} {spec}: the repository is an HF folder (safetensors), it has no quants: "
                             f"drop ':{tag}'")
        return Plan(repo, [f for f in files if any(Path(f).match(p) for p in FOLDER_PATTERNS)], folder=True)
    primary = None
    if draft and any(DRAFT_SIDECAR in f.rsplit("/", 1)[-1] for f in ggufs):
        sidecar = lambda f: f.endswith(".gguf") and DRAFT_SIDECAR in f.rsplit("/", 1)[-1]  # noqa: E731
        primary = find_best(files, tag, sidecar)
        tags = quant_tags(files, sidecar)
    if primary is None:
        primary = find_best(files, tag)
        tags = quant_tags(files)
    if primary is None:
        if not ggufs:
            raise FileNotFoundError(f"{option} {repo}: no GGUF files {where or 'in the repository'} "
                                    f"({len(files)} files: {', '.join(files[:5]) or 'none'}"
                                    f"{', ...' if len(files) > 5 else ''})")
        raise ValueError(f"{option} {spec}: no GGUF file for quant {tag!r} {where or 'in ' + repo} "
                         f"(available: {', '.join(tags) or 'none'}; pick one as {repo}:{tags[0] if tags else 'TAG'})")
    return Plan(repo, split_parts(files, primary))


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def cached_files(repo: str) -> list[str]:
    """The files of a repository's cached snapshot (the one refs/main names, else the newest), as paths in it."""
    from huggingface_hub import constants
    root = Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))
    snapshots = root / "snapshots"
    ref = root / "refs" / "main"
    folder = snapshots / ref.read_text().strip() if ref.is_file() else None
    if folder is None or not folder.is_dir():
        folders = sorted(snapshots.glob("*"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
        folder = folders[-1] if folders else None
    if folder is None:
        return []
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def repo_files(repo: str, token: str | None, option: str) -> tuple[list[str], bool]:
    """The repository's files, and whether they come from the cache (offline, or the hub unreachable)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    unreachable = None
    if not offline():
        try:
            return HfApi(token=token).list_repo_files(repo), False
        except GatedRepoError:
            raise PermissionError(f"{option} {repo}: a gated repository: accept its terms on the hub, then set "
                                  "HF_TOKEN (or pass -hft TOKEN)") from None
        except RepositoryNotFoundError:
            raise FileNotFoundError(f"{option} {repo}: no such model repository on {constants.ENDPOINT} (a private "
                                    "one needs HF_TOKEN or -hft TOKEN)") from None
        except RevisionNotFoundError:
            raise FileNotFoundError(f"{option} {repo}: the repository has no main branch") from None
        except HfHubHTTPError as e:
            status = e.response.status_code if getattr(e, "response", None) is not None else "?"
            raise OSError(f"{option} {repo}: the hub answered HTTP {status} listing the repository") from None
        except Exception as e:  # the network: a connection refused or timed out, a proxy, DNS (after retries)
            unreachable = f"{constants.ENDPOINT} is unreachable ({type(e).__name__})"
    files = cached_files(repo)
    if not files:
        why = unreachable or "HF_HUB_OFFLINE=1 keeps it from downloading"
        raise FileNotFoundError(f"{option} {repo}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                                f"{why}: run once online to download it")
    return files, True


def resolve(spec: str, draft: bool = False, file: str | None = None, token: str | None = None,
            option: str = "-hf") -> Path:
    """The local path of what `-hf spec` (`-hfd` with draft=True) names, downloaded into the HF cache unless it is
    there: a GGUF file (a split model's first part, its other parts beside it) or an HF folder."""
    repo, _ = split_repo_tag(spec, option)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ValueError(f"{option} needs huggingface_hub: pip install huggingface_hub") from None
    files, cached = repo_files(repo, token, option)
    return download(plan(spec, files, draft=draft, file=file, option=option, cached=cached), token, option,
                    local=cached)


def download(p: Plan, token: str | None, option: str, local: bool = False) -> Path:
    """Each file of the plan from the HF cache, downloaded first unless it is there (local: cache only)."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        if p.folder:
            return Path(snapshot_download(p.repo, allow_patterns=p.files, token=token, local_files_only=local))
        paths = [hf_hub_download(p.repo, f, token=token, local_files_only=local) for f in p.files]
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 keeps it from downloading" if offline() else f"{constants.ENDPOINT} is unreachable"
        raise FileNotFoundError(f"{option} {p.repo}: {', '.join(p.files[:3])} not in the Hugging Face cache and "
                                f"{why}: run once online to download it") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if getattr(e, "response", None) is not None else "?"
        raise OSError(f"{option} {p.repo}: the hub answered HTTP {status} downloading {p.files[0]}") from None
    return Path(paths[0])

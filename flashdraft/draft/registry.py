"""Drafter kinds by what a draft's files say they are (a folder's config.json `architectures`, a GGUF's
`general.architecture`), and how each loads into a `Drafter` (draft/interface.py). A new drafter is its own file
plus an entry here; the engine and the server stay as they are."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashdraft.draft.config import DRAFT_ARCHITECTURE
from flashdraft.draft.interface import Drafter, LoadOptions
from flashdraft.draft.load import load_dflash
from flashdraft.formats.gguf_draft import is_draft_architecture

if TYPE_CHECKING:
    from flashdraft.formats.gguf import GGUFFile


@dataclass(frozen=True)
class DraftSource:
    """A draft's files as read once to find its kind: a folder's config.json, or a GGUF file's metadata (its
    tensor data memory-mapped, for the loader)."""
    path: Path
    config: dict | None = None
    gguf: GGUFFile | None = None

    @property
    def architectures(self) -> list[str]:
        return [self.gguf.architecture] if self.gguf is not None else list(self.config.get("architectures") or [])


def _no_gguf(architecture: str) -> bool:
    return False


@dataclass(frozen=True)
class DrafterKind:
    name: str
    load: Callable[[DraftSource, Any, LoadOptions], Drafter]  # (source, target, options), checked against the target
    hf_architectures: tuple[str, ...] = ()  # a folder's config.json "architectures" this kind reads
    gguf_architecture: Callable[[str], bool] = field(default=_no_gguf)  # a GGUF general.architecture it reads


DFLASH = DrafterKind(name="dflash", load=load_dflash, hf_architectures=(DRAFT_ARCHITECTURE,),
                     gguf_architecture=is_draft_architecture)

KINDS: list[DrafterKind] = [DFLASH]


def register(kind: DrafterKind) -> None:
    KINDS.append(kind)


def read_source(path: Path) -> DraftSource:
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"{path}: no config.json, not a draft folder")
        return DraftSource(path, config=json.loads(config.read_text()))
    from flashdraft.formats.gguf import read_gguf
    return DraftSource(path, gguf=read_gguf(path))


def kind_for(source: DraftSource) -> DrafterKind:
    for kind in KINDS:
        if source.gguf is not None and kind.gguf_architecture(source.gguf.architecture):
            return kind
        if source.config is not None and set(kind.hf_architectures) & set(source.architectures):
            return kind
    raise ValueError(f"{source.path}: architecture {', '.join(source.architectures) or 'unnamed'} is no draft that "
                     f"flashdraft reads (drafters: {', '.join(k.name for k in KINDS)})")


def load(path: Path, target, options: LoadOptions) -> Drafter:
    """The drafter of a draft folder or file, for `target`."""
    source = read_source(path)
    return kind_for(source).load(source, target, options)

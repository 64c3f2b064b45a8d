"""Drafter kinds by what a draft's files say they are (a folder's config.json `architectures`, a GGUF's
`general.architecture`) or by the `--spec-type` name that chooses them (llama.cpp's names), and how each loads
into a `Drafter` (draft/interface.py): from its files, or, for a kind that needs none (the n-gram lookup), from
its settings alone. A new drafter is its own file plus an entry here; the engine and the server stay as they
are."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashdraft.draft.config import DRAFT2_ARCHITECTURE, DRAFT_ARCHITECTURE
from flashdraft.draft.interface import Drafter, LoadOptions
from flashdraft.draft import gemma4_assistant, mtp, ngram
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


def _no_target(target) -> bool:
    return False


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # (source, target, options), checked against the target; None: a kind without files
    load: Callable[[DraftSource, Any, LoadOptions], Drafter] | None = None
    hf_architectures: tuple[str, ...] = ()  # a folder's config.json "architectures" this kind reads
    gguf_architecture: Callable[[str], bool] = field(default=_no_gguf)  # a GGUF general.architecture it reads
    spec_types: tuple[str, ...] = ()  # the --spec-type names that choose this kind
    # (spec type, target, options) -> the drafter of a kind that needs no draft file (None: it loads from one)
    create: Callable[[str, Any, LoadOptions], Drafter] | None = None
    # the setting that --spec-draft-n-max gives the kind (None: it has its own flags, or the engine reads it)
    n_max_param: str | None = None
    lookup: bool = False  # proposes from the request's own tokens (no model): may come first in a chain
    # a kind that loads files: whether it drafts for `target`, named where a kind without files that takes the same
    # --spec-type does not fit the target (mtp on a Gemma 4 target: its assistant comes with -md)
    drafts_for: Callable[[Any], bool] = field(default=_no_target)
    what: str = ""  # in words, for messages ("a DFlash draft"; default: "a NAME draft")

    @property
    def words(self) -> str:
        return self.what or f"a {self.name} draft"


DFLASH = DrafterKind(name="dflash", what="a DFlash draft", load=load_dflash,
                     hf_architectures=(DRAFT_ARCHITECTURE, DRAFT2_ARCHITECTURE),
                     gguf_architecture=is_draft_architecture, spec_types=("dflash", "draft-dflash"))
NGRAM = DrafterKind(name="ngram", what="an n-gram lookup", spec_types=("ngram-mod", "ngram-simple"),
                    create=ngram.create, lookup=True)
MTP = DrafterKind(name="mtp", what="the target checkpoint's MTP block", spec_types=("mtp", "draft-mtp"),
                  create=mtp.create, n_max_param="draft_n_max")
# a separate MTP assistant (-md), which llama.cpp also takes as --spec-type draft-mtp
GEMMA4_ASSISTANT = DrafterKind(name="gemma4-assistant", what="a Gemma 4 assistant", load=gemma4_assistant.load,
                               hf_architectures=gemma4_assistant.HF_ARCHITECTURES,
                               gguf_architecture=gemma4_assistant.is_assistant_gguf, spec_types=("mtp", "draft-mtp"),
                               n_max_param="draft_n_max", drafts_for=gemma4_assistant.drafts_for)

KINDS: list[DrafterKind] = [DFLASH, NGRAM, MTP, GEMMA4_ASSISTANT]

# llama.cpp's other --spec-type names, and why flashdraft does not take them
NOT_BUILT = {
    "draft-simple": "a separate small draft model; flashdraft's model drafters are DFlash drafts (-md)",
    "draft-eagle3": "EAGLE-3 drafts are not read yet",
    "draft-dspark": "DSpark drafts are not read yet",
    "ngram-map-k": "its n-gram map with hit counts is not built; ngram-mod and ngram-simple look up the prompt and "
                   "output",
    "ngram-map-k4v": "its n-gram map with hit counts is not built; ngram-mod and ngram-simple look up the prompt and "
                     "output",
    "ngram-cache": "lookup cache files are not read; ngram-mod and ngram-simple look up the prompt and output",
}


def register(kind: DrafterKind) -> None:
    KINDS.append(kind)


def spec_types() -> list[str]:
    return ["none", *dict.fromkeys(name for kind in KINDS for name in kind.spec_types)]


def kind_named(spec_type: str, with_file: bool = False) -> DrafterKind | None:
    """The kind that `--spec-type spec_type` chooses (None for "none"); `with_file`: a draft file comes with it,
    and a kind that loads one is chosen where one takes the name (draft-mtp with -md: a Gemma 4 assistant, as
    llama.cpp's), which the file must then be (source_kind). ValueError, in one line, for a name that no kind
    takes."""
    if spec_type == "none":
        return None
    if "," in spec_type:
        chain_kinds(spec_type)
        return kind_named(spec_type.split(",")[-1].strip(), with_file)
    named = [kind for kind in KINDS if spec_type in kind.spec_types]
    if named:
        return next((kind for kind in named if (kind.load is not None) == with_file), named[0])
    why = f"not supported: {NOT_BUILT[spec_type]}" if spec_type in NOT_BUILT else "unknown type"
    raise ValueError(f"--spec-type {spec_type}: {why} (types: {', '.join(spec_types())})")


def shared_settings(spec_type: str | None, draft_n_max: int | None, draft: DrafterKind | None = None) -> dict:
    """The settings the drafter flags shared by every kind give the drafter: the draft file's kind (`draft`, as
    source_kind found it) where one comes, else `spec_type`'s (a chain's: its model drafter's). --spec-draft-n-max
    as the proposals of an MTP block or a Gemma 4 assistant; {} where the kind has its own flags (n-gram) or the
    engine reads it (a DFlash draft's verify block)."""
    kind = draft or (kind_named(spec_type) if spec_type is not None else None)
    return {kind.n_max_param: draft_n_max} if kind and kind.n_max_param and draft_n_max is not None else {}


def spec_type_names(name: str) -> tuple[str, ...]:
    """A drafter's --spec-type names: its own, then its llama.cpp spelling (dflash and draft-dflash, mtp and
    draft-mtp), not its kind's other types (an ngram-mod drafter is no ngram-simple one)."""
    kind = next((k for k in KINDS if name == k.name), None) or next((k for k in KINDS if name in k.spec_types), None)
    same = [n for n in (kind.spec_types if kind else ()) if n.removeprefix("draft-") == name.removeprefix("draft-")]
    if kind is not None and not same:  # a kind named apart from its types (gemma4-assistant: mtp, draft-mtp)
        same = list(kind.spec_types)
    return tuple(dict.fromkeys([name, *same]))


def chain_kinds(spec_type: str) -> list[DrafterKind]:
    """The kinds of a chain, `--spec-type ngram-mod,draft-dflash` (llama.cpp's): lookups first, then one model
    drafter. ValueError, in one line, for a chain in another order or with an unknown type."""
    names = [n.strip() for n in spec_type.split(",")]
    kinds = [kind_named(n) for n in names]
    if "none" in names or len(set(names)) < len(names):
        raise ValueError(f"--spec-type {spec_type}: a chain names each drafter once, and not none")
    if any(not k.lookup for k in kinds[:-1]) or kinds[-1].lookup:
        raise ValueError(f"--spec-type {spec_type}: a chain is n-gram lookups first, then one model drafter last "
                         "(e.g. ngram-mod,draft-dflash)")
    return kinds


def chain(spec_type: str, model: Drafter, target, options: LoadOptions) -> Drafter:
    """The chain `spec_type` names, its model drafter given (loaded from a draft file or created)."""
    from flashdraft.draft.chain import ChainDrafter
    names = [n.strip() for n in spec_type.split(",")]
    lookups = [k.create(n, target, options) for k, n in zip(chain_kinds(spec_type)[:-1], names)]
    return ChainDrafter(lookups, model)


def create(spec_type: str, target, options: LoadOptions) -> Drafter:
    """The drafter of a kind that needs no draft file, chosen by its --spec-type name. Where it does not fit the
    target and a kind with files that takes the name does, the error says that this one comes with -md."""
    kind = kind_named(spec_type)
    if kind is None or kind.create is None:
        raise ValueError(f"--spec-type {spec_type} needs a draft model (--spec-draft-model)")
    try:
        return kind.create(spec_type, target, options)
    except ValueError as e:
        beside = next((k for k in KINDS if k.load is not None and spec_type in k.spec_types and k.drafts_for(target)),
                      None)
        if beside is None:
            raise
        raise ValueError(f"{e}; {beside.words} comes with -md (--spec-type {spec_type} -md FILE)") from None


def read_source(path: Path) -> DraftSource:
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"{path}: no config.json, not a draft folder")
        return DraftSource(path, config=json.loads(config.read_text()))
    from flashdraft.formats.gguf import read_gguf
    return DraftSource(path, gguf=read_gguf(path))


def kind_for(source: DraftSource) -> DrafterKind:
    """The kind that reads a draft's files, from its config.json or GGUF header (no weights read)."""
    for kind in KINDS:
        if source.gguf is not None and kind.gguf_architecture(source.gguf.architecture):
            return kind
        if source.config is not None and set(kind.hf_architectures) & set(source.architectures):
            return kind
    raise ValueError(f"{source.path}: architecture {', '.join(source.architectures) or 'unnamed'} is no draft that "
                     f"flashdraft reads (drafters: {', '.join(k.name for k in KINDS if k.load)})")


def source_kind(source: DraftSource, spec_type: str | None = None) -> DrafterKind:
    """The kind of a draft's files, which must be the one that `--spec-type spec_type` (a chain's last type) takes
    with a draft file: draft-mtp and mtp a Gemma 4 assistant, dflash a DFlash draft. ValueError, in one line naming
    both, for another (the file's own kind is not run in its place)."""
    kind = kind_for(source)
    named = kind_named(spec_type, with_file=True) if spec_type is not None else None
    if named is not None and named.load is not None and named is not kind:
        raise ValueError(f"--spec-type {spec_type} -md takes {named.words}; {source.path} is {kind.words}")
    return kind


def load(path: Path, target, options: LoadOptions, spec_type: str | None = None) -> Drafter:
    """The drafter of a draft folder or file, for `target`; `spec_type`: the --spec-type that came with it, which
    its kind must be (source_kind)."""
    source = read_source(path)
    return source_kind(source, spec_type).load(source, target, options)

"""Drafters: what proposes the tokens a target verifies. `interface.py` says what the engine calls on one
(`Drafter`), `registry.py` which files load as which kind. DFlash (and DFlash2) is the first kind: `model.py`
(the network, its per-slot rings and the Drafter methods), `config.py`, `load.py`; then the n-gram lookup
(`ngram.py`), the target's own MTP block (`mtp.py`), Gemma 4's assistants (`gemma4_assistant.py`) and chains of
lookups before a model drafter (`chain.py`). A new drafter is a file of its own plus a registry entry. The package keeps the shape of models/ (`interface.py`,
`registry.py`, a file per family) rather than a second package beside it: DFlash's files are already here, and
one place answers "where does a drafter go". (`flashdraft/drafts/` holds shipped draft weights, no code.)"""
from flashdraft.draft.config import DraftConfig, build_target_layer_ids
from flashdraft.draft.load import check_compatible, dequantize_int8, load_draft_folder
from flashdraft.draft.model import DFlashDraft

__all__ = ["DFlashDraft", "DraftConfig", "build_target_layer_ids", "check_compatible", "dequantize_int8",
           "load_draft_folder"]

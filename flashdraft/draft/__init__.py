from flashdraft.draft.model import (
    DFlashDraft,
    DraftConfig,
    build_target_layer_ids,
    check_compatible,
    load_draft_folder,
)

__all__ = ["DFlashDraft", "DraftConfig", "build_target_layer_ids", "check_compatible", "load_draft_folder"]

from flashdraft.draft.config import DraftConfig, build_target_layer_ids
from flashdraft.draft.load import check_compatible, dequantize_int8, load_draft_folder
from flashdraft.draft.model import DFlashDraft

__all__ = ["DFlashDraft", "DraftConfig", "build_target_layer_ids", "check_compatible", "dequantize_int8",
           "load_draft_folder"]

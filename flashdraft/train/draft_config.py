"""A fresh draft's configuration from the target: widths mirror the target, depth by the target's size."""
from __future__ import annotations

from flashdraft.draft import DraftConfig, build_target_layer_ids


DFLASH2_DEFAULTS = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


def target_parameters(cfg) -> int:
    """Decoder parameters of the target, embeddings excluded."""
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attention + 3 * cfg.hidden_size * cfg.intermediate_size)


def default_draft_layers(cfg) -> int:
    """1 for toy targets, 2 below 1B decoder parameters (SmolLM2-135M, Qwen2.5-0.5B), up to 5 from 7B."""
    params = target_parameters(cfg)
    for limit, layers in ((50e6, 1), (1e9, 2), (3e9, 3), (7e9, 4)):
        if params < limit:
            return layers
    return 5


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The first embedding row no token uses (as for Qwen3), else the highest special token that the chat
    template never writes and that is neither BOS nor an end-of-turn token."""
    if tokenizer is None:
        return vocab_size - 1
    if tokenizer.vocab_size < vocab_size:
        return tokenizer.vocab_size
    reserved = set(tokenizer.eos_ids) | ({tokenizer.bos_id} if tokenizer.bos_id is not None else set())
    template = tokenizer.chat_template or ""
    decoder = getattr(tokenizer.backend, "get_added_tokens_decoder", lambda: {})()
    for token_id in sorted(decoder, reverse=True):
        if token_id not in reserved and token_id < vocab_size and decoder[token_id].content not in template:
            return token_id
    return vocab_size - 1


def parse_layer_ids(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--target-layer-ids must be comma-separated integers, got {text!r}") from None


def build_draft_config(target_cfg, tokenizer, draft_layers: int | None = None, block_size: int = 16,
                       target_layer_ids: list[int] | None = None, num_feature_layers: int | None = None,
                       mask_token_id: int | None = None, intermediate_size: int | None = None,
                       dflash2: dict | None = None) -> DraftConfig:
    """`dflash2`: a DFlash2 draft with these of its fields (conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k; speculators' defaults 2, 16, 256, 16 for those left out)."""
    t = target_cfg
    layers = draft_layers or default_draft_layers(t)
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(t.num_layers, num_feature_layers or layers)
    bad = [i for i in target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} are outside the target's {t.num_layers} layers")
    mask = default_mask_token(tokenizer, t.vocab_size) if mask_token_id is None else mask_token_id
    hf = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=t.hidden_size,
        intermediate_size=intermediate_size or t.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings, vocab_size=t.vocab_size,
        num_target_layers=t.num_layers, block_size=block_size,
        dflash_config=dict(mask_token_id=mask, target_layer_ids=list(target_layer_ids)),
    )
    if dflash2 is not None:
        hf["architectures"] = ["DFlash2DraftModel"]
        hf["dflash_config"].update(DFLASH2_DEFAULTS, **{k: v for k, v in dflash2.items() if v is not None})
    return DraftConfig.from_hf(hf)

"""The llama family: llama, mistral, qwen2 and qwen3 (one block; the flags below are what differs).

Module names mirror HF's so that an HF state dict loads as is. Built for one rank of a tensor-parallel
group, a model holds that rank's share of the weights (models/tp.py)."""
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from flashdraft.layers.attention import AttentionSpec, attend, attend_cache, position_mask
from flashdraft.layers.kv_cache import KVCache, KVSlots
from flashdraft.layers.linear import Linear, fuse_linears_on_load
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope, rope_table
from flashdraft.models.decoder import DecoderLM
from flashdraft.models.tp import local_config, padded_vocab, sum_over_ranks

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class LlamaConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @staticmethod
    def from_hf(cfg: dict) -> "LlamaConfig":
        arch = cfg.get("model_type", "")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        if arch in ("qwen2", "qwen3") and sliding is not None:
            # HF Qwen2/3 apply the window only above max_window_layers; the released models leave it off.
            sliding = None
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return LlamaConfig(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        fuse_linears_on_load(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"], [q_size, kv_size, kv_size])
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.spec = AttentionSpec(scale=cfg.head_dim ** -0.5, window=cfg.sliding_window)

    def forward(self, x: Tensor, cache: KVSlots | None, positions: Tensor, cos_sin: Tensor,
                mask: Tensor | None, attn_len: int) -> Tensor:
        # x: [B, T, H]; cos_sin [B, T, 1, 2, D]; mask: [B, T, attn_len] bool, or None (causal over the chunk)
        B, T, H, KV, D = *x.shape[:2], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * KV, D)
        if self.qk_norm:
            q, k = apply_rope(self.q_norm(qkv[:, :, :H]), cos_sin), apply_rope(self.k_norm(qkv[:, :, H:H + KV]), cos_sin)
        else:  # one rotation for q and k together
            qk = apply_rope(qkv[:, :, :H + KV], cos_sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
        v = qkv[:, :, H + KV:]
        if cache is not None:
            cache.write(positions, k, v)
        if mask is None or cache is None:  # a fresh prefill from position 0 (or training): the chunk's own keys
            if cache is not None:
                k, v = cache.as_read(k, v)
            return self.o_proj(attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, self.spec))
        return self.o_proj(attend_cache(q, cache, attn_len, mask, self.spec, positions))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, sharded: bool = False):
        super().__init__()
        self.sharded = sharded  # cfg is one rank's share: attention and MLP outputs are partial sums
        self.self_attn = LlamaAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cache: KVSlots | None, positions: Tensor, cos_sin: Tensor,
                mask: Tensor | None, attn_len: int) -> Tensor:
        x = x + self.summed(self.self_attn(self.input_layernorm(x), cache, positions, cos_sin, mask, attn_len))
        return x + self.summed(self.mlp(self.post_attention_layernorm(x)))

    def summed(self, x: Tensor) -> Tensor:
        return sum_over_ranks(x) if self.sharded else x


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, world_size: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        local = local_config(cfg, world_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(local, world_size > 1) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(DecoderLM):
    def __init__(self, cfg: LlamaConfig, rank: int = 0, world_size: int = 1):
        """cfg: the whole model's; rank, world_size: this rank's share under tensor parallelism."""
        super().__init__(cfg, rank, world_size)
        self.model = LlamaModel(cfg, world_size)
        self.lm_head = Linear(cfg.hidden_size, padded_vocab(cfg.vocab_size, world_size) // world_size, bias=False)
        if cfg.tie_word_embeddings and world_size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = torch.empty(0, 2, cfg.head_dim)

    def prepare(self, max_len: int) -> None:
        if self.rope.shape[0] < max_len or self.rope.device != self.device:
            self.rope = rope_table(self.cfg, max_len).to(self.device, self.dtype)  # apply_rope rounds to it

    def layer_cache(self, i: int, n_slots: int, max_len: int, codecs) -> KVCache:
        cfg = self.cfg
        return KVCache(n_slots, cfg.num_kv_heads // self.world_size, max_len, cfg.head_dim, self.dtype, self.device,
                       codecs)

    def layer_inputs(self, positions: Tensor, attn_len: int, fresh: bool) -> list[tuple]:
        self.prepare(int(positions.shape[1]) if fresh else attn_len)
        cos_sin = self.rope[positions][:, :, None]  # [B, T, 1, 2, D]: broadcast over heads
        window = self.cfg.sliding_window
        mask = None if fresh and window is None else \
            position_mask(positions, torch.arange(attn_len, device=positions.device), True, window)
        return [(cos_sin, mask, attn_len)] * len(self.model.layers)

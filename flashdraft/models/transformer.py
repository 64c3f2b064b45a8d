"""Decoder-only target model (llama, qwen2, qwen3, mistral) with a static KV cache.

Module names mirror HF's so that an HF state dict loads as is. The KV cache is indexed by position:
a forward writes K/V at the rows of its positions and attends to rows at positions <= its own, so rows
beyond the committed length are stale and harmless, and rolling back is just resetting a length.
Built for one rank of a tensor-parallel group, it holds that rank's share of the weights (models/tp.py).
"""
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flashdraft.models.attention import SMALL_QUERY, few_query_attention
from flashdraft.models.config import ModelConfig
from flashdraft.models.layers import (Linear, RMSNorm, SwiGLU, apply_rope, compile_layer_forward, fuse_linears_on_load,
                                      position_mask, rope_table)
from flashdraft.models.tp import gather_vocab, local_config, padded_vocab, sum_over_ranks


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.split_sizes = {"qkv_proj": [q_size, kv_size, kv_size]}
        fuse_linears_on_load(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                rows: Tensor, mask: Tensor | None, attn_len: int) -> Tensor:
        # x: [T, H]; k_cache/v_cache: [kv_heads, max_len, head_dim]; mask: [T, attn_len] bool or None
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(T, H + 2 * KV, D)
        if self.qk_norm:
            q, k = apply_rope(self.q_norm(qkv[:, :H]), cos_sin), apply_rope(self.k_norm(qkv[:, H:H + KV]), cos_sin)
        else:  # one rotation for q and k together
            qk = apply_rope(qkv[:, :H + KV], cos_sin)
            q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, H + KV:]
        k_cache.index_copy_(1, rows, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, rows, v.transpose(0, 1).to(v_cache.dtype))
        if mask is None:  # a fresh prefill from position 0: plain causal attention (flash kernels)
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys, values = k_cache[:, :attn_len].to(q.dtype), v_cache[:, :attn_len].to(q.dtype)
        if mask is not None and T <= SMALL_QUERY:
            return self.o_proj(few_query_attention(q, keys, values, mask))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=H != KV)
        return self.o_proj(out.transpose(0, 1).reshape(T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sharded: bool = False):
        super().__init__()
        self.sharded = sharded  # cfg is one rank's share: attention and MLP outputs are partial sums
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                rows: Tensor, mask: Tensor | None, attn_len: int) -> Tensor:
        x = x + self.summed(self.self_attn(self.input_layernorm(x), cos_sin, k_cache, v_cache, rows, mask, attn_len))
        return x + self.summed(self.mlp(self.post_attention_layernorm(x)))

    def summed(self, x: Tensor) -> Tensor:
        return sum_over_ranks(x) if self.sharded else x


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, world_size: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        local = local_config(cfg, world_size)
        self.layers = nn.ModuleList(DecoderLayer(local, world_size > 1) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, rank: int = 0, world_size: int = 1):
        """cfg: the whole model's; rank, world_size: this rank's share under tensor parallelism."""
        super().__init__()
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.model = Backbone(cfg, world_size)
        self.lm_head = Linear(cfg.hidden_size, padded_vocab(cfg.vocab_size, world_size) // world_size, bias=False)
        if cfg.tie_word_embeddings and world_size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.rope: Tensor | None = None
        self.compiled_layer = None
        self.compiled_widths: set[int] = set()

    def compile_layers(self, widths: tuple[int, ...] = (1, 16)) -> None:
        """Steps of `widths` tokens over the cache (decode and verify: the shapes CUDA graphs capture) run each
        layer through torch.compile, which fuses the norms, RoPE, SwiGLU and residual adds into a few kernels.
        Parameters are graph inputs, so one compiled graph per (width, attended length) serves every layer;
        other shapes (prefill chunks) stay eager rather than compile once per prompt length."""
        self.compiled_layer = compile_layer_forward(DecoderLayer.forward)
        self.compiled_widths = set(widths)

    @property
    def max_len(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[3]

    def setup_cache(self, max_len: int, n_slots: int = 1, dtype: torch.dtype | None = None) -> None:
        cfg, weight = self.cfg, self.model.embed_tokens.weight
        shape = (n_slots, cfg.num_layers, cfg.num_kv_heads // self.world_size, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=weight.device, dtype=dtype or weight.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.rope = rope_table(cfg, max_len).to(weight.device)

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed_tokens(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.world_size > 1:
            return gather_vocab(self.lm_head(hidden), self.cfg.vocab_size)
        return self.lm_head(hidden)

    def attention_mask(self, positions: Tensor, attn_len: int, fresh: bool = False) -> Tensor | None:
        if fresh and self.cfg.sliding_window is None:
            return None
        return position_mask(positions, torch.arange(attn_len, device=positions.device), True, self.cfg.sliding_window)

    def forward(self, input_ids: Tensor, positions: Tensor, slot: int = 0, capture: list[int] | None = None,
                attn_len: int | None = None, all_logits: bool = True, fresh: bool = False) -> tuple[Tensor, Tensor | None]:
        """input_ids, positions: [T]. Returns logits [T or 1, V] and the captured layer outputs [T, L*H]."""
        if attn_len is None:
            attn_len = int(positions.max()) + 1
        if attn_len > self.max_len:
            raise ValueError(f"position {attn_len - 1} is past the context size {self.max_len}")
        x = self.embed(input_ids)
        cos_sin = self.rope[positions, None]  # [T, 1, 2, D]: broadcast over heads
        # fresh: the caller promises positions == arange(attn_len), e.g. the first prefill chunk
        mask = self.attention_mask(positions, attn_len, fresh)
        captured = []
        want = set(capture or ())
        compiled = self.compiled_layer if mask is not None and input_ids.shape[0] in self.compiled_widths else None
        for i, layer in enumerate(self.model.layers):
            args = (x, cos_sin, self.k_cache[slot, i], self.v_cache[slot, i], positions, mask, attn_len)
            x = compiled(layer, *args) if compiled is not None else layer(*args)
            if i in want:
                captured.append(x)
        if capture:
            by_layer = dict(zip(sorted(want), captured))
            features = torch.cat([by_layer[i] for i in capture], dim=-1)
        else:
            features = None
        x = self.model.norm(x if all_logits else x[-1:])
        return self.logits(x), features

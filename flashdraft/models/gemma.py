"""The Gemma family: Gemma 3 and Gemma 4 dense (one block; the config says what differs).

Both interleave sliding-window and full layers (5:1), normalise around attention and MLP (four norms per block),
use QK-norm, GELU-tanh and a scaled embedding. Gemma 3 stores its norm weights as w of (1 + w) and scales
attention by query_pre_attn_scalar^-0.5. Gemma 4 uses plain w, attention scale 1, full layers of their own head
size and KV-head count whose V is the K projection (`attention_k_eq_v`) normalised without weight,
proportional RoPE on full layers, a per-layer output scalar and a softcapped LM head.

Sliding layers keep only their window (layers.kv_cache.window_cache). Module names mirror HF's."""
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.layers.attention import SMALL_QUERY, AttentionSpec, attend, attend_cache, position_mask
from flashdraft.layers.kv_cache import KVCache, window_cache, window_positions
from flashdraft.layers.linear import Linear, fuse_linears_on_load
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope, rope_table
from flashdraft.models.decoder import DecoderLM
from flashdraft.quant.dequant import tensor_values

MODEL_TYPES = ("gemma3", "gemma3_text", "gemma4", "gemma4_text")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class RopeSpec:  # layers.rope.RopeConfig for one layer type
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int


@dataclass
class GemmaConfig:
    arch: str  # "gemma3" or "gemma4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: list[str]
    head_dims: list[int]  # per layer
    kv_heads: list[int]  # per layer
    k_eq_v: list[bool]  # per layer: V is the K projection (no v_proj)
    rope: dict[str, RopeSpec]  # per layer type
    sliding_window: int
    rms_norm_eps: float = 1e-6
    attn_scale: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    norm_offset: float = 0.0  # 1.0: Gemma 3's (1 + w)
    v_norm: bool = False
    layer_scalar: bool = False
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5

    @staticmethod
    def from_hf(cfg: dict) -> "GemmaConfig":
        cfg = {**cfg, **cfg.get("text_config", {})}  # the text part of Gemma*ForConditionalGeneration
        arch = "gemma4" if cfg.get("model_type", "").startswith("gemma4") else "gemma3"
        unsupported = {"hidden_size_per_layer_input": "per-layer embeddings (Gemma 4 E2B/E4B)",
                       "num_kv_shared_layers": "shared KV layers (Gemma 4 E2B/E4B)",
                       "enable_moe_block": "the mixture of experts (Gemma 4 26B-A4B)",
                       "use_double_wide_mlp": "double-wide MLPs (Gemma 4 E2B)"}
        for key, what in unsupported.items():
            if arch == "gemma4" and cfg.get(key):
                raise ValueError(f"{what} is not supported yet ({key} = {cfg[key]})")
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError("bidirectional attention (use_bidirectional_attention = 'all') is not supported")
        n = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv = cfg.get("num_key_value_heads") or heads
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)])
        if arch == "gemma4":
            types[-1] = FULL  # as transformers forces it
        head_dims, kv_heads = [head_dim] * n, [kv] * n
        k_eq_v = [arch == "gemma4" and bool(cfg.get("attention_k_eq_v")) and t == FULL for t in types]
        if arch == "gemma4":
            global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", True) else None
            for i, t in enumerate(types):
                if t == FULL:
                    head_dims[i] = cfg.get("global_head_dim") or 512
                    kv_heads[i] = global_kv or kv
            for i, override in (cfg.get("per_layer_config") or {}).items():  # transformers >= 5.24 writes these
                head_dims[int(i)] = override.get("head_dim", head_dims[int(i)])
                kv_heads[int(i)] = override.get("num_key_value_heads", kv_heads[int(i)])
        eos = cfg.get("eos_token_id")
        max_pos = cfg.get("max_position_embeddings", 131072)
        rope = {}
        for t in (SLIDING, FULL):
            params = _rope_parameters(cfg, t, arch)
            theta = float(params.pop("rope_theta"))
            kind = params.get("rope_type", "default")
            dim = next((d for d, tt in zip(head_dims, types) if tt == t), head_dim)
            rope[t] = RopeSpec(dim, theta, None if kind == "default" else params, max_pos)
        query_scalar = cfg.get("query_pre_attn_scalar") or head_dim
        return GemmaConfig(
            arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads, layer_types=types,
            head_dims=head_dims, kv_heads=kv_heads, k_eq_v=k_eq_v, rope=rope,
            sliding_window=int(cfg.get("sliding_window") or 4096), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            attn_scale=1.0 if arch == "gemma4" else float(query_scalar) ** -0.5,
            attn_softcap=cfg.get("attn_logit_softcapping") if arch == "gemma3" else None,
            final_softcap=cfg.get("final_logit_softcapping"), norm_offset=1.0 if arch == "gemma3" else 0.0,
            v_norm=arch == "gemma4", layer_scalar=arch == "gemma4", max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos))


def _rope_parameters(cfg: dict, layer_type: str, arch: str) -> dict:
    """One layer type's RoPE: transformers 5's per-type rope_parameters, or the older keys (rope_theta and
    rope_scaling for full layers, rope_local_base_freq for sliding ones)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:
        return dict(params[layer_type])
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    default = {"rope_type": "proportional", "partial_rotary_factor": 0.25} if arch == "gemma4" else {}
    scaling = dict(cfg.get("rope_scaling") or default)
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": cfg.get("rope_theta", 1e6)}


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, i: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads[i], cfg.head_dims[i]
        self.k_eq_v = cfg.k_eq_v[i]
        q_size, kv_size = cfg.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts, sizes = (["q_proj", "k_proj"], [q_size, kv_size]) if self.k_eq_v else \
            (["q_proj", "k_proj", "v_proj"], [q_size, kv_size, kv_size])
        self.qkv_proj = Linear(cfg.hidden_size, sum(sizes), bias=False)
        fuse_linears_on_load(self, "qkv_proj", parts, sizes)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, fp32_weight=True)
        self.q_norm = RMSNorm(self.head_dim, **norm)
        self.k_norm = RMSNorm(self.head_dim, **norm)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, weight=False) if cfg.v_norm else None
        sliding = cfg.layer_types[i] == SLIDING
        self.spec = AttentionSpec(scale=cfg.attn_scale, softcap=cfg.attn_softcap,
                                  window=cfg.sliding_window if sliding else None)

    def forward(self, x: Tensor, cache, positions: Tensor, cos_sin: Tensor, mask: Tensor | None, attn_len: int,
                keys_from: str) -> Tensor:
        """keys_from: "chunk" (a fresh prefill: this chunk's own K/V), "cache" (the step's K/V written first), or
        "cache+chunk" (a long chunk over a window ring: the ring as it was, then the chunk)."""
        B, T, H, KV, D = *x.shape[:2], self.num_heads, self.num_kv_heads, self.head_dim
        proj = self.qkv_proj(x).view(B, T, -1, D)
        q = apply_rope(self.q_norm(proj[:, :, :H]), cos_sin)
        raw_k = proj[:, :, H:H + KV]
        k = apply_rope(self.k_norm(raw_k), cos_sin)
        v = raw_k if self.k_eq_v else proj[:, :, H + KV:]
        if self.v_norm is not None:
            v = self.v_norm(v)
        if cache is not None and keys_from != "cache":  # the chunk's own K/V as the cache gives them back
            k_read, v_read = cache.as_read(k, v)
        else:
            k_read, v_read = k, v
        if keys_from == "cache+chunk":
            old_k, old_v = cache.read(attn_len, q.dtype)
            keys, values = torch.cat([old_k, k_read.transpose(1, 2)], 2), torch.cat([old_v, v_read.transpose(1, 2)], 2)
        if cache is not None:
            cache.write(positions, k, v)
        if keys_from == "chunk":
            keys, values = k_read.transpose(1, 2), v_read.transpose(1, 2)
        elif keys_from == "cache":  # a full layer's rows are positions; a sliding layer's ring's are not
            return self.o_proj(attend_cache(q, cache, attn_len, mask, self.spec,
                                            None if self.spec.window else positions))
        return self.o_proj(attend(q, keys, values, mask, self.spec))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, i: int):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, i)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act="gelu_tanh")
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, fp32_weight=True)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalar else None

    def forward(self, x: Tensor, cache, positions: Tensor, cos_sin: Tensor, mask: Tensor | None, attn_len: int,
                keys_from: str) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), cache, positions, cos_sin, mask, attn_len, keys_from)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x if self.layer_scalar is None else x * self.layer_scalar.to(x.dtype)


class GemmaModel(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, fp32_weight=True)
        self.norm = RMSNorm(cfg.hidden_size, **norm)


class Gemma(DecoderLM):
    # A step of up to this many tokens reads a sliding layer's ring as it is; a longer prefill chunk reads the
    # ring from before the chunk and then its own keys.
    WINDOW_STEP = SMALL_QUERY

    @property
    def window_rows(self) -> int:
        """Rows of a sliding layer's ring."""
        return self.cfg.sliding_window + self.WINDOW_STEP

    def __init__(self, cfg: GemmaConfig, rank: int = 0, world_size: int = 1):
        if world_size > 1:
            raise ValueError("tensor parallelism is not supported for Gemma models yet")
        super().__init__(cfg, rank, world_size)
        self.model = GemmaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ropes: dict[str, Tensor] = {}

    def prepare(self, max_len: int) -> None:
        for kind, spec in self.cfg.rope.items():
            table = self.ropes.get(kind)
            if table is None or table.shape[0] < max_len or table.device != self.device:
                self.ropes[kind] = rope_table(spec, max_len).to(self.device, self.dtype)  # apply_rope rounds to it

    def layer_cache(self, i: int, n_slots: int, max_len: int, codecs) -> KVCache:
        cfg = self.cfg
        kv, dim = cfg.kv_heads[i], cfg.head_dims[i]
        if cfg.layer_types[i] == SLIDING:
            return window_cache(n_slots, kv, cfg.sliding_window, self.WINDOW_STEP, dim, self.dtype, self.device, codecs)
        return KVCache(n_slots, kv, max_len, dim, self.dtype, self.device, codecs)

    def embed(self, ids: Tensor) -> Tensor:
        x = self.model.embed_tokens(ids)
        return x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)  # the scale rounded to the model's dtype

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits.float() / cap).to(logits.dtype) * cap

    def layer_inputs(self, positions: Tensor, attn_len: int, fresh: bool) -> list[tuple]:
        cfg = self.cfg
        T = positions.shape[1]
        self.prepare(T if fresh else attn_len)
        cos_sin = {kind: table[positions][:, :, None] for kind, table in self.ropes.items()}
        window = cfg.sliding_window
        if fresh:
            full = (None, "chunk")
            sliding = (position_mask(positions, positions, True, window), "chunk")
        else:
            full = (position_mask(positions, torch.arange(attn_len, device=positions.device)), "cache")
            rows = self.window_rows
            if T <= self.WINDOW_STEP:
                key_pos, keys_from = window_positions(positions.max(dim=1).values, rows), "cache"
            else:
                key_pos = torch.cat([window_positions(positions[:, 0] - 1, rows), positions], dim=1)
                keys_from = "cache+chunk"
            sliding = (position_mask(positions, key_pos, True, window) & (key_pos >= 0)[:, None, :], keys_from)
        inputs = {FULL: full, SLIDING: sliding}
        return [(cos_sin[t], inputs[t][0], attn_len, inputs[t][1]) for t in cfg.layer_types]


def gguf_config(metadata: dict[str, Any], tensors: dict[str, Any], base: dict) -> dict:
    """An HF config dict for a `gemma3` / `gemma4` GGUF file (llama.cpp's keys; `base` holds what every
    architecture shares, read by formats.gguf)."""
    arch = metadata["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    for key, what in (("embedding_length_per_layer_input", "per-layer embeddings (Gemma 4 E2B/E4B)"),
                      ("attention.shared_kv_layers", "shared KV layers (Gemma 4 E2B/E4B)"),
                      ("expert_count", "the mixture of experts (Gemma 4 26B-A4B)")):
        if get(key):
            raise ValueError(f"{what} is not supported yet ({arch}.{key} = {get(key)})")
    n = base["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        types = [SLIDING if p else FULL for p in pattern]
    else:
        types = [SLIDING if i % int(pattern or 6) < int(pattern or 6) - 1 else FULL for i in range(n)]
    kv = get("attention.head_count_kv", base["num_attention_heads"])
    kv_per_layer = kv if isinstance(kv, list) else [kv] * n
    cfg = {**base, "model_type": arch, "architectures": [HF_CLASSES[arch]], "layer_types": types,
           "sliding_window": get("attention.sliding_window"), "hidden_activation": "gelu_pytorch_tanh",
           "final_logit_softcapping": get("final_logit_softcapping")}
    full_theta, swa_theta = float(get("rope.freq_base", 1e6)), float(get("rope.freq_base_swa", 10000.0))
    if arch == "gemma3":
        scaling = {"rope_type": "default"}
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        head_dim = int(get("attention.key_length") or base["head_dim"])
        cfg.update(head_dim=head_dim, num_key_value_heads=int(kv_per_layer[0]), query_pre_attn_scalar=head_dim,
                   attn_logit_softcapping=get("attn_logit_softcapping"),
                   rope_parameters={FULL: {**scaling, "rope_theta": full_theta},
                                    SLIDING: {"rope_type": "default", "rope_theta": swa_theta}})
        return cfg
    full_dim, swa_dim = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    full_kv = [k for k, t in zip(kv_per_layer, types) if t == FULL]
    swa_kv = [k for k, t in zip(kv_per_layer, types) if t == SLIDING]
    factors = tensors.get("rope_freqs.weight")  # 1 for a rotated frequency, 1e30 for one that stands still
    rotated = full_dim // 2 if factors is None else int((tensor_values(factors) < 1e10).sum())
    cfg.update(head_dim=swa_dim, global_head_dim=full_dim, num_key_value_heads=int(swa_kv[0] if swa_kv else kv_per_layer[0]),
               num_global_key_value_heads=int(full_kv[0]) if full_kv else None,
               attention_k_eq_v=not any(f"blk.{i}.attn_v.weight" in tensors for i, t in enumerate(types) if t == FULL),
               rope_parameters={FULL: {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / full_dim,
                                       "rope_theta": full_theta},
                                SLIDING: {"rope_type": "default", "rope_theta": swa_theta}})
    return cfg


HF_CLASSES = {"gemma3": "Gemma3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM",
              "gemma4_text": "Gemma4ForCausalLM"}

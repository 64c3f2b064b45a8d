"""The Qwen3.5 family, dense (HF `qwen3_5`, whose text part Qwen3.6 and 3.8 share; GGUF `qwen35`): hybrid layers,
three Gated DeltaNet layers (layers/gated_deltanet.py) to each gated attention layer by default.

Gated attention: q_proj gives each head its query and a gate of the same size ([q | gate] per head), the output
is multiplied by sigmoid(gate) before o_proj; QK-norm, RoPE on the first partial_rotary_factor of each head
(text positions: Qwen's interleaved M-RoPE reduces to plain RoPE). Every norm but the DeltaNet's gated output
norm is (1 + w) with w stored, as HF's checkpoints hold it; llama.cpp's converter bakes the 1 into the GGUF file
(undone on load: gguf_values), stores A_log as -exp(A_log) and orders the DeltaNet's value heads tiled by key
head, which the model then reads as they lie (`tiled_value_heads`).

Module names mirror HF's Qwen3_5ForCausalLM; a Qwen3_5ForConditionalGeneration checkpoint's language model loads
too (its vision tower is left out). The checkpoint's multi-token-prediction block (HF `mtp.*`, GGUF `nextn`
layers) is not part of the target: `Qwen35MTP` is that block, which the MTP drafter (draft/mtp.py) loads on its own
(`mtp_tensors`) when `--spec-type mtp` asks for it."""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.layers.attention import AttentionSpec, attend, attend_cache, position_mask
from flashdraft.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from flashdraft.layers.kv_cache import KVCache, KVSlots, RecurrentCache
from flashdraft.layers.linear import Linear, fuse_linears_on_load
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope, rope_table, rotary_dim
from flashdraft.models.decoder import DecoderLM

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
HF_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM"}
LINEAR, FULL = "linear_attention", "full_attention"
MOE_NOT_YET = ("the Qwen3.5/3.6 mixture-of-experts models ({}) are not supported yet (the dense qwen3_5 models "
               "are): their experts need grouped kernels over the quantized expert matrices")
REFUSED = {name: MOE_NOT_YET.format(name) for name in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen35moe")} | {
    name: f"Qwen3-Next ({name}) is not supported yet" for name in ("qwen3_next", "qwen3next")}


@dataclass
class Qwen35Config:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: list[str]
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    linear_conv_kernel: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    rope_scaling: dict | None = None  # with partial_rotary_factor (layers.rope.rotary_dim)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    tiled_value_heads: bool = False  # llama.cpp's order of the DeltaNet's value heads
    mtp_layers: int = 0  # the checkpoint's MTP blocks (HF mtp_num_hidden_layers, GGUF nextn_predict_layers)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @staticmethod
    def from_hf(cfg: dict) -> "Qwen35Config":
        arch = cfg.get("model_type", "qwen3_5")
        cfg = {**cfg, **cfg.get("text_config", {})}  # the language model of Qwen3_5ForConditionalGeneration
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Qwen3.5 uses silu)")
        n = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        interval = cfg.get("full_attention_interval", 4)
        types = list(cfg.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)])
        if set(types) - {LINEAR, FULL}:
            raise ValueError(f"unknown layer types {sorted(set(types) - {LINEAR, FULL})}")
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.pop("rope_theta", cfg.get("rope_theta", 1e7))
        for key in ("mrope_section", "mrope_interleaved"):  # text positions: the three sections are one
            params.pop(key, None)
        params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
        params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        eos = cfg.get("eos_token_id")
        return Qwen35Config(
            arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, layer_types=types,
            linear_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_value_heads=cfg.get("linear_num_value_heads", 32),
            linear_key_dim=cfg.get("linear_key_head_dim", 128), linear_value_dim=cfg.get("linear_value_head_dim", 128),
            linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=params,
            max_position_embeddings=cfg.get("max_position_embeddings", 262144),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tiled_value_heads=bool(cfg.get("tiled_value_heads", False)), bos_token_id=cfg.get("bos_token_id"),
            mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos))

    @property
    def deltanet(self) -> DeltaNetShape:
        return DeltaNetShape(self.hidden_size, self.linear_key_heads, self.linear_value_heads, self.linear_key_dim,
                             self.linear_value_dim, self.linear_conv_kernel, self.rms_norm_eps,
                             self.tiled_value_heads)


class Qwen35Attention(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim  # q: queries and gates
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        fuse_linears_on_load(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"], [q_size, kv_size, kv_size])
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.spec = AttentionSpec(scale=cfg.head_dim ** -0.5)

    def project(self, x: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, T, hidden] -> q [B, T, H, D], k and v [B, T, KV, D], the gates [B, T, H * D]."""
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        proj = self.qkv_proj(x)
        q_gate = proj[..., :2 * H * D].unflatten(-1, (H, 2 * D))
        q = apply_rope(self.q_norm(q_gate[..., :D]), cos_sin)
        k = apply_rope(self.k_norm(proj[..., 2 * H * D:(2 * H + KV) * D].unflatten(-1, (KV, D))), cos_sin)
        v = proj[..., (2 * H + KV) * D:].unflatten(-1, (KV, D))
        return q, k, v, q_gate[..., D:].flatten(-2)

    def project_kv(self, x: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, hidden] -> k and v [B, T, KV, D] alone (no query rows computed)."""
        KV, D = self.num_kv_heads, self.head_dim
        kv = self.qkv_proj.part(x, 2 * self.num_heads * D, self.qkv_proj.out_features).unflatten(-1, (2 * KV, D))
        return apply_rope(self.k_norm(kv[..., :KV, :]), cos_sin), kv[..., KV:, :]

    def gated_output(self, out: Tensor, gate: Tensor) -> Tensor:
        """Attention output [..., H * D] -> the layer's output: gated by sigmoid(gate), then o_proj."""
        return self.o_proj(out * torch.sigmoid(gate))

    def forward(self, x: Tensor, cache: KVSlots | None, positions: Tensor, cos_sin: Tensor,
                mask: Tensor | None, attn_len: int) -> Tensor:
        """As llama.LlamaAttention: mask None for a fresh prefill (causal over the chunk's own keys)."""
        q, k, v, gate = self.project(x, cos_sin)
        if cache is not None:
            cache.write(positions, k, v)
        if mask is None or cache is None:
            if cache is not None:
                k, v = cache.as_read(k, v)
            out = attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, self.spec)
        else:
            out = attend_cache(q, cache, attn_len, mask, self.spec, positions)
        return self.gated_output(out, gate)


class Qwen35DecoderLayer(nn.Module):
    """A Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`) layer, then the MLP; pre-norm."""

    def __init__(self, cfg: Qwen35Config, i: int, layer_type: str | None = None):
        super().__init__()
        self.recurrent = (layer_type or cfg.layer_types[i]) == LINEAR
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg.deltanet)
        else:
            self.self_attn = Qwen35Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)

    def forward(self, x: Tensor, cache, positions: Tensor, *mixer_args) -> Tensor:
        mixer = self.linear_attn if self.recurrent else self.self_attn
        x = x + mixer(self.input_layernorm(x), cache, positions, *mixer_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35Model(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)


class Qwen35MTP(nn.Module):
    """The checkpoint's MTP block (HF names under `mtp.`): the pair (h, t) of a target hidden state after the final
    norm and the embedding of the token after it -> fc([norm(embedding); norm(h)]) -> one gated-attention decoder
    layer -> norm: the hidden state the LM head reads for the token after t, and the next chained step's h."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, offset=1.0)
        self.layers = nn.ModuleList([Qwen35DecoderLayer(cfg, 0, FULL)])  # (checkpoints with more: refused)
        self.norm = RMSNorm(h, eps, offset=1.0)

    def pair(self, embedding: Tensor, hidden: Tensor) -> Tensor:
        """The layer's input for pairs (embedding of token t, h before it) [..., H] -> [..., H]."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def keys_values(self, x: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
        """The attention's K and V [B, T, KV, D] of pair inputs x [B, T, H] (all a committed position keeps)."""
        layer = self.layers[0]
        return layer.self_attn.project_kv(layer.input_layernorm(x), cos_sin)

    def forward(self, x: Tensor, cos_sin: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """Pair inputs x [B, T, H] -> [B, T, H] after the block's final norm. `attend(q, k, v)`: the attention over
        the drafter's own K/V, given the new rows' q [B, T, H, D], k and v [B, T, KV, D] -> [B, T, H * D]."""
        layer = self.layers[0]
        q, k, v, gate = layer.self_attn.project(layer.input_layernorm(x), cos_sin)
        x = x + layer.self_attn.gated_output(attend(q, k, v), gate)
        return self.norm(x + layer.mlp(layer.post_attention_layernorm(x)))


def mtp_tensors(path, dtype: torch.dtype, device, quantized: bool = False):
    """(name inside Qwen35MTP, tensor) of a checkpoint's MTP block: an HF folder's `mtp.*` (or `model.mtp.*`), a
    `qwen35` GGUF's layers from blk.{num_layers} on (its `nextn` tensors and the layer's own), their norms back to
    HF's w as the trunk's. quantized: GGUF matrices stay in their block format where kernels read them."""
    from pathlib import Path
    path = Path(path)
    if path.is_dir():
        from flashdraft.formats.safetensors import iter_tensors
        for name, tensor in iter_tensors(path, dtype, device, keep=lambda n: n.startswith(("mtp.", "model.mtp."))):
            yield name.removeprefix("model.").removeprefix("mtp."), tensor
        return
    from flashdraft.formats import gguf
    yield from gguf.iter_gguf_tensors(path, dtype, device, keep_quantized=quantized, mtp=True)


class Qwen35(DecoderLM):
    def __init__(self, cfg: Qwen35Config, rank: int = 0, world_size: int = 1):
        if world_size > 1:
            raise ValueError("tensor parallelism is not supported for Qwen3.5 models yet")
        super().__init__(cfg, rank, world_size)
        self.model = Qwen35Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = torch.empty(0, 2, rotary_dim(cfg))
        self._register_load_state_dict_pre_hook(self._language_model_names)

    def _language_model_names(self, state_dict: dict, prefix: str, *args) -> None:
        """A Qwen3_5ForConditionalGeneration checkpoint: model.language_model.* is the model; the vision tower and
        the MTP head (mtp.*) are not read; a tied LM head is the embedding."""
        for name in list(state_dict):
            rest = name[len(prefix):] if name.startswith(prefix) else None
            if rest is None:
                continue
            if rest.startswith(("model.visual.", "mtp.")):
                del state_dict[name]
            elif rest.startswith("model.language_model."):
                state_dict[prefix + "model." + rest[len("model.language_model."):]] = state_dict.pop(name)
        embedding = state_dict.get(prefix + "model.embed_tokens.weight")
        if self.cfg.tie_word_embeddings and embedding is not None:
            state_dict.setdefault(prefix + "lm_head.weight", embedding)

    def prepare(self, max_len: int) -> None:
        if self.rope.shape[0] < max_len or self.rope.device != self.device:
            self.rope = rope_table(self.cfg, max_len).to(self.device, self.dtype)  # apply_rope rounds to it

    def layer_cache(self, i: int, n_slots: int, max_len: int, codecs) -> KVCache | RecurrentCache:
        cfg = self.cfg
        if cfg.layer_types[i] == LINEAR:
            s = cfg.deltanet
            return RecurrentCache(n_slots, s.value_heads, s.key_dim, s.value_dim, s.channels, s.conv_kernel,
                                  self.dtype, self.device)
        return KVCache(n_slots, cfg.num_kv_heads, max_len, cfg.head_dim, self.dtype, self.device, codecs)

    def layer_inputs(self, positions: Tensor, attn_len: int, fresh: bool) -> list[tuple]:
        self.prepare(int(positions.shape[1]) if fresh else attn_len)
        cos_sin = self.rope[positions][:, :, None]  # [B, T, 1, 2, rotary dim]
        mask = None if fresh else position_mask(positions, torch.arange(attn_len, device=positions.device))
        return [(fresh,) if t == LINEAR else (cos_sin, mask, attn_len) for t in self.cfg.layer_types]


def gguf_config(metadata: dict[str, Any], tensors: dict[str, Any], base: dict) -> dict:
    """An HF config dict for a `qwen35` GGUF file (llama.cpp's keys; `base` holds what every architecture shares,
    read by formats.gguf). The file's block count includes its MTP layers (nextn_predict_layers), which the
    model leaves out; a layer is recurrent where the file has its convolution."""
    arch = metadata["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    n = base["num_hidden_layers"] - int(get("nextn_predict_layers", 0))
    kv = get("attention.head_count_kv", base["num_attention_heads"])
    head_dim = int(get("attention.key_length") or base["head_dim"])
    value_heads = int(get("ssm.time_step_rank"))
    return {
        **base, "model_type": "qwen3_5_text", "architectures": [HF_CLASSES["qwen3_5_text"]],
        "num_hidden_layers": n, "head_dim": head_dim,
        "num_key_value_heads": int(max(kv) if isinstance(kv, list) else kv),
        "layer_types": [LINEAR if f"blk.{i}.ssm_conv1d.weight" in tensors else FULL for i in range(n)],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")), "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e7)),
                            "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 4)) / head_dim},
        "tiled_value_heads": True, "mtp_num_hidden_layers": int(get("nextn_predict_layers", 0)),
    }


def gguf_values(name: str) -> Callable[[Tensor], Tensor] | None:
    """How a tensor that llama.cpp's converter changed comes back to HF's values (None: as stored)."""
    if name.endswith("linear_attn.A_log"):  # stored as -exp(A_log)
        return lambda a: torch.log(-a)
    if name.endswith("linear_attn.conv1d.weight"):  # stored squeezed: [channels, kernel]
        return lambda w: w[:, None, :]
    if (name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight"))  # stored as 1 + w
            and not name.endswith("linear_attn.norm.weight")):
        return lambda w: w - 1.0
    return None


# GGUF blk.N parts -> HF modules of layer N, besides registry.DECODER_LAYER_NAMES
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}

# GGUF blk.N.nextn.<name> (N from the model's layer count on) -> the name inside Qwen35MTP
GGUF_MTP_NAMES = {"nextn.eh_proj": "fc", "nextn.enorm": "pre_fc_norm_embedding",
                  "nextn.hnorm": "pre_fc_norm_hidden", "nextn.shared_head_norm": "norm"}

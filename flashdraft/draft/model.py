"""DFlash draft: target features fused into one context vector per token, injected as extra K/V into every
layer of a small Qwen3-style stack that denoises a block [anchor, MASK, ...] in one non-causal pass. DFlash2
(z-lab, 2026; speculators' `dflash2`, llama.cpp's `dflash` with convolution and selector tensors) adds a pair of
dynamic causal convolutions over the block's rows around each layer's attention and MLP (`LocalConv`), and picks
the drafted path with a candidate selector (`CandidateSelector`) instead of each row's argmax.

`DFlashDraft` is the network and the engine's `Drafter` (draft/interface.py); its per-slot context rings are a
`DraftRings`. State dict names are z-lab's (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...).
Configuration in draft/config.py, loading in draft/load.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from flashdraft.draft.config import DraftConfig
from flashdraft.engine.sampling import argmax_rows
from flashdraft.layers.attention import few_query_attention, masked_attention, position_mask, uses_split_kernel
from flashdraft.layers.compile import compile_layer_forward
from flashdraft.layers.kv_cache import RingKVCache, slot_row
from flashdraft.layers.linear import Linear, fuse_linears_on_load
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq


class Rotary(nn.Module):
    """The shared RoPE frequencies as a float32 buffer that follows the model across devices."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Rotary:
        # Casting the model to bf16 must not round the frequencies: recompute them in float32 on the new device.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.cfg, self.inv_freq.device)[0]
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """positions [...] -> (cos, sin) [..., 2, head_dim] in dtype, for `apply_rope`."""
        return rope_cos_sin(self.inv_freq, positions, self.attention_scaling).to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * kv_size, bias=bias)
        self.split_sizes = {"qkv_proj": [self.q_size, kv_size, kv_size]}
        fuse_linears_on_load(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.is_causal, self.sliding_window = cfg.layer_attention(layer_id)
        self.scale = self.head_dim ** -0.5

    def project_kv(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> K = RoPE(k_norm(Wk x)), V = Wv x, both [..., Hkv, T, D]. Used for context and block."""
        return self.keys_values(self.qkv_proj.part(x, self.q_size, self.qkv_proj.out_features), cos_sin)

    def project_qkv(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> Q [..., Hq, T, D] and the block's own K, V [..., Hkv, T, D], from one matrix product."""
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[..., :self.q_size].unflatten(-1, (self.num_heads, self.head_dim))).transpose(-3, -2)
        return apply_rope(q, cos_sin), *self.keys_values(qkv[..., self.q_size:], cos_sin)

    def keys_values(self, kv: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k and v [..., T, 2*Hkv*D] -> RoPE(k_norm(k)), v, both [..., Hkv, T, D]."""
        k, v = kv.unflatten(-1, (2 * self.num_kv_heads, self.head_dim)).transpose(-3, -2).chunk(2, dim=-3)
        return apply_rope(self.k_norm(k), cos_sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [..., B, H] (normed block states). keys/values [..., Hkv, B + R, D]: context K/V in the last R rows;
        the block's own K/V are written into the first B rows here, so the caller owns that scratch space."""
        block_len = x.shape[-2]
        q, block_k, block_v = self.project_qkv(x, cos_sin)
        keys[..., :block_len, :].copy_(block_k)
        values[..., :block_len, :].copy_(block_v)
        if q.dim() == 3 and mask is not None and uses_split_kernel(q.transpose(0, 1)):  # else SDPA, as z-lab's
            return self.o_proj(few_query_attention(q.transpose(0, 1), keys, values, mask, self.scale))
        # a ring stored in another float type (--spec-draft-type-k/-v) meets q in q's
        return self.o_proj(masked_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, self.scale))


class LocalConv(nn.Module):
    """DFlash2's pair of dynamic causal convolutions around a sublayer (its input and its output), over the rows
    of a draft block: row i mixes rows i, i - 1, ..., i - K + 1 of the block (none before its first), tap t
    weighing channel c by base_kernel[side, t, c] plus a per-row change shared by each group of `group` channels,
    which a projection of the sublayer's normed input gives for both sides at once."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"DFlash2: hidden size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def changes(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., T, H] -> the per-row coefficient changes [..., T, 2 (input, output), K, groups]."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, x: torch.Tensor, changes: torch.Tensor, side: int) -> torch.Tensor:
        """x [..., T, H], the block's rows from its first."""
        rows = x.shape[-2]
        grouped = x.unflatten(-1, (self.groups, -1))  # [..., T, groups, group]
        out = torch.zeros_like(grouped)
        for tap in range(min(self.kernel_size, rows)):
            shifted = grouped if tap == 0 else F.pad(grouped[..., :rows - tap, :, :], (0, 0, 0, 0, tap, 0))
            weight = (self.base_kernel[side, tap].to(x.dtype).view(self.groups, -1)
                      + changes[..., side, tap, :, None])
            out = out + shifted * weight
        return out.flatten(-2)


class CandidateSelector(nn.Module):
    """DFlash2's path selector: each drafted row's top-k tokens by the draft's logits, rescored by a low-rank
    bilinear term between the token before it (the anchor for the first row, else the row before's choice), the
    row's hidden state and the candidate; the best of each row in turn."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = Linear(hidden_size, rank, bias=False)

    def gates(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [T, H] -> the rows' gates [T, R] of the bilinear term."""
        return self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)

    def transition_scores(self, gates: torch.Tensor, predecessors: torch.Tensor,
                          candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term: gates [T, R], predecessors [T], candidates [T, k] -> [T, k] (training scores every
        row at once; `walk` one row at a time, each after its predecessor is chosen)."""
        context = self.predecessor_codebook[predecessors] * gates  # [T, R]
        return (self.successor_codebook[candidates] * context[:, None, :]).sum(-1)

    def walk(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """logits [k, V] and final-normed hidden [k, H] of rows 1..k, the anchor [1] -> [k] chosen tokens."""
        candidates = logits.topk(self.top_k, dim=-1).indices  # [k, top_k]
        unary = logits.gather(-1, candidates)
        gates = self.gates(hidden)
        chosen, before = [], anchor[:1]
        for row in range(logits.shape[0]):
            pair = self.transition_scores(gates[row:row + 1], before, candidates[row:row + 1])  # [1, top_k]
            before = candidates[row, argmax_rows(unary[row:row + 1] + pair.to(unary.dtype))]
            chosen.append(before)
        return torch.cat(chosen)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.convolved = cfg.dflash2
        if cfg.dflash2:
            self.attention_conv = LocalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = LocalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if not self.convolved:
            x = x + self.self_attn(h, cos_sin, keys, values, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        changes = self.attention_conv.changes(h)
        out = self.self_attn(self.attention_conv(h, changes, 0), cos_sin, keys, values, mask)
        x = x + self.attention_conv(out, changes, 1)
        h = self.post_attention_layernorm(x)
        changes = self.mlp_conv.changes(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, changes, 0)), changes, 1)


class DraftRings:
    """The draft's per-slot state: a context K/V ring of `window` rows per slot and layer
    (`layers.kv_cache.RingKVCache`), after `scratch` rows where each forward writes the block's transient K/V, and
    the table of the position each ring row holds (-1: none), shared by all layers."""

    def __init__(self, cfg: DraftConfig, window: int, n_slots: int, scratch: int, device: torch.device | str,
                 k_dtype: torch.dtype, v_dtype: torch.dtype):
        self.row_positions = torch.full((n_slots, window), -1, device=device, dtype=torch.long)
        self.caches = [RingKVCache(n_slots, cfg.num_key_value_heads, window, scratch, cfg.head_dim, k_dtype, device,
                                   self.row_positions, v_dtype) for _ in range(cfg.num_hidden_layers)]
        self.window, self.scratch = window, scratch

    def reset(self, slot: int = 0, keep: int = 0) -> None:
        rows = self.row_positions[slot]
        rows.masked_fill_(rows >= keep, -1)

    @property
    def bytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in self.caches)


class DFlashDraft(nn.Module):
    name = "dflash"
    slot_tensors = True  # propose and observe take the slot as a [1] tensor too (draft/interface.Drafter)

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(cfg.context_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2:
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        self.rotary = Rotary(cfg)
        self.layer_attention = [cfg.layer_attention(i) for i in range(cfg.num_hidden_layers)]
        self.attention_kinds = list(dict.fromkeys(self.layer_attention))  # one mask per distinct kind
        self.state: DraftRings | None = None
        self.compiled_layer = None
        self.compiled_blocks: set[int] = set()

    def compile_layers(self, block_sizes: tuple[int, ...] | None = None) -> None:
        """Draft steps of `block_sizes` tokens (default: the configured block, the shape CUDA graphs capture) run
        their layers through torch.compile (fused norms, RoPE, SiLU gating); other lengths stay eager rather than
        compile once per length."""
        self.compiled_layer = compile_layer_forward(DraftLayer.forward)
        self.compiled_blocks = set(block_sizes or (self.cfg.block_size,))

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.target_layer_ids)

    @property
    def caches(self) -> list[RingKVCache]:
        """Each layer's context ring (in `state`)."""
        return self.state.caches

    def setup_cache(
        self,
        window: int,
        n_slots: int = 1,
        cache_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_block_size: int | None = None,
    ) -> None:
        """`state`: rings of `window` rows per slot and layer (a `DraftRings`), after `max_block_size` scratch rows
        (default: the configured block): attention reads one contiguous view, the block's rows and then as much of
        the ring as holds context (a prefix of it until the ring wraps). `cache_dtypes`: the rings' K and V storage
        (None: `dtype`, by default the draft's)."""
        device = self.norm.weight.device if device is None else device  # the final norm: dense in every format
        dtype = self.norm.weight.dtype if dtype is None else dtype
        max_block_size = self.cfg.block_size if max_block_size is None else max_block_size
        k_dtype, v_dtype = (d or dtype for d in cache_dtypes)
        self.state = DraftRings(self.cfg, window, n_slots, max_block_size, device, k_dtype, v_dtype)

    def reset(self, slot: int = 0, keep: int = 0) -> None:
        """Forget the slot's context from position `keep` on (0: all of it)."""
        self.state.reset(slot, keep)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., L*H] -> context vectors [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.norm.weight.dtype)))

    def append_context(self, features: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor = 0) -> None:
        """Write the context K/V of committed positions (increasing) into the slot's ring at rows p % window.
        `slot` an int or a [1] tensor (one CUDA graph then serves every slot)."""
        rings = self.state
        if features.shape[0] > rings.window:  # earlier rows would be overwritten anyway
            features, positions = features[-rings.window :], positions[-rings.window :]
        context = self.fuse(features)
        cos_sin = self.rotary(positions, context.dtype)
        for layer, cache in zip(self.layers, rings.caches):
            cache.write(slot, positions, *layer.self_attn.project_kv(context, cos_sin))
        rings.row_positions[slot, positions % rings.window] = positions  # the table all layers' rings share

    def forward(self, noise_embedding: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor = 0,
                live: torch.Tensor | None = None, context_rows: int | None = None) -> torch.Tensor:
        """noise_embedding [B, H] (block embeddings, already scaled), positions [B] (anchor first) -> hidden
        [B, H] after the final norm. Sees the ring rows holding positions before the anchor. `live` (a one-element
        tensor, so one CUDA graph serves every value) hides the block rows from `live` on: the first `live` rows
        come out as from a block of that length (where the output budget ends a block early). `context_rows`
        (a static bound, e.g. the target's attention bucket: more than the anchor's position) reads only that
        prefix of the ring while it has not wrapped."""
        block_len, rings = noise_embedding.shape[0], self.state
        if block_len > rings.scratch:
            raise ValueError(f"block of {block_len} exceeds the cache's scratch rows; raise setup_cache max_block_size")
        ring = rings.window if context_rows is None else min(context_rows, rings.window)
        x = noise_embedding.to(self.norm.weight.dtype)
        cos_sin = self.rotary(positions, x.dtype)
        row_positions = slot_row(rings.row_positions, slot)[:ring]
        context_valid = (row_positions >= 0) & (row_positions < positions[:1])
        key_positions = torch.cat([positions, row_positions])
        block_valid = torch.ones_like(positions, dtype=torch.bool) if live is None else \
            torch.arange(block_len, device=positions.device) < live
        key_valid = torch.cat([block_valid, context_valid])
        masks = {kind: position_mask(positions, key_positions, *kind) & key_valid for kind in self.attention_kinds}
        for i, (layer, cache) in enumerate(zip(self.layers, rings.caches)):
            args = (x, cos_sin, *cache.block_view(slot, block_len, ring), masks[self.layer_attention[i]])
            x = self.compiled_layer(layer, *args) if block_len in self.compiled_blocks else layer(*args)
        return self.norm(x)

    def forward_with_context(
        self,
        noise_embedding: torch.Tensor,
        positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Stateless forward: the block attends to the given context rows (subject to each layer's causal and
        window rules by position), without touching the ring. Same result as append_context + forward."""
        x = noise_embedding.to(self.norm.weight.dtype)
        context = self.fuse(context_features)
        cos_sin = self.rotary(positions, x.dtype)
        context_cos_sin = self.rotary(context_positions, x.dtype)
        key_positions = torch.cat([positions, context_positions])
        masks = {kind: position_mask(positions, key_positions, *kind) for kind in self.attention_kinds}
        for i, layer in enumerate(self.layers):
            context_k, context_v = layer.self_attn.project_kv(context, context_cos_sin)
            scratch = context_k.new_empty(*context_k.shape[:-2], x.shape[-2], context_k.shape[-1])
            keys, values = torch.cat([scratch, context_k], dim=-2), torch.cat([scratch, context_v], dim=-2)
            x = layer(x, cos_sin, keys, values, masks[self.layer_attention[i]])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        logits = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        softcap = self.cfg.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    # ---------------------------------------------------------------- the engine's Drafter (draft/interface.py)
    def observe(self, tokens: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                slots: int | torch.Tensor = 0) -> None:
        """One row (B = 1, `slots` an int or a [1] tensor): its features go into the slot's rings (the tokens are
        in them)."""
        self.append_context(features[0], positions[0], slots)

    def propose(self, target, anchors: torch.Tensor, positions: torch.Tensor, slots: int | torch.Tensor, k: int,
                live: torch.Tensor | None = None, block: int | None = None,
                context_rows: int | None = None) -> torch.Tensor:
        """One row (B = 1): the block [anchor, MASK, ...] of `block` rows at the anchor's position on, through the
        draft in one pass, and the greedy tokens of its rows 1..k, [1, k]."""
        block = block or self.cfg.block_size
        ids = torch.cat([anchors[:1], anchors.new_full((block - 1,), self.cfg.mask_token_id)])
        noise = target.token_embedding(ids) * self.cfg.input_embedding_scale
        hidden = self(noise, positions[:1] + torch.arange(block, device=positions.device), slots, live, context_rows)
        logits = self.compute_logits(hidden[1:k + 1], target.logits)
        if self.cfg.dflash2:
            return self.candidate_selector.walk(logits, hidden[1:k + 1], anchors)[None]
        return argmax_rows(logits)[None]

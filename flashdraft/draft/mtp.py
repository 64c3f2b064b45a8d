"""MTP drafter: the target checkpoint's own multi-token-prediction block (Qwen3.5's `mtp.*`, the `nextn` layers
of llama.cpp's GGUF files; `--spec-type mtp`, llama.cpp's `draft-mtp`), proposing k tokens in k chained steps.

A step reads a pair (h, t): h a hidden state after the target's final norm, t the token after it, at t's position;
the block's output (after its own norm) gives the next token through the target's LM head and is the next step's
h. Its one attention layer keeps K/V per slot in a ring of `window` rows by position (`layers.kv_cache
.RingKVCache`, the whole context unless --draft-window is smaller). Committed position p holds the K/V of the pair
(the target's h at p - 1, token p), which `observe` writes from the target's last-layer outputs (normed here with
the target's final norm): only K and V, as the layer's output there is never needed. A proposal's steps write their
K/V in the ring's scratch rows, which no later step reads. As llama.cpp's: position 0 pairs with h = 0, and so does
the first position after a reset that keeps a prefix (the prefix's last h is not kept): one position's context
slightly off costs acceptance, never correctness."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdraft.engine.sampling import argmax_rows
from flashdraft.layers.attention import masked_attention
from flashdraft.layers.kv_cache import RingKVCache, slot_row
from flashdraft.layers.quantized import QuantizedWeight
from flashdraft.layers.rope import rope_cos_sin, rope_inv_freq

N_MAX = 3  # proposals per step unless --spec-draft-n-max says otherwise


NONE = -2  # hidden_at of a row holding no h (-1 would match position 0's predecessor)


class MTPState:
    """Per slot: the block's K/V ring (and its scratch rows for a proposal's steps), the position each ring row
    holds (-1: none), and two rows of the target's h at an observed position (`hidden_at`: which; NONE): an
    observe reads the row of the position before its first and writes the other, so running it twice (a CUDA
    graph's capture, then its replay) reads the same h both times."""

    def __init__(self, cfg, window: int, n_slots: int, scratch: int, device, k_dtype: torch.dtype,
                 v_dtype: torch.dtype, dtype: torch.dtype):
        self.row_positions = torch.full((n_slots, window), -1, dtype=torch.long, device=device)
        self.cache = RingKVCache(n_slots, cfg.num_kv_heads, window, scratch, cfg.head_dim, k_dtype, device,
                                 self.row_positions, v_dtype)
        self.hidden = torch.zeros(n_slots, 2, cfg.hidden_size, dtype=dtype, device=device)
        self.hidden_at = torch.full((n_slots, 2), NONE, dtype=torch.long, device=device)
        self.window = window

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cache.k, self.cache.v, self.hidden))


class MTPDrafter(nn.Module):
    """The Drafter (draft/interface.py) over a family's MTP block (models.registry.Family.mtp_block), which
    provides `pair`, `keys_values` and a forward through a given attention."""
    name = "mtp"
    slot_tensors = True  # propose and observe take the slot as a [1] tensor too: one graph for every slot

    def __init__(self, block: nn.Module, target, n_max: int = N_MAX):
        super().__init__()
        if n_max < 1:
            raise ValueError(f"--spec-draft-n-max {n_max}: the MTP drafter proposes at least one token")
        cfg = target.cfg
        self.block, self.cfg = block, cfg
        # the target's embedding and final norm, in a tuple: read here, not this module's own weights
        self.target_parts = (target.model.embed_tokens, target.model.norm)
        self.block_size = n_max + 1
        self.target_layers = (cfg.num_layers - 1,)
        inv_freq, self.rope_scaling = rope_inv_freq(cfg, target.device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = cfg.head_dim ** -0.5
        self.state: MTPState | None = None

    # ---- Drafter

    def setup_cache(self, window: int, n_slots: int = 1,
                    cache_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)) -> None:
        dtype = self.block.norm.weight.dtype
        k_dtype, v_dtype = (d or dtype for d in cache_dtypes)
        self.state = MTPState(self.cfg, window, n_slots, self.block_size, self.inv_freq.device, k_dtype, v_dtype,
                              dtype)

    def reset(self, slot: int = 0, keep: int = 0) -> None:
        s = self.state
        s.row_positions[slot].masked_fill_(s.row_positions[slot] >= keep, -1)
        s.hidden_at[slot].masked_fill_(s.hidden_at[slot] >= keep, NONE)

    def observe(self, tokens: Tensor, features: Tensor | None, positions: Tensor, slots: int | Tensor = 0) -> None:
        """One row (B = 1): the K/V of each committed position's pair (h before it, its token) into the ring; the
        last position's h kept for the next pair."""
        s = self.state
        embed, final_norm = self.target_parts
        hidden = final_norm(features[0]).to(s.hidden.dtype)  # [T, H]: the target's h at each position
        positions = positions[0]
        before, read = self._hidden_before(slots, positions[:1])
        pairs_h = torch.cat([before, hidden[:-1]])[-s.window:]  # earlier rows would be overwritten anyway
        tokens, at = tokens[0, -s.window:], positions[-s.window:]
        x = self.block.pair(embed(tokens).to(s.hidden.dtype), pairs_h)
        k, v = self.block.keys_values(x[None], self._rope(at)[:, None])
        s.cache.write(slots, at, k[0].transpose(0, 1), v[0].transpose(0, 1))
        s.row_positions[slots, at % s.window] = at
        s.hidden[slots, 1 - read] = hidden[-1:]  # the row not read (read: [1])
        s.hidden_at[slots, 1 - read] = positions[-1:]

    def propose(self, target, anchors: Tensor, positions: Tensor, slots: int | Tensor, k: int,
                live: Tensor | None = None, block: int | None = None,
                context_rows: int | None = None) -> Tensor:
        """One row (B = 1): k chained steps from the pair (h before the anchor, the anchor), [1, k] greedy tokens.
        Each step attends to the ring's positions before the anchor and to the earlier steps' rows."""
        s = self.state
        ring = s.window if context_rows is None else min(context_rows, s.window)
        keys, values = s.cache.block_view(slots, k, ring)  # [KV, k + ring, D]: k scratch rows, then the ring
        at = positions[:1]
        context = slot_row(s.row_positions, slots)[:ring]
        context_valid = (context >= 0) & (context < at)
        h = self._hidden_before(slots, at)[0]  # [1, H]
        token, proposed = anchors[:1], []
        embed = self.target_parts[0]
        steps = torch.arange(k, device=at.device)
        for j in range(k):

            def attend(q: Tensor, new_k: Tensor, new_v: Tensor, j: int = j) -> Tensor:
                keys[:, j] = new_k[0, 0]
                values[:, j] = new_v[0, 0]
                mask = torch.cat([steps <= j, context_valid])[None]
                out = masked_attention(q[0].transpose(0, 1), keys.to(q.dtype), values.to(q.dtype), mask, self.scale)
                return out[None]

            x = self.block.pair(embed(token).to(h.dtype), h)
            h = self.block(x[None], self._rope(at + j)[:, None], attend)[0]
            token = argmax_rows(target.logits(h))
            proposed.append(token)
        return torch.cat(proposed)[None]

    def compile_layers(self, block_sizes: tuple[int, ...] | None = None) -> None:
        pass

    def _hidden_before(self, slots: int | Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        """The slot's h at position first - 1 ([1, H]; zeros where neither row holds it) and the row read ([1])."""
        s = self.state
        match = slot_row(s.hidden_at, slots) == first - 1  # [2]
        h = (match[:, None].to(s.hidden.dtype) * slot_row(s.hidden, slots)).sum(0, keepdim=True)
        return h, match[1:].long()  # row 1 where it matched, else row 0 (its write goes to the other)

    def _rope(self, positions: Tensor) -> Tensor:
        return rope_cos_sin(self.inv_freq, positions, self.rope_scaling)


def create(spec_type: str, target, options) -> MTPDrafter:
    """The registry's constructor (draft/registry.py): the target family's MTP block, read from the target's
    own checkpoint (`options.target_source`)."""
    from flashdraft.formats.loader import load_into
    from flashdraft.models.registry import family_for

    family = family_for(target.cfg.arch)
    if family.mtp_block is None:
        raise ValueError(f"--spec-type {spec_type}: {family.name} models have no MTP block")
    layers = getattr(target.cfg, "mtp_layers", 0)
    if layers == 0:
        raise ValueError(f"--spec-type {spec_type}: this checkpoint holds no MTP block (its config says "
                         "mtp_num_hidden_layers 0, or its GGUF nextn_predict_layers 0: converted without it)")
    if layers > 1:
        raise ValueError(f"--spec-type {spec_type}: checkpoints with {layers} MTP layers are not supported yet")
    if options.target_source is None:
        raise ValueError(f"--spec-type {spec_type}: the MTP block is read from the target's files, none given")
    with torch.device("meta"):
        block = family.mtp_block(target.cfg)
    state, quantized = {}, {}
    for name, tensor in family.mtp_tensors(options.target_source, options.dtype, options.device, options.quantized):
        if isinstance(tensor, QuantizedWeight):
            quantized[name] = tensor
        else:
            state[name] = tensor.to(device=options.device, dtype=options.dtype)
    load_into(block, state, quantized, options.dtype, options.device, "the MTP block")
    for p in block.parameters():
        p.requires_grad_(False)
    drafter = MTPDrafter(block.eval(), target, int(options.params.get("draft_n_max", N_MAX)))
    drafter.name = spec_type
    return drafter

"""What every decoder-only family shares: the token embedding, the layer loop with feature capture for the
draft, the final norm and LM head (vocabulary-split under tensor parallelism), state allocation and compiled
layers. A family's file builds `self.model` (`embed_tokens`, `layers`, `norm`) and `self.lm_head` with HF's
names, says which cache each layer needs (`layer_cache`) and what each layer reads besides x (`layer_inputs`)."""
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flashdraft.layers.compile import compile_layer_forward
from flashdraft.layers.kv_cache import KVCache, KVState, Slots
from flashdraft.layers.kv_quant import SHIFT_KEYS, KVCodec, kv_codecs
from flashdraft.models.interface import LogitsAt
from flashdraft.models.tp import gather_vocab

KEY_SHIFT_TOKENS = 256  # random tokens from position 0 whose mean key per layer shifts a quantized cache's keys
KEY_SHIFT_SEED = 0


class DecoderLM(nn.Module):
    def __init__(self, cfg, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.compiled_layer = None
        self.compiled_widths: set[int] = set()
        self.key_shift_means: list[Tensor | None] | None = None

    # -------------------------------------------------------------------------------- for the family to say
    def layer_cache(self, i: int, n_slots: int, max_len: int, codecs: tuple[KVCodec, KVCodec]) -> KVCache:
        raise NotImplementedError

    def layer_inputs(self, positions: Tensor, attn_len: int, fresh: bool) -> list[tuple]:
        """Per layer, the arguments after (x, cache view, positions) that its forward takes."""
        raise NotImplementedError

    def prepare(self, max_len: int) -> None:
        """Position tables for up to `max_len` positions (called by new_state)."""

    # -------------------------------------------------------------------------------- shared
    @property
    def dtype(self) -> torch.dtype:  # the final norm: dense in every weight format
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_state(self, n_slots: int, max_len: int, cache_types: tuple[str, str] | None = None) -> KVState:
        codecs = kv_codecs(cache_types, self.dtype)
        shifts = self.key_shifts() if SHIFT_KEYS and codecs[0].packed else [None] * len(self.model.layers)
        self.prepare(max_len)
        caches = [self.layer_cache(i, n_slots, max_len, codecs) for i in range(len(self.model.layers))]
        for cache, shift in zip(caches, shifts):
            if isinstance(cache, KVCache):
                cache.key_shift = shift
        return KVState(caches, max_len)

    @torch.no_grad()  # (not inference tensors: compiled graphs and training may read the shifts)
    def key_shifts(self) -> list[Tensor | None]:
        """Per layer, the mean key [KV, D] (float32, after RoPE) over KEY_SHIFT_TOKENS random tokens from position
        0, which a quantized K cache subtracts from its keys (layers/kv_cache.py); None for a layer whose scores
        do not ignore a constant shift (softcapped). Random tokens find the same mean as text does: it is the
        key bias and the few channels every token lights. Computed once per model."""
        if self.key_shift_means is None:
            n = KEY_SHIFT_TOKENS
            ids = torch.randint(0, self.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(KEY_SHIFT_SEED))
            state = self.new_state(1, n)
            self.forward(ids.to(self.device), torch.arange(n, device=self.device)[None], state, fresh=True,
                         logits_at=None)
            self.key_shift_means = [
                cache.k[0, :, :n].float().mean(1) if isinstance(cache, KVCache) and layer.self_attn.spec.softcap is None
                else None for cache, layer in zip(state.layers, self.model.layers)]
        return self.key_shift_means

    def compile_layers(self, widths: tuple[int, ...] = (1, 16)) -> None:
        """Steps of `widths` tokens over the cache (decode and verify: the shapes CUDA graphs capture) run each
        layer through torch.compile, which fuses the norms, RoPE, MLP activation and residual adds into a few
        kernels. Parameters are graph inputs, so one compiled graph per (width, attended length) serves every
        layer; other shapes (prefill chunks) stay eager rather than compile once per prompt length."""
        self.compiled_layer = compile_layer_forward(type(self.model.layers[0]).forward)
        self.compiled_widths = set(widths)

    def embed(self, ids: Tensor) -> Tensor:
        """The first layer's input (a family may scale the rows)."""
        return self.model.embed_tokens(ids)

    def token_embedding(self, ids: Tensor) -> Tensor:
        """The embedding's rows as stored (what a DFlash draft's input starts from)."""
        return self.model.embed_tokens(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.world_size > 1:
            return gather_vocab(self.lm_head(hidden), self.cfg.vocab_size)
        return self.lm_head(hidden)

    def forward(self, ids: Tensor, positions: Tensor, state: KVState | None = None, slots: Slots = 0,
                attn_len: int | None = None, capture: Sequence[int] = (), fresh: bool = False,
                logits_at: LogitsAt = "all", last_layer: int | None = None,
                eager: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """See models.interface.CausalLM.forward."""
        if state is None and not fresh:
            raise ValueError("a forward over cached positions needs the model state")
        if attn_len is None:
            attn_len = ids.shape[1] if fresh else int(positions.max()) + 1
        if state is not None and attn_len > state.max_len:
            raise ValueError(f"position {attn_len - 1} is past the context size {state.max_len}")
        x = self.embed(ids)
        inputs = self.layer_inputs(positions, attn_len, fresh)
        want = set(capture)
        captured = {}
        compiled = self.compiled_layer if not (fresh or eager) and ids.shape[1] in self.compiled_widths else None
        layers = self.model.layers if last_layer is None else self.model.layers[:last_layer + 1]
        for i, layer in enumerate(layers):
            cache = None if state is None else state.layers[i].view(slots)
            args = (x, cache, positions, *inputs[i])
            x = compiled(layer, *args) if compiled is not None else layer(*args)
            if i in want:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if logits_at is None or last_layer is not None:
            return None, features
        if isinstance(logits_at, Tensor):
            x = x[torch.arange(x.shape[0], device=x.device), logits_at][:, None]
        elif logits_at == "last":
            x = x[:, -1:]
        return self.logits(self.model.norm(x)), features

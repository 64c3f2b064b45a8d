"""What every decoder-only family shares: the token embedding, the layer loop with feature capture for the
draft, the final norm and LM head (vocabulary-split under tensor parallelism), state allocation and compiled
layers. A family's file builds `self.model` (`embed_tokens`, `layers`, `norm`) and `self.lm_head` with HF's
names, says which cache each layer needs (`layer_cache`) and what each layer reads besides x (`layer_inputs`)."""
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flashdraft.layers.compile import compile_layer_forward
from flashdraft.layers.kv_cache import KVCache, KVState, Slots
from flashdraft.layers.kv_quant import KVCodec, kv_codecs
from flashdraft.models.interface import LogitsAt
from flashdraft.models.tp import gather_vocab


class DecoderLM(nn.Module):
    def __init__(self, cfg, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.compiled_layer = None
        self.compiled_widths: set[int] = set()

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
        self.prepare(max_len)
        codecs = kv_codecs(cache_types, self.dtype)
        return KVState([self.layer_cache(i, n_slots, max_len, codecs) for i in range(len(self.model.layers))], max_len)

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
                logits_at: LogitsAt = "all", last_layer: int | None = None) -> tuple[Tensor | None, Tensor | None]:
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
        compiled = self.compiled_layer if not fresh and ids.shape[1] in self.compiled_widths else None
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

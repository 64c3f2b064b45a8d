"""Gemma 4 assistant drafter (Google's `gemma-4-*-it-assistant`: transformers' Gemma4AssistantForCausalLM, llama.cpp's
`gemma4-assistant` GGUF; `-md ASSISTANT`, with or without llama.cpp's `--spec-type draft-mtp`).

A few Gemma 4 blocks whose attention has queries only: each layer attends over the target's own K/V, that of the
target's last layer of the same type (sliding or full), so the assistant keeps no cache. A step reads (t, h): t a
token at position p, h the target's final-normed hidden state at p - 1; its input is pre_projection(cat(target
embedding of t times sqrt(target hidden), h)), and after its layers and final norm it gives the next token through
its own LM head (tied to its embedding, no softcap) and the next step's h through post_projection. All k steps of a
proposal sit at the anchor's position p, so they read the same target K/V: positions before p, which the target
wrote in earlier steps (the verify step after the proposal writes p on). As llama.cpp's (seq_rm) and unlike
transformers' generate (whose crop leaves a rejected draft's K/V at the anchor's position visible), it reads only
committed positions before the anchor. A sliding layer reads the last window + 1 of them, as transformers' mask does
(llama.cpp's standard sliding mask keeps window - 1: only contexts longer than the window tell them apart), from the
target's window ring, where a verify step leaves rejected rows up to p - 1 + n_max: the window and n_max must fit in
its rows (check_target).

E2B/E4B assistants (`use_ordered_embeddings`) pick the next token among the vocabulary clusters of their top
centroids (transformers' masked embedder); a GGUF has no centroids (llama.cpp's converter drops them), so its head is
dense, as llama.cpp's graph is."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flashdraft.engine.sampling import argmax_rows
from flashdraft.layers.attention import AttentionSpec, attend_cache
from flashdraft.layers.kv_cache import slot_row, window_positions
from flashdraft.layers.linear import Linear
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.quantized import QuantizedWeight
from flashdraft.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq
from flashdraft.models.gemma import FULL, SLIDING, GemmaConfig, GemmaDecoderLayer

if TYPE_CHECKING:
    from flashdraft.draft.interface import LoadOptions
    from flashdraft.draft.registry import DraftSource
    from flashdraft.formats.gguf import GGUFFile

HF_ARCHITECTURES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")  # (the latter refused)
GGUF_ARCHITECTURE = "gemma4-assistant"
N_MAX = 3  # proposals per step unless --spec-draft-n-max says otherwise (llama.cpp's default)
NONE = -2  # hidden_at of a slot holding no h (-1 would match position 0's predecessor)
# llama.cpp's names of the tensors the assistant has beyond a Gemma 4 block's (llama-arch.cpp)
GGUF_NAMES = {"nextn.pre_projection.weight": "pre_projection.weight",
              "nextn.post_projection.weight": "post_projection.weight"}
GGUF_IGNORED = ("masked_embd_centroids", "masked_embd_ordering")  # not read by llama.cpp's graph either


def is_assistant_gguf(architecture: str) -> bool:
    return architecture == GGUF_ARCHITECTURE


def drafts_for(target) -> bool:
    """Whether a Gemma 4 assistant may draft for `target` (a Gemma 4 model: check_target says what else must fit)."""
    return getattr(target.cfg, "arch", None) == "gemma4"


@dataclass
class AssistantConfig:
    blocks: GemmaConfig  # the assistant's own Gemma 4 layers (their K/V parts unused)
    backbone_hidden_size: int  # the target's hidden size
    centroids: int = 0  # > 0: the centroid-masked head of E2B/E4B assistants
    centroid_top_k: int = 0

    @staticmethod
    def from_hf(cfg: dict) -> AssistantConfig:
        unified = cfg.get("model_type") == "gemma4_unified_assistant"
        if unified or HF_ARCHITECTURES[1] in (cfg.get("architectures") or []):
            raise ValueError("Gemma 4 unified assistants (the 12B's) draft for Gemma 4 unified targets, which "
                             "flashdraft does not read yet")
        text = cfg.get("text_config")
        if not isinstance(text, dict) or "backbone_hidden_size" not in cfg:
            raise ValueError("not a Gemma 4 assistant config: it needs text_config and backbone_hidden_size")
        # every assistant layer reads the target's K/V, which is what num_kv_shared_layers says there
        blocks = GemmaConfig.from_hf({**text, "num_kv_shared_layers": 0})
        if blocks.arch != "gemma4":
            raise ValueError(f"a Gemma 4 assistant's text_config is gemma4_text, not {text.get('model_type')!r}")
        ordered = bool(cfg.get("use_ordered_embeddings"))
        return AssistantConfig(blocks, int(cfg["backbone_hidden_size"]),
                               int(cfg.get("num_centroids", 2048)) if ordered else 0,
                               int(cfg.get("centroid_intermediate_top_k", 32)) if ordered else 0)


class QueryAttention(nn.Module):
    """A Gemma 4 attention layer with queries only, over a target layer's cache view (layers.kv_cache.KVSlots)."""

    def __init__(self, cfg: GemmaConfig, i: int):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dims[i]
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, fp32_weight=True)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.spec = AttentionSpec(scale=cfg.attn_scale)

    def forward(self, x: Tensor, cache, last: Tensor | None, cos_sin: Tensor, mask: Tensor | None, length: int,
                keys_from: str = "cache") -> Tensor:
        """x [B, T, hidden] over the first `length` rows of `cache`: a cache by position reads the rows up to
        `last` [B, T]; a window ring takes `mask` [B, T, length] instead. (GemmaDecoderLayer's argument order.)"""
        B, T = x.shape[:2]
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)), cos_sin)
        return self.o_proj(attend_cache(q, cache, length, mask, self.spec, last))


class AssistantLayer(GemmaDecoderLayer):
    def __init__(self, cfg: GemmaConfig, i: int):
        super().__init__(cfg, i)
        self.self_attn = QueryAttention(cfg, i)


class MaskedEmbedder(nn.Module):
    """E2B/E4B heads: the tokens of the top centroids' vocabulary clusters only (transformers' masked embedder)."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int):
        super().__init__()
        if vocab % centroids:
            raise ValueError(f"a vocabulary of {vocab} does not split into {centroids} centroid clusters")
        self.centroids = Linear(hidden, centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))
        self.top_k = top_k

    def greedy(self, normed: Tensor, head: Tensor) -> Tensor:
        """normed [1, hidden], head [vocab, hidden] -> the best token [1] among the clusters of the top centroids."""
        top = self.centroids(normed).topk(self.top_k, dim=-1).indices[0]  # [top_k]
        clusters = self.token_ordering.view(self.centroids.out_features, -1)
        ids = clusters[top].flatten()  # [top_k * tokens per cluster]
        return ids[argmax_rows(normed @ head[ids].t())]


class Gemma4Assistant(nn.Module):
    """The network, with HF's module names (but `lm_head` holding the tied embedding's rows)."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        b = cfg.blocks
        self.cfg = cfg
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(AssistantLayer(b, i) for i in range(b.num_layers))
        self.model.norm = RMSNorm(b.hidden_size, b.rms_norm_eps, fp32_weight=True)
        self.pre_projection = Linear(2 * cfg.backbone_hidden_size, b.hidden_size, bias=False)
        self.post_projection = Linear(b.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.lm_head = Linear(b.hidden_size, b.vocab_size, bias=False)
        self.masked_embedding = MaskedEmbedder(b.hidden_size, b.vocab_size, cfg.centroids, cfg.centroid_top_k) \
            if cfg.centroids else None

    def next_token(self, normed: Tensor) -> Tensor:
        if self.masked_embedding is None:
            return argmax_rows(self.lm_head(normed))
        return self.masked_embedding.greedy(normed, self.lm_head.weight)


class AssistantState:
    """Per slot: the target's final-normed h at one observed position (`hidden_at`: which; NONE)."""

    def __init__(self, n_slots: int, width: int, dtype: torch.dtype, device):
        self.hidden = torch.zeros(n_slots, width, dtype=dtype, device=device)
        self.hidden_at = torch.full((n_slots,), NONE, dtype=torch.long, device=device)

    @property
    def bytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()


class Gemma4AssistantDrafter(nn.Module):
    """The Drafter (draft/interface.py). It reads the target's state (`read_target_state`), which the engine hands it
    once; `target_layers` is the target's last layer, whose output `observe` norms into h."""
    name = "gemma4-assistant"
    slot_tensors = True  # propose and observe take the slot as a [1] tensor too: one graph for every slot

    def __init__(self, assistant: Gemma4Assistant, target, n_max: int = N_MAX):
        super().__init__()
        if n_max < 1:
            raise ValueError(f"--spec-draft-n-max {n_max}: the assistant proposes at least one token")
        self.assistant = assistant
        self.target_norm = (target.model.norm,)  # in a tuple: the target's module, not this one's
        self.block_size = n_max + 1
        self.target_layers = (target.cfg.num_layers - 1,)
        blocks = assistant.cfg.blocks
        # each assistant layer reads the target's last layer of its type, as transformers' shared K/V
        self.reads = [max(i for i, t in enumerate(target.cfg.layer_types) if t == kind) for kind in blocks.layer_types]
        for kind, spec in blocks.rope.items():
            inv_freq, scaling = rope_inv_freq(spec, target.device)
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)
            setattr(self, f"rope_scaling_{kind}", scaling)
        self.window = blocks.sliding_window
        self.target_state = None
        self.state: AssistantState | None = None

    # ---- Drafter

    def read_target_state(self, state) -> None:
        self.target_state = state

    def setup_cache(self, window: int, n_slots: int = 1,
                    cache_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)) -> None:
        weight = self.assistant.model.norm.weight
        self.state = AssistantState(n_slots, self.assistant.cfg.backbone_hidden_size, weight.dtype, weight.device)

    def reset(self, slot: int = 0, keep: int = 0) -> None:
        self.state.hidden_at[slot].masked_fill_(self.state.hidden_at[slot] >= keep, NONE)

    def observe(self, tokens: Tensor, features: Tensor | None, positions: Tensor, slots: int | Tensor = 0) -> None:
        """One row (B = 1): the target's h at the last committed position, for the next proposal."""
        s = self.state
        s.hidden[slots] = self.target_norm[0](features[0, -1:]).to(s.hidden.dtype)
        s.hidden_at[slots] = positions[0, -1:]

    def propose(self, target, anchors: Tensor, positions: Tensor, slots: int | Tensor, k: int,
                live: Tensor | None = None, block: int | None = None, context_rows: int | None = None) -> Tensor:
        """One row (B = 1): k chained steps at the anchor's position, [1, k] greedy tokens."""
        if self.target_state is None:
            raise RuntimeError("the Gemma 4 assistant reads the target's caches: read_target_state was not called")
        s, a = self.state, self.assistant
        at = positions[:1]
        known = slot_row(s.hidden_at, slots) == at - 1  # zeros where the anchor's predecessor was not observed
        h = slot_row(s.hidden, slots)[None] * known.to(s.hidden.dtype)
        layer_inputs = self._layer_inputs(slots, at, context_rows)
        token, proposed = anchors[:1], []
        for _ in range(k):
            x = a.pre_projection(torch.cat([target.embed(token).to(h.dtype), h], dim=-1))[None]
            for layer, inputs in zip(a.model.layers, layer_inputs):
                x = layer(x, *inputs)
            normed = a.model.norm(x[0])
            token = a.next_token(normed)
            h = a.post_projection(normed)
            proposed.append(token)
        return torch.cat(proposed)[None]

    def compile_layers(self, block_sizes: tuple[int, ...] | None = None) -> None:
        pass

    # ---- the target's K/V

    def _layer_inputs(self, slots: int | Tensor, at: Tensor, context_rows: int | None) -> list[tuple]:
        """Per assistant layer, what GemmaDecoderLayer.forward takes after x: the target layer's cache view, the last
        position read, (cos, sin) at the anchor's position, the mask, the rows read."""
        last = (at - 1)[None]  # [1, 1]: the queries read the positions before the anchor's
        kinds = self.assistant.cfg.blocks.layer_types
        cos_sin = {kind: rope_cos_sin(getattr(self, f"inv_freq_{kind}"), at, getattr(self, f"rope_scaling_{kind}"))
                   [:, None] for kind in set(kinds)}
        inputs = []
        for kind, i in zip(kinds, self.reads):
            cache = self.target_state.layers[i]
            if kind == SLIDING:  # a ring: the positions its rows hold up to the anchor's predecessor (rows that a
                held = window_positions(at - 1, cache.rows)  # verify step wrote past it come out older than the window)
                mask = (held >= 0) & (held >= at - 1 - self.window)
                inputs.append((cache.view(slots), None, cos_sin[kind], mask[:, None], cache.rows, "cache"))
            else:
                rows = cache.rows if context_rows is None else min(context_rows, cache.rows)
                inputs.append((cache.view(slots), last, cos_sin[kind], None, rows, "cache"))
        return inputs


def check_target(cfg: AssistantConfig, target, n_max: int = N_MAX) -> None:
    """ValueError naming what does not fit between an assistant proposing `n_max` tokens a step and its target."""
    t = target.cfg
    if not drafts_for(target):
        raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 target, not a {getattr(t, 'arch', 'unknown')} one")
    b = cfg.blocks
    if cfg.backbone_hidden_size != t.hidden_size:
        raise ValueError(f"the assistant's backbone_hidden_size {cfg.backbone_hidden_size} is not the target's "
                         f"hidden size {t.hidden_size}")
    if b.vocab_size != t.vocab_size:
        raise ValueError(f"the assistant's vocabulary ({b.vocab_size}) is not the target's ({t.vocab_size})")
    for i, kind in enumerate(b.layer_types):
        if kind not in t.layer_types:
            raise ValueError(f"assistant layer {i} reads the target's {kind} K/V, and the target has no such layer")
        read = max(j for j, tt in enumerate(t.layer_types) if tt == kind)
        if b.head_dims[i] != t.head_dims[read] or b.num_heads % t.kv_heads[read]:
            raise ValueError(f"assistant layer {i} ({b.num_heads} heads of {b.head_dims[i]}) does not fit target layer "
                             f"{read} ({t.kv_heads[read]} KV heads of {t.head_dims[read]})")
    if SLIDING in b.layer_types:
        # The proposals at anchor p read positions p - 1 - window ... p - 1 from the target's ring, taking row r
        # as the latest position <= p - 1 that is r mod rows. The verify step before (at worst n_max + 1 rows from
        # p - 1, only its first kept) left rejected rows at positions up to p - 1 + n_max, each taken as the
        # position a ring's length before it, which the mask must drop: p - 1 + n_max - rows < p - 1 - window,
        # i.e. window + n_max < rows.
        rows = target.window_rows
        most = rows - 1 - b.sliding_window
        if most < 1:
            raise ValueError(f"the assistant's sliding window {b.sliding_window} reaches past the target's ring "
                             f"({rows} rows: window {t.sliding_window} + {target.WINDOW_STEP})")
        if n_max > most:
            raise ValueError(f"--spec-draft-n-max {n_max}: at most {most} for this assistant (its sliding window "
                             f"{b.sliding_window} and the rows a verify step rejects must fit in the target's window "
                             f"ring of {rows} rows)")
    if FULL not in b.layer_types and SLIDING not in b.layer_types:
        raise ValueError("the assistant has no attention layers")


def build(cfg: AssistantConfig, tensors: dict, options: LoadOptions, where: str) -> Gemma4Assistant:
    """The network holding `tensors` (HF names; GGUF matrices may be QuantizedWeights), checked against cfg."""
    from flashdraft.formats.loader import load_into
    tensors = dict(tensors)
    embedding = tensors.pop("model.embed_tokens.weight", None)
    if "lm_head.weight" not in tensors and embedding is not None:  # tied: the head is the embedding's rows
        tensors["lm_head.weight"] = embedding
    tensors = {n: t for n, t in tensors.items() if "rotary_emb" not in n}
    with torch.device("meta"):
        model = Gemma4Assistant(cfg)
    state, quantized = {}, {}
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantizedWeight):
            quantized[name] = tensor
        else:
            state[name] = tensor.to(options.device, torch.long if tensor.dtype == torch.long else options.dtype)
    try:
        load_into(model, state, quantized, options.dtype, options.device, "a Gemma 4 assistant")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return model.requires_grad_(False).eval()


def gemma4_view(g: GGUFFile) -> GGUFFile:
    """A `gemma4-assistant` GGUF as a gemma4 file: its keys renamed, so that formats/gguf.py reads its blocks."""
    prefix = f"{GGUF_ARCHITECTURE}."
    if g.metadata.get(prefix + "embedding_length_out") is None:
        raise ValueError(f"{g.path.name}: no {prefix}embedding_length_out (the target's hidden size)")
    metadata = {("gemma4." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in g.metadata.items()}
    metadata["general.architecture"] = "gemma4"
    metadata.pop("gemma4.attention.shared_kv_layers", None)  # all of them: every layer reads the target's K/V
    return dataclasses.replace(g, metadata=metadata)


def gguf_config(g: GGUFFile) -> dict:
    """The HF config.json dict of a `gemma4-assistant` GGUF."""
    from flashdraft.formats.gguf import gguf_to_hf_config
    view = gemma4_view(g)
    return {"architectures": [HF_ARCHITECTURES[0]], "model_type": "gemma4_assistant",
            "backbone_hidden_size": int(view.metadata["gemma4.embedding_length_out"]),
            "text_config": gguf_to_hf_config(view)}


def gguf_tensors(g: GGUFFile, options: LoadOptions) -> dict:
    """HF-named tensors of a `gemma4-assistant` GGUF (the Gemma family's names for the blocks)."""
    from flashdraft.formats.gguf import hf_name, iter_gguf_tensors
    from flashdraft.models.registry import GEMMA

    def name(gguf_name: str) -> str | None:
        return None if gguf_name.startswith(GGUF_IGNORED) else GGUF_NAMES.get(gguf_name) or hf_name(gguf_name, GEMMA)
    return dict(iter_gguf_tensors(gemma4_view(g), options.dtype, options.device, keep_quantized=options.quantized,
                                  names=name))


def load(source: DraftSource, target, options: LoadOptions) -> Gemma4AssistantDrafter:
    """The registry's loader (draft/registry.py): an HF folder or a `gemma4-assistant` GGUF, checked against
    `target`."""
    from flashdraft.formats.safetensors import iter_tensors
    n_max = int(options.params.get("draft_n_max", N_MAX))
    try:
        cfg = AssistantConfig.from_hf(gguf_config(source.gguf) if source.gguf is not None else source.config)
        check_target(cfg, target, n_max)  # before the weights are read
        if source.gguf is not None:
            tensors = gguf_tensors(source.gguf, options)
        else:
            tensors = dict(iter_tensors(source.path, None, options.device))
    except (ValueError, KeyError) as e:
        raise ValueError(f"{source.path}: {e}") from None
    drafter = Gemma4AssistantDrafter(build(cfg, tensors, options, str(source.path)), target, n_max)
    return drafter.requires_grad_(False).eval()

"""Model families by HF `model_type` and GGUF `general.architecture`: config reader, model class, GGUF tensor
names and tensor-parallel rules. A new family is its own file plus an entry here; nothing else changes."""
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashdraft.models import gemma, llama, qwen3_5

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn import Module


@dataclass(frozen=True)
class Family:
    name: str
    model_class: type                                  # built as model_class(cfg, rank, world_size)
    read_config: Callable[[dict], object]              # HF config.json dict -> the family's config
    hf_classes: dict[str, str]                         # model_type -> transformers class name
    gguf_architectures: dict[str, str] = field(default_factory=dict)  # GGUF general.architecture -> model_type
    gguf_global_names: dict[str, str] = field(default_factory=dict)   # GGUF tensor base name -> HF module name
    gguf_layer_names: dict[str, str] = field(default_factory=dict)    # GGUF blk.N part -> HF module in layer N
    gguf_permuted_qk: tuple[str, ...] = ()             # GGUF architectures whose q/k rows llama.cpp permutes
    tp_row_split: tuple[str, ...] = ()                 # modules split by output features (heads or columns)
    tp_column_split: tuple[str, ...] = ()              # modules split by input features (summed by all-reduce)
    gguf_config: Callable[[dict, dict, dict], dict] | None = None  # (metadata, tensors, shared keys) -> HF config
    gguf_norm_shift: dict[str, float] = field(default_factory=dict)  # GGUF arch -> subtracted from norm weights
    # HF name -> None, or how a tensor's float32 values as llama.cpp's converter wrote them become the model's
    # (changes that a table of names cannot say; such a tensor is always dequantised)
    gguf_values: Callable[[str], Callable[["Tensor"], "Tensor"] | None] | None = None
    refused: dict[str, str] = field(default_factory=dict)  # model_type or GGUF architecture -> why it does not load
    # the checkpoint's multi-token-prediction block, for the MTP drafter (draft/mtp.py): (cfg) -> module, and
    # (checkpoint path, dtype, device, quantized) -> its (name, tensor) pairs; None: the family has none
    mtp_block: Callable[[object], "Module"] | None = None
    mtp_tensors: Callable[..., Iterator] | None = None
    gguf_mtp_names: dict[str, str] = field(default_factory=dict)  # GGUF blk.N.nextn.<name> -> name in the block

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.hf_classes)


# llama.cpp's names of the attention and MLP tensors every family here shares (blk.N.<name>)
DECODER_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

LLAMA = Family(
    name="llama",
    model_class=llama.Llama,
    read_config=llama.LlamaConfig.from_hf,
    hf_classes={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"},
    gguf_architectures={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"},
    gguf_global_names=GLOBAL_NAMES,
    gguf_layer_names={**DECODER_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"},
    gguf_permuted_qk=("llama",),  # the converter permutes q/k for `llama` (and so Mistral) only
    tp_row_split=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    tp_column_split=("o_proj", "down_proj"),
)

GEMMA = Family(
    name="gemma",
    model_class=gemma.Gemma,
    read_config=gemma.GemmaConfig.from_hf,
    hf_classes=gemma.HF_CLASSES,
    gguf_architectures={"gemma3": "gemma3", "gemma4": "gemma4"},
    gguf_global_names=GLOBAL_NAMES,
    gguf_layer_names={
        **DECODER_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
        "layer_output_scale.weight": "layer_scalar",
    },
    gguf_config=gemma.gguf_config,
    gguf_norm_shift={"gemma3": 1.0},  # llama.cpp bakes Gemma 3's (1 + w) into the file; HF stores w
)

QWEN3_5 = Family(
    name="qwen3_5",
    model_class=qwen3_5.Qwen35,
    read_config=qwen3_5.Qwen35Config.from_hf,
    hf_classes=qwen3_5.HF_CLASSES,
    gguf_architectures={"qwen35": "qwen3_5_text"},
    gguf_global_names=GLOBAL_NAMES,
    gguf_layer_names={**DECODER_LAYER_NAMES, **qwen3_5.GGUF_LAYER_NAMES},
    gguf_config=qwen3_5.gguf_config,
    gguf_values=qwen3_5.gguf_values,
    refused=qwen3_5.REFUSED,
    mtp_block=qwen3_5.Qwen35MTP,
    mtp_tensors=qwen3_5.mtp_tensors,
    gguf_mtp_names=qwen3_5.GGUF_MTP_NAMES,
)

FAMILIES: list[Family] = [LLAMA, GEMMA, QWEN3_5]


def register(family: Family) -> None:
    FAMILIES.append(family)


def model_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]


def _refuse(name: str) -> None:
    for f in FAMILIES:
        if name in f.refused:
            raise ValueError(f.refused[name])


def family_for(model_type: str) -> Family:
    for f in FAMILIES:
        if model_type in f.hf_classes:
            return f
    _refuse(model_type)
    raise ValueError(f"unsupported architecture {model_type!r} (supported: {', '.join(model_types())})")


def family_for_gguf(architecture: str) -> Family:
    for f in FAMILIES:
        if architecture in f.gguf_architectures:
            return f
    _refuse(architecture)
    supported = [a for f in FAMILIES for a in f.gguf_architectures]
    raise ValueError(f"unsupported GGUF architecture {architecture!r} (supported: {', '.join(supported)})")


def read_config(hf_config: dict):
    """(family, config) for an HF config.json dict."""
    family = family_for(hf_config.get("model_type", ""))
    return family, family.read_config(hf_config)

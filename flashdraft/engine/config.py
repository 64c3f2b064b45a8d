"""EngineConfig: how to build an engine, passed whole (no torch import, so command lines can fill it cheaply)."""
from dataclasses import dataclass


# KV cache storage types, by llama.cpp's names (quant/kv_types.py; "auto": the model's dtype)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl", "turbo3", "turbo4")
DRAFT_KV_CACHE_TYPES = ("f32", "f16", "bf16")  # the draft's context ring (--spec-draft-type-k/-v)


@dataclass
class EngineConfig:
    """How to build an engine; passed whole (the command lines fill it through flashdraft.args)."""
    model: str = ""
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    ctx_size: int = 4096  # per slot
    n_slots: int = 1
    draft_window: int | None = None
    block_size: int | None = None
    draft_n_max: int | None = None  # llama.cpp's --spec-draft-n-max: a draft model's block is this + 1 (clamped)
    compile: bool | None = None  # torch.compile'd layers in the step graphs (None: on with CUDA; compile_enabled)
    adaptive: bool = False  # adaptive verify width (--spec-dm-adaptive)
    progress: bool = False
    # GGUF matrices (the target's and a GGUF draft's): "quantized" keeps them in their block format (the GPU
    # kernels), "dequantized" expands them to `dtype` (--dequantize); "auto": quantized on CUDA, dequantized
    # elsewhere (engine.keep_quantized)
    weights: str = "auto"
    # the draft's input embedding: token rows times this (None: the draft config's input_embedding_scale, 1.0
    # when absent, as z-lab's reference and BeeLlama; vLLM applies a Gemma target's sqrt(hidden) instead)
    draft_embed_scale: float | None = None
    cache_type_k: str = "auto"  # KV_CACHE_TYPES (--cache-type-k / -ctk)
    cache_type_v: str = "auto"
    slot_prompt_similarity: float = 0.1  # a request takes the slot sharing this much of its prompt (-sps)
    draft_cache_type_k: str = "auto"  # DRAFT_KV_CACHE_TYPES (--spec-draft-type-k); auto: the draft's dtype
    draft_cache_type_v: str = "auto"
    # the requests' default sampling (SamplingParams fields: a server's command line), which warm-up also runs so
    # that the first request finds its sampler graph captured
    warmup_sampling: dict | None = None
    # a drafter kind that needs no files, by its --spec-type name (ngram-mod), used when `draft` is None, and its
    # own settings by name (draft/registry.py)
    spec_type: str | None = None
    draft_params: dict | None = None
    # synthetic acceptance for benchmarking (--spec-synth-len / --spec-synth-rates: engine/synthetic.py)
    synth_len: float | None = None
    synth_rates: list[float] | None = None


def compile_enabled(config: EngineConfig) -> bool:
    """Whether the engine compiles its layers: asked for (--compile / --no-compile), else on with CUDA, where the
    step graphs capture compiled layers (the fast path; compiling for the CPU's eager steps does not pay)."""
    cuda = config.device.startswith("cuda")
    return cuda and (config.compile if config.compile is not None else True)

"""What `flashdraft serve` was asked to do, independent of how it was asked (flags, tests)."""
from dataclasses import dataclass

from flashdraft.engine.config import EngineConfig
from flashdraft.engine.sampling import llama_top


@dataclass
class Settings:
    model: str = ""
    draft: str | None = None
    speculative: bool = True
    spec_type: str | None = None  # a drafter kind without files, by its --spec-type name (ngram-mod)
    draft_params: dict | None = None  # its settings by name (--spec-ngram-mod-n-max: n_max)
    draft_window: int | None = None
    block_size: int | None = None
    draft_n_max: int | None = None  # --spec-draft-n-max
    host: str = "127.0.0.1"
    port: int = 8080
    n_slots: int = 1
    slot_prompt_similarity: float = 0.1  # -sps
    ctx_size: int = 4096  # total over all slots, as llama-server's -c; each slot gets ctx_size // n_slots
    fit: bool = True  # --fit: -c 0 shrinks to the largest context the free GPU memory holds
    fit_min_ctx: int = 4096  # --fit-ctx: the least context --fit may leave
    device: str | None = None
    dtype: str = "auto"
    compile: bool | None = None  # None: on with CUDA (engine.config.compile_enabled)
    dequantize: bool = False  # --dequantize: GGUF weights expanded to --dtype
    quantized: bool = False  # --quantized: GGUF matrices kept in their block format (the default on CUDA)
    adaptive: bool = True  # adaptive verify width (--spec-dm-adaptive)
    synth_len: float | None = None  # --spec-synth-len / --spec-synth-rates (benchmarking: engine/synthetic.py)
    synth_rates: list[float] | None = None
    draft_embed_scale: float | None = None  # --spec-draft-embed-scale
    cache_type_k: str = "auto"  # -ctk / -ctv
    cache_type_v: str = "auto"
    draft_cache_type_k: str = "auto"  # --spec-draft-type-k / -v
    draft_cache_type_v: str = "auto"
    threads: int | None = None  # -t: CPU threads (None: the physical cores, shared by the ranks of this host)
    threads_batch: int | None = None  # -tb: accepted; prompts run with -t threads
    tp: int = 1  # tensor-parallel ranks (processes); more than one serves one request at a time
    # request defaults (llama-server's), overridden per request
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n_predict: int = -1
    seed: int = -1
    chat_template_file: str | None = None
    reasoning: str = "auto"
    reasoning_format: str = "auto"  # a leading <think>...</think> goes to reasoning_content, unless "none"
    metrics: bool = False
    api_key: str | None = None
    alias: str | None = None
    webui: bool = True
    log_timestamps: bool = False
    log_prefix: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    timeout_headers: float = 10.0  # seconds for a request's headers (and for a new connection's first request)
    timeout: float = 600.0  # seconds for a whole request to arrive (llama-server's -to)
    timeout_idle: float = 5.0  # seconds an idle keep-alive connection stays open

    @property
    def slot_ctx(self) -> int:
        return self.ctx_size // max(self.n_slots, 1)

    def engine_config(self, draft: str | None, device: str, slot_ctx: int, progress: bool = False) -> EngineConfig:
        top_k, top_p = llama_top(self.top_k, self.top_p)  # as a request with the defaults takes them
        return EngineConfig(model=self.model, draft=draft, device=device, dtype=self.dtype, ctx_size=slot_ctx,
                            n_slots=self.n_slots, slot_prompt_similarity=self.slot_prompt_similarity,
                            draft_window=self.draft_window, block_size=self.block_size,
                            draft_n_max=self.draft_n_max,
                            compile=self.compile, adaptive=self.adaptive, progress=progress,
                            draft_embed_scale=self.draft_embed_scale, cache_type_k=self.cache_type_k,
                            cache_type_v=self.cache_type_v, draft_cache_type_k=self.draft_cache_type_k,
                            draft_cache_type_v=self.draft_cache_type_v,
                            weights="dequantized" if self.dequantize else "quantized" if self.quantized else "auto",
                            spec_type=self.spec_type if self.speculative else None, draft_params=self.draft_params,
                            synth_len=self.synth_len, synth_rates=self.synth_rates,
                            warmup_sampling=dict(temperature=self.temperature, top_k=top_k, top_p=top_p,
                                                 min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                                                 repeat_last_n=self.repeat_last_n,
                                                 presence_penalty=self.presence_penalty,
                                                 frequency_penalty=self.frequency_penalty))

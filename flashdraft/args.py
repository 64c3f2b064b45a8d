"""The engine's command-line flags, declared once for generate, serve and bench, and the EngineConfig they give."""
import argparse

from flashdraft.engine.config import DRAFT_KV_CACHE_TYPES, KV_CACHE_TYPES, EngineConfig

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_engine_args(ap: argparse.ArgumentParser, model: bool = True, context: bool = True) -> None:
    """model: -m/-md (the bench declares its own, optional, ones); context: --ctx-size, --block-size,
    --draft-window (the server declares llama-server's spellings and meanings: -c is the total over all slots,
    --spec-dflash-cross-ctx the window)."""
    if model:
        ap.add_argument("-m", "--model", required=True, help="target: GGUF file, HF folder, or a named model")
        ap.add_argument("-md", "--draft", help="DFlash draft (z-lab HF folder or draft GGUF); a named model brings "
                                               "its own")
    if context:
        ap.add_argument("--ctx-size", type=int, default=4096)
        ap.add_argument("--block-size", type=int, default=None, help="verify block (at most the draft's)")
        ap.add_argument("--draft-window", type=int, default=None, help="draft sees the last N positions")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    ap.add_argument("--dequantize", action="store_true",
                    help="expand GGUF weights (target and draft) to --dtype at load (default: on CUDA they stay in "
                         "their block format, read by the GGUF kernels; on the CPU they are expanded)")
    ap.add_argument("--quantized", action="store_true",
                    help="keep GGUF matrices in their block format (the default on CUDA; the CPU runs the kernels "
                         "only under TRITON_INTERPRET=1)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="fuse each layer's small ops with torch.compile inside the decode/verify step graphs (default: "
                         "on with CUDA; its caches persist under the cache folder, so a later start reuses the compiled "
                         "kernels; --no-compile: plain CUDA graphs, a faster first start, slower steps)")
    ap.add_argument("-ctk", "--cache-type-k", default="auto", choices=("auto", *KV_CACHE_TYPES),
                    help="KV cache storage for K, as llama.cpp's (default auto: the model's dtype); q8_0, q5_0, "
                         "q5_1, q4_0, q4_1, iq4_nl are 32-value blocks with fp16 scales, quantized as rows are "
                         "written (after a Hadamard rotation of each head where its size is a multiple of 64, as "
                         "llama.cpp; LLAMA_ATTN_ROT_DISABLE=1 turns it off); turbo3/turbo4: 3/4 bits per value after "
                         "a randomised Hadamard rotation")
    ap.add_argument("-ctv", "--cache-type-v", default="auto", choices=("auto", *KV_CACHE_TYPES),
                    help="KV cache storage for V (as --cache-type-k)")
    ap.add_argument("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft", dest="draft_cache_type_k", default="auto",
                    choices=("auto", *DRAFT_KV_CACHE_TYPES),
                    help="the draft's context cache storage for K (default auto: the draft's dtype)")
    ap.add_argument("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft", dest="draft_cache_type_v", default="auto",
                    choices=("auto", *DRAFT_KV_CACHE_TYPES), help="the draft's context cache storage for V")
    ap.add_argument("--spec-draft-embed-scale", dest="draft_embed_scale", type=float, default=None, metavar="X",
                    help="scale of the draft's input token embeddings (default: the draft's input_embedding_scale, "
                         "1.0 when its config has none; Gemma drafts trained on the target's scaled embedding "
                         "want sqrt(hidden size))")
    ap.add_argument("--spec-dm-adaptive", dest="adaptive", action=argparse.BooleanOptionalAction, default=True,
                    help="choose each verify step's width from the draft's recent acceptance and measured step costs, "
                         "down to plain decoding when drafting does not pay (default on; off: always the full block)")


def default_device(device: str | None) -> str:
    import torch
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def engine_config(args: argparse.Namespace, draft: str | None, device: str, **overrides) -> EngineConfig:
    """The EngineConfig of parsed engine flags (the draft is resolved by the caller: named models bring one)."""
    fields = dict(model=args.model, draft=draft, device=device, dtype=args.dtype, ctx_size=args.ctx_size,
                  draft_window=args.draft_window, block_size=args.block_size, compile=args.compile,
                  adaptive=args.adaptive, draft_embed_scale=args.draft_embed_scale,
                  cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                  draft_cache_type_k=args.draft_cache_type_k, draft_cache_type_v=args.draft_cache_type_v,
                  weights="dequantized" if args.dequantize else "quantized" if args.quantized else "auto")
    return EngineConfig(**(fields | overrides))

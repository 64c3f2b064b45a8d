"""The engine's command-line flags, declared once for generate, serve and bench, and the EngineConfig they give."""
import argparse
import os
import time
from pathlib import Path

from flashdraft.engine.config import DRAFT_KV_CACHE_TYPES, KV_CACHE_TYPES, EngineConfig

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def comma_floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def add_engine_args(ap: argparse.ArgumentParser, model: bool = True, context: bool = True) -> None:
    """model: -m/-md (the bench declares its own, optional, ones); context: --ctx-size, --block-size,
    --draft-window (the server declares llama-server's spellings and meanings: -c is the total over all slots,
    --spec-dflash-cross-ctx the window)."""
    if model:
        ap.add_argument("-m", "--model", required=True, help="target: GGUF file, HF folder, or a named model")
        ap.add_argument("-md", "--draft", help="draft model: a DFlash or DFlash2 draft (z-lab HF folder or draft "
                                               "GGUF) or a Gemma 4 assistant; a named model brings its own")
    if context:
        ap.add_argument("--ctx-size", type=int, default=4096)
        ap.add_argument("--block-size", type=int, default=None, help="verify block (at most the draft's)")
        ap.add_argument("--draft-window", type=int, default=None, help="draft sees the last N positions")
    hub = ap.add_argument_group("models from the Hugging Face Hub (as llama.cpp's; downloaded into the Hugging "
                                "Face cache, then given as -m/-md)")
    hub.add_argument(*HUB_OPTIONS["model"], dest="hf_repo", metavar="<user>/<model>[:quant]",
                     help="the target from a Hugging Face repository: quant is case-insensitive, by default Q4_K_M, "
                          "else Q8_0, else the repository's first GGUF file; a repository of safetensors (an HF "
                          "folder) downloads whole. Example: ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF:Q8_0")
    hub.add_argument(*HUB_OPTIONS["draft"], dest="hf_repo_draft", metavar="<user>/<model>[:quant]",
                     help="the draft (-md) from a Hugging Face repository (a dflash-*.gguf file first, else as -hf; "
                          "an HF folder, as z-lab publishes drafts, downloads whole)")
    hub.add_argument(*HUB_OPTIONS["file"], dest="hf_file", metavar="FILE",
                     help="the file of the -hf repository to load, instead of the one its quant picks")
    hub.add_argument(*HUB_OPTIONS["token"], dest="hf_token", metavar="TOKEN",
                     help="Hugging Face access token (default: HF_TOKEN, or the one `hf auth login` saved)")
    hub.add_argument(OFFLINE, action="store_true",
                     help="use the Hugging Face cache only, never the network (as HF_HUB_OFFLINE=1)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                    help=f"CPU threads for generation (default: OMP_NUM_THREADS if set, else the physical cores this "
                         f"process may run on, {default_threads()} here, less those other processes keep busy when "
                         f"the command starts; on CUDA only host-side work uses them)")
    ap.add_argument("-tb", "--threads-batch", type=int, default=None, metavar="N",
                    help="CPU threads for prompt processing (accepted as llama.cpp's; prompts run with --threads)")
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
    ap.add_argument("--spec-draft-n-max", dest="draft_n_max", type=int, default=None, metavar="N",
                    help="the most tokens a draft model drafts a step (llama.cpp's; its default is 3): a verify block of "
                         "N + 1, clamped to the draft's trained block (default: the whole block; the adaptive width "
                         "then verifies what pays)")
    ap.add_argument("--spec-synth-len", dest="synth_len", type=float, default=None, metavar="L",
                    help="target mean synthetic acceptance length, including the target token (benchmarking only: "
                         "drafted tokens are accepted at random, the output is not valid; llama.cpp's)")
    ap.add_argument("--spec-synth-rates", dest="synth_rates", type=comma_floats, default=None,
                    metavar="P0,P1,...", help="comma-separated unconditional per-position synthetic acceptance "
                                              "probabilities, one per drafted token (benchmarking only)")
    ap.add_argument("--spec-dm-adaptive", dest="adaptive", action=argparse.BooleanOptionalAction, default=True,
                    help="choose each verify step's width from the draft's recent acceptance and measured step costs, "
                         "down to plain decoding when drafting does not pay (default on; off: always the full block)")


# the n-gram drafter's flags (llama.cpp's): (flag, the --spec-type it is for, its setting's name, the least value)
NGRAM_FLAGS = [
    ("--spec-ngram-mod-n-match", "ngram-mod", "n_match", 1),
    ("--spec-ngram-mod-n-max", "ngram-mod", "n_max", 1),
    ("--spec-ngram-mod-n-min", "ngram-mod", "n_min", 0),
    ("--spec-ngram-simple-size-n", "ngram-simple", "size_n", 1),
    ("--spec-ngram-simple-size-m", "ngram-simple", "size_m", 1),
    ("--spec-ngram-simple-min-hits", "ngram-simple", "min_hits", 1),
]


def add_speculation_args(ap: argparse.ArgumentParser) -> None:
    """--spec-type (llama.cpp's names) and the n-gram drafter's flags, for generate and serve."""
    ap.add_argument("--spec-type", default=None, metavar="TYPE",
                    help="none (plain decoding, a draft is not loaded), dflash or draft-dflash (a DFlash draft, "
                         "-md; implied by one), ngram-mod or ngram-simple (n-gram lookup over the request's prompt "
                         "and output: no draft model), mtp or draft-mtp (the target checkpoint's own MTP block: "
                         "Qwen3.5/3.6/3.8; with -md, a Gemma 4 assistant, which -md alone implies too)")
    ngram = ap.add_argument_group("n-gram lookup (--spec-type ngram-mod / ngram-simple, as llama.cpp's)")
    ngram.add_argument("--spec-ngram-mod-n-match", type=int, default=None, metavar="N",
                       help="ngram-mod lookup length: the tokens matched, the last committed one included "
                            "(default 24)")
    ngram.add_argument("--spec-ngram-mod-n-max", type=int, default=None, metavar="N",
                       help="the most tokens ngram-mod proposes: a verify block of N + 1 (default 64)")
    ngram.add_argument("--spec-ngram-mod-n-min", type=int, default=None, metavar="N",
                       help="fewer tokens found in a row propose nothing (default 48)")
    ngram.add_argument("--spec-ngram-simple-size-n", type=int, default=None, metavar="N",
                       help="ngram-simple lookup length, also the fewest tokens it proposes (default 12)")
    ngram.add_argument("--spec-ngram-simple-size-m", type=int, default=None, metavar="N",
                       help="the most tokens ngram-simple proposes (default 48)")
    ngram.add_argument("--spec-ngram-simple-min-hits", type=int, default=None, metavar="N",
                       help="accepted; llama.cpp's ngram-simple does not use it either")


def speculation(args: argparse.Namespace, draft: str | None) -> tuple[str | None, dict]:
    """The drafter kind without files that --spec-type names (None: a draft's kind, or plain decoding) and its
    settings by name. ValueError, in one line, for a type or a value that no drafter takes, flags that do not fit
    together, or a draft (-md) of another kind than --spec-type names (the command exits 1, as llama.cpp's does)."""
    from flashdraft.draft import ngram, registry
    from flashdraft.engine import synthetic

    given = [(flag, kind, name, least, value) for flag, kind, name, least in NGRAM_FLAGS
             if (value := getattr(args, flag[2:].replace("-", "_"))) is not None]
    spec_type = args.spec_type
    synth = args.synth_len is not None or bool(args.synth_rates)
    if synth and (spec_type == "none" or getattr(args, "no_spec", False) or not (draft or spec_type)):
        raise ValueError("--spec-synth-len / --spec-synth-rates need speculative decoding: a draft (-md) or "
                         "--spec-type ngram-mod")
    synthetic.check_flags(args.synth_len, args.synth_rates)
    if args.draft_n_max is not None:
        if args.draft_n_max < 0:
            raise ValueError(f"--spec-draft-n-max {args.draft_n_max}: invalid value")
        if getattr(args, "block_size", None) is not None:
            raise ValueError("--spec-draft-n-max and --block-size both set the verify block: give one")
    kind = registry.kind_named(spec_type, bool(draft)) if spec_type is not None else None  # a chain's: its last
    chained = spec_type is not None and "," in spec_type
    named = [n.strip() for n in spec_type.split(",")] if spec_type else []
    for flag, for_type, _, _, _ in given:
        if for_type not in named:
            raise ValueError(f"{flag} is for --spec-type {for_type}" + (f", not {spec_type}" if spec_type else ""))
    if kind is not None and kind.create is None and not draft:
        raise ValueError(f"--spec-type {spec_type} needs a draft model (-md / --spec-draft-model)")
    if kind is not None and kind.create is not None and draft:
        raise ValueError(f"--spec-type {spec_type} takes no draft model: drop -md (to chain an n-gram lookup before "
                         "a draft model: --spec-type ngram-mod,draft-dflash -md DRAFT)")
    drafted = draft_kind(draft, spec_type) if draft and spec_type != "none" else None
    settings = registry.shared_settings(spec_type, args.draft_n_max, drafted)
    if kind is None or (kind.create is None and not chained):
        return None, settings
    for flag, _, _, least, value in given:
        if not least <= value <= ngram.LIMIT:
            raise ValueError(f"{flag} {value}: must be between {least} and {ngram.LIMIT}")
    params = {name: value for _, _, name, _, value in given if name != "min_hits"}
    return spec_type, params | settings


def draft_kind(draft: str, spec_type: str | None):
    """The kind of the draft that -md names (draft/registry.py), read from its config.json or GGUF header before
    anything loads, and checked against --spec-type (ValueError, in one line naming both, for a DFlash draft under
    draft-mtp or a Gemma 4 assistant under draft-dflash). None where it is not on disk yet: the loader names it."""
    from flashdraft.draft import registry
    from flashdraft.formats.named import resolve_draft
    path = Path(resolve_draft(draft)).expanduser()
    if not path.exists():
        return None
    return registry.source_kind(registry.read_source(path), spec_type)


# llama.cpp's spellings; the flashdraft command resolves them into -m/-md before a subcommand parses its arguments
# (flashdraft.cli.hub_argv), so the parsers declare them for --help only
HUB_OPTIONS = {
    "model": ("-hf", "-hfr", "--hf-repo"),
    "draft": ("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"),
    "file": ("-hff", "--hf-file"),
    "token": ("-hft", "--hf-token"),
}
OFFLINE = "--offline"


def take_hub_options(argv: list[str]) -> tuple[list[str], dict[str, tuple[str, str]], bool]:
    """argv without the Hugging Face options; their values as {"model"|"draft"|"file"|"token": (as typed, value)};
    whether --offline was given. Raises ValueError for an option without its value."""
    kinds = {name: kind for kind, names in HUB_OPTIONS.items() for name in names}
    rest, found, offline = [], {}, False
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a == OFFLINE:
            offline = True
        elif name in kinds:
            if not eq:
                if i + 1 >= len(argv) or (argv[i + 1].startswith("-") and len(argv[i + 1]) > 1):
                    what = {"file": "FILE", "token": "TOKEN"}.get(kinds[name], "<user>/<model>[:quant]")
                    raise ValueError(f"{name} needs a value: {name} {what}")
                value = argv[i + 1]
                i += 1
            if kinds[name] in found:
                raise ValueError(f"{found[kinds[name]][0]} and {name} are given both: give one")
            found[kinds[name]] = (name, value)
        else:
            rest.append(a)
        i += 1
    return rest, found, offline


# the thread pools that read these when their library loads: set before torch is imported, so that no library starts
# a pool of its own size next to torch's
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                    "NUMEXPR_NUM_THREADS")


def default_threads() -> int:
    """The physical cores among the CPUs this process may run on: hyperthreads of one core count once (read from
    sysfs where it has the topology), so that busy sibling threads do not slow each other down."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add((Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def requested_threads(argv: list[str]) -> int | None:
    """The value of -t/--threads in a command line, read before it is parsed (None when absent or malformed)."""
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name in ("-t", "--threads"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return int(value) if int(value) > 0 else None
            except ValueError:
                return None
    return None


# How long the command looks at what the CPUs are doing before it picks its default thread count.
LOAD_WINDOW_S = 0.25


def _cpu_jiffies(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) time of these CPUs since boot, in clock ticks (/proc/stat; steal time counts as busy)."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def busy_cpus(window: float = LOAD_WINDOW_S) -> float | None:
    """How many of the CPUs this process may run on other processes keep busy now: their busy time over `window`
    seconds, less this process's own (None where /proc/stat is not there). A snapshot, unlike the load average,
    which still counts a command that ended a minute ago."""
    try:
        cpus = os.sched_getaffinity(0)
        busy0, total0 = _cpu_jiffies(cpus)
        own0 = sum(os.times()[:2])
        time.sleep(window)
        busy1, total1 = _cpu_jiffies(cpus)
        own1 = sum(os.times()[:2])
    except (AttributeError, OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return max(0.0, (busy1 - busy0) / (total1 - total0) * len(cpus) - (own1 - own0) / window)


def free_threads() -> int:
    """The default thread count of a command that computes: the physical cores less those other processes keep
    busy right now (at least 1). On a busy machine a thread that shares its core with another process is a step
    behind at every parallel region, and the others wait for it: one thread a free core runs faster."""
    physical = default_threads()
    busy = busy_cpus()
    if busy is None:
        return physical
    logical = len(os.sched_getaffinity(0))
    return max(1, min(physical, round((logical - busy) * physical / logical)))


def thread_env(argv: list[str], env=None, load_aware: bool = False) -> int:
    """Size the OpenMP/BLAS pools before torch loads, unless the user set them: -t, else the user's
    OMP_NUM_THREADS, else the physical cores (load_aware: those other processes leave free now, free_threads).
    OpenMP threads that wait sleep at once (OMP_WAIT_POLICY=PASSIVE) instead of spinning: a spinning thread takes
    the core from the thread it waits for when other processes share the cores. Returns the count."""
    env = os.environ if env is None else env
    user = env.get("OMP_NUM_THREADS", "")
    n = requested_threads(argv) or (int(user) if user.isdigit() and int(user) > 0 else None)
    n = n or (free_threads() if load_aware else default_threads())
    for name in THREAD_VARIABLES:
        if not env.get(name):
            env[name] = str(n)
    if not env.get("OMP_WAIT_POLICY") and not env.get("GOMP_SPINCOUNT"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return n


def set_threads(threads: int | None, world: int = 1) -> int:
    """torch's intra-op pool: `threads` (-t), else OMP_NUM_THREADS (the user's, or what thread_env chose), else the
    physical cores, shared by `world` processes of this host; one inter-op thread (the engine runs no independent
    ops side by side). Returns the count used."""
    import torch
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the ranks on this host (torchrun sets it)
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    n = threads or max(1, (int(chosen) if chosen.isdigit() and int(chosen) > 0 else default_threads())
                       // max(sharing, 1))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op work; already running: leave it
        pass
    return n


def default_device(device: str | None) -> str:
    import torch
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def engine_config(args: argparse.Namespace, draft: str | None, device: str, **overrides) -> EngineConfig:
    """The EngineConfig of parsed engine flags (the draft is resolved by the caller: named models bring one)."""
    fields = dict(model=args.model, draft=draft, device=device, dtype=args.dtype, ctx_size=args.ctx_size,
                  draft_window=args.draft_window, block_size=args.block_size, draft_n_max=args.draft_n_max,
                  compile=args.compile,
                  adaptive=args.adaptive, draft_embed_scale=args.draft_embed_scale,
                  cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                  draft_cache_type_k=args.draft_cache_type_k, draft_cache_type_v=args.draft_cache_type_v,
                  synth_len=args.synth_len, synth_rates=args.synth_rates,
                  weights="dequantized" if args.dequantize else "quantized" if args.quantized else "auto")
    return EngineConfig(**(fields | overrides))

"""`flashdraft serve`: llama-server's command line over the flashdraft engine."""
import argparse
import contextlib
import functools
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from flashdraft.args import add_engine_args, add_speculation_args, speculation
from flashdraft.server.settings import Settings

log = logging.getLogger("flashdraft.server")

API_KEY_VARIABLES = ("FLASHDRAFT_API_KEY", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY")

# llama-server flags that mean nothing here: (option strings, takes a value, why it is ignored)
IGNORED_FLAGS = [
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), True, "the whole model always runs on --device"),
    (("-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft"), True,
     "the draft always runs on --device with the target"),
    (("-b", "--batch-size"), True, "prompts are processed in the engine's own chunks (1024 tokens; 16-token "
                                   "slices beside other requests)"),
    (("-ub", "--ubatch-size"), True, "prompts are processed in the engine's own chunks (1024 tokens; 16-token "
                                     "slices beside other requests)"),
    (("-fa", "--flash-attn"), "?", "attention always takes fused kernels: the split-K kernel over the cache for "
                                   "decode and verify steps and prompt slices, PyTorch's flash attention for "
                                   "whole prompts"),
    (("--no-mmap",), False, "weights are read into PyTorch tensors, never memory-mapped"),
    (("--mlock",), False, "weights are read into PyTorch tensors, never memory-mapped"),
    (("--no-host",), False, "there are no host-side weight buffers to place"),
    (("-kvu", "--kv-unified"), False, "each slot has its own KV cache of ctx-size / parallel tokens"),
    (("-cram", "--cache-ram"), True, "there is no host-RAM prompt cache"),
    (("--spec-draft-n-min",), True, "the adaptive verify width (--spec-dm-adaptive) decides when drafting pays"),
    (("--spec-draft-p-min", "--draft-p-min"), True, "a step's drafted tokens are all verified in one captured "
                                                     "graph, so a low-confidence tail costs no extra pass; the "
                                                     "adaptive verify width decides how much a step drafts"),
    (("-fitt", "--fit-target"), True, "--fit leaves 1 GiB of GPU memory beside the caches (llama.cpp's default)"),
]
ON, OFF = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")  # llama.cpp's is_truthy / is_falsey


def on_off(value: str) -> bool:
    if value.lower() in ON + OFF:
        return value.lower() in ON
    raise argparse.ArgumentTypeError(f"unknown value {value!r}: on or off")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    ap = Parser(prog="flashdraft serve", allow_abbrev=False,
                description="OpenAI- and llama.cpp-compatible HTTP server (a drop-in for llama-server).")
    d = Settings()
    ap.add_argument("-m", "--model", required=True, help="target: GGUF file, HF folder, or a named model")
    ap.add_argument("-md", "--spec-draft-model", "--model-draft", "--draft", dest="draft", metavar="PATH",
                    help="draft model: a DFlash or DFlash2 draft (z-lab HF folder, draft GGUF, or a named draft such "
                         "as smollm2-135m: flashdraft pull --list) or a Gemma 4 assistant; turns on speculative "
                         "decoding with it. Without it (or --spec-type ngram-mod), plain decoding")
    add_speculation_args(ap)
    ap.add_argument("--spec-dflash-cross-ctx", "--draft-window", dest="draft_window", type=int, default=None,
                    metavar="N",
                    help="the draft sees the last N positions of context (default: all)")
    ap.add_argument("--block-size", type=int, default=None, help="verify block size (at most the draft's)")
    ap.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    ap.add_argument("--port", type=int, default=d.port, help=f"port to listen on (default {d.port})")
    ap.add_argument("-sps", "--slot-prompt-similarity", type=float, default=d.slot_prompt_similarity, metavar="F",
                    help="a request takes the free slot whose cached tokens start with at least this fraction of its "
                         "prompt (the longest such prefix; else the least recently used slot)")
    ap.add_argument("-np", "--parallel", dest="n_slots", type=int, default=d.n_slots, metavar="N",
                    help="number of slots: requests served at once, the rest wait in a queue (default 1)")
    ap.add_argument("-c", "--ctx-size", type=int, default=d.ctx_size, metavar="N",
                    help=f"total context over all slots; each slot gets ctx-size / parallel tokens, as in "
                         f"llama-server (default {d.ctx_size}; 0 = the model's trained context, fitted to the free "
                         f"GPU memory under --fit on)")
    ap.add_argument("-fit", "--fit", type=on_off, default=d.fit, metavar="on|off",
                    help="with -c 0, run the largest context the free GPU memory holds where the trained one does not "
                         "fit, down to --fit-ctx (default on, as llama.cpp's; a context given with -c is never changed)")
    ap.add_argument("-fitc", "--fit-ctx", dest="fit_min_ctx", type=int, default=d.fit_min_ctx, metavar="N",
                    help=f"the least context --fit may leave (default {d.fit_min_ctx})")
    ap.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=d.n_predict, metavar="N",
                    help="default tokens to generate per request (-1 = up to the end of the context)")
    ap.add_argument("--temp", dest="temperature", type=float, default=d.temperature, metavar="T",
                    help=f"default temperature (default {d.temperature}; 0 = greedy)")
    ap.add_argument("--top-k", type=int, default=d.top_k, help=f"default top-k (default {d.top_k}; 0 = off)")
    ap.add_argument("--top-p", type=float, default=d.top_p, help=f"default top-p (default {d.top_p})")
    ap.add_argument("--min-p", type=float, default=d.min_p, help=f"default min-p (default {d.min_p})")
    ap.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty,
                    help=f"default repeat penalty (default {d.repeat_penalty}; 1 = off)")
    ap.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n,
                    help=f"tokens the penalties look back over (default {d.repeat_last_n}; -1 = all, 0 = off)")
    ap.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                    help=f"default presence penalty (default {d.presence_penalty})")
    ap.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                    help=f"default frequency penalty (default {d.frequency_penalty})")
    ap.add_argument("-s", "--seed", type=int, default=d.seed, help="default seed (-1 = random per request)")
    ap.add_argument("--jinja", action="store_true", help="accepted; chat templates always run through jinja")
    ap.add_argument("--chat-template-file", help="jinja chat template to use instead of the model's")
    ap.add_argument("--reasoning", choices=["on", "off", "auto"], default=d.reasoning,
                    help="enable_thinking for the chat template, unless a request's chat_template_kwargs "
                         "sets it (auto = leave it to the template)")
    ap.add_argument("--reasoning-format", choices=["auto", "deepseek", "deepseek-legacy", "none"],
                    default=d.reasoning_format,
                    help="none: thinking stays in the content; otherwise a leading <think>...</think> is "
                         "returned as reasoning_content (default auto)")
    ap.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    ap.add_argument("--api-key", default=None,
                    help=f"require this key (Authorization: Bearer KEY); also read from {', '.join(API_KEY_VARIABLES)}")
    ap.add_argument("-a", "--alias", default=None, help="model name in responses and /v1/models")
    ap.add_argument("-to", "--timeout", type=float, default=d.timeout, metavar="S",
                    help=f"seconds for a whole request to arrive, body included (default {d.timeout:g})")
    ap.add_argument("--timeout-headers", type=float, default=d.timeout_headers, metavar="S",
                    help=f"seconds for a request's headers, and for a new connection to send one "
                         f"(default {d.timeout_headers:g})")
    ap.add_argument("--timeout-idle", type=float, default=d.timeout_idle, metavar="S",
                    help=f"seconds an idle keep-alive connection stays open (default {d.timeout_idle:g})")
    ap.add_argument("--log-timestamps", action="store_true", help="time since start on every log line")
    ap.add_argument("--log-prefix", action="store_true", help="level letter (I, W, E) on every log line")
    add_engine_args(ap, model=False, context=False)
    ap.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=int, default=d.tp, metavar="N",
                    help="tensor parallelism over N GPUs of this host, one process each (gloo on the CPU); "
                         "requests are then served one at a time (-np 1)")
    ap.add_argument("--no-webui", "--no-ui", dest="webui", action="store_false", help="do not serve the web page")
    ap.add_argument("--version", action="version", version="flashdraft 0.1.0")
    ignored = ap.add_argument_group("accepted and ignored (llama-server placement and memory flags)")
    for names, value, why in IGNORED_FLAGS:
        dest = "ignored_" + names[-1].lstrip("-").replace("-", "_")
        if value is True:
            ignored.add_argument(*names, dest=dest, default=None, metavar="X", help=why)
        elif value == "?":
            ignored.add_argument(*names, dest=dest, nargs="?", const="on", default=None, metavar="X", help=why)
        else:
            ignored.add_argument(*names, dest=dest, action="store_const", const=True, default=None, help=why)
    return ap


def typed_name(argv: list[str], names: tuple[str, ...]) -> str:
    return next((a.split("=")[0] for a in argv if a.split("=")[0] in names), names[0])


def parse_settings(argv: list[str]) -> tuple[Settings, list[str]]:
    """Settings, and notes about flags accepted but ignored. Exits (code 2) on a bad command line; ValueError for
    drafter flags that no drafter takes (the command exits 1, as llama.cpp's)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, value, ok in (("-np", args.n_slots, args.n_slots >= 1), ("--ctx-size", args.ctx_size, args.ctx_size >= 0),
                            ("--fit-ctx", args.fit_min_ctx, args.fit_min_ctx >= 2),
                            ("--port", args.port, 0 <= args.port < 65536), ("--tp", args.tp, args.tp >= 1),
                            ("--repeat-penalty", args.repeat_penalty, args.repeat_penalty > 0),
                            ("--repeat-last-n", args.repeat_last_n, args.repeat_last_n >= -1)):
        if not ok:
            ap.error(f"{name} {value} is out of range")
    if args.tp > 1 and args.n_slots != 1:
        ap.error(f"--tp {args.tp} serves one request at a time: -np {args.n_slots} must be 1")
    if args.ctx_size and args.ctx_size // args.n_slots < 2:
        ap.error(f"--ctx-size {args.ctx_size} leaves no room in each of the {args.n_slots} slots")
    notes = []
    for names, _, why in IGNORED_FLAGS:
        value = getattr(args, "ignored_" + names[-1].lstrip("-").replace("-", "_"))
        if value is not None:
            name = typed_name(argv, names)
            shown = name if value is True else f"{name} {value}"
            notes.append(f"ignoring {shown}: {why}")
    api_key = args.api_key or next((os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)), None)
    spec_type, draft_params = speculation(args, args.draft)
    settings = Settings(
        model=args.model, draft=args.draft, speculative=args.spec_type != "none",
        spec_type=spec_type, draft_params=draft_params,
        draft_window=args.draft_window, block_size=args.block_size, draft_n_max=args.draft_n_max,
        host=args.host, port=args.port,
        n_slots=args.n_slots, slot_prompt_similarity=args.slot_prompt_similarity, ctx_size=args.ctx_size,
        fit=args.fit, fit_min_ctx=args.fit_min_ctx, device=args.device, dtype=args.dtype, compile=args.compile, adaptive=args.adaptive,
        synth_len=args.synth_len, synth_rates=args.synth_rates,
        draft_embed_scale=args.draft_embed_scale, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
        draft_cache_type_k=args.draft_cache_type_k, draft_cache_type_v=args.draft_cache_type_v,
        dequantize=args.dequantize, quantized=args.quantized,
        threads=args.threads, threads_batch=args.threads_batch, tp=args.tp,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        n_predict=args.n_predict, seed=args.seed, chat_template_file=args.chat_template_file,
        reasoning=args.reasoning, reasoning_format=args.reasoning_format, metrics=args.metrics,
        api_key=api_key, alias=args.alias, webui=args.webui, log_timestamps=args.log_timestamps,
        log_prefix=args.log_prefix, timeout=args.timeout, timeout_headers=args.timeout_headers,
        timeout_idle=args.timeout_idle)
    for name in ("timeout", "timeout_headers", "timeout_idle"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if args.spec_type == "none" and args.draft:
        notes.append("--spec-type none: the draft is not loaded, decoding is plain")
    for name, value in (("--threads", args.threads), ("--threads-batch", args.threads_batch)):
        if value is not None and value < 1:
            ap.error(f"{name} {value} is out of range")
    if args.threads_batch is not None and args.threads_batch != args.threads:
        notes.append(f"{typed_name(argv, ('-tb', '--threads-batch'))} {args.threads_batch}: prompts are processed "
                     "with the --threads threads")
    return settings, notes


class LogFormatter(logging.Formatter):
    """llama.cpp's log look: optional time since start (m.ss.mmm.uuu) and level letter."""

    def __init__(self, timestamps: bool, prefix: bool):
        super().__init__()
        self.timestamps, self.prefix, self.start = timestamps, prefix, time.time()

    def format(self, record: logging.LogRecord) -> str:
        head = ""
        if self.timestamps:
            us = int((record.created - self.start) * 1e6)
            head += f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d} "
        if self.prefix:
            head += record.levelname[0] + " "
        return head + super().format(record)


def setup_logging(timestamps: bool, prefix: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormatter(timestamps, prefix))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def fitted_context(trained: int, n_slots: int, fits: int | None, least: int) -> int:
    """-c 0: the total context to run, the trained one where it fits (fits: the most tokens a slot's caches may
    hold in the free GPU memory, None where nothing is fitted), else the most that fits, logged; never under
    `least` (--fit-ctx: then the command stops, as llama.cpp's)."""
    if fits is None or fits * n_slots >= trained:
        return trained
    total = fits * n_slots
    if total < least:
        raise ValueError(f"-c 0: the model's trained context of {trained} tokens does not fit the free GPU memory, "
                         f"and {total} would (at most {fits} a slot), under --fit-ctx {least}: lower --fit-ctx or "
                         "-np, or take a smaller --cache-type-k/--cache-type-v")
    log.warning("-c 0: the model's trained context of %d tokens does not fit the free GPU memory: running %d "
                "(%d a slot; --fit off to refuse instead)", trained, total, fits)
    return total


def load_engine(s: Settings):
    from flashdraft.args import default_device
    from flashdraft.engine.engine import Engine
    from flashdraft.formats.named import resolve_draft
    from flashdraft.models.tp import rank_and_world
    device = default_device(s.device)
    draft = resolve_draft(s.draft) if s.speculative else None  # a draft only when the command names one
    t0 = time.perf_counter()
    log.info("loading model %s on %s (%s), %s", s.model, device, s.dtype,
             f"draft {draft}" if draft else f"{s.spec_type} drafter, no draft file" if s.spec_type
             else "no draft: plain decoding")
    # -c 0: the trained context, known only once the model is read, so the caches are set up twice
    ctx = s.slot_ctx if s.ctx_size > 0 else 2
    engine = Engine.load(s.engine_config(draft, device, ctx, progress=rank_and_world()[0] == 0))
    if s.ctx_size <= 0:
        trained = engine.target.cfg.max_position_embeddings
        fits = None
        if s.fit and device.startswith("cuda"):
            from flashdraft.engine.engine import largest_context
            fits = largest_context(engine.target, s.engine_config(draft, device, trained // s.n_slots))
        s.ctx_size = fitted_context(trained, s.n_slots, fits, s.fit_min_ctx)
        engine = engine.resized(s.slot_ctx)
    if s.chat_template_file:
        engine.tokenizer.chat_template = Path(s.chat_template_file).read_text()
    spec = ""
    if engine.draft is not None:
        spec = f", {engine.draft.name} draft, block size {engine.draft_block}"
        if engine.adaptive:
            costs = ", ".join(f"{w}: {c:.2f}" for w, c in (engine.width_costs or {}).items())
            spec += ", adaptive verify width" + (f" (step cost by width: {costs})" if costs else "")
            for rows, by_width in sorted(engine.batch_costs.items()):  # what a batch's width is chosen against
                spec += f"; {rows} slots: " + ", ".join(f"{w}: {c:.2f}" for w, c in by_width.items())
    log.info("loaded in %.1f s: %d slot(s) of %d tokens%s%s", time.perf_counter() - t0, engine.n_slots,
             engine.ctx_size, spec, f", tensor-parallel over {engine.world_size} ranks" if engine.world_size > 1 else "")
    log.info("memory: %s", ", ".join(f"{name} {n} bytes" if name == "kv_per_token" else f"{name} {n / 2 ** 20:.1f} MiB"
                                     for name, n in engine.memory.items()))
    return engine


def main(argv: list[str] | None = None) -> int:
    settings, notes = parse_settings(sys.argv[1:] if argv is None else argv)
    setup_logging(settings.log_timestamps, settings.log_prefix)
    for note in notes:
        log.warning(note)
    if settings.chat_template_file and not Path(settings.chat_template_file).is_file():
        log.error("--chat-template-file %s: no such file", settings.chat_template_file)
        return 1
    problem = startup_problem(settings)
    if problem:
        log.error("%s", problem)
        return 1
    from flashdraft.args import default_device
    from flashdraft.launch import run_tensor_parallel
    return run_tensor_parallel(functools.partial(serve_rank, settings), settings.tp, default_device(settings.device))


def startup_problem(s: Settings) -> str | None:
    """What would make the server fail after it said it is listening: a model or draft that is neither a file nor
    a name, or a port taken. Checked first, so that such a mistake is one line."""
    from flashdraft.formats.named import check_exists
    try:
        check_exists(s.model, "model")
        if s.draft and s.speculative:
            check_exists(s.draft, "draft")
    except FileNotFoundError as e:
        return str(e)
    if s.port:
        try:
            infos = socket.getaddrinfo(s.host, s.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as e:
            return f"cannot listen on {s.host}:{s.port}: {e.strerror or e}"
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                sock.bind(address)
            except OSError as e:
                return f"cannot listen on {s.host}:{s.port}: {e.strerror or e} (--host, --port)"
    return None


def serve_rank(settings: Settings, device: str) -> int:
    """Rank 0 serves HTTP; under tensor parallelism the other ranks load their share of the model and
    run rank 0's requests with it."""
    from flashdraft.args import set_threads
    from flashdraft.models.tp import rank_and_world
    settings.device = device
    setup_logging(settings.log_timestamps, settings.log_prefix)  # again, in a spawned rank
    rank, world = rank_and_world()
    set_threads(settings.threads, world)
    if rank == 0:
        return serve(settings)
    logging.getLogger().setLevel(logging.WARNING)
    load_engine(settings).follow()
    return 0


def serve(settings: Settings) -> int:
    import uvicorn
    from flashdraft.server.app import create_app
    from flashdraft.server.timeouts import timed_protocol

    failed: list[str] = []

    def loader():
        try:
            return load_engine(settings)
        except Exception as e:
            failed.append(str(e))
            server.should_exit = True
            raise

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGINT/SIGTERM: end the running generations first (their streams get an error event and [DONE])
            so that the graceful shutdown finds no request left to cancel."""
            scheduler = app.state.server.scheduler
            if scheduler is not None:
                scheduler.close()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # a clean shutdown exits 0, not by re-raising the signal

    app = create_app(loader, settings)
    http = timed_protocol(settings.timeout_headers, settings.timeout)
    # the graceful shutdown waits for the cancelled generations' last events: each ends within an engine step, and a
    # step on a CPU can take seconds (a 5 s wait once ran out under load in the signal test, cancelling a stream)
    server = Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, http=http,
                                   access_log=False, timeout_graceful_shutdown=30,
                                   timeout_keep_alive=settings.timeout_idle))
    log.info("listening on http://%s:%d (the model loads in the background; /health says when it is ready)",
             settings.host, settings.port)
    try:
        server.run()
    finally:
        scheduler, engine = app.state.server.scheduler, app.state.server.engine
        if scheduler is not None:
            scheduler.close()
            if not scheduler.join(timeout=30):  # the slot threads hold the engine: exit only once they are done
                log.warning("shutdown: a generation did not end within 30 s")
        if engine is not None and engine.world_size > 1:
            engine.stop_followers()
        # A failed load ends the server from the loading thread: wait for that thread to finish unwinding (and to
        # free what it loaded) before the interpreter exits. A daemon thread still inside torch's C++ code at exit
        # is stopped there, which aborts the process ("terminate called without an active exception", exit 134).
        for thread in threading.enumerate() if failed else ():
            if thread.name == "load-model" and thread is not threading.current_thread():
                thread.join(timeout=60)
    log.info("shut down")
    return 1 if failed else 0

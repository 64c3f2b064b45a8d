"""`flashdraft` command line: generate, serve, bench, pull, train-draft, make-data."""
import argparse
import functools
import json
import os
import sys

from flashdraft.args import add_engine_args, default_device, engine_config, thread_env

VERSION = "0.1.0"

# one line each in `flashdraft --help`
HELP = {
    "generate": "generate text from a prompt (plain decoding, or DFlash with -md DRAFT)",
    "serve": "OpenAI- and llama.cpp-compatible HTTP server (a drop-in for llama-server)",
    "bench": "compare plain decoding with DFlash: speed, acceptance, same text",
    "pull": "fetch a named model into the cache; --list: the named models and drafts",
    "train-draft": "train a DFlash draft for a target model",
    "make-data": "build a draft-training data set from a target's own answers",
}

SUBCOMMANDS = {
    "serve": "flashdraft.server.main",
    "bench": "flashdraft.bench.main",
    "train-draft": "flashdraft.train.main",
    "make-data": "flashdraft.train.data",
}


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def generate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashdraft generate", allow_abbrev=False,
                                 description="Generate text from a prompt: plain decoding, or DFlash speculative "
                                             "decoding when -md names a draft.")
    add_engine_args(ap)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids (skips tokenizer and template)")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    ap.add_argument("--system", help="system message (with --chat)")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-spec", action="store_true", help="plain decoding even with a draft")
    ap.add_argument("--reasoning", choices=["on", "off"], default=None, help="enable_thinking in the template")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor parallelism over N GPUs of this host (N processes; gloo on the CPU)")
    return ap


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    from flashdraft.launch import run_tensor_parallel
    return run_tensor_parallel(functools.partial(generate, args), args.tp, default_device(args.device))


def generate(args: argparse.Namespace, device: str) -> int:
    """`flashdraft generate` on one rank; under tensor parallelism only rank 0 prints."""
    from flashdraft.engine.engine import Engine, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.formats.chat import render_prompt
    from flashdraft.args import set_threads
    from flashdraft.models.tp import rank_and_world

    rank, world = rank_and_world()
    set_threads(args.threads, world)
    shown = rank == 0
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids else None
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    params.validate()
    from flashdraft.formats.named import resolve_draft
    draft = None if args.no_spec else resolve_draft(args.draft)  # a draft only when -md names one
    engine = Engine.load(engine_config(args, draft, device, progress=shown and not args.json))
    if shown and not args.json:
        print(f"DFlash draft {draft}" if engine.draft is not None else "no draft: plain decoding", file=sys.stderr)
    if prompt_ids is None:
        prompt_ids = render_prompt(engine.tokenizer, args.prompt, chat=args.chat, system=args.system,
                                   reasoning=args.reasoning)
    bad = [t for t in prompt_ids if not 0 <= t < engine.target.cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids out of the vocabulary (size {engine.target.cfg.vocab_size}): {bad[:5]}")
    req = Request(prompt_ids=prompt_ids, params=params, speculative=not args.no_spec)
    result = None
    for event in engine.stream(req):
        if hasattr(event, "finish_reason"):
            result = event
        elif not args.json and shown:
            print(event.text, end="", flush=True)
    if not shown:
        return 0
    if args.json:
        print(json.dumps(dict(
            text=result.text, token_ids=result.token_ids, prompt_ids=result.prompt_ids,
            finish_reason=result.finish_reason, timings=result.timings.to_dict(),
            acceptance_lengths=result.spec.acceptance_lengths, draft_steps=result.spec.draft_steps,
            speculative=result.speculative_summary() if result.spec.draft_steps else None)))
    else:
        t = result.timings.to_dict()
        line = (f"\n\n[prompt {t['prompt_n']} tok, {t['prompt_per_second']:.1f} tok/s | "
                f"generated {t['predicted_n']} tok, {t['predicted_per_second']:.1f} tok/s")
        if result.spec.draft_steps:
            s = result.speculative_summary()
            line += (f" | mean acceptance length {s['mean_acceptance_length']:.2f}, "
                     f"acceptance rate {s['acceptance_rate']:.1%}")
        print(line + "]", file=sys.stderr)
    return 0


def pull_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flashdraft pull", description="Fetch a named model into the cache.")
    ap.add_argument("name", nargs="?", help="a named model (see --list)")
    ap.add_argument("--list", action="store_true", help="list the named models and the named (shipped) drafts")
    args = ap.parse_args(argv)
    from flashdraft.formats.named import listing, pull
    if args.list or not args.name:
        print(listing())
        return 0 if args.list else 2
    print(pull(args.name))
    return 0


def usage() -> str:
    width = max(map(len, HELP))
    return "\n".join([f"usage: flashdraft {{{','.join(HELP)}}} ... | --version | --help", "",
                      "Speculative decoding with DFlash drafts, behind llama.cpp's command line.", "", "commands:",
                      *(f"  {cmd:<{width}}  {text}" for cmd, text in HELP.items()), "",
                      "flashdraft COMMAND --help: the command's options"])


# Before torch starts CUDA: the caching allocator maps memory in pages it can hand back, so what loading leaves free
# between live tensors (fused weights are concatenated from their parts: 2.6 GiB of holes for the Gemma 4 31B
# shape) is returned instead of held by the process.
ALLOCATOR = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)
    argv = sys.argv[1:] if argv is None else argv
    thread_env(argv)  # before torch is imported: the OpenMP/BLAS pools read it when they load
    commands = ["generate", "pull", *SUBCOMMANDS]
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"flashdraft {VERSION}")
        return 0
    if not argv or argv[0] not in commands:
        what = f"unknown command {argv[0]!r}" if argv else "a command is needed"
        print(f"flashdraft: {what}: one of {', '.join(commands)} (flashdraft --help)", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "generate":
            return generate_main(rest)
        if cmd == "pull":
            return pull_main(rest)
        import importlib
        return importlib.import_module(SUBCOMMANDS[cmd]).main(rest) or 0
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"flashdraft {cmd}: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # torch.OutOfMemoryError (torch is not imported here): one line, not a traceback
        if type(e).__name__ != "OutOfMemoryError":
            raise
        print(f"flashdraft {cmd}: error: out of GPU memory ({str(e).splitlines()[0]}): the weights, the KV caches "
              "(--ctx-size, --parallel, --cache-type-k/-v) and the CUDA graphs must fit together", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

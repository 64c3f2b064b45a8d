"""`flashdraft` command line: generate, serve, bench, pull, train-draft, make-data."""
import argparse
import functools
import json
import os
import sys

from flashdraft.args import (add_engine_args, add_speculation_args, default_device, engine_config, speculation,
                             thread_env)

VERSION = "0.1.0"

# one line each in `flashdraft --help`
HELP = {
    "generate": "generate text from a prompt (plain decoding, speculative with -md DRAFT, n-gram lookup with "
                "--spec-type ngram-mod)",
    "serve": "OpenAI- and llama.cpp-compatible HTTP server (a drop-in for llama-server)",
    "bench": "compare plain decoding with DFlash: speed, acceptance, same text",
    "pull": "fetch a named model, or one of the Hugging Face Hub (-hf), into its cache; --list: the names",
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
                                 description="Generate text from a prompt: plain decoding, speculative decoding "
                                             "when -md names a draft (DFlash or DFlash2, or a Gemma 4 assistant), "
                                             "or n-gram lookup with --spec-type ngram-mod.")
    add_engine_args(ap)
    add_speculation_args(ap)
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
    ap.add_argument("--no-spec", action="store_true", help="plain decoding even with a draft (as --spec-type none)")
    ap.add_argument("--reasoning", choices=["on", "off"], default=None, help="enable_thinking in the template")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor parallelism over N GPUs of this host (N processes; gloo on the CPU)")
    return ap


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    speculation(args, args.draft)  # a mistake in the drafter flags is one line before anything loads
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
    threads = set_threads(args.threads, world)
    shown = rank == 0
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids else None
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    params.validate()
    from flashdraft.formats.named import resolve_draft
    spec_type, draft_params = speculation(args, args.draft)
    plain = args.no_spec or args.spec_type == "none"
    draft = None if plain else resolve_draft(args.draft)  # a draft only when -md names one
    engine = Engine.load(engine_config(args, draft, device, progress=shown and not args.json,
                                       spec_type=None if plain else spec_type, draft_params=draft_params))
    if shown and not args.json:
        print((f"{engine.draft.name} draft {draft}" if draft else f"{engine.draft.name} drafter, no draft file"
               if engine.draft is not None else "no draft: plain decoding")
              + f", {threads} CPU thread{'s' if threads > 1 else ''}", file=sys.stderr)
    if prompt_ids is None:
        prompt_ids = render_prompt(engine.tokenizer, args.prompt, chat=args.chat, system=args.system,
                                   reasoning=args.reasoning)
    bad = [t for t in prompt_ids if not 0 <= t < engine.target.cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids out of the vocabulary (size {engine.target.cfg.vocab_size}): {bad[:5]}")
    req = Request(prompt_ids=prompt_ids, params=params, speculative=not plain)
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
    from flashdraft.args import HUB_OPTIONS, OFFLINE
    ap = argparse.ArgumentParser(prog="flashdraft pull", allow_abbrev=False,
                                 description="Fetch a named model into the cache, or a model from the Hugging Face "
                                             "Hub into the Hugging Face cache (-hf, -hfd, as generate and serve take "
                                             "them), and print its path.")
    ap.add_argument("name", nargs="?", help="a named model (see --list)")
    ap.add_argument("--list", action="store_true", help="list the named models and the named (shipped) drafts")
    hub = ap.add_mutually_exclusive_group()
    hub.add_argument(*HUB_OPTIONS["model"], dest="hf_repo", metavar="<user>/<model>[:quant]",
                     help="a model of the Hugging Face Hub, its quant picked as llama.cpp does (default Q4_K_M)")
    hub.add_argument(*HUB_OPTIONS["draft"], dest="hf_repo_draft", metavar="<user>/<model>[:quant]",
                     help="a draft (-md) of the Hugging Face Hub")
    ap.add_argument(*HUB_OPTIONS["file"], dest="hf_file", metavar="FILE", help="this file of the -hf repository")
    ap.add_argument(*HUB_OPTIONS["token"], dest="hf_token", metavar="TOKEN", help="Hugging Face access token")
    ap.add_argument(OFFLINE, action="store_true", help="the Hugging Face cache only (as HF_HUB_OFFLINE=1)")
    args = ap.parse_args(argv)
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    if args.hf_repo or args.hf_repo_draft:
        if args.name or args.list:
            ap.error("a named model or -hf/-hfd, not both")
        if args.hf_file and not args.hf_repo:
            ap.error("-hff names a file of the -hf repository")
        from flashdraft.formats.hub import resolve
        spec = args.hf_repo or args.hf_repo_draft
        print(resolve(spec, draft=not args.hf_repo, file=args.hf_file, token=args.hf_token,
                      option="-hf" if args.hf_repo else "-hfd"))
        return 0
    from flashdraft.formats.named import listing, pull
    if args.list or not args.name:
        print(listing())
        return 0 if args.list else 2
    print(pull(args.name))
    return 0


MODEL_OPTIONS = ("-m", "--model")
DRAFT_OPTIONS = ("-md", "--draft", "--spec-draft-model", "--model-draft")
ALIAS_OPTIONS = ("-a", "--alias")


def given(argv: list[str], names: tuple[str, ...]) -> str | None:
    return next((a.partition("=")[0] for a in argv if a.partition("=")[0] in names), None)


def hub_argv(cmd: str, argv: list[str]) -> list[str]:
    """generate, serve and bench arguments with -hf/-hfd (llama.cpp's) resolved: the files are downloaded into the
    Hugging Face cache, or found there, and named by -m/-md. The command line is checked first, with the repository
    names in place of the paths, so that --help or a typo answers before a download."""
    from flashdraft.args import take_hub_options

    rest, hub, offline = take_hub_options(argv)
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported, which reads it once
    if not hub:
        return rest
    if "file" in hub and "model" not in hub:
        raise ValueError(f"{hub['file'][0]} names a file of the -hf repository: give -hf <user>/<model> too")
    for kind, names in (("model", MODEL_OPTIONS), ("draft", DRAFT_OPTIONS)):
        if kind in hub and (typed := given(rest, names)):
            raise ValueError(f"{typed} and {hub[kind][0]} both name the {kind}: give one")
    if cmd == "bench" and "--url" in (a.partition("=")[0] for a in rest):
        raise ValueError("-hf/-hfd are for the in-process bench: with --url, -m names the model the servers serve")
    stand_in = rest + [x for kind, flag in (("model", "-m"), ("draft", "-md")) if kind in hub
                       for x in (flag, hub[kind][1])]
    check_arguments(cmd, stand_in)  # exits on --help or a mistake, as the subcommand itself would
    from flashdraft.formats import hub as hf
    token = hub["token"][1] if "token" in hub else None
    out = list(rest)
    if "model" in hub:
        option, spec = hub["model"]
        file = hub["file"][1] if "file" in hub else None
        out += ["-m", str(hf.resolve(spec, file=file, token=token, option=option))]
        if cmd == "serve" and not given(rest, ALIAS_OPTIONS):
            out += ["--alias", spec]  # llama-server names the model by its -hf, as typed
    if "draft" in hub:
        option, spec = hub["draft"]
        out += ["-md", str(hf.resolve(spec, draft=True, token=token, option=option))]
    return out


def check_arguments(cmd: str, argv: list[str]) -> None:
    """Parse a subcommand's arguments as it will (exits with its message on a mistake, or after --help)."""
    if cmd == "generate":
        generate_parser().parse_args(argv)
    elif cmd == "serve":
        from flashdraft.server.main import parse_settings
        parse_settings(argv)
    elif cmd == "bench":
        from flashdraft.bench.main import parse_args
        parse_args(argv)


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
    # before torch is imported: the OpenMP/BLAS pools read it when they load
    thread_env(argv, load_aware=bool(argv) and argv[0] in ("generate", "serve", "bench", "train-draft", "make-data"))
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
        if cmd in ("generate", "serve", "bench"):
            rest = hub_argv(cmd, rest)
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

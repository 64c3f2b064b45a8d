"""`flashdraft generate` end to end: JSON output, and one clear line with a non-zero exit for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import make_draft, make_target


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashdraft.cli", "generate", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = make_target(root / "target")
    return target, make_draft(root / "draft", target)


def test_json_output_with_and_without_speculation(tiny_pair):
    target, draft = tiny_pair
    common = ["-m", str(target), "--prompt-ids", "5,6,7,8", "-n", "20", "--json", "--device", "cpu"]
    spec = json.loads(generate(*common, "-md", str(draft)).stdout)
    plain = json.loads(generate(*common, "-md", str(draft), "--no-spec").stdout)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 20
    assert spec["prompt_ids"] == [5, 6, 7, 8]
    assert set(spec["timings"]) >= {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                                    "predicted_n", "predicted_ms", "predicted_per_token_ms",
                                    "predicted_per_second", "draft_n", "draft_n_accepted"}
    assert "draft_n" not in plain["timings"]
    assert len(spec["acceptance_lengths"]) == len(spec["draft_steps"]) > 0
    assert spec["timings"]["draft_n"] == sum(len(d) for d in spec["draft_steps"])
    assert spec["timings"]["draft_n_accepted"] == sum(a - 1 for a in spec["acceptance_lengths"])


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_truncated_gguf(tmp_path, smollm2_gguf):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(Path(smollm2_gguf).read_bytes()[:5_000_000])
    one_line_error(generate("-m", str(bad), "--prompt", "hi", "--json"), "cut.gguf")


def test_folder_without_tokenizer(tmp_path, tiny_pair):
    target, _ = tiny_pair
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in ("config.json", "model.safetensors"):
        (folder / f).write_bytes((target / f).read_bytes())
    one_line_error(generate("-m", str(folder), "--prompt", "hi", "--json"), "tokenizer.json")


def test_mismatched_draft(tmp_path, tiny_pair):
    target, _ = tiny_pair
    other = make_target(tmp_path / "other", vocab_size=256)
    draft = make_draft(tmp_path / "draft", other)
    one_line_error(generate("-m", str(target), "-md", str(draft), "--prompt-ids", "1,2", "--json"), "vocab")


def test_draft_texts_name_every_kind_of_draft(tmp_path, monkeypatch):
    """-md may be a DFlash or DFlash2 draft or a Gemma 4 assistant: its help (generate, serve), generate's description
    and the loader's missing-draft error say so."""
    import flashdraft.formats.named as named
    from flashdraft.cli import generate_parser
    from flashdraft.formats.loader import load_draft
    from flashdraft.server.main import build_parser as serve_parser

    def draft_help(ap):
        return next(a.help for a in ap._actions if "-md" in a.option_strings)

    monkeypatch.setattr(named, "resolve_model", Path)  # the path as it is: the loader's own check answers
    with pytest.raises(FileNotFoundError, match="draft not found") as missing:
        load_draft(str(tmp_path / "absent"), target=None)
    for text in (draft_help(generate_parser()), draft_help(serve_parser()), generate_parser().description,
                 str(missing.value)):
        assert "DFlash2" in text and "Gemma 4 assistant" in text, text


def test_prompt_longer_than_context(tiny_pair):
    target, _ = tiny_pair
    ids = ",".join(["5"] * 40)
    one_line_error(generate("-m", str(target), "--prompt-ids", ids, "--ctx-size", "32", "--json"), "context")


def test_bad_prompt_ids(tiny_pair):
    target, _ = tiny_pair
    one_line_error(generate("-m", str(target), "--prompt-ids", "1,x", "--json"), "--prompt-ids")


def test_kv_caches_too_large_for_memory(tiny_pair):
    """A context no memory holds: one line naming the flags that shrink the caches, not an allocator traceback (on a
    GPU the same path turns torch.OutOfMemoryError into it, with the GB left after the weights)."""
    target, _ = tiny_pair
    result = generate("-m", str(target), "--prompt-ids", "1,2", "--ctx-size", str(10 ** 11), "--json", "--device",
                      "cpu")
    one_line_error(result, "KV caches", "--ctx-size", "--cache-type-k")


def test_out_of_gpu_memory_is_one_line(monkeypatch, capsys):
    """torch.OutOfMemoryError from anywhere past the caches (warm-up, graph capture) ends the command with one line."""
    import torch
    from flashdraft import cli

    def oom(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "23.55 GiB\nOf the allocated memory ...")
    monkeypatch.setattr(cli, "generate_main", oom)
    assert cli.main(["generate", "-m", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB" in err[0], err


def test_compile_is_the_default_on_cuda_only():
    """The fast path needs no flag: `serve` and `generate` leave --compile unset, which compiles on CUDA (the step
    graphs capture compiled layers) and not on the CPU; --compile / --no-compile override it."""
    import argparse

    from flashdraft.args import add_engine_args
    from flashdraft.engine.config import EngineConfig, compile_enabled
    from flashdraft.server.main import parse_settings
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    for argv, want in (([], None), (["--compile"], True), (["--no-compile"], False)):
        assert ap.parse_args(["-m", "x", *argv]).compile is want
        assert parse_settings(["-m", "x", *argv])[0].compile is want
    assert compile_enabled(EngineConfig(device="cuda")) and compile_enabled(EngineConfig(device="cuda:1"))
    assert not compile_enabled(EngineConfig(device="cuda", compile=False))
    assert not compile_enabled(EngineConfig(device="cpu")) and not compile_enabled(EngineConfig(device="cpu", compile=True))


def test_fit_flags_and_the_fitted_context(caplog, capsys):
    """llama.cpp's --fit / --fit-ctx: with -c 0 the trained context where the free GPU memory holds it, else the
    most it holds (logged), never under --fit-ctx; --fit-target is accepted and noted; bad values are one line."""
    from flashdraft.server.main import fitted_context, parse_settings
    s, notes = parse_settings(["-m", "x", "-c", "0", "--fit", "off", "-fitc", "8192", "-fitt", "512"])
    assert (s.ctx_size, s.fit, s.fit_min_ctx) == (0, False, 8192)
    assert any("--fit-target" in n or "-fitt" in n for n in notes), notes
    assert parse_settings(["-m", "x", "-fit", "on"])[0].fit and parse_settings(["-m", "x"])[0].fit
    for bad in (["--fit", "maybe"], ["--fit-ctx", "1"]):
        with pytest.raises(SystemExit) as e:
            parse_settings(["-m", "x", *bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("maybe" in err or "--fit-ctx 1" in err), err
    assert fitted_context(131072, 1, None, 4096) == 131072  # nothing fitted (the CPU, --fit off)
    assert fitted_context(131072, 2, 70000, 4096) == 131072  # fits
    with caplog.at_level("WARNING", logger="flashdraft.server"):
        assert fitted_context(131072, 2, 40960, 4096) == 81920
    assert "131072" in caplog.text and "81920" in caplog.text
    with pytest.raises(ValueError, match="--fit-ctx 32768"):
        fitted_context(131072, 1, 16384, 32768)


def test_warmup_samples_as_a_request_with_the_defaults_does():
    """serve's warm-up sampling takes the command line's defaults as a request with no sampling fields does
    (llama.cpp's top-k -1 off, top-p 0 the most likely token), so it validates and captures the request's sampler."""
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.server.main import parse_settings
    from flashdraft.server.protocol import sampling_params
    for argv in (["--top-k", "-1"], ["--top-p", "0"], ["--top-k", "20", "--top-p", "0.9"]):
        s = parse_settings(["-m", "x", *argv])[0]
        warm = SamplingParams(**s.engine_config(None, "cpu", 64).warmup_sampling)
        warm.validate()
        request = sampling_params({}, s, ("n_predict",), None, 32)
        assert (warm.top_k, warm.top_p) == (request.top_k, request.top_p), argv

"""-hf/-hfd (llama.cpp's): a quant tag picks a GGUF file as llama.cpp does, the files go into the Hugging Face
cache, HF_HUB_OFFLINE=1 uses that cache; against a local stand-in for the hub (HF_ENDPOINT)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hub_stub import COMMIT, Hub
from tiny import interrupt, make_draft, make_target, wait_healthy, write_target_gguf

from flashdraft.formats.hub import plan

REPO = Path(__file__).resolve().parents[1]
TARGET = "user/tiny-GGUF"
DRAFT = "user/tiny-DFlash"


# --- the file a tag picks (llama.cpp's find_best_model), on listings alone ----------------------------------------

def picked(spec: str, files: list[str], draft: bool = False) -> list[str]:
    return plan(spec, files, draft=draft).files


QUANTS = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-F16.gguf", "mmproj-m-Q8_0.gguf", "README.md"]


@pytest.mark.parametrize("spec, expected", [
    ("u/m:Q8_0", "m-Q8_0.gguf"),
    ("u/m:q8_0", "m-Q8_0.gguf"),  # case-insensitive
    ("u/m:f16", "m-F16.gguf"),
    ("u/m", "m-Q4_K_M.gguf"),  # no tag: Q4_K_M
])
def test_tag_picks_the_file(spec, expected):
    assert picked(spec, QUANTS) == [expected]


def test_default_falls_back_to_q8_0_then_the_first_model_file():
    assert picked("u/m", ["m-F16.gguf", "m-Q8_0.gguf", "m-Q6_K.gguf"]) == ["m-Q8_0.gguf"]
    assert picked("u/m", ["mmproj-m-F16.gguf", "m-Q6_K.gguf", "m-Q5_K_M.gguf"]) == ["m-Q5_K_M.gguf"]


def test_tag_needs_a_separator_after_it():
    # Q4_K must not take Q4_K_M's file: llama.cpp's pattern is the tag followed by "." or "-"
    with pytest.raises(ValueError, match="Q4_K"):
        picked("u/m:Q4_K", QUANTS)


def test_split_model_is_found_by_its_first_part_and_downloads_whole():
    files = ["m-Q8_0-00002-of-00003.gguf", "m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf",
             "m-Q4_K_M.gguf"]
    assert picked("u/m:Q8_0", files) == [f"m-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert picked("u/m", files) == ["m-Q4_K_M.gguf"]


def test_unknown_tag_names_the_available_ones():
    with pytest.raises(ValueError) as e:
        picked("u/m:Q5_K_S", QUANTS)
    message = str(e.value)
    assert "Q5_K_S" in message and "F16, Q4_K_M, Q8_0" in message and "\n" not in message


def test_draft_takes_the_dflash_sidecar_first():
    files = ["m-Q4_K_M.gguf", "dflash-m-Q8_0.gguf", "dflash-m-Q4_K_M.gguf"]
    assert picked("u/m", files) == ["m-Q4_K_M.gguf"]  # a target never takes a sidecar
    assert picked("u/m", files, draft=True) == ["dflash-m-Q4_K_M.gguf"]
    assert picked("u/m:q8_0", files, draft=True) == ["dflash-m-Q8_0.gguf"]
    assert picked("u/d:Q8_0", ["d-Q8_0.gguf"], draft=True) == ["d-Q8_0.gguf"]  # a draft GGUF by another name


def test_folder_repository():
    p = plan("u/d", ["config.json", "model.safetensors", "README.md", "img.png"], draft=True)
    assert p.folder and p.files == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="no quants"):
        plan("u/d:Q8_0", ["config.json", "model.safetensors"])


@pytest.mark.parametrize("spec", ["tiny-GGUF", "a/b/c", "/x", "u/"])
def test_malformed_repo(spec):
    with pytest.raises(ValueError, match="<user>/<model>"):
        plan(spec, QUANTS)


# --- against the stand-in hub -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    target = make_target(root / "target")
    gguf = write_target_gguf(root / "tiny.gguf", target).read_bytes()
    draft = make_draft(root / "draft", target)
    # the two quants: the same tensors, told apart by a metadata string only
    q8 = gguf.replace(b"target", b"tArget", 1)
    assert len(q8) == len(gguf) and q8 != gguf
    repos = {
        TARGET: {"tiny-Q4_K_M.gguf": gguf, "tiny-Q8_0.gguf": q8, "mmproj-tiny-F16.gguf": b"GGUF-not-a-model",
                 "README.md": b"a tiny model\n"},
        DRAFT: {"config.json": (draft / "config.json").read_bytes(),
                "model.safetensors": (draft / "model.safetensors").read_bytes(), "README.md": b"a tiny draft\n"},
    }
    return dict(target=target, draft=draft, repos=repos)


@pytest.fixture
def hub(models):
    with Hub(models["repos"]) as h:
        yield h


def env(hub: Hub, home: Path, offline: bool = False) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    return out | dict(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="1" if offline else "0",
                      HF_HUB_DISABLE_TELEMETRY="1")


def flashdraft(*args: str, environ: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashdraft.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=environ, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def pulled(hub: Hub, home: Path, *args: str, offline: bool = False) -> Path:
    out = flashdraft("pull", *args, environ=env(hub, home, offline))
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


def downloads(hub: Hub) -> list[str]:
    return sorted(r.split("/")[-1] for r in hub.requests if r.startswith("GET") and "/resolve/" in r)


def test_tag_downloads_that_file_into_the_hf_cache(hub, models, tmp_path):
    path = pulled(hub, tmp_path, "-hf", f"{TARGET}:q8_0")
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == models["repos"][TARGET]["tiny-Q8_0.gguf"]
    assert path.parent == tmp_path / "hub" / "models--user--tiny-GGUF" / "snapshots" / COMMIT
    assert downloads(hub) == ["tiny-Q8_0.gguf"]  # that file only


def test_default_tag_is_q4_k_m(hub, models, tmp_path):
    path = pulled(hub, tmp_path, "-hf", TARGET)
    assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == models["repos"][TARGET]["tiny-Q4_K_M.gguf"]


def test_draft_folder_repository(hub, models, tmp_path):
    path = pulled(hub, tmp_path, "-hfd", DRAFT)
    assert path.is_dir() and sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_unknown_tag_is_one_line_with_the_available_tags(hub, tmp_path):
    out = flashdraft("generate", "-hf", f"{TARGET}:Q5_K_S", "--prompt", "hi", environ=env(hub, tmp_path))
    line = one_line_error(out, "Q5_K_S", "available: Q4_K_M, Q8_0", TARGET)
    assert "F16" not in line  # the mmproj file is not a quant of the model
    assert downloads(hub) == []


@pytest.mark.parametrize("args, words", [
    (["-hf", "user/no-such-repo"], ["user/no-such-repo", "no such model repository"]),
    (["-hf", "tiny-GGUF"], ["<user>/<model>[:quant]"]),
    (["-hf", TARGET, "-m", "x.gguf"], ["-m", "-hf", "give one"]),
    (["-hf"], ["-hf needs a value"]),
])
def test_mistakes_are_one_line(hub, tmp_path, args, words):
    one_line_error(flashdraft("generate", *args, "--prompt", "hi", environ=env(hub, tmp_path)), *words)


def test_offline_uses_the_cache(hub, models, tmp_path):
    online = pulled(hub, tmp_path, "-hf", f"{TARGET}:Q8_0")
    before = list(hub.requests)
    assert pulled(hub, tmp_path, "-hf", f"{TARGET}:Q8_0", offline=True) == online
    assert pulled(hub, tmp_path, "-hf", f"{TARGET}:Q8_0", "--offline") == online
    assert hub.requests == before  # not one request
    # what the cache lacks is named, with the cached quants
    out = flashdraft("pull", "-hf", f"{TARGET}:Q4_K_M", environ=env(hub, tmp_path, offline=True))
    one_line_error(out, "Q4_K_M", "Hugging Face cache", "available: Q8_0")


def test_offline_without_the_cache_is_one_line(hub, tmp_path):
    out = flashdraft("generate", "-hf", f"{TARGET}:Q8_0", "--prompt", "hi", environ=env(hub, tmp_path, offline=True))
    one_line_error(out, TARGET, "not in the Hugging Face cache", "HF_HUB_OFFLINE=1")
    assert hub.requests == []


def generated(*args: str, environ: dict) -> dict:
    out = flashdraft("generate", *args, "--prompt-ids", "5,6,7,8", "-n", "12", "--temp", "1", "--seed", "3",
                     "--json", "--device", "cpu", "-t", "1", environ=environ)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_generate_from_the_hub(hub, models, tmp_path):
    """-hf and -hfd end to end: the GGUF from the hub is the folder's model, the draft loads, and the answer is
    the same without the hub once it is cached."""
    online = generated("-hf", f"{TARGET}:Q8_0", "-hfd", DRAFT, environ=env(hub, tmp_path))
    assert online["speculative"] is not None and online["draft_steps"]  # the draft ran
    plain = generated("-hf", f"{TARGET}:Q8_0", "--no-spec", environ=env(hub, tmp_path))
    folder = generated("-m", str(models["target"]), "--no-spec", environ=env(hub, tmp_path))
    n = len(plain["token_ids"])
    assert n > 0 and plain["token_ids"] == folder["token_ids"][:n]  # the GGUF may stop at its end-of-text token
    assert sorted(downloads(hub)) == ["config.json", "model.safetensors", "tiny-Q8_0.gguf"]
    hub.requests.clear()
    offline = generated("-hf", f"{TARGET}:Q8_0", "-hfd", DRAFT, environ=env(hub, tmp_path, offline=True))
    assert offline["token_ids"] == online["token_ids"] and hub.requests == []


def test_serve_from_the_hub(hub, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "serve", "-hf", f"{TARGET}:Q8_0", "--port",
                             str(port), "--device", "cpu", "-t", "1", "-c", "256"], cwd=REPO,
                            env=env(hub, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [f"{TARGET}:Q8_0"]  # named as typed, as llama-server does
        reply = httpx.post(url + "/completion", json=dict(prompt="def", n_predict=4), timeout=120)
        assert reply.status_code == 200 and reply.json()["tokens_predicted"] > 0
    finally:
        log = interrupt(proc)
    assert "tiny-Q8_0.gguf" in log


def test_bench_from_the_hub(hub, tmp_path):
    out = flashdraft("bench", "-hf", f"{TARGET}:Q8_0", "-hfd", DRAFT, "--num-prompts", "1", "--max-tokens", "8",
                     "--warmup", "0", "--device", "cpu", "-t", "1", "--json", environ=env(hub, tmp_path))
    assert out.returncode == 0, out.stderr
    assert "tiny-Q8_0.gguf" in out.stderr and "snapshots" in out.stderr  # "loading <the cached file> with draft ..."

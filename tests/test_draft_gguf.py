"""DFlash drafts stored as GGUF by BeeLlama's and llama.cpp's converters (made from the folders beside them): the
same configuration and tensors as the folder, the same proposals, and the same speculative decoding on the real
SmolLM2 target. The tiny draft and its GGUF are carried in tests/data/drafts; the SmolLM2 drafts (36 MB) are read
from ../shared/fixtures or $FLASHDRAFT_FIXTURES (tests/data/drafts/README.md says how they are made)."""
import os
import dataclasses
from pathlib import Path

import pytest
import torch
from test_engine import random_target
from tiny import decode_tokens

from flashdraft.draft.load import load_draft_folder, load_draft_gguf
from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams

CARRIED = Path(__file__).resolve().parent / "data" / "drafts"
PAIRS = [("tiny-draft", "tiny-draft.beellama-f32.gguf"), ("smollm2-draft-bf16", "smollm2-draft.beellama-bf16.gguf"),
         ("smollm2-draft-bf16", "smollm2-draft.llamacpp-bf16.gguf")]


def fixture(name: str) -> Path:
    """A draft fixture: carried with the tests, or in ../shared/fixtures or $FLASHDRAFT_FIXTURES; else a skip."""
    folders = [CARRIED, Path(__file__).resolve().parents[2] / "shared" / "fixtures"]
    if os.environ.get("FLASHDRAFT_FIXTURES"):
        folders.append(Path(os.environ["FLASHDRAFT_FIXTURES"]).expanduser())
    for folder in folders:
        if (folder / name).exists():
            return folder / name
    pytest.skip(f"{name} is not in ../shared/fixtures or $FLASHDRAFT_FIXTURES: it is made from the shipped SmolLM2 "
                f"draft by BeeLlama's and llama.cpp's converters, as tests/data/drafts/README.md shows; point "
                f"FLASHDRAFT_FIXTURES at a folder holding it")


@pytest.mark.parametrize("folder,file", PAIRS)
def test_gguf_draft_equals_its_folder(folder, file):
    a = load_draft_folder(fixture(folder))
    b = load_draft_gguf(fixture(file), num_target_layers=a.cfg.num_target_layers)
    # target layer ids raw (BeeLlama) and stored + 1 (llama.cpp), mask id, window, ...; eps as float32 in GGUF
    assert b.cfg.rms_norm_eps == pytest.approx(a.cfg.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(b.cfg, rms_norm_eps=a.cfg.rms_norm_eps) == a.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_gguf_draft_proposes_what_its_folder_proposes():
    target = random_target(vocab=512, layers=4, hidden=64)
    prompt = torch.randint(0, 512, (24,))
    params = SamplingParams(max_tokens=40)
    runs = []
    for draft in (load_draft_folder(fixture("tiny-draft")), load_draft_gguf(fixture("tiny-draft.beellama-f32.gguf"))):
        draft.setup_cache(target.state.max_len)
        stats = SpecStats()
        tokens = decode_tokens(target, target.state, prompt, params, draft=draft, stats=stats)
        runs.append((tokens, stats.acceptance_lengths, stats.draft_n))
    assert runs[0] == runs[1]
    assert runs[0][0] == decode_tokens(target, target.state, prompt, params)  # and lossless


def test_smollm2_gguf_drafts_decode_as_the_folder(smollm2_gguf):
    from flashdraft.engine.engine import Engine, EngineConfig, Request
    prompt_ids = [1, 504, 2365, 1545, 28, 253, 4750, 6803, 30, 198]
    results = []
    for draft in ("smollm2-draft-bf16", "smollm2-draft.beellama-bf16.gguf", "smollm2-draft.llamacpp-bf16.gguf"):
        engine = Engine.load(EngineConfig(str(smollm2_gguf), str(fixture(draft)), device="cpu", ctx_size=256,
                                          dtype="float32", adaptive=False))
        c = engine.generate(Request(prompt_ids=prompt_ids, params=SamplingParams(max_tokens=48, ignore_eos=True)))
        results.append((c.token_ids, c.spec.draft_n_accepted, c.spec.draft_n))
    assert results[0] == results[1] == results[2] and results[0][1] > 0


def test_a_target_gguf_is_not_a_draft(smollm2_gguf):
    with pytest.raises(ValueError, match="not a DFlash draft"):
        load_draft_gguf(smollm2_gguf)

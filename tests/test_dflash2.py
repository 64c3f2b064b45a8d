"""DFlash2 drafts against vLLM's `speculators` (0.9.0, models/dflash2): its decoder layer with the two dynamic
convolutions, swapped into z-lab's DFlash reference model in place of the v1 layers, gives the backbone over
speculative steps; its `CandidateSelector.score_candidates`, applied row by row with the row before's choice as
the predecessor (the anchor for the first), gives the drafted path. Loaded without the package's training
imports (only the two model_definitions modules and what they import)."""
import copy
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from flashdraft.draft import DFlashDraft, DraftConfig
from test_draft import BASE, BLOCK, H, VOCAB, randomise, run_scenario
from test_gemma_gguf import converter  # noqa: F401  (the llama.cpp converter fixture)

reference = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

CONV, GROUP, RANK, TOP_K = 2, 16, 24, 6
DFLASH2 = dict(BASE, architectures=["DFlash2DraftModel"],
               dflash_config=dict(BASE["dflash_config"], conv_kernel_size=CONV, conv_group_size=GROUP,
                                  selector_rank=RANK, selector_top_k=TOP_K))


def speculators_modules(names: tuple[str, ...], stubs: tuple[str, ...]) -> list:
    """speculators' modules `names` (dotted, under the package), imported with the package, `models` and the
    packages `stubs` as empty stubs (the real package's __init__ pulls in its training stack)."""
    spec = importlib.util.find_spec("speculators")
    if spec is None:
        pytest.skip("speculators is not installed (.ci/run installs speculators==0.9.0 without its dependencies)")
    root = Path(spec.submodule_search_locations[0])
    saved = {name: sys.modules.get(name) for name in list(sys.modules) if name.startswith("speculators")}
    try:
        for package in ("", "models", *stubs):
            stub = types.ModuleType("speculators" + ("." + package if package else ""))
            stub.__path__ = [str(root.joinpath(*package.split(".")) if package else root)]
            sys.modules[stub.__name__] = stub
        return [importlib.import_module("speculators." + name) for name in names]
    finally:
        for name in [n for n in sys.modules if n.startswith("speculators")]:
            del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


def speculators_definitions():
    """speculators' dflash2 model_definitions module."""
    return speculators_modules(("models.dflash2.model_definitions",), ("models.dflash", "models.dflash2"))[0]


def make_pair(config: dict, seed: int = 0):
    """z-lab's reference with speculators' DFlash2 layers, and its selector; ours with the same weights."""
    definitions = speculators_definitions()
    hf = transformers.Qwen3Config(**copy.deepcopy(config))
    ref = reference.DFlashDraftModel(hf).float().eval()
    ref.layers = nn.ModuleList(definitions.Qwen3DFlash2DecoderLayer(hf, i, block_size=BLOCK, conv_kernel_size=CONV,
                                                                    conv_group_size=GROUP)
                               for i in range(hf.num_hidden_layers)).float().eval()
    selector = definitions.CandidateSelector(vocab_size=config["vocab_size"], hidden_size=H, rank=RANK,
                                             top_k=TOP_K).float()
    randomise(ref, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("base_kernel"):  # near the identity (tap 0 = 1), as trained ones start
                p.copy_(torch.zeros_like(p).index_fill_(1, torch.tensor([0]), 1.0)
                        + 0.3 * torch.randn(p.shape, generator=gen))
        for p in selector.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    ours = DFlashDraft(DraftConfig.from_hf(config)).float().eval()
    state = {**ref.state_dict(), **{f"candidate_selector.{k}": v for k, v in selector.state_dict().items()}}
    ours.load_state_dict(state, strict=True)
    return ref, selector, ours


def test_config_reads_and_writes_dflash2():
    cfg = DraftConfig.from_hf(DFLASH2)
    assert (cfg.dflash2, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == \
        (True, CONV, GROUP, RANK, TOP_K)
    assert cfg.is_causal is False  # sliding layers bidirectional in the block too (sliding_window_non_causal)
    again = DraftConfig.from_hf(cfg.to_hf())
    assert again == cfg and cfg.to_hf()["architectures"] == ["DFlash2DraftModel"]
    assert not DraftConfig.from_hf(BASE).dflash2


@pytest.mark.parametrize("name", ["full", "logit-scaling"])
def test_backbone_matches_speculators_layers_over_steps(name):
    """Full-attention layers (speculators and llama.cpp place a sliding window's edge differently: its training
    counts the window back from the anchor, llama.cpp and flashdraft from each query)."""
    extra = dict(dflash_config=dict(DFLASH2["dflash_config"], output_multiplier=0.5, final_logit_softcapping=3.0))
    ref, _, ours = make_pair(dict(DFLASH2, **(extra if name != "full" else {})))
    run_scenario(ref, ours)


def selector_reference(selector, logits: torch.Tensor, hidden: torch.Tensor, anchor: int) -> list[int]:
    """Row by row: the unary top-k, scored by speculators' score_candidates with the row before's choice."""
    chosen, before = [], anchor
    for row in range(logits.shape[0]):
        candidates = logits[row].topk(selector.top_k).indices
        scores = selector.score_candidates(logits[row:row + 1], hidden[row:row + 1], torch.tensor([before]),
                                           candidates[None])[0]
        before = int(candidates[scores.argmax()])
        chosen.append(before)
    return chosen


@torch.no_grad()
def test_proposals_follow_the_selector_not_the_argmax():
    """propose: the backbone's block, then the selector's path (which differs from each row's argmax here)."""
    ref, selector, ours = make_pair(DFLASH2, seed=3)
    gen = torch.Generator().manual_seed(5)
    embed = nn.Embedding(VOCAB, H)
    lm_head = nn.Linear(H, VOCAB, bias=False)
    nn.init.normal_(embed.weight, std=1.0, generator=gen)
    nn.init.normal_(lm_head.weight, std=0.3, generator=gen)
    target = types.SimpleNamespace(token_embedding=embed, logits=lm_head)
    ours.setup_cache(64)
    prompt = 11
    features = torch.randn(prompt, ours.cfg.context_width, generator=gen)
    ours.append_context(features, torch.arange(prompt), 0)
    differs = 0
    for anchor in (3, 17, 42, 77):
        proposed = ours.propose(target, torch.tensor([anchor]), torch.tensor([prompt]), 0, BLOCK - 1)
        ids = torch.tensor([anchor] + [ours.cfg.mask_token_id] * (BLOCK - 1))
        hidden = ref(target_hidden=features[None], noise_embedding=embed(ids)[None],
                     position_ids=torch.arange(prompt + BLOCK)[None])[0][1:]
        logits = ref.compute_logits(hidden, lm_head)
        want = selector_reference(selector, logits, hidden, anchor)
        assert proposed[0].tolist() == want
        differs += want != logits.argmax(-1).tolist()
    assert differs  # the selector changed the path somewhere: the test sees it


def test_walk_matches_the_reference_selector():
    _, selector, ours = make_pair(DFLASH2, seed=7)
    gen = torch.Generator().manual_seed(8)
    for trial in range(20):
        logits = torch.randn(5, VOCAB, generator=gen) * 3
        hidden = torch.randn(5, H, generator=gen)
        anchor = int(torch.randint(0, VOCAB, (1,), generator=gen))
        got = ours.candidate_selector.walk(logits, hidden, torch.tensor([anchor]))
        assert got.tolist() == selector_reference(selector, logits, hidden, anchor)


def test_dflash2_folder_loads_as_a_drafter(tmp_path):
    """A speculators-style folder (config.json with DFlash2DraftModel, safetensors of its names) loads by its
    architecture through the drafter registry."""
    from safetensors.torch import save_file

    from flashdraft.draft.load import load_draft_folder
    _, _, ours = make_pair(DFLASH2, seed=2)
    folder = tmp_path / "dflash2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DFLASH2))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(folder / "model.safetensors"))
    loaded = load_draft_folder(folder)
    assert loaded.cfg.dflash2 and all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                                         ours.state_dict().values()))


def test_dflash2_gguf_from_llama_cpp_converter(converter, tmp_path):  # noqa: F811
    """llama.cpp's convert_hf_to_gguf.py on a DFlash2 folder (its `dflash` GGUF: attn_conv_*/ffn_conv_* per
    layer, selector_* tensors, the conv and selector keys): the same weights and configuration as the folder,
    and the same proposals."""
    import subprocess

    from safetensors.torch import save_file

    from flashdraft.draft.load import load_draft_folder, load_draft_gguf
    from tiny import make_target
    vocab = 320  # the converter takes the tiny target's whole tokenizer
    config = dict(DFLASH2, vocab_size=vocab, dflash_config=dict(DFLASH2["dflash_config"], mask_token_id=vocab - 1))
    target = make_target(tmp_path / "target", arch="qwen3", vocab_size=vocab)
    _, _, ours = make_pair(config, seed=4)
    folder = tmp_path / "dflash2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(folder / "model.safetensors"))
    out = tmp_path / "dflash2.gguf"
    run = ("import runpy, sys; root = sys.argv[1]; sys.path[:0] = [root, root + '/gguf-py']; "
           "import conversion.base as base; base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'; "
           "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", run, str(converter), str(folder), "--target-model-dir", str(target),
                        "--outfile", str(out), "--outtype", "f32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    from_gguf = load_draft_gguf(out, vocab_size=vocab, num_target_layers=4)
    from_folder = load_draft_folder(folder)
    assert from_gguf.cfg.rms_norm_eps == pytest.approx(from_folder.cfg.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(from_gguf.cfg, rms_norm_eps=from_folder.cfg.rms_norm_eps) == from_folder.cfg
    assert from_gguf.cfg.dflash2
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_folder.state_dict().items()):
        assert torch.equal(a, b), name


def test_dflash2_drafts_through_the_engine(tmp_path):
    """A DFlash2 folder as -md: greedy speculative answers equal plain ones, over adaptive and fixed widths."""
    from safetensors.torch import save_file

    from flashdraft.engine.config import EngineConfig
    from flashdraft.engine.engine import Engine, Request
    from flashdraft.engine.sampling import SamplingParams
    from tiny import make_target
    vocab = 320
    config = dict(DFLASH2, vocab_size=vocab, dflash_config=dict(DFLASH2["dflash_config"], mask_token_id=vocab - 1))
    target = make_target(tmp_path / "target", vocab_size=vocab)
    _, _, ours = make_pair(config, seed=6)
    folder = tmp_path / "dflash2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(folder / "model.safetensors"))
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompt = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    for adaptive in (True, False):
        engine = Engine.load(EngineConfig(model=str(target), draft=str(folder), ctx_size=256, adaptive=adaptive))
        assert engine.draft.cfg.dflash2
        plain = engine.generate(Request(prompt, params, speculative=False))
        spec = engine.generate(Request(prompt, params))
        assert spec.token_ids == plain.token_ids and spec.spec.draft_steps


def test_training_continues_from_a_dflash2_draft(tmp_path):
    """train-draft --init with a DFlash2 folder: the DFlash2 draft, its weights as they were (its training:
    tests/test_dflash2_train.py)."""
    from safetensors.torch import save_file

    from flashdraft.train.main import load_or_build_draft
    _, _, ours = make_pair(DFLASH2, seed=2)
    folder = tmp_path / "dflash2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DFLASH2))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(folder / "model.safetensors"))
    args = types.SimpleNamespace(resume=False, init=str(folder))
    target = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_size=H, vocab_size=VOCAB, num_layers=4))
    draft, state, optim_state = load_or_build_draft(args, target, None, tmp_path / "out", "cpu")
    assert draft.cfg == ours.cfg and draft.training and state == {} and optim_state is None
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), ours.state_dict().values()))

"""DFlash draft against z-lab's reference `DFlashDraftModel` on small random configs."""

import copy
import json
import time

import pytest
import torch
from torch import nn

from flashdraft.draft import (
    DFlashDraft,
    DraftConfig,
    build_target_layer_ids,
    check_compatible,
    load_draft_folder,
)

reference = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

H, VOCAB, BLOCK = 64, 100, 8
TARGET_LAYER_IDS = [0, 2, 3]
BASE = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, num_target_layers=4, block_size=BLOCK,
    dflash_config={"mask_token_id": 99, "target_layer_ids": TARGET_LAYER_IDS},
)
SLIDING = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               use_sliding_window=True, sliding_window=5)

SCENARIOS = {
    "full": {},
    "sliding": SLIDING,
    "sliding-bidirectional": dict(SLIDING, is_causal=False),
    "full-causal": dict(is_causal=True),
    "logit-scaling": dict(dflash_config=dict(BASE["dflash_config"], output_multiplier=0.5,
                                             final_logit_softcapping=3.0)),
    "rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-llama3": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "rope-yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
}
ACCEPTED = [3, 0, 7, 1, 5, 2, 0, 4]  # accepted drafts per step: the context grows by a+1


@pytest.fixture(autouse=True)
def _no_cuda_timing(monkeypatch):
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)


pytestmark = pytest.mark.usefixtures("one_thread")


def randomise(model: nn.Module, seed: int = 0) -> None:
    """Weights large enough that attention is far from uniform, so a wrong mask shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.5 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_pair(config: dict, seed: int = 0) -> tuple[nn.Module, DFlashDraft]:
    # Qwen3Config edits nested dicts (rope_scaling) in place
    ref = reference.DFlashDraftModel(transformers.Qwen3Config(**copy.deepcopy(config))).float().eval()
    randomise(ref, seed)
    ours = DFlashDraft(DraftConfig.from_hf(config)).float().eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    error = (got - want).abs().max().item()
    assert error <= tol * want.abs().max().item(), f"max abs error {error}, max abs {want.abs().max().item()}"


@torch.no_grad()
def run_scenario(ref, ours: DFlashDraft, window: int | None = None, prompt_len: int = 13, slot: int = 1):
    """Speculative steps with random features and block embeddings; ours on the ring, the reference on a
    DynamicCache cropped to `start` after each call (or, with a draft window, fed only the last `window`
    committed positions). Returns our hidden states per step."""
    gen = torch.Generator().manual_seed(1)
    total = prompt_len + sum(a + 1 for a in ACCEPTED) + BLOCK
    features = torch.randn(total, ours.cfg.context_width, generator=gen)
    lm_head = nn.Linear(H, VOCAB, bias=False)
    nn.init.normal_(lm_head.weight, std=0.3, generator=gen)

    ours.setup_cache(window or 256, n_slots=2)
    for junk_slot in (0, 1):  # stale rows everywhere: the other slot and the reset slot must not leak in
        ours.append_context(torch.randn(20, ours.cfg.context_width, generator=gen), torch.arange(20), junk_slot)
    ours.reset(slot)

    ref_cache = reference._make_cache(ref.config)
    start, ours_len, ref_len, outputs = prompt_len, 0, 0, []
    for accepted in ACCEPTED:
        positions = torch.arange(start, start + BLOCK)
        noise = torch.randn(BLOCK, H, generator=gen)

        ours.append_context(features[ours_len:start], torch.arange(ours_len, start), slot)
        ours_len = start
        got = ours(noise, positions, slot)

        if window is None:
            want = ref(target_hidden=features[None, ref_len:start], noise_embedding=noise[None],
                       position_ids=torch.arange(ref_len, start + BLOCK)[None],
                       past_key_values=ref_cache, use_cache=True)[0]
            reference._crop_to(ref_cache, start)
            ref_len = start
        else:
            first = max(0, start - window)
            want = ref(target_hidden=features[None, first:start], noise_embedding=noise[None],
                       position_ids=torch.arange(first, start + BLOCK)[None])[0]

        assert_rel_close(got, want)
        assert_rel_close(ours.compute_logits(got, lm_head), ref.compute_logits(want, lm_head))
        outputs.append(got)
        start += accepted + 1
    return outputs


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference_over_steps(name):
    config = dict(BASE, **SCENARIOS[name])
    run_scenario(*make_pair(config))


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_draft_window_matches_reference_fed_last_window(name):
    ref, ours = make_pair(dict(BASE, **SCENARIOS[name]))
    windowed = run_scenario(ref, ours, window=10)  # the 13-token prompt already overflows the ring
    unlimited = run_scenario(ref, ours)
    assert not torch.allclose(windowed[-1], unlimited[-1], atol=1e-3), "the window did not change anything"


def test_sliding_layers_change_the_output():
    _, full = make_pair(BASE)
    _, sliding = make_pair(dict(BASE, **SLIDING))
    with torch.no_grad():
        features, noise = torch.randn(30, full.cfg.context_width), torch.randn(BLOCK, H)
        outs = [m.forward_with_context(noise, torch.arange(30, 30 + BLOCK), features, torch.arange(30))
                for m in (full, sliding)]
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


@pytest.mark.parametrize("name", ["full", "sliding", "sliding-bidirectional"])
@torch.no_grad()
def test_forward_with_context_matches_ring(name):
    _, ours = make_pair(dict(BASE, **SCENARIOS[name]))
    features, noise = torch.randn(21, ours.cfg.context_width), torch.randn(BLOCK, H)
    positions = torch.arange(21, 21 + BLOCK)
    ours.setup_cache(32)
    ours.append_context(features[:12], torch.arange(12))
    ours.append_context(features[12:], torch.arange(12, 21))
    assert_rel_close(ours(noise, positions), ours.forward_with_context(noise, positions, features, torch.arange(21)))


# --- config ------------------------------------------------------------------------------------------------


def test_build_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    for n_target in range(4, 70):
        for n_draft in range(1, 9):
            assert build_target_layer_ids(n_target, n_draft) == reference.build_target_layer_ids(n_target, n_draft)


def test_from_hf_reads_zlab_format():
    cfg = DraftConfig.from_hf(dict(BASE, **SLIDING))
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (BLOCK, 99, TARGET_LAYER_IDS)
    assert cfg.layer_attention(0) == (True, 5) and cfg.layer_attention(1) == (False, None)
    assert cfg.context_width == 3 * H

    # dflash_config wins over the top level; block_size and causal may live there
    nested = dict(BASE, block_size=16, dflash_config={"mask_token_id": 7, "block_size": 4, "causal": True})
    cfg = DraftConfig.from_hf(nested)
    assert (cfg.block_size, cfg.mask_token_id, cfg.is_causal) == (4, 7, True)
    assert cfg.target_layer_ids == build_target_layer_ids(4, 3)  # fallback spacing

    # Qwen3Config drops the window unless use_sliding_window is set
    assert DraftConfig.from_hf(dict(BASE, **dict(SLIDING, use_sliding_window=False))).sliding_window is None

    # transformers-5 `rope_parameters` reads the same as the old keys
    saved = transformers.Qwen3Config(**dict(BASE, **SCENARIOS["rope-yarn"])).to_dict()
    assert "rope_parameters" in saved
    assert DraftConfig.from_hf(saved) == DraftConfig.from_hf(dict(BASE, **SCENARIOS["rope-yarn"]))


@pytest.mark.parametrize("bad, message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_target_layers=None, dflash_config={"mask_token_id": 1}), "target_layer_ids"),
])
def test_from_hf_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig.from_hf(dict(BASE, **bad))


@pytest.mark.parametrize("name", SCENARIOS)
def test_to_hf_round_trip(name):
    cfg = DraftConfig.from_hf(dict(BASE, **SCENARIOS[name]))
    assert DraftConfig.from_hf(cfg.to_hf()) == cfg
    assert DraftConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


@pytest.mark.parametrize("name", ["sliding", "sliding-bidirectional", "full-causal", "logit-scaling", "rope-yarn"])
def test_to_hf_loads_in_reference(name):
    """A checkpoint config written by us means the same thing to z-lab's model."""
    cfg = DraftConfig.from_hf(dict(BASE, **SCENARIOS[name]))
    cfg.input_embedding_scale = 2.0
    ours = DFlashDraft(cfg).float().eval()
    randomise(ours, seed=3)
    ref = reference.DFlashDraftModel(transformers.Qwen3Config(**cfg.to_hf())).float().eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert reference._draft_value(ref.config, "input_embedding_scale") == 2.0
    assert (ref.block_size, ref.mask_token_id, ref.target_layer_ids) == (BLOCK, 99, TARGET_LAYER_IDS)
    run_scenario(ref, ours)


# --- compatibility and loading ------------------------------------------------------------------------------


def test_block_larger_than_scratch_rows_is_refused():
    _, ours = make_pair(BASE)
    ours.setup_cache(16, max_block_size=4)
    with pytest.raises(ValueError, match="scratch rows"):
        ours(torch.randn(5, H), torch.arange(5))


def test_check_compatible():
    cfg = DraftConfig.from_hf(BASE)
    check_compatible(cfg, target_hidden_size=H, target_vocab_size=VOCAB, target_num_layers=4)
    with pytest.raises(ValueError, match="hidden size"):
        check_compatible(cfg, target_hidden_size=2 * H, target_vocab_size=VOCAB, target_num_layers=4)
    with pytest.raises(ValueError, match="vocabulary size"):
        check_compatible(cfg, target_hidden_size=H, target_vocab_size=99, target_num_layers=4)
    cfg.vocab_size = 99
    with pytest.raises(ValueError, match="mask token id 99 is outside the target's vocabulary"):
        check_compatible(cfg, target_hidden_size=H, target_vocab_size=99, target_num_layers=4)
    cfg.vocab_size = VOCAB
    with pytest.raises(ValueError, match=r"target layer ids \[3\]"):
        check_compatible(cfg, target_hidden_size=H, target_vocab_size=VOCAB, target_num_layers=3)
    cfg.mask_token_id = None
    with pytest.raises(ValueError, match="no mask token id"):
        check_compatible(cfg, target_hidden_size=H, target_vocab_size=VOCAB, target_num_layers=4)


def save_checkpoint(folder, model: DFlashDraft, shards: int = 1, prefix: str = "", config: dict | None = None):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or model.cfg.to_hf()))
    names = list(model.state_dict())
    tensors = {prefix + n: t.contiguous() for n, t in model.state_dict().items()}
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {prefix + n: tensors[prefix + n] for n in names[i::shards]}
        save_file(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards, prefix", [(1, ""), (3, ""), (2, "model.")])
@torch.no_grad()
def test_load_draft_folder_round_trip(tmp_path, shards, prefix):
    cfg = DraftConfig.from_hf(dict(BASE, **SLIDING))
    saved = DFlashDraft(cfg).float().eval()
    randomise(saved, seed=5)
    save_checkpoint(tmp_path, saved, shards, prefix)
    loaded = load_draft_folder(tmp_path, device="cpu")
    assert loaded.cfg == cfg
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    features, noise, positions = torch.randn(9, cfg.context_width), torch.randn(BLOCK, H), torch.arange(9, 17)
    for model in (saved, loaded):
        model.setup_cache(16)
        model.append_context(features, torch.arange(9))
    # equal weights; the CPU GEMM's blocking may follow the buffers' alignment, so not bit for bit
    torch.testing.assert_close(loaded(noise, positions), saved(noise, positions), rtol=1e-5, atol=1e-5)

    half = load_draft_folder(tmp_path, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(half.rotary.inv_freq, saved.rotary.inv_freq)


def test_load_draft_folder_errors(tmp_path):
    model = DFlashDraft(DraftConfig.from_hf(BASE))
    with pytest.raises(ValueError, match="no config.json"):
        load_draft_folder(tmp_path / "nothing")

    save_checkpoint(tmp_path / "qwen", model, config=dict(BASE, architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        load_draft_folder(tmp_path / "qwen")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_draft_folder(tmp_path / "empty")

    fewer = dict(BASE, num_hidden_layers=2)  # the checkpoint has a third layer the config does not
    save_checkpoint(tmp_path / "extra", model, config=fewer)
    with pytest.raises(ValueError, match=r"unexpected tensors: layers\.2\."):
        load_draft_folder(tmp_path / "extra")

    more = dict(BASE, num_hidden_layers=4)
    save_checkpoint(tmp_path / "short", model, config=more)
    with pytest.raises(ValueError, match=r"missing tensors: layers\.3\."):
        load_draft_folder(tmp_path / "short")

    wider = dict(BASE, intermediate_size=256)
    save_checkpoint(tmp_path / "shape", model, config=wider)
    with pytest.raises(ValueError, match=r"wrong shapes: .*mlp\.down_proj\.weight"):
        load_draft_folder(tmp_path / "shape")


def test_dflash_observe_takes_its_slot_as_a_tensor():
    """One observe graph serves every slot (engine/steps.Steps.observe): the slot as a [1] tensor writes the rings
    the int slot writes, into that slot only."""
    from test_engine import random_draft, random_target
    target = random_target(vocab=64, layers=4, hidden=32, seed=3, max_len=64)
    draft = random_draft(target, block_size=4, seed=4)
    width = len(draft.target_layers) * target.cfg.hidden_size
    feats = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(5))
    rings = []
    for slot in (2, torch.tensor([2])):
        draft.setup_cache(32, n_slots=3)
        draft.observe(torch.zeros(1, 5, dtype=torch.long), feats, torch.arange(7, 12)[None], slot)
        rings.append([t.clone() for c in draft.state.caches for t in (c.k, c.v)] + [draft.state.row_positions.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*rings))
    assert rings[0][0][2].abs().sum() > 0 and rings[0][0][:2].abs().sum() == 0  # slot 2's rows, no other's

"""DFlash draft training: the objective's pieces against slow references, the batched training forward
against the draft's inference path, training, checkpoints (flashdraft and z-lab's `dflash`), resume."""
import json
import math
import time
from pathlib import Path

import pytest
import torch
from tiny import forward1

from flashdraft.draft import DFlashDraft, DraftConfig, load_draft_folder
from flashdraft.models.llama import LlamaConfig
from flashdraft.models.llama import Llama
from flashdraft.train.blocks import (Batch, anchor_candidates, apply_layer_rules, block_inputs, block_mask,
                                     collate, draft_blocks_forward, layer_masks, sample_anchors)
from flashdraft.train.draft_config import build_draft_config, default_draft_layers
from flashdraft.train.features import target_features
from flashdraft.train.main import build_parser, init_weights, run


pytestmark = pytest.mark.usefixtures("one_thread")


def random_target(vocab=96, layers=4, hidden=64, seed=0, std=0.2, **extra) -> Llama:
    cfg = LlamaConfig(**dict(dict(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                                  rms_norm_eps=1e-5), **extra))
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * std)
    return model.eval().requires_grad_(False)


def random_draft(hidden=64, block_size=8, layer_ids=(1, 2), seed=1, **extra) -> DFlashDraft:
    hf = dict(architectures=["DFlashDraftModel"], hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96, num_target_layers=4,
              block_size=block_size, dflash_config=dict(mask_token_id=95, target_layer_ids=list(layer_ids)), **extra)
    torch.manual_seed(seed)
    draft = DFlashDraft(DraftConfig.from_hf(hf))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return draft.eval()


def random_batch(n=3, s=40, vocab=96, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        length = s - 7 * i
        prompt = 5 + 3 * i
        ids = torch.randint(0, vocab - 1, (length,), generator=gen).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        if i == 1:  # a hole in the loss mask (a second user turn)
            mask[prompt + 6:prompt + 9] = [0, 0, 0]
        records.append((ids, mask))
    return collate(records)


# ---------------------------------------------------------------------------------------------------------
# Anchors, masks, labels
# ---------------------------------------------------------------------------------------------------------


def test_anchors_are_distinct_valid_sorted_and_redrawn():
    batch = random_batch()
    b = 8
    cand = anchor_candidates(batch.loss_mask, batch.lengths, b)
    for i in range(3):
        L = int(batch.lengths[i])
        m = batch.loss_mask[i].tolist()
        want = [p for p in range(L - b + 1) if m[p] and m[p + 1]]
        assert cand[i].nonzero().squeeze(1).tolist() == want
    draws = []
    for seed in range(2):
        blocks = sample_anchors(batch.loss_mask, batch.lengths, 6, b, torch.Generator().manual_seed(seed))
        for i in range(3):
            chosen = blocks.anchors[i][blocks.valid[i]].tolist()
            assert chosen == sorted(set(chosen)) and len(chosen) == min(6, int(cand[i].sum()))
            assert all(cand[i, p] for p in chosen)
            assert not blocks.valid[i, len(chosen):].any()
        draws.append(blocks.anchors.tolist())
    assert draws[0] != draws[1]
    few = sample_anchors(batch.loss_mask, batch.lengths, 100, b, torch.Generator().manual_seed(0))
    assert few.valid.sum(1).tolist() == cand.sum(1).tolist()  # all candidates when fewer than asked


def slow_mask(anchors, valid, s, b):
    n, a = len(anchors), len(anchors[0])
    out = torch.zeros(n, a * b, s + a * b, dtype=torch.bool)
    for i in range(n):
        for j in range(a):
            if not valid[i][j]:
                continue  # an invalid block sees nothing
            for k in range(b):
                q = j * b + k
                for t in range(s):
                    out[i, q, t] = t < anchors[i][j]  # strictly before the anchor
                for k2 in range(b):
                    out[i, q, s + j * b + k2] = True  # its own block, both directions
    return out


def test_block_mask_matches_slow_reference():
    batch = random_batch()
    s, b = batch.input_ids.shape[1], 8
    blocks = sample_anchors(batch.loss_mask, batch.lengths, 10, b, torch.Generator().manual_seed(3))
    assert not blocks.valid.all()  # the short sequence has fewer candidates: invalid blocks are exercised
    got = block_mask(blocks, s, b)
    assert torch.equal(got, slow_mask(blocks.anchors.tolist(), blocks.valid.tolist(), s, b))


@pytest.mark.parametrize("causal,window", [(True, None), (True, 6), (False, 6)])
def test_sliding_and_causal_rules_match_slow_reference(causal, window):
    batch = random_batch(n=2)
    s, b = batch.input_ids.shape[1], 8
    blocks = sample_anchors(batch.loss_mask, batch.lengths, 4, b, torch.Generator().manual_seed(1))
    base = block_mask(blocks, s, b)
    positions = (blocks.anchors[:, :, None] + torch.arange(b)).flatten(1)
    key_pos = torch.cat([torch.arange(s).expand(2, -1), positions], dim=1)
    got = apply_layer_rules(base, positions, key_pos, causal, window)
    want = base.clone()
    for i in range(2):
        for q in range(positions.shape[1]):
            for kk in range(key_pos.shape[1]):
                off = int(positions[i, q] - key_pos[i, kk])
                ok = (off >= 0 or not causal) and (window is None or (off < window and (causal or off > -window)))
                want[i, q, kk] &= ok
    assert torch.equal(got, want)


def test_same_position_labels_and_decayed_weights():
    batch = random_batch()
    b, gamma = 8, 3.0
    blocks = sample_anchors(batch.loss_mask, batch.lengths, 4, b, torch.Generator().manual_seed(0))
    inputs = block_inputs(batch, blocks, b, mask_token_id=95, gamma=gamma)
    for i in range(3):
        for j in range(4):
            p = int(blocks.anchors[i, j])
            if not blocks.valid[i, j]:
                assert (inputs.block_ids[i, j] == 95).all() and (inputs.weights[i, j] == 0).all()
                continue
            assert inputs.block_ids[i, j].tolist() == [int(batch.input_ids[i, p])] + [95] * (b - 1)
            assert inputs.positions[i, j].tolist() == list(range(p, p + b))
            assert inputs.labels[i, j].tolist() == batch.input_ids[i, p:p + b].tolist()  # not shifted
            assert inputs.weights[i, j, 0] == 0  # the anchor carries no loss
            for k in range(1, b):
                want = math.exp(-(k - 1) / gamma) * float(batch.loss_mask[i, p + k])
                assert inputs.weights[i, j, k].item() == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# The batched training forward is the inference computation
# ---------------------------------------------------------------------------------------------------------

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=5)


@pytest.mark.parametrize("extra", [{}, SLIDING], ids=["full", "sliding"])
def test_training_forward_matches_forward_with_context(extra):
    draft = random_draft(**extra)
    batch = random_batch()
    n, s = batch.input_ids.shape
    b = draft.cfg.block_size
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(n, s, draft.cfg.context_width, generator=gen)
    blocks = sample_anchors(batch.loss_mask, batch.lengths, 4, b, gen)
    inputs = block_inputs(batch, blocks, b, draft.cfg.mask_token_id, 7.0)
    noise = torch.randn(n, 4 * b, 64, generator=gen)
    positions = inputs.positions.view(n, -1)
    with torch.no_grad():
        hidden = draft_blocks_forward(draft, features, noise, positions, layer_masks(draft, blocks, positions, s))
        assert torch.isfinite(hidden).all()
        checked = 0
        for i in range(n):
            for j in range(4):
                if not blocks.valid[i, j]:
                    continue
                p = int(blocks.anchors[i, j])
                want = draft.forward_with_context(noise[i, j * b:(j + 1) * b], positions[i, j * b:(j + 1) * b],
                                                  features[i, :p], torch.arange(p))
                assert (hidden[i, j * b:(j + 1) * b] - want).abs().max() < 1e-5
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("extra", [{}, dict(sliding_window=6, arch="mistral")], ids=["llama", "sliding"])
def test_target_features_match_target_forward(extra):
    target = random_target(**extra)
    target.state = target.new_state(1, 64)
    batch = random_batch()
    layer_ids = [3, 0, 2]
    got = target_features(target, batch.input_ids, layer_ids)
    for i in range(3):
        L = int(batch.lengths[i])
        _, want = forward1(target, target.state, batch.input_ids[i, :L], torch.arange(L), capture=layer_ids)
        assert (got[i, :L] - want).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------------------
# Draft configuration
# ---------------------------------------------------------------------------------------------------------


def smollm2_config() -> LlamaConfig:
    return LlamaConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                       max_position_embeddings=8192, tie_word_embeddings=True)


def test_smollm2_draft_is_two_layers_and_under_20_mb():
    cfg = smollm2_config()
    assert default_draft_layers(cfg) == 2
    draft_cfg = build_draft_config(cfg, None, num_feature_layers=5)
    assert draft_cfg.target_layer_ids == [1, 8, 14, 20, 27]
    assert (draft_cfg.hidden_size, draft_cfg.intermediate_size, draft_cfg.num_attention_heads,
            draft_cfg.num_key_value_heads, draft_cfg.head_dim) == (576, 1536, 9, 3, 64)
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDraft(draft_cfg).parameters())
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576 + 2 * 64
    assert params == 2 * per_layer + 5 * 576 * 576 + 2 * 576 == 8_740_480
    assert params * 2 < 20e6  # bf16 safetensors: ~17.5 MB
    assert build_draft_config(cfg, None).target_layer_ids == [1, 27]  # the reference's spacing for 2 layers


# ---------------------------------------------------------------------------------------------------------
# Training end to end on a tiny target
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target_folder(tmp_path_factory):
    from tiny import make_target
    return make_target(tmp_path_factory.mktemp("target"), layers=4, std=0.15)


def motif_records(n=12, prompt_len=6, response_len=40, vocab=320, seed=0):
    """Responses that repeat a per-record motif the prompt shows: learnable from the context."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (5,), generator=gen).tolist()
        ids = (motif * 20)[:prompt_len + response_len]
        out.append(dict(input_ids=ids, loss_mask=[0] * prompt_len + [1] * response_len))
    return out


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in motif_records()))
    return path


def train_args(target, data, out, *extra):
    return build_parser().parse_args([
        "-m", str(target), "--data", str(data), "--out", str(out), "--device", "cpu", "--block-size", "8",
        "--num-anchors", "8", "--batch-size", "4", "--lr", "3e-3", "--eval-records", "2", "--log-every", "1",
        "--seed", "3", *extra])


def log_losses(out):
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_training_lowers_loss_and_saves_a_draft_both_libraries_load(tiny_target_folder, tiny_data, tmp_path,
                                                                      monkeypatch):
    out = tmp_path / "draft"
    summary = run(train_args(tiny_target_folder, tiny_data, out, "--steps", "30", "--draft-layers", "2",
                             "--export-dtype", "float32"))
    losses = log_losses(out)
    assert len(losses) == 30 and summary["finished"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert summary["held_out"]["acceptance"] >= 1.0

    ours = load_draft_folder(out)
    assert ours.cfg.num_hidden_layers == 2 and ours.cfg.block_size == 8
    reference = pytest.importorskip("dflash.model")
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    ref = reference.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 13, ours.cfg.context_width, generator=gen)
    noise = torch.randn(1, 8, 64, generator=gen)
    with torch.no_grad():
        got = ours.forward_with_context(noise[0], torch.arange(13, 21), ctx[0], torch.arange(13))
        want = ref(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(21)[None])[0]
        head = torch.nn.Linear(64, ours.cfg.vocab_size, bias=False)
        got_logits, want_logits = ours.compute_logits(got, head), ref.compute_logits(want, head)
    assert (got_logits - want_logits).abs().max() <= 1e-4 * want_logits.abs().max()
    # the float32 checkpoint is a loadable draft folder too
    assert load_draft_folder(out / "checkpoint").cfg.to_hf() == ours.cfg.to_hf()
    # and so is a copy in shards (the GPU script exports that way to pass a file-size limit)
    from flashdraft.train.checkpoint import copy_draft_sharded
    files = copy_draft_sharded(out, tmp_path / "sharded", 60_000)
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3
    sharded = load_draft_folder(tmp_path / "sharded")
    ref_sharded = reference.DFlashDraftModel.from_pretrained(str(tmp_path / "sharded"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(sharded.forward_with_context(noise[0], torch.arange(13, 21), ctx[0], torch.arange(13)), got)
        again = ref_sharded(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(21)[None])[0]
        assert torch.equal(again, want)


def test_resume_continues_where_it_stopped(tiny_target_folder, tiny_data, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(train_args(tiny_target_folder, tiny_data, whole, "--steps", "6"))
    run(train_args(tiny_target_folder, tiny_data, parts, "--steps", "6", "--stop-after-steps", "3"))
    state = json.loads((parts / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["total_steps"] == 6
    optim = torch.load(parts / "checkpoint" / "optimizer.pt", weights_only=False)
    assert optim["scheduler"]["last_epoch"] == 3 and optim["optimizer"]["state"]
    summary = run(train_args(tiny_target_folder, tiny_data, parts, "--resume"))
    assert summary["steps_this_run"] == 3 and summary["step"] == 6
    assert log_losses(parts) == pytest.approx(log_losses(whole), rel=1e-5)
    a, b = load_draft_folder(whole / "checkpoint"), load_draft_folder(parts / "checkpoint")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), name


def test_resume_without_optimizer_state_and_init_from_a_draft(tiny_target_folder, tiny_data, tmp_path):
    out = tmp_path / "run"
    run(train_args(tiny_target_folder, tiny_data, out, "--steps", "6", "--stop-after-steps", "2"))
    (out / "checkpoint" / "optimizer.pt").unlink()  # e.g. only the weights were carried to a new machine
    summary = run(train_args(tiny_target_folder, tiny_data, out, "--resume", "--stop-after-steps", "2"))
    assert summary["step"] == 4 and summary["total_steps"] == 6
    started = run(train_args(tiny_target_folder, tiny_data, tmp_path / "init", "--steps", "2", "--init", str(out)))
    assert started["step"] == 2
    assert load_draft_folder(tmp_path / "init").cfg.to_hf() == load_draft_folder(out).cfg.to_hf()


def test_train_draft_cli_regenerates_data_from_prompts(tiny_target_folder, tmp_path):
    from flashdraft.cli import main as cli_main
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write function number {i}."}) + "\n" for i in range(6)))
    out = tmp_path / "draft"
    assert cli_main(["train-draft", "-m", str(tiny_target_folder), "--data", str(prompts), "--out", str(out),
                     "--device", "cpu", "--steps", "3", "--block-size", "4", "--num-anchors", "4",
                     "--batch-size", "2", "--max-new-tokens", "24", "--eval-records", "0"]) == 0
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(sum(r["loss_mask"]) >= 1 for r in rows)
    assert load_draft_folder(out).cfg.block_size == 4
    assert json.loads((out / "train_summary.json").read_text())["finished"]


def test_int8_draft_round_trip_and_the_shipped_draft(tmp_path):
    """The package's draft is stored as int8 with group scales: it reads back within about 1% of the weights it
    was made from (bf16 rounding is ~0.3%), to the dtype of its other tensors, and keeps the draft's shapes."""
    from flashdraft.draft import dequantize_int8
    from flashdraft.formats.named import default_draft
    from flashdraft.train.checkpoint import quantize_int8, save_draft, save_int8_draft
    torch.manual_seed(0)
    weights = {"w": torch.randn(256, 512) * torch.linspace(0.01, 3, 512), "norm": torch.ones(512)}
    packed = quantize_int8(weights)
    assert packed["w"].dtype == torch.int8 and packed["w_scale"].shape == (256, 16) and packed["norm"] is weights["norm"]
    restored = dequantize_int8(packed)
    assert set(restored) == {"w", "norm"} and restored["w"].dtype == torch.float32
    assert (restored["w"] - weights["w"]).norm() / weights["w"].norm() < 7e-3  # Gaussian rows: ~0.6%

    cfg = DraftConfig.from_hf(json.loads((Path(default_draft("smollm2-135m")) / "config.json").read_text()))
    draft = DFlashDraft(cfg)
    init_weights(draft, seed=0)
    save_draft(draft, tmp_path / "bf16", torch.bfloat16)
    save_int8_draft(tmp_path / "bf16", tmp_path / "int8")
    assert (tmp_path / "int8" / "model.safetensors").stat().st_size < 0.55 * (tmp_path / "bf16" / "model.safetensors").stat().st_size
    a, b = load_draft_folder(tmp_path / "bf16"), load_draft_folder(tmp_path / "int8")
    assert all(t.dtype == torch.bfloat16 for t in b.state_dict().values())
    for name, t in a.state_dict().items():
        assert (b.state_dict()[name].float() - t.float()).norm() <= 1e-2 * t.float().norm() + 1e-6, name

    shipped = Path(default_draft("smollm2-135m"))
    assert (shipped / "model.safetensors").stat().st_size < 10e6
    assert json.loads((shipped / "config.json").read_text())["quantization_config"]["quant_method"] == "flashdraft-int8"
    assert load_draft_folder(shipped).cfg.num_hidden_layers == 2

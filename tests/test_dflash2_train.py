"""DFlash2 draft training against vLLM's `speculators` (0.9.0, models/dflash2): the training forward and loss
equal speculators' on the same weights and inputs (its DFlash2 decoder layers in z-lab's reference model for the
backbone, block by block; its `selector_training_candidates`, `CandidateSelector.score_candidates` and
`compute_metrics` with the eager KL for the loss), and `flashdraft train-draft --dflash2` trains a draft that
loads and drafts through the engine."""
import json
import types

import pytest
import torch
from torch import nn

from flashdraft.train.blocks import blocks_step, sample_anchors
from test_dflash2 import BLOCK, DFLASH2, H, TOP_K, VOCAB, make_pair, speculators_modules
from test_train import log_losses, motif_records, random_batch, train_args

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4.0


def speculators_objective():
    """speculators' dflash2 metrics module and its eager losses."""
    eager, metrics = speculators_modules(("losses.eager", "models.dflash2.metrics"),
                                         ("models.dflash2", "models.dspark"))
    return metrics, eager


def reference_loss(ref, selector, target, batch, blocks, features, final):
    """speculators' DFlash2 loss, its tensors laid out as its forward lays them ([1, blocks * B]): the hidden
    states of each valid block from the reference backbone (context strictly before the anchor), the targets the
    verifier's logits at the position before each slot, the predecessors the tokens before each slot."""
    metrics, eager = speculators_objective()
    hidden, targets, mask, before = [], [], [], []
    for i in range(batch.input_ids.shape[0]):
        ids, length = batch.input_ids[i], int(batch.lengths[i])
        for p, valid in zip(blocks.anchors[i].tolist(), blocks.valid[i].tolist()):
            if not valid:
                continue  # speculators' padded anchors: masked out entirely
            block = torch.tensor([int(ids[p])] + [DFLASH2["dflash_config"]["mask_token_id"]] * (BLOCK - 1))
            hidden.append(ref(target_hidden=features[i:i + 1, :p], noise_embedding=target.token_embedding(block)[None],
                              position_ids=torch.arange(p + BLOCK)[None])[0])
            slots = torch.arange(p, p + BLOCK)
            targets.append(target.logits(final[i, slots - 1]))
            supervised = batch.loss_mask[i, slots] & (slots < length)
            supervised[0] = False  # the anchor
            mask.append(supervised)
            before.append(torch.cat([ids[p:p + 1], ids[p:p + BLOCK - 1]]))
    hidden, targets = torch.cat(hidden)[None], torch.cat(targets)[None]
    mask, before = torch.cat(mask)[None].float(), torch.cat(before)[None]
    unary = ref.compute_logits(hidden, target.logits)
    candidates = unary.topk(TOP_K, dim=-1).indices
    training_ids, positions, contains = metrics.selector_training_candidates(candidates, targets.argmax(-1))
    candidate_logits = selector.score_candidates(unary, hidden, before, training_ids)
    loss, out = metrics.compute_metrics(
        unary_logits=unary, targets=targets, training_candidate_ids=training_ids, candidate_logits=candidate_logits,
        target_positions=positions, contains_target=contains, loss_mask=mask, block_size=BLOCK, top_k=TOP_K,
        loss_config={"kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss, gamma=GAMMA,
        selector_loss_alpha=0.7)
    accuracy = out["teacher_forced_selector_acc_sum"] / out["teacher_forced_selector_acc_total"]
    return loss, out["unary_loss_sum"], out["selector_loss_sum"], float(accuracy)


def fake_target(seed: int):
    gen = torch.Generator().manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB, bias=False)
    nn.init.normal_(embed.weight, std=1.0, generator=gen)
    nn.init.normal_(head.weight, std=0.3, generator=gen)
    return types.SimpleNamespace(token_embedding=embed, logits=head)


def test_loss_and_gradients_match_speculators():
    ref, selector, ours = make_pair(DFLASH2, seed=11)
    ours.train()
    target = fake_target(12)
    batch = random_batch(n=3, s=40, vocab=VOCAB, seed=4)
    blocks = sample_anchors(batch.loss_mask, batch.lengths, 10, BLOCK, torch.Generator().manual_seed(5))
    assert not blocks.valid.all()  # an invalid block is exercised
    gen = torch.Generator().manual_seed(6)
    n, s = batch.input_ids.shape
    features = torch.randn(n, s, ours.cfg.context_width, generator=gen)
    final = torch.randn(n, s, H, generator=gen)
    out = blocks_step(ours, target, batch, features, blocks, GAMMA, loss_chunk=16, target_hidden=final,
                      selector_alpha=0.7)
    want, want_token, want_selector, want_accuracy = reference_loss(ref, selector, target, batch, blocks, features,
                                                                    final)
    # the logged accuracy as speculators': over the slots whose target was among the candidates
    assert out.accuracy == pytest.approx(want_accuracy, rel=1e-6)
    assert out.token_loss == pytest.approx(float(want_token), rel=1e-5)
    assert out.selector_loss == pytest.approx(float(want_selector), rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(out.selector_loss) > 0.1 and float(out.token_loss) > 0.1
    # the same gradients reach the same weights (the modules served are the ones trained)
    out.loss.backward()
    want.backward()
    theirs = {**dict(ref.named_parameters()), **{f"candidate_selector.{k}": v for k, v in selector.named_parameters()}}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = []
    for name, p in ours.named_parameters():
        stem, _, leaf = name.rpartition(".")
        parts = fused.get(stem.rpartition(".")[2])
        if parts:  # ours fuses z-lab's projections: their gradients, stacked
            prefix = stem.rpartition(".")[0]
            want_grad = torch.cat([theirs[f"{prefix}.{part}.{leaf}"].grad for part in parts])
        else:
            want_grad = theirs[name].grad
        assert (p.grad - want_grad).abs().max() <= 1e-4 * want_grad.abs().max(), name
        checked.append(name)
    assert len(checked) == len(list(ours.parameters())) and any("kernel_projection" in n for n in checked)


def test_walk_adds_the_trained_transition_scores(monkeypatch):
    """The selector's walk scores each row by the unary logits plus `transition_scores`, the term training
    trains: a term that favours each row's last candidate makes the walk choose it, row after row."""
    _, _, ours = make_pair(DFLASH2, seed=7)
    selector, seen = ours.candidate_selector, []

    def favour_last(gates, predecessors, candidates):
        seen.append(predecessors.tolist())
        return torch.zeros(candidates.shape).index_fill_(1, torch.tensor([candidates.shape[1] - 1]), 1e4)

    monkeypatch.setattr(selector, "transition_scores", favour_last)
    gen = torch.Generator().manual_seed(8)
    logits, hidden = torch.randn(5, VOCAB, generator=gen) * 3, torch.randn(5, H, generator=gen)
    last = logits.topk(TOP_K, dim=-1).indices[:, -1].tolist()
    assert selector.walk(logits, hidden, torch.tensor([4])).tolist() == last
    assert seen == [[4], *[[t] for t in last[:-1]]]


@pytest.fixture(scope="module")
def tiny_target_folder(tmp_path_factory):
    from tiny import make_target
    return make_target(tmp_path_factory.mktemp("target"), layers=4, std=0.15)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in motif_records()))
    return path


def test_train_draft_dflash2_lowers_loss_loads_and_drafts(tiny_target_folder, tiny_data, tmp_path):
    from flashdraft.draft import load_draft_folder
    from flashdraft.engine.config import EngineConfig
    from flashdraft.engine.engine import Engine, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.train.main import run

    out = tmp_path / "draft"
    summary = run(train_args(tiny_target_folder, tiny_data, out, "--dflash2", "--steps", "30", "--draft-layers", "1",
                             "--selector-rank", "32", "--export-dtype", "float32"))
    losses = log_losses(out)
    assert len(losses) == 30 and summary["finished"] and summary["gamma"] == GAMMA
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    draft = load_draft_folder(out)
    assert draft.cfg.dflash2 and (draft.cfg.block_size, draft.cfg.conv_kernel_size, draft.cfg.selector_top_k,
                                  draft.cfg.selector_rank) == (8, 2, 16, 32)
    assert load_draft_folder(out / "checkpoint").cfg == draft.cfg
    moved = [n for n, p in draft.named_parameters() if "kernel_projection" in n and p.abs().max() > 0]
    assert moved  # the convolutions trained away from their identity start

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = motif_records(1, seed=9)[0]["input_ids"][:10]
    engine = Engine.load(EngineConfig(model=str(tiny_target_folder), draft=str(out), ctx_size=256))
    assert engine.draft.cfg.dflash2
    plain = engine.generate(Request(prompt, params, speculative=False))
    spec = engine.generate(Request(prompt, params))
    assert spec.token_ids == plain.token_ids and spec.spec.draft_steps


def v1_run(root, target):
    """A DFlash draft folder, and an output folder whose checkpoint is of that draft (for --resume)."""
    from tiny import make_draft
    folder = make_draft(root / "v1", target)
    checkpoint = root / "v1-run" / "checkpoint"
    checkpoint.mkdir(parents=True)
    for f in folder.iterdir():
        (checkpoint / f.name).write_bytes(f.read_bytes())
    (checkpoint / "state.json").write_text(json.dumps({"step": 1, "total_steps": 2}))
    return folder, root / "v1-run"


@pytest.mark.parametrize("flags, words", [
    *[([flag, value], f"{flag} is a DFlash2 flag: add --dflash2") for flag, value in [
        ("--conv-kernel-size", "2"), ("--conv-group-size", "16"), ("--selector-rank", "32"),
        ("--selector-top-k", "8"), ("--selector-loss-alpha", "0.5")]],
    (["--dflash2", "--conv-kernel-size", "9"], "--conv-kernel-size 9 exceeds the block size 8"),
    (["--dflash2", "--block-size", "4", "--conv-kernel-size", "5"], "--conv-kernel-size 5 exceeds the block size 4"),
    (["--dflash2", "--init", "V1"], "--dflash2: --init {v1} is a DFlash draft, not a DFlash2 one"),
    (["--dflash2", "--resume", "--out", "V1_RUN"], "--dflash2: the checkpoint in {run} (--resume) is a DFlash draft"),
])
def test_train_draft_flags_that_cannot_apply_are_one_line_errors(flags, words, tiny_target_folder, tiny_data, tmp_path,
                                                                 capsys):
    """Each stops train-draft before the target loads, in one line naming the flag (not a draft trained without
    them, a v1 draft trained under --dflash2, or a convolution quietly cut to the block)."""
    from flashdraft.cli import main as cli_main
    v1, run_folder = v1_run(tmp_path, tiny_target_folder)
    flags = [{"V1": str(v1), "V1_RUN": str(run_folder)}.get(f, f) for f in flags]
    out = tmp_path / "out"
    code = cli_main(["train-draft", "-m", str(tiny_target_folder), "--data", str(tiny_data), "--out", str(out),
                     "--device", "cpu", "--steps", "1", "--num-anchors", "4", "--eval-records", "0", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("flashdraft train-draft: error: ") and words.format(v1=v1, run=run_folder) in lines[0]
    assert not out.exists() and not (run_folder / "model.safetensors").exists()  # nothing trained or written


def test_dflash2_flags_accept_a_dflash2_start(tmp_path):
    """--dflash2 with --init of a DFlash2 folder, or --resume of a DFlash2 run: no error."""
    from flashdraft.train.main import build_parser, check_flags
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DFLASH2))
    (folder / "state.json").write_text("{}")
    for flags, out in ((["--init", str(folder)], tmp_path / "new"), (["--resume"], tmp_path)):
        check_flags(build_parser().parse_args(["-m", "t", "--data", "d", "--out", str(out), "--dflash2", *flags]), out)

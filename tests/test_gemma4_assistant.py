"""Gemma 4 assistant drafters (draft/gemma4_assistant.py) against transformers' own classes: a random tiny
Gemma4ForCausalLM target and Gemma4AssistantForCausalLM assistants (the dense tied head of 26B/31B assistants and
the centroid-masked head of E2B/E4B ones), written as HF folders. The reference is transformers' chained drafting
as its SinglePositionMultiTokenCandidateGenerator runs it: the target's shared K/V and last hidden state over the
tokens before the anchor, the anchor's position for every step. Proposals are identical to it over rounds whose
rejected verify rows stay in the target's cache, past the target's sliding ring too with the widest verify steps the
ring allows (one more is refused). Through the engine (two slots at once, and from the command line with llama.cpp's
`--spec-type draft-mtp -md`) greedy answers equal plain decoding and the assistant drafts every step; a --spec-type
that names another kind of draft than -md's is one line; a `gemma4-assistant` GGUF from llama.cpp's own converter
drafts as its folder does; files that do not fit are named."""
import json
import queue
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gemma_gguf import converter  # noqa: F401  (llama.cpp's convert_hf_to_gguf.py, a fixture shared by the run)
from tiny import write_gemma_tokenizer

from flashdraft import cli
from flashdraft.draft import registry
from flashdraft.engine.config import EngineConfig
from flashdraft.engine.engine import Completion, Engine, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.loader import load_draft, load_target

transformers = pytest.importorskip("transformers")
K = 4  # proposals per step
WINDOW = 8  # both models' sliding window: the contexts here run past it
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def text_config(vocab: int, **kw):
    return transformers.Gemma4TextConfig(**{
        **dict(vocab_size=vocab, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
               attention_k_eq_v=True, sliding_window=WINDOW, hidden_size_per_layer_input=0,
               vocab_size_per_layer_input=0, eos_token_id=1, bos_token_id=2, pad_token_id=0), **kw})


def randomize(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.75)
    return model.float().eval()


def make_assistant(folder: Path, vocab: int, seed: int, **config):
    cfg = transformers.Gemma4AssistantConfig(
        text_config=text_config(vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, layer_types=LAYER_TYPES[:2], num_kv_shared_layers=2),
        backbone_hidden_size=64, **config)
    model = randomize(transformers.Gemma4AssistantForCausalLM(cfg), seed)
    if model.masked_embedding is not None:  # a permutation of the vocabulary into its clusters
        model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=torch.Generator().manual_seed(3)))
    vocab_written = write_gemma_tokenizer(folder)  # llama.cpp's converter reads a tokenizer
    assert vocab_written == vocab
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_assistant")
    vocab = write_gemma_tokenizer(root / "target")
    target = randomize(transformers.Gemma4ForCausalLM(text_config(
        vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        layer_types=LAYER_TYPES, final_logit_softcapping=30.0)), seed=0)
    target.save_pretrained(root / "target")
    dense = make_assistant(root / "dense", vocab, seed=1)
    ordered = make_assistant(root / "ordered", vocab, seed=2, use_ordered_embeddings=True, num_centroids=2,
                             centroid_intermediate_top_k=1)
    return SimpleNamespace(root=root, vocab=vocab, hf_target=target, hf={"dense": dense, "ordered": ordered})


@torch.no_grad()
def reference_chain(hf_target, hf_assistant, tokens: torch.Tensor, at: int, k: int) -> list[int]:
    """transformers' k chained draft tokens after the anchor tokens[at], the target having read tokens[:at]."""
    out = hf_target(tokens[None, :at], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    h, shared = out.hidden_states[-1][:, -1:], out.shared_kv_states
    token, proposed = tokens[None, at:at + 1], []
    for _ in range(k):
        embedded = hf_target.get_input_embeddings()(token)
        step = hf_assistant(inputs_embeds=torch.cat([embedded, h], dim=-1), position_ids=torch.tensor([[at]]),
                            shared_kv_states=shared, use_cache=False)
        token, h = step.logits.argmax(-1), step.last_hidden_state
        proposed.append(int(token))
    return proposed


@torch.no_grad()
def drafting_rounds(target, drafter, tokens: torch.Tensor, slot, rounds: int = 7, start: int = 12,
                    width: int = K + 1):
    """(anchor position, proposals) of `rounds` speculative steps over `tokens` in one slot of a fresh state: a
    step's proposals, padded with other tokens to a verify block of `width` rows, are verified into the target's
    cache (its rejected rows stay there, as the engine leaves them), then 0, 1 or 2 of the true tokens after the
    anchor are committed and observed."""
    index = slot if isinstance(slot, int) else int(slot)
    state = target.new_state(index + 1, len(tokens) + width)
    padding = torch.Generator().manual_seed(11)
    drafter.setup_cache(64, index + 1)
    drafter.read_target_state(state)
    capture = drafter.target_layers
    _, features = target(tokens[None, :start], torch.arange(start)[None], state, slot, capture=capture, fresh=True)
    drafter.observe(tokens[None, :start], features, torch.arange(start)[None], slot)
    at, steps = start, []
    for r in range(rounds):
        proposed = drafter.propose(target, tokens[at:at + 1], torch.tensor([at]), slot, K)
        steps.append((at, proposed[0].tolist()))
        rejected = torch.randint(0, target.cfg.vocab_size, (width - 1 - K,), generator=padding)
        block = torch.cat([tokens[at:at + 1], proposed[0], rejected])
        target(block[None], torch.arange(at, at + width)[None], state, slot)  # the verify pass writes its rows
        n = r % 3 + 1
        committed = torch.arange(at, at + n)
        _, features = target(tokens[None, at:at + n], committed[None], state, slot, capture=capture)
        drafter.observe(tokens[None, at:at + n], features, committed[None], slot)
        at += n
    return steps


@pytest.mark.parametrize("head", ["dense", "ordered"])
@pytest.mark.parametrize("slot", [0, torch.tensor([1])], ids=["int-slot", "tensor-slot"])
def test_proposals_equal_transformers_chained_drafting(pair, head, slot):
    target, _, _ = load_target(str(pair.root / "target"))
    drafter = load_draft(str(pair.root / head), target)
    assert drafter.name == "gemma4-assistant"
    assert (drafter.assistant.masked_embedding is not None) == (head == "ordered")
    assert drafter.reads == [2, 3]  # the target's last sliding and last full layer
    tokens = torch.randint(0, pair.vocab, (40,), generator=torch.Generator().manual_seed(5))
    steps = drafting_rounds(target, drafter, tokens, slot)
    assert steps[-1][0] > 2 * WINDOW + 1  # the sliding window cut the context
    for at, proposed in steps:
        assert proposed == reference_chain(pair.hf_target, pair.hf[head], tokens, at, K), at


def run_engine(folder: Path, draft: Path | None, prompts: list[list[int]]) -> tuple[Engine, list[Completion]]:
    """Two prompts one after the other, then the rest at once in two slots."""
    engine = Engine.load(EngineConfig(model=str(folder), draft=None if draft is None else str(draft), ctx_size=128,
                                      n_slots=2, dtype="float32", adaptive=False))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    done = [engine.generate(Request(p, params, cache_prompt=False)) for p in prompts[:2]]
    answers: list[queue.Queue] = [queue.Queue() for _ in prompts[2:]]
    with engine._wake:
        for p, q in zip(prompts[2:], answers):
            engine.submit(Request(p, params, cache_prompt=False),
                          lambda e, q=q: isinstance(e, (Completion, Exception)) and q.put(e))
    return engine, done + [q.get(timeout=300) for q in answers]


def test_engine_decodes_as_plain_and_drafts_as_transformers(pair):
    """Greedy speculative answers equal plain ones; every verify step's proposals equal the reference over the
    tokens committed before it (so the engine hands the drafter the target's state of the right slot)."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, pair.vocab, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    _, plain = run_engine(pair.root / "target", None, prompts)
    engine, spec = run_engine(pair.root / "target", pair.root / "dense", prompts)
    assert engine.draft.name == "gemma4-assistant" and engine.draft_block == K
    checked = 0
    for prompt, p, c in zip(prompts, plain, spec):
        assert c.token_ids == p.token_ids
        tokens, at = torch.tensor(prompt + c.token_ids), len(prompt)
        for proposed, accepted in zip(c.spec.draft_steps, c.spec.acceptance_lengths):
            assert proposed == reference_chain(pair.hf_target, pair.hf["dense"], tokens, at, len(proposed)), at
            checked += 1
            at += accepted
    assert checked >= 30


def test_llama_cpp_flags_choose_the_assistant(pair, capsys):
    """`--spec-type draft-mtp -md ASSISTANT` (llama.cpp's spelling), `-md` alone, and a chain after an n-gram
    lookup: the assistant drafts every step (not a DFlash draft or an MTP block: greedy answers would equal plain
    ones whoever drafted), and --spec-draft-n-max, past its default, sets its chained steps."""
    target, assistant = str(pair.root / "target"), str(pair.root / "dense")
    common = ["generate", "-m", target, "--prompt-ids", "40,41,42,43,44,45", "-n", "16", "--json", "--dtype",
              "float32", "--no-spec-dm-adaptive"]
    runs = {}
    for name, flags in (("plain", []), ("draft-mtp", ["--spec-type", "draft-mtp", "-md", assistant]),
                        ("md", ["-md", assistant, "--spec-draft-n-max", "5"]),
                        ("chain", ["--spec-type", "ngram-mod,draft-mtp", "-md", assistant, "--spec-draft-n-max",
                                   "6"])):
        assert cli.main(common + flags) == 0, capsys.readouterr().err
        runs[name] = json.loads(capsys.readouterr().out)
    for name, n_max in (("draft-mtp", K - 1), ("md", 5), ("chain", 6)):
        run = runs[name]
        assert run["token_ids"] == runs["plain"]["token_ids"], name
        assert list(run["speculative"]["drafted_by"]) == ["gemma4-assistant"], (name, run["speculative"])
        assert run["speculative"]["block_size"] == n_max + 1 and max(map(len, run["draft_steps"])) == n_max, name
        tokens, at = torch.tensor(run["prompt_ids"] + run["token_ids"]), len(run["prompt_ids"])
        for proposed, accepted in zip(run["draft_steps"], run["acceptance_lengths"]):
            assert proposed == reference_chain(pair.hf_target, pair.hf["dense"], tokens, at, len(proposed)), name
            at += accepted
    assert registry.spec_type_names("gemma4-assistant") == ("gemma4-assistant", "mtp", "draft-mtp")
    assert registry.kind_named("draft-mtp").name == "mtp"  # without a file: the target's own MTP block


@pytest.fixture(scope="module")
def dflash(pair):
    """A DFlash draft for the target (the other kind of draft file)."""
    from tiny import make_draft
    return make_draft(pair.root / "dflash", pair.root / "target")


@pytest.mark.parametrize("spec_type", ["draft-mtp", "mtp", "ngram-mod,draft-mtp", "draft-dflash", "dflash"])
def test_a_spec_type_that_names_another_kind_of_draft_is_one_line(pair, dflash, capsys, spec_type):
    """--spec-type names the kind of draft that -md must be (a chain: its last type); another kind is a one-line
    error naming both, from the flags and the draft's config before any weights load (not the file's own kind
    run in its place)."""
    from flashdraft.args import speculation
    assistant = pair.root / "dense"
    draft, words = (dflash, "takes a Gemma 4 assistant; {} is a DFlash draft") if "mtp" in spec_type else \
        (assistant, "takes a DFlash draft; {} is a Gemma 4 assistant")
    error = f"--spec-type {spec_type} -md " + words.format(draft)
    flags = ["-m", str(pair.root / "target"), "--prompt-ids", "40,41,42", "-n", "4", "--dtype", "float32",
             "--spec-type", spec_type, "-md", str(draft)]
    args = cli.generate_parser().parse_args(flags)
    with pytest.raises(ValueError) as e:
        speculation(args, args.draft)  # (the command checks its flags before it loads anything)
    assert str(e.value) == error
    assert cli.main(["generate", *flags]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"flashdraft generate: error: {error}"]
    target, _, _ = load_target(str(pair.root / "target"))
    with pytest.raises(ValueError) as e:  # an engine configured without the command line: the loader's check
        load_draft(str(draft), target, spec_type=spec_type)
    assert str(e.value) == error


def test_spec_draft_n_max_reaches_the_kind_that_reads_it(pair, dflash):
    """--spec-draft-n-max is a setting of the draft file's kind where it has one (a Gemma 4 assistant: its chained
    steps), through the one path that gives it to the target's MTP block too; a DFlash draft's block is the
    engine's (EngineConfig.draft_n_max), not a setting of the draft."""
    from flashdraft.args import speculation

    def settings(*flags):
        args = cli.generate_parser().parse_args(["-m", str(pair.root / "target"), "--prompt", "hi", *flags])
        return speculation(args, args.draft)

    for spec_type in ([], ["--spec-type", "draft-mtp"]):
        assert settings(*spec_type, "-md", str(pair.root / "dense"), "--spec-draft-n-max", "5") == \
            (None, {"draft_n_max": 5})
    assert settings("--spec-type", "ngram-mod,draft-mtp", "-md", str(pair.root / "dense"), "--spec-draft-n-max",
                    "5") == ("ngram-mod,draft-mtp", {"draft_n_max": 5})
    assert settings("-md", str(dflash), "--spec-draft-n-max", "5") == (None, {})
    assert settings("--spec-type", "draft-mtp", "--spec-draft-n-max", "5") == ("draft-mtp", {"draft_n_max": 5})


def test_mtp_without_a_draft_on_gemma4_points_at_the_assistant(pair, capsys):
    """A Gemma 4 checkpoint has no MTP block: its MTP drafter is the separate assistant, which comes with -md."""
    assert cli.main(["generate", "-m", str(pair.root / "target"), "--prompt-ids", "40,41", "-n", "2", "--dtype",
                     "float32", "--spec-type", "mtp"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "a Gemma 4 assistant comes with -md" in lines[0], lines


def test_past_the_ring_with_the_widest_verify_steps(pair):
    """About 110 tokens, past the target's sliding ring (window + WINDOW_STEP rows), with the most proposals the
    ring allows: every verify step leaves rejected rows up to anchor + n_max in the ring, each in the row of a
    position a ring's length before it, which the sliding layers must not read as that position; proposals equal
    transformers'. One proposal more is refused when the assistant loads, naming the largest value."""
    target, _, _ = load_target(str(pair.root / "target"))
    most = target.window_rows - 1 - WINDOW  # window + n_max < rows
    with pytest.raises(ValueError) as e:
        load_draft(str(pair.root / "dense"), target, params={"draft_n_max": most + 1})
    assert f"--spec-draft-n-max {most + 1}" in str(e.value) and f"at most {most}" in str(e.value), str(e.value)
    drafter = load_draft(str(pair.root / "dense"), target, params={"draft_n_max": most})
    assert drafter.block_size == most + 1
    tokens = torch.randint(0, pair.vocab, (112,), generator=torch.Generator().manual_seed(7))
    steps = drafting_rounds(target, drafter, tokens, 0, rounds=48, width=drafter.block_size)
    assert steps[-1][0] > target.window_rows + 2 * WINDOW
    for at, proposed in steps:
        assert proposed == reference_chain(pair.hf_target, pair.hf["dense"], tokens, at, K), at


def test_gguf_from_llama_cpp_converter_drafts_as_its_folder(pair, converter):  # noqa: F811
    from test_gemma_gguf import convert
    from flashdraft.formats.gguf import read_gguf
    gguf = convert(converter, pair.root / "dense")
    assert read_gguf(gguf).architecture == "gemma4-assistant"
    target, _, _ = load_target(str(pair.root / "target"))
    from_gguf, from_folder = load_draft(str(gguf), target), load_draft(str(pair.root / "dense"), target)
    ours, theirs = from_gguf.state_dict(), from_folder.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    a, b = from_gguf.assistant.cfg, from_folder.assistant.cfg
    assert a.backbone_hidden_size == b.backbone_hidden_size
    assert a.blocks.rms_norm_eps == pytest.approx(b.blocks.rms_norm_eps)  # (stored as float32)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "layer_types",
                  "head_dims", "rope", "sliding_window", "attn_scale", "attn_softcap", "norm_offset", "layer_scalar"):
        assert getattr(a.blocks, field) == getattr(b.blocks, field), field  # (the K/V heads are the target's)
    tokens = torch.randint(0, pair.vocab, (40,), generator=torch.Generator().manual_seed(6))
    assert drafting_rounds(target, from_gguf, tokens, 0) == drafting_rounds(target, from_folder, tokens, 0)


def edited_copy(pair, name: str, config=None, drop: str | None = None) -> Path:
    folder = pair.root / name
    shutil.copytree(pair.root / "dense", folder, dirs_exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    if drop:
        tensors = load_file(folder / "model.safetensors")
        save_file({n: t for n, t in tensors.items() if n != drop}, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("name, config, drop, words", [
    ("backbone", lambda c: {**c, "backbone_hidden_size": 48}, None,
     "backbone_hidden_size 48 is not the target's hidden size 64"),
    ("missing", None, "model.layers.1.self_attn.q_proj.weight",
     "missing tensors for a Gemma 4 assistant: model.layers.1.self_attn.q_proj.weight"),
    ("heads", lambda c: {**c, "text_config": {**c["text_config"], "head_dim": 8}}, None,
     "assistant layer 0 (4 heads of 8) does not fit target layer 2 (2 KV heads of 16)"),
    ("unified", lambda c: {**c, "architectures": ["Gemma4UnifiedAssistantForCausalLM"]}, None,
     "unified targets, which flashdraft does not read yet"),
])
def test_an_assistant_that_does_not_fit_is_named(pair, name, config, drop, words):
    target, _, _ = load_target(str(pair.root / "target"))
    folder = edited_copy(pair, name, config, drop)
    with pytest.raises(ValueError) as e:
        load_draft(str(folder), target)
    assert str(e.value).startswith(str(folder)) and words in str(e.value), str(e.value)


def test_a_target_that_is_not_gemma4_is_named(pair, tmp_path):
    from tiny import make_target
    llama, _, _ = load_target(str(make_target(tmp_path / "llama", vocab_size=pair.vocab)))
    with pytest.raises(ValueError, match="drafts for a Gemma 4 target, not a llama one"):
        load_draft(str(pair.root / "dense"), llama)

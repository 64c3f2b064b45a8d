"""A drafter added through draft/registry.py alone (a class and an entry, as the toy model family of
test_layers.py) runs in the engine and behind the server with no other change: a lookup drafter with no model
and no target layers, which proposes what followed the anchor's latest earlier occurrence. Then the n-gram lookup
drafter that flashdraft ships (draft/ngram.py, `--spec-type ngram-mod`, no draft file): its proposals against a
lookup written here in plain Python, greedy speculative decoding equal to plain, the server and the command line."""
import json
import random
import subprocess
import sys

import httpx
import pytest
import torch

from flashdraft import cli
from flashdraft.draft import registry
from flashdraft.draft.ngram import LookupGate, NGramConfig, NGramDrafter
from flashdraft.engine.engine import Engine, EngineConfig, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app
from flashdraft.server.main import load_engine, parse_settings
from test_server import REPO, DEVICE, models, serving, settings  # noqa: F401  (models: a fixture shared by the run)

DTYPE = "float32"  # a GPU's bf16 verify rows may round apart from its one-token steps; greedy equality needs float32


class TokensByPosition:
    def __init__(self, n_slots: int, window: int, device: str):
        self.tokens = torch.full((n_slots, window), -1, dtype=torch.long, device=device)  # -1: not observed

    @property
    def bytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size()


class LookupDrafter:
    """Proposes the k tokens that followed the anchor's latest earlier occurrence among the committed tokens it
    observed (the anchor itself where there is none). Its state holds a slot's tokens by position, so its window
    is the context."""
    name = "toy-lookup"
    target_layers = ()

    def __init__(self, block_size: int, device: str):
        self.block_size, self.device, self.state = block_size, device, None

    def setup_cache(self, window, n_slots=1, cache_dtypes=(None, None)):
        self.state = TokensByPosition(n_slots, window, self.device)

    def reset(self, slot=0, keep=0):
        self.state.tokens[slot, keep:] = -1

    def observe(self, tokens, features, positions, slots=0):
        assert features is None  # it names no target layer
        self.state.tokens[slots, positions[0]] = tokens[0]

    def propose(self, target, anchors, positions, slots, k, live=None, block=None, context_rows=None):
        history = self.state.tokens[slots]
        index = torch.arange(len(history), device=history.device)
        last = torch.where((history == anchors[0]) & (index < positions[0]), index, -1).max()
        after = history[(last + 1 + index[:k]).clamp(max=len(history) - 1)]
        return torch.where((last >= 0) & (after >= 0), after, anchors[0])[None]

    def compile_layers(self, block_sizes=None):
        pass


def lookup(history: list[int], anchor: int, k: int) -> list[int]:
    """LookupDrafter.propose in plain Python, over the tokens committed before the anchor."""
    last = max((i for i, t in enumerate(history) if t == anchor), default=-1)
    after = history[last + 1:last + 1 + k] if last >= 0 else []
    return after + [anchor] * (k - len(after))


@pytest.fixture
def lookup_folder(tmp_path, monkeypatch):
    """A draft folder naming the toy's architecture, and the toy's registry entry (for this test only)."""
    kind = registry.DrafterKind(name="toy-lookup", hf_architectures=("ToyLookup",),
                                load=lambda source, target, options: LookupDrafter(source.config["block_size"],
                                                                                   options.device))
    monkeypatch.setattr(registry, "KINDS", [*registry.KINDS])
    registry.register(kind)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyLookup"], "block_size": 4}))
    return tmp_path


def check_proposals(prompt: list[int], completion) -> None:
    """Each verify step proposed the lookup over exactly the tokens committed before its anchor."""
    tokens, pos = prompt + completion.token_ids, len(prompt)  # the first verify step's anchor: the first output
    for proposed, accepted in zip(completion.spec.draft_steps, completion.spec.acceptance_lengths):
        assert proposed == lookup(tokens[:pos], tokens[pos], len(proposed))
        pos += accepted


def test_a_drafter_added_through_the_registry_alone_runs_in_the_engine(models, lookup_folder):
    target, _ = models
    engine = Engine.load(EngineConfig(model=str(target), draft=str(lookup_folder), device=DEVICE, dtype=DTYPE,
                                      ctx_size=256))
    assert type(engine.draft) is LookupDrafter
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = [40, 41, 42, 43, 40, 41, 42, 43, 40]
    plain = engine.generate(Request(prompt, params, speculative=False))
    spec = engine.generate(Request(prompt, params))
    assert spec.token_ids == plain.token_ids
    assert spec.spec.draft_steps and spec.spec.draft_n_accepted > 0
    check_proposals(prompt, spec)
    committed = prompt + spec.token_ids[:-1]  # every token whose position ran (the last one has not)
    assert engine.draft.state.tokens[0, :len(committed) + 1].tolist() == committed + [-1]
    # one token a step (a verify width of 1): plain steps that the drafter still observes
    follow = engine.generate(Request(prompt[:5], params, block_size=1))
    assert follow.token_ids == engine.generate(Request(prompt[:5], params, speculative=False)).token_ids
    assert not follow.spec.draft_steps
    committed = prompt[:5] + follow.token_ids[:-1]
    assert engine.draft.state.tokens[0, :len(committed) + 1].tolist() == committed + [-1]


def test_a_drafter_added_through_the_registry_alone_serves(models, lookup_folder):
    target, _ = models
    engine = Engine.load(EngineConfig(model=str(target), draft=str(lookup_folder), device=DEVICE, dtype=DTYPE,
                                      ctx_size=256, n_slots=2))
    prompt = [40, 41, 42, 43, 40, 41, 42, 43, 40]
    plain = engine.generate(Request(prompt, SamplingParams(max_tokens=32), speculative=False))
    with serving(create_app(engine, settings())) as url:
        props = httpx.get(url + "/props", timeout=30).json()
        assert props["speculative"] == {"type": "toy-lookup", "block_size": 4, "draft_window": None}
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 32, "temperature": 0,
                                                  "return_tokens": True}, timeout=60).json()
    assert r["tokens"] == plain.token_ids
    assert r["speculative"]["draft_n"] > 0 and r["speculative"]["draft_n_accepted"] > 0


# ---- the n-gram lookup drafter (draft/ngram.py)

def ngram_lookup(history: list[int], anchor: int, n: int, n_max: int, n_min: int, k: int,
                 chain: bool = True) -> list[int]:
    """llama.cpp's ngram-mod lookup over the committed tokens before the anchor, without its hash table: each n
    tokens map to the position that followed their latest occurrence, and the last n tokens (the anchor, then each
    proposed token, at the end) are looked up again for every token (chain), or the tokens after the first match
    are copied (ngram-simple). A run shorter than n_min proposes nothing; the anchor fills the k tokens after it."""
    follower = {}
    for f in range(n, len(history)):
        follower[tuple(history[f - n:f])] = f
    tail, run, f = history + [anchor], [], None
    for i in range(n_max):
        if chain or i == 0:
            f = follower.get(tuple(tail[-n:])) if len(tail) >= n else None
        else:
            f = f + 1 if f + 1 < len(history) else None
        if f is None:
            break
        run.append(history[f])
        tail.append(history[f])
    if len(run) < min(n_min, n_max):
        run = []
    return (run + [anchor] * k)[:k]


def test_ngram_proposals_equal_the_plain_lookup():
    """Random histories over small vocabularies (many repeats), observed in chunks as the engine does (the slot an
    int or a [1] tensor), some of them cut back by a prompt-cache reset and continued otherwise, in either of two
    slots."""
    rng = random.Random(0)
    for trial in range(300):
        cfg = NGramConfig(n_match=rng.choice([1, 2, 3, 4]), n_max=rng.choice([1, 3, 6, 10]),
                          n_min=rng.choice([0, 1, 2, 5]), chain=rng.random() < 0.7)
        drafter = NGramDrafter(cfg)
        drafter.setup_cache(rng.choice([64, 200]), n_slots=2)
        slot, vocab = rng.randrange(2), rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        anchor_at = rng.randrange(len(tokens))
        if trial % 3 == 0:  # an earlier request in the slot: its tokens past the shared prefix are dropped
            earlier = tokens[:anchor_at // 2] + [rng.randrange(vocab) for _ in range(40)]
            drafter.observe(torch.tensor([earlier]), None, torch.arange(len(earlier))[None], slot)
            drafter.reset(slot, keep=anchor_at // 2)
            at = anchor_at // 2
        else:
            drafter.reset(slot)
            at = 0
        while at < anchor_at:
            chunk = tokens[at:min(anchor_at, at + rng.randint(1, 7))]
            slot_arg = torch.tensor([slot]) if rng.random() < 0.5 else slot  # as a graph for every slot takes it
            drafter.observe(torch.tensor([chunk]), None, torch.arange(at, at + len(chunk))[None], slot_arg)
            at += len(chunk)
        k = rng.randint(1, cfg.n_max)
        proposed = drafter.propose(None, torch.tensor([tokens[anchor_at]]), torch.tensor([anchor_at]), slot, k)
        assert proposed.shape == (1, k) and proposed.dtype == torch.long
        want = ngram_lookup(tokens[:anchor_at], tokens[anchor_at], cfg.n_match, cfg.n_max, cfg.n_min, k, cfg.chain)
        assert proposed[0].tolist() == want, (cfg, tokens, anchor_at, k)


@pytest.mark.parametrize("chain", [True, False])
def test_ngram_steps_read_nothing_on_the_host(chain):
    """observe and propose run inside CUDA graphs: on meta tensors, where reading a value (.item(), a
    zero-dimensional index) raises, they still run."""
    drafter = NGramDrafter(NGramConfig(n_match=3, n_max=6, n_min=2, chain=chain), device="meta")
    drafter.setup_cache(64, n_slots=2)
    ids = torch.zeros(1, 5, dtype=torch.long, device="meta")
    drafter.observe(ids, None, ids, 1)
    proposed = drafter.propose(None, ids[0, :1], ids[0, :1], 1, 4, block=7)
    assert proposed.shape == (1, 4) and proposed.dtype == torch.long


NGRAM = dict(n_match=2, n_max=6, n_min=0)


def check_ngram_proposals(prompt: list[int], completion, n_match: int, n_max: int, n_min: int) -> None:
    """Each verify step proposed the lookup over exactly the tokens committed before its anchor."""
    tokens, pos = prompt + completion.token_ids, len(prompt)
    for proposed, accepted in zip(completion.spec.draft_steps, completion.spec.acceptance_lengths):
        assert proposed == ngram_lookup(tokens[:pos], tokens[pos], n_match, n_max, n_min, len(proposed))
        pos += accepted


@pytest.mark.parametrize("params", [NGRAM, dict(n_match=3, n_max=8, n_min=3)])
def test_ngram_drafter_decodes_as_plain(models, params):
    """The n-gram drafter by its --spec-type name, with no draft file: greedy speculative decoding equals plain
    token for token on a prompt that repeats itself (proposals accepted) and on one that does not, the second
    request of a slot reusing the first one's prompt cache and the drafter's state of it."""
    target, _ = models
    engine = Engine.load(EngineConfig(model=str(target), spec_type="ngram-mod", draft_params=params, device=DEVICE,
                                      dtype=DTYPE, ctx_size=256))
    assert engine.draft.name == "ngram-mod" and engine.draft.block_size == params["n_max"] + 1
    assert engine.draft.target_layers == ()
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    repeating = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]
    for prompt in (repeating, [7, 100, 33, 250, 12, 90, 8, 61], repeating + [9, 40, 41]):
        plain = engine.generate(Request(prompt, sampling, speculative=False))
        spec = engine.generate(Request(prompt, sampling))
        assert spec.token_ids == plain.token_ids
        assert spec.spec.draft_steps
        check_ngram_proposals(prompt, spec, params["n_match"], params["n_max"], params["n_min"])
        if prompt is repeating:
            assert spec.spec.draft_n_accepted > 0


def lookup_run(cfg: NGramConfig, tokens: list[int], block: int, window: int) -> int:
    """The run NGramDrafter.lookup proposes with the last token as the anchor, every earlier one observed."""
    drafter = NGramDrafter(cfg)
    drafter.setup_cache(window, 1)
    anchor_at = len(tokens) - 1
    drafter.observe(torch.tensor(tokens[:anchor_at])[None], None, torch.arange(anchor_at)[None], 0)
    _, run = drafter.lookup(torch.tensor(tokens[-1:]), torch.tensor([anchor_at]), 0, block - 1, block)
    return int(run)


def self_copying(rng: random.Random, length: int) -> list[int]:
    """Tokens that now and then copy an earlier stretch of themselves or fall into a short loop."""
    tokens = [rng.randrange(5) for _ in range(8)]
    while len(tokens) < length:
        r = rng.random()
        if r < 0.4:
            tokens += tokens[-rng.randrange(5, 40):][:rng.randrange(1, 12)]
        elif r < 0.5:
            tokens += tokens[-rng.randrange(2, 6):] * 3
        else:
            tokens.append(rng.randrange(5))
    return tokens[:length]


@pytest.mark.parametrize("n_match, n_min, n_max, chain, block, window", [
    (1, 0, 4, True, None, 512), (2, 3, 8, True, None, 512), (3, 6, 4, False, None, 512), (4, 1, 16, True, None, 512),
    (2, 5, 12, False, None, 512), (3, 8, 16, True, None, 512), (2, 12, 16, True, 7, 512), (2, 4, 8, True, None, 40),
    (2, 4, 10, False, None, 40)])
def test_lookup_gate_opens_where_the_lookup_proposes(n_match, n_min, n_max, chain, block, window):
    """draft/ngram.LookupGate against NGramDrafter.lookup itself, over tokens that copy stretches of themselves
    and loop: open exactly where the lookup proposes a run (the block narrower than n_max + 1, or the drafter's
    window shorter than the tokens, as the step's)."""
    cfg = NGramConfig(n_match=n_match, n_max=n_max, n_min=n_min, chain=chain)
    tokens = self_copying(random.Random(n_match * 100 + n_min), 160)
    block = block or n_max + 1
    gate, opened = LookupGate(cfg, tokens[:5], window), 0
    for end in range(5, len(tokens)):
        if end > 5:
            gate.add([tokens[end - 1]])
        want = lookup_run(cfg, tokens[:end], block, window) > 0
        assert gate.open(block) == want, end
        opened += want
    assert 0 < opened < len(tokens) - 5


def test_lookup_gate_rests_after_rejected_runs():
    """Five drafting steps in a row with under a quarter of the run accepted shut the gate for QUIET tokens, then
    twice as long; a step that pays ends the count."""
    cfg = NGramConfig(n_match=2, n_max=8, n_min=8)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 30
    gate = LookupGate(cfg, tokens[:30])
    assert gate.open(9)
    for _ in range(4):
        gate.record(1)
    gate.record(2)  # a quarter of 8: it pays
    for _ in range(4):
        gate.record(1)
    assert gate.open(9)
    gate.record(1)
    assert not gate.open(9)
    gate.add(tokens[:LookupGate.QUIET - 1])
    assert not gate.open(9)
    gate.add(tokens[LookupGate.QUIET - 1:LookupGate.QUIET])
    assert gate.open(9)
    for _ in range(5):
        gate.record(0)
    gate.add(tokens[:2 * LookupGate.QUIET - 10])  # the loop goes on
    assert not gate.open(9)
    gate.add(tokens[:10])
    assert gate.open(9)


def test_ngram_steps_verify_only_where_the_gate_is_open(models):
    """With the adaptive width on, a request whose tokens never hold a run for the lookup runs plain steps only
    (the verify rows a lookup could not fill are never spent), and one whose output loops drafts there; the width
    fixed checks every step; every answer equals plain decoding."""
    target, _ = models
    prompt = [7, 100, 33, 250, 12, 90, 8, 61]
    for kind, params, tokens, drafts in (
            ("ngram-simple", dict(size_n=30, size_m=32), 24, False),  # 8 + 24 tokens: no 30-token key seen twice
            ("ngram-mod", dict(n_match=2, n_max=16, n_min=8), 120, True)):  # the tiny model's output loops
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        runs = {}
        for adaptive in (True, False):
            engine = Engine.load(EngineConfig(model=str(target), spec_type=kind, draft_params=params,
                                              device=DEVICE, dtype=DTYPE, ctx_size=256, adaptive=adaptive))
            runs[adaptive] = engine.generate(Request(prompt, sampling))
            plain = engine.generate(Request(prompt, sampling, speculative=False))
            assert runs[adaptive].token_ids == plain.token_ids
        gated, fixed = runs[True].spec, runs[False].spec
        assert len(fixed.draft_steps) > 0 and gated.plain_steps > 0
        if drafts:
            assert 0 < len(gated.draft_steps) < len(fixed.draft_steps) and gated.draft_n_accepted > 0
            assert gated.draft_n_accepted / len(gated.draft_steps) > fixed.draft_n_accepted / len(fixed.draft_steps)
        else:
            assert not gated.draft_steps


def test_ngram_drafter_serves_as_plain(models):
    """`flashdraft serve --spec-type ngram-mod` with no draft file (its flags through the server's parser and
    loader) answers over HTTP with the plain answer's text and tokens."""
    target, _ = models
    flags = ["--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-max", "6", "--spec-ngram-mod-n-min", "0"]
    s, notes = parse_settings(["-m", str(target), "--spec-type", "ngram-mod", *flags, "--device", DEVICE,
                               "--dtype", DTYPE, "-c", "256", "--no-spec-dm-adaptive", "--temp", "0", "-a", "tiny"])
    assert (s.spec_type, s.draft_params, s.draft) == ("ngram-mod", NGRAM, None) and not notes
    engine = load_engine(s)
    prompt = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]
    plain = engine.generate(Request(prompt, SamplingParams(max_tokens=32), speculative=False))
    with serving(create_app(engine, s)) as url:
        props = httpx.get(url + "/props", timeout=30).json()
        assert props["speculative"] == {"type": "ngram-mod", "block_size": 7, "draft_window": None}
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 32, "temperature": 0,
                                                  "return_tokens": True}, timeout=60).json()
        other = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 4,
                                                      "speculative.type": "ngram-simple"}, timeout=60)
        assert other.status_code == 400 and "this server drafts with ngram-mod" in other.text, other.text
    assert r["tokens"] == plain.token_ids and r["content"] == plain.text
    assert r["speculative"]["draft_n"] > 0 and r["speculative"]["draft_n_accepted"] > 0


def test_ngram_drafter_generates_from_the_command_line(models, capsys):
    target, _ = models
    common = ["generate", "-m", str(target), "--prompt-ids", "40,41,42,43,40,41,42,43,40", "-n", "24", "--json",
              "--device", DEVICE, "--dtype", DTYPE]
    runs = {}
    for name, extra in (("plain", []), ("mod", ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "2",
                                                "--spec-ngram-mod-n-min", "1"]),
                        ("simple", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1"])):
        assert cli.main(common + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["mod"]["token_ids"] == runs["simple"]["token_ids"] == runs["plain"]["token_ids"]
    assert runs["plain"]["speculative"] is None
    assert runs["mod"]["speculative"]["block_size"] == 65 and runs["simple"]["speculative"]["block_size"] == 49


@pytest.mark.parametrize("flags, words", [
    (["--spec-type", "ngram-bogus"], ["--spec-type ngram-bogus: unknown type", "ngram-mod"]),
    (["--spec-type", "ngram-cache"], ["--spec-type ngram-cache: not supported"]),
    (["--spec-type", "ngram-mod,draft-dflash"], ["--spec-type ngram-mod,draft-dflash needs a draft model"]),
    (["--spec-type", "draft-dflash,ngram-mod"], ["a chain is n-gram lookups first, then one model drafter"]),
    (["--spec-type", "ngram-mod,ngram-simple"], ["a chain is n-gram lookups first"]),
    (["--spec-type", "ngram-mod,ngram-mod,draft-mtp"], ["a chain names each drafter once"]),
    (["--spec-type", "ngram-mod,draft-simple"], ["--spec-type draft-simple: not supported"]),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "0"], ["--spec-ngram-mod-n-match 0", "1 and 1024"]),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "1025"], ["--spec-ngram-mod-n-max 1025"]),
    (["--spec-type", "ngram-simple", "--spec-ngram-mod-n-min", "4"], ["--spec-ngram-mod-n-min is for --spec-type "
                                                                      "ngram-mod, not ngram-simple"]),
    (["--spec-type", "ngram-mod", "-md", "draft"], ["takes no draft model"]),
])
def test_ngram_flag_mistakes_are_one_line(models, capsys, flags, words):
    target, _ = models
    for command in ("generate", "serve"):
        rest = ["--prompt", "hi"] if command == "generate" else []
        assert cli.main([command, "-m", str(target), *rest, *flags]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"flashdraft {command}: error: "), lines
        assert all(w in lines[0] for w in words), lines[0]


def test_an_unknown_spec_type_exits_1(models):
    target, _ = models
    out = subprocess.run([sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "--spec-type",
                          "ngram-nope"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "flashdraft serve: error: --spec-type ngram-nope: unknown type (types: none, dflash, draft-dflash, ngram-mod, "
        "ngram-simple, mtp, draft-mtp)"]


def test_mtp_on_a_model_without_one_is_one_line(models, capsys):
    target, _ = models
    assert cli.main(["generate", "-m", str(target), "--prompt", "hi", "--spec-type", "draft-mtp"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "flashdraft generate: error: --spec-type draft-mtp: llama models have no MTP block", lines


def test_a_chain_takes_the_lookup_where_it_found_a_run_else_the_model(models):
    """--spec-type ngram-mod,draft-dflash: each proposal is the lookup's where the lookup found a run, else the
    DFlash draft's (padded with the anchor past its block), the members' own proposals from the same history;
    greedy answers equal plain ones, and lookups are accepted on a prompt that repeats itself."""
    target, draft = models
    engine = Engine.load(EngineConfig(model=str(target), draft=str(draft), spec_type="ngram-mod,draft-dflash",
                                      draft_params=dict(n_match=2, n_max=20, n_min=2), device=DEVICE, dtype=DTYPE,
                                      ctx_size=256))
    chain = engine.draft
    lookup, model = chain.lookups[0], chain.model
    assert chain.name == "ngram-mod,dflash" and chain.target_layers == model.target_layers
    assert chain.block_size == model.block_size  # the lookup's runs cut to the model's block
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    repeating = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]
    found = {True: 0, False: 0}
    for prompt in (repeating, [7, 100, 33, 250, 12, 90, 8, 61]):
        plain = engine.generate(Request(prompt, sampling, speculative=False))
        spec = engine.generate(Request(prompt, sampling))
        assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
        # each step's proposal counted under the member that made it
        by = spec.spec.drafted_by
        assert set(by) <= {"ngram-mod", "dflash"} and sum(by.values()) == spec.spec.draft_n
        assert sum(spec.spec.accepted_by.values()) == spec.spec.draft_n_accepted
        assert spec.timings.to_dict()["draft_n_accepted_by"] == spec.spec.accepted_by
        if prompt is repeating:
            assert spec.spec.draft_n_accepted > 0 and spec.spec.accepted_by.get("ngram-mod", 0) > 0
        # each member's proposal now, after the slot's history: the chain's is the lookup's or the model's
        slot, at = 0, len(prompt) + len(spec.token_ids) - 1
        pos = torch.tensor([at], device=engine.device)
        most = chain.block_size - 1
        for k, last in ((3, spec.token_ids[-1]), (most, spec.token_ids[-1]), (3, 319), (most, 319)):  # 319: unseen
            anchor = torch.tensor([last], device=engine.device)
            tokens, run = lookup.lookup(anchor, pos, slot, k)
            mine = model.propose(engine.target, anchor, pos, slot, min(k, model.block_size - 1))
            proposed = chain.propose(engine.target, anchor, pos, slot, k)
            want = tokens if int(run) > 0 else torch.cat([mine, anchor[:, None].expand(1, k - mine.shape[1])], 1)
            assert torch.equal(proposed, want)
            assert chain.proposed_by(slot) == ("ngram-mod" if int(run) > 0 else "dflash")
            found[int(run) > 0] += 1
    assert found[True] and found[False]


def test_a_chain_from_the_command_line(models, capsys):
    target, draft = models
    common = ["generate", "-m", str(target), "--prompt-ids", "40,41,42,43,40,41,42,43,40", "-n", "24", "--json",
              "--device", DEVICE, "--dtype", DTYPE]
    assert cli.main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "-md", str(draft), "--spec-type", "ngram-mod,draft-dflash",
                     "--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1"]) == 0
    chained = json.loads(capsys.readouterr().out)
    assert chained["token_ids"] == plain["token_ids"] and chained["speculative"]["block_size"] == 8  # the draft's


def test_a_lookup_pads_past_its_n_max():
    """A chain asks its lookup for as many tokens as the model drafter's block holds, which may be more than the
    lookup's n_max: the tokens past it are the anchor, as past a run (a chain with --spec-ngram-mod-n-max 3 before
    a draft of block 8 failed on the shapes)."""
    drafter = NGramDrafter(NGramConfig(n_match=2, n_max=3, n_min=1))
    drafter.setup_cache(64)
    history = [5, 6, 7, 8, 9, 5, 6]
    drafter.observe(torch.tensor([history]), None, torch.arange(len(history))[None], 0)
    tokens, run = drafter.lookup(torch.tensor([7]), torch.tensor([len(history)]), 0, 7)
    assert tokens[0].tolist() == [8, 9, 5, 7, 7, 7, 7] and int(run) == 3


def test_a_chain_whose_lookup_is_shorter_than_the_draft_block(models):
    target, draft = models
    engine = Engine.load(EngineConfig(model=str(target), draft=str(draft), spec_type="ngram-mod,draft-dflash",
                                      draft_params=dict(n_match=2, n_max=3, n_min=1), device=DEVICE, dtype=DTYPE,
                                      ctx_size=256))
    prompt = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.generate(Request(prompt, sampling, speculative=False))
    assert engine.generate(Request(prompt, sampling)).token_ids == plain.token_ids

"""A drafter added through draft/registry.py alone (a class and an entry, as the toy model family of
test_layers.py) runs in the engine and behind the server with no other change: a lookup drafter with no model
and no target layers, which proposes what followed the anchor's latest earlier occurrence."""
import json

import httpx
import pytest
import torch

from flashdraft.draft import registry
from flashdraft.engine.engine import Engine, EngineConfig, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app
from test_server import DEVICE, models, serving, settings  # noqa: F401  (models: a fixture shared by the whole run)

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

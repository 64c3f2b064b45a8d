"""The adaptive verify width: the controller's rule, and decoding with it stays lossless and keeps the draft fed."""
import torch
from test_engine import oracle_proposals, random_draft, random_target, run

from flashdraft.engine.adaptive import WidthController, candidate_widths, measure_costs
from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams

COSTS = {1: 1.0, 2: 1.15, 4: 1.4, 8: 2.0}


def test_controller_narrows_on_rejections_probes_and_widens_on_acceptance():
    c = WidthController(dict(COSTS))
    assert c.width() == 8  # starts wide
    widths = []
    for _ in range(20):
        widths.append(c.width())
        c.record(widths[-1], 0)
    # nothing accepted: three full-width steps, then plain decoding, and a probe after probe_every steps
    assert widths == [8] * 3 + [1] * 16 + [8]
    for interval in (32, 64, 128, 256, 256):  # each probe that finds nothing doubles the wait for the next
        for _ in range(interval):
            assert c.width() == 1
            c.record(1, 0)
        assert c.width() == 8
        c.record(8, 0)
    assert c.width() == 1
    for _ in range(256):
        c.record(1, 0)
    c.record(c.width(), 1)  # a probe whose 2 tokens do not pay for its cost (2.0): the wait stays long
    assert c.current == 1 and c.probe_interval == 256
    for _ in range(256):
        c.record(1, 0)
    c.record(c.width(), 2)  # 3 tokens for the cost of 2 plain steps: probes come every probe_every steps again
    assert c.probe_interval == 16  # (and the estimates it updated may already move the width off plain)
    for _ in range(300):
        c.record(c.width(), c.width() - 1)  # everything accepted
    assert c.width() == 8 and c.expected_tokens(8) > 7
    widths = []
    for _ in range(60):
        widths.append(c.width())
        c.record(widths[-1], 1)  # exactly one draft accepted each time
    assert c.current == 2  # E_2 = 2 at cost 1.15 beats E_4 ~ 2 at 1.4
    assert 4 in widths[-20:]  # and a wider step now and then keeps checking


def test_the_first_steps_outweigh_the_optimistic_start_but_not_a_learned_one():
    from flashdraft.engine.adaptive import AcceptancePrior
    fresh = WidthController({1: 1.0, 16: 2.5})  # a batch's full-width step against its plain step
    widths = []
    for _ in range(8):
        widths.append(fresh.width())
        fresh.record(widths[-1], 0)
    assert widths == [16] * 4 + [1] * 4  # a draft that accepts nothing: four full-width steps, then plain
    good = WidthController(dict(COSTS))
    good.record(8, 3)  # one early rejection: halfway, so positions 4-7 still look worth checking
    assert good.survival == [1.0] * 3 + [0.5] * 4 and good.width() == 8
    prior = AcceptancePrior(survival=[0.6] * 7)
    learned = prior.controller(COSTS)
    learned.record(learned.width(), 0)  # one step weighs as in the moving average against a learned start
    assert learned.survival == [0.6 * (1 - learned.alpha)] * 7


def test_a_narrowed_probe_costs_as_the_next_measured_width():
    """A probe narrowed to a width that was not measured (the output budget's or the context's end) is judged at the
    cost of the next wider measured width, the graph it runs."""
    c = WidthController({1: 1.0, 16: 1.6})
    for _ in range(40):
        c.record(c.width(), 0)
    assert c.current == 1 and c.probe_interval == 2 * c.probe_every
    assert c.cost(15) == c.cost(16) == c.cost(3) == 1.6 and c.cost(1) == 1.0
    c.record(5, 0)  # 1 token for a step that cost 1.6 plain steps: the wait doubles
    assert c.probe_interval == 4 * c.probe_every
    c.record(5, 1)  # 2 tokens: it pays
    assert c.probe_interval == c.probe_every


def test_candidate_widths_and_measured_costs():
    assert candidate_widths(16, graphs=True) == [1, 16]
    assert candidate_widths(16, graphs=False) == [1, 2, 4, 8, 16]
    assert candidate_widths(4, graphs=False) == [1, 2, 4]
    calls = []
    costs = measure_costs(lambda w: calls.append(w) or sum(range(20000 * w)), [1, 4], lambda: None)
    assert costs[1] == 1.0 and costs[4] > 1.0 and calls == [1] * 4 + [4] * 4


def test_adaptive_decoding_is_lossless_and_feeds_the_draft_on_plain_steps():
    target = random_target()
    draft = random_draft(target, block_size=8)  # random: almost nothing is accepted
    draft.setup_cache(target.state.max_len)
    prompt = torch.randint(0, 90, (20,))
    params = SamplingParams(max_tokens=90)
    plain = run(target, prompt, params)
    stats, controller = SpecStats(), WidthController(dict(COSTS))
    assert run(target, prompt, params, draft=draft, stats=stats, controller=controller) == plain
    verify_steps = len(stats.acceptance_lengths)
    assert 0 < verify_steps < 90 - sum(stats.acceptance_lengths)  # plain steps took most tokens
    assert stats.plain_steps + sum(stats.acceptance_lengths) == len(plain) - 1  # every token after the first
    committed = len(prompt) + len(plain) - 1  # the last token is never fed back
    rows = set(draft.state.row_positions[0].tolist())
    assert set(range(committed)) <= rows  # every committed position reached the draft's context


def test_adaptive_decoding_with_a_good_draft_stays_wide(monkeypatch):
    target = random_target()
    draft = random_draft(target, block_size=8)
    draft.setup_cache(target.state.max_len)
    prompt = torch.randint(0, 90, (20,))
    params = SamplingParams(max_tokens=120)
    plain = run(target, prompt, params)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), corrupt_every=29)
    stats, controller = SpecStats(), WidthController(dict(COSTS))
    assert run(target, prompt, params, draft=draft, stats=stats, controller=controller) == plain
    assert sum(stats.acceptance_lengths) / len(stats.acceptance_lengths) > 4 and max(map(len, stats.draft_steps)) == 7


def test_seeded_sampling_repeats_with_the_adaptive_width():
    target = random_target()
    draft = random_draft(target, block_size=8)
    draft.setup_cache(target.state.max_len)
    prompt = torch.randint(0, 90, (20,))
    params = SamplingParams(max_tokens=60, temperature=0.9)
    outs = [run(target, prompt, params, draft=draft, controller=WidthController(dict(COSTS)),
                generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert outs[0] == outs[1]


def test_batch_width_speculates_only_where_the_batch_gains():
    from flashdraft.engine.adaptive import batch_width
    costs = {1: 1.0, 4: 1.6, 8: 3.0}  # a batch's verify steps against its plain step
    sure, unsure = WidthController({1: 1.0, 8: 3.0}), WidthController({1: 1.0, 8: 3.0})
    assert batch_width([sure, unsure], costs) == 8  # estimates start optimistic
    for _ in range(40):
        unsure.record(8, 0)
    assert batch_width([sure, unsure], costs) == 4  # one slot's drafts still land: narrower pays
    for _ in range(40):
        sure.record(8, 0)
    assert batch_width([sure, unsure], costs) == 1  # nothing pays: plain, batched


def test_a_request_starts_from_what_the_requests_before_it_learned():
    from flashdraft.engine.adaptive import AcceptancePrior
    prior = AcceptancePrior(weight=0.5)
    first = prior.controller(COSTS)
    assert first.width() == 8  # nothing learned yet: optimistic
    prior.learn(WidthController(dict(COSTS)))  # a request that checked no drafted token teaches nothing
    assert prior.survival is None
    for _ in range(40):
        first.record(first.width(), 0)
    prior.learn(first)
    after_nothing = prior.controller(COSTS)
    assert after_nothing.width() == 1 and after_nothing.steps_at_current == 0  # plain, probing as usual
    good = WidthController(dict(COSTS))
    for _ in range(40):
        good.record(8, 7)
    prior.learn(good)
    assert prior.survival == [0.5 * (a + b) for a, b in zip(first.survival, good.survival)]
    assert prior.controller(COSTS).width() > 1  # half the drafts landing: speculating pays


def test_the_engine_starts_a_request_plain_after_its_draft_accepted_nothing(tmp_path):
    """A draft that accepts nothing costs its first request the steps that learn it; the next request starts plain
    (probing), and a fresh engine's first request starts wide (the warm-up's made-up prompt teaches nothing)."""
    from tiny import make_draft, make_target

    from flashdraft.engine.engine import Engine, EngineConfig, Request
    target = make_target(tmp_path / "target")
    engine = Engine.load(EngineConfig(str(target), str(make_draft(tmp_path / "draft", target)), ctx_size=256,
                                      dtype="float32", adaptive=True))
    engine.warmup()  # (on CUDA, part of loading)
    assert engine.prior.survival is None  # the warm-up's made-up prompt teaches nothing
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs = [engine.generate(Request(list(range(5 + i, 25 + i)), params)).spec for i in range(2)]
    assert runs[0].draft_steps and len(runs[0].draft_steps[0]) == engine.draft_block - 1  # starts wide
    assert len(runs[1].draft_steps) < len(runs[0].draft_steps) and runs[1].plain_steps > runs[0].plain_steps


def test_the_warm_up_reads_prompt_slices_and_leaves_the_answers_unchanged(tmp_path, monkeypatch):
    """Start-up reads a made-up prompt in slices (a fresh one, then over the cache, through the drafter too), so the
    kernels of a slice's shape compile before any stream waits on one; the answers after it are the answers before."""
    from tiny import make_draft, make_target

    from flashdraft.engine import engine as engine_module
    from flashdraft.engine.engine import WARM_SLICES, Engine, EngineConfig, Request
    target = make_target(tmp_path / "target")
    engine = Engine.load(EngineConfig(str(target), str(make_draft(tmp_path / "draft", target)), ctx_size=256,
                                      dtype="float32", n_slots=2))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [list(range(5 + i, 40 + i)) for i in range(2)]
    before = [engine.generate(Request(p, params)).token_ids for p in prompts]
    slices, prefill = [], engine_module.prefill

    def recorded(target, state, ids, slot, cached=0, draft=None, end=None, chunk=0):
        slices.append((cached, end, draft is not None))
        return prefill(target, state, ids, slot, cached, draft, end, chunk)
    monkeypatch.setattr(engine_module, "prefill", recorded)
    engine.warmup()
    starts = [sum(WARM_SLICES[:i]) for i in range(len(WARM_SLICES))]
    assert slices == [(a, a + n, True) for a, n in zip(starts, WARM_SLICES)]
    assert [engine.generate(Request(p, params)).token_ids for p in prompts] == before


def test_a_slot_in_a_batch_probes_after_as_many_more_steps_as_slots_step_together(tmp_path, monkeypatch):
    """A probe beside a plain batch runs alone and costs every slot a step: with B slots stepping together a slot's
    probe comes after B times its interval of plain steps (alone: after its interval)."""
    from types import SimpleNamespace

    from tiny import make_draft, make_target

    from flashdraft.engine import engine as engine_module
    from flashdraft.engine.engine import Engine, EngineConfig
    target = make_target(tmp_path / "target")
    engine = Engine.load(EngineConfig(str(target), str(make_draft(tmp_path / "draft", target)), ctx_size=256,
                                      dtype="float32", n_slots=2))
    wants: list[int | None] = []
    monkeypatch.setattr(engine_module, "plan", lambda steps, state, want: wants.append(want) or SimpleNamespace())
    monkeypatch.setattr(engine, "_batch_width", lambda running: 1 if len(running) > 1 else None)

    def slot(steps_plain: int) -> SimpleNamespace:
        c = WidthController(dict(COSTS), current=1)
        c.steps_at_current = steps_plain
        return SimpleNamespace(state=SimpleNamespace(controller=c, token_t=torch.zeros(1)))
    interval = WidthController(dict(COSTS)).probe_every
    for plain_steps, want in ((interval, 1), (2 * interval - 1, 1), (2 * interval, None)):
        engine._active, wants[:] = [slot(plain_steps), slot(0)], []
        engine._plan()
        assert wants == [want, 1], plain_steps
    engine._active, wants[:] = [slot(interval)], []
    engine._plan()
    assert wants == [None]  # alone: its own width, the probe it is due

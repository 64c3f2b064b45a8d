"""The engine loop runs one step over every running slot (engine.Engine.step): plain steps of several slots in one
target call, speculative steps of the same width in one call. A request's answer must not depend on what runs
beside it: greedy, seeded sampling, grammar, penalties and log-probabilities, each equal to its solo run."""
import queue
import threading

import pytest
import torch

from flashdraft.engine.engine import YOUNG_TOKENS, Completion, Engine, EngineConfig, Request
from flashdraft.engine.grammar import Grammar
from flashdraft.engine.sampling import SamplingParams
from flashdraft.engine.steps import BatchKey, SpecBatchKey
from test_engine import SAMPLING_CASES, chi_square_pvalue, exact_first_tokens, small_vocab_pair  # noqa: F401
from test_server import DEVICE, PROMPTS, models  # noqa: F401  (models: a fixture shared by the run)

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def mixed_requests(tokenizer) -> list[Request]:
    """Plain, speculative, grammar-constrained, penalised, logprob and seeded sampled requests."""
    def req(i: int, **kw) -> Request:
        params = dict(max_tokens=16, ignore_eos=True)
        params.update(kw.pop("params", {}))
        return Request(tokenizer.encode(PROMPTS[i]), SamplingParams(**params), **kw)

    return [req(0, speculative=False), req(1, speculative=False, params=dict(logprobs=1)), req(2),
            req(3, grammar=Grammar("json_schema", SCHEMA), params=dict(ignore_eos=False)),
            req(4, params=dict(repeat_penalty=1.3, presence_penalty=0.5)), req(5, params=dict(logprobs=2)),
            req(6, params=dict(temperature=0.9, top_k=20, seed=7)),
            req(7, params=dict(temperature=0.7, seed=11, frequency_penalty=0.4))]


def answer(c: Completion) -> tuple:
    """The answer, and the drafter's proposals at each step (output equality alone cannot see a drafter that reads
    another slot's state: speculation is lossless whatever it proposes)."""
    return c.token_ids, c.finish_reason, [(t, round(lp, 5)) for t, lp, _ in (c.logprobs or [])], c.spec.draft_steps


def all_at_once(engine: Engine, requests: list[Request]) -> list[Completion]:
    out: list[Completion | None] = [None] * len(requests)

    def run(i: int) -> None:
        out[i] = engine.generate(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def until_steady(stream) -> None:
    """Read a stream until it has handed out YOUNG_TOKENS tokens: a prompt arriving beside it is then read in slices
    (beside younger streams, whole)."""
    seen = 0
    while seen < YOUNG_TOKENS:
        seen += len(next(stream).token_ids)


@pytest.fixture(scope="module")
def engine(models) -> Engine:
    target, draft = models
    return Engine.load(EngineConfig(str(target), str(draft), device=DEVICE, ctx_size=512, n_slots=4,
                                    dtype="float32"))


def spy_batches(engine: Engine, monkeypatch) -> list[tuple[str, int]]:
    seen = []
    for name in ("plain_batch", "speculative_batch"):
        run = getattr(engine.steps, name)
        monkeypatch.setattr(engine.steps, name, lambda states, *a, _run=run, _name=name:
                            seen.append((_name, len(states))) or _run(states, *a))
    return seen


@pytest.mark.parametrize("together", [2, 3, 4])
def test_requests_together_answer_as_alone(engine, monkeypatch, together):
    requests = mixed_requests(engine.tokenizer)
    alone = [answer(engine.generate(r)) for r in requests]
    seen = spy_batches(engine, monkeypatch)
    keys, run = [], engine.steps.graphs.run
    monkeypatch.setattr(engine.steps.graphs, "run", lambda key, *a, **kw: keys.append(key) or run(key, *a, **kw))
    for start in range(0, len(requests), together):
        group = [Request(r.prompt_ids, r.params, r.speculative, grammar=r.grammar)
                 for r in requests[start:start + together]]
        assert [answer(c) for c in all_at_once(engine, group)] == alone[start:start + together]
    assert {name for name, n in seen if n > 1} == {"plain_batch", "speculative_batch"}  # batching happened
    batched = [k for k in keys if isinstance(k, SpecBatchKey)]  # DFlash takes its slots as a graph input
    assert batched and all(k.slots is None for k in batched)
    assert {k.rows for k in keys if isinstance(k, BatchKey)} <= {2, 4}  # three slots' plain steps run padded to four
    assert engine.free_slot_count == 4


def test_three_plain_slots_step_padded_to_four(engine, monkeypatch):
    """Three slots decoding plain run the four-row step (a graph per padded batch size; the fourth row repeats the
    third, writing the same keys and values again), and each answers as alone, logprobs and sampling included."""
    tokenizer = engine.tokenizer
    requests = [Request(tokenizer.encode(PROMPTS[i]), SamplingParams(max_tokens=12, ignore_eos=True, **params),
                        speculative=False, cache_prompt=False)
                for i, params in enumerate([{}, dict(logprobs=2), dict(temperature=0.8, seed=3)])]
    alone = [answer(engine.generate(r)) for r in requests]
    seen = spy_batches(engine, monkeypatch)
    keys, run = [], engine.steps.graphs.run
    monkeypatch.setattr(engine.steps.graphs, "run", lambda key, *a, **kw: keys.append(key) or run(key, *a, **kw))
    assert [answer(c) for c in all_at_once(engine, requests)] == alone
    assert ("plain_batch", 3) in seen and BatchKey in map(type, keys)
    assert {k.rows for k in keys if isinstance(k, BatchKey)} <= {2, 4}


def test_cancel_mid_stream_frees_the_slot(engine):
    tokenizer = engine.tokenizer
    long = Request(tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=200, ignore_eos=True))
    beside = Request(tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=24, ignore_eos=True))
    fresh = engine.generate(Request(beside.prompt_ids, beside.params)).token_ids
    done: list[Completion] = []
    thread = threading.Thread(target=lambda: done.append(engine.generate(beside)))
    stream = engine.stream(long)
    next(stream)  # running
    thread.start()
    next(stream)
    stream.close()  # the client goes away
    assert engine.free_slot_count >= 3  # its slot is back before close returns
    thread.join()
    assert done[0].token_ids == fresh
    after = Request(long.prompt_ids, SamplingParams(max_tokens=24, ignore_eos=True))
    again = engine.generate(after).token_ids
    assert again == engine.generate(Request(after.prompt_ids, after.params, cache_prompt=False)).token_ids
    assert engine.free_slot_count == 4


def test_a_long_prompt_is_read_between_the_steps_of_a_running_stream(engine, monkeypatch):
    """A prompt that arrives while another request decodes is read in slices (the pacer's size) between the
    running stream's steps, and both answer as alone."""
    from flashdraft.engine import engine as engine_mod
    tokenizer = engine.tokenizer
    running = Request(tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=80, ignore_eos=True))
    long = Request(tokenizer.encode(" ".join(PROMPTS) * 6)[:300], SamplingParams(max_tokens=8, ignore_eos=True))
    alone = [engine.generate(Request(r.prompt_ids, r.params, cache_prompt=False)) for r in (running, long)]
    events: list[str | tuple[int, int]] = []
    monkeypatch.setattr(engine.pacer, "size", lambda: 16)
    slices = engine_mod.prefill_slice
    monkeypatch.setattr(engine_mod, "prefill_slice", lambda steps, s, most, beside=False: events.append(
        (len(s.prompt), most)) or slices(steps, s, most, beside))
    stream = engine.stream(Request(running.prompt_ids, running.params, cache_prompt=False))
    until_steady(stream)
    done: list[Completion] = []
    thread = threading.Thread(target=lambda: done.append(engine.generate(Request(long.prompt_ids, long.params,
                                                                                 cache_prompt=False))))
    thread.start()
    for event in stream:
        events.append("token")
    thread.join()
    assert event.token_ids == alone[0].token_ids and done[0].token_ids == alone[1].token_ids
    assert done[0].spec.draft_steps == alone[1].spec.draft_steps  # the drafter saw the prompt's slices
    slices_seen = [e for e in events if e != "token" and e[0] == len(long.prompt_ids)]
    assert len(slices_seen) >= len(long.prompt_ids) // 16 and all(most <= 16 for _, most in slices_seen)
    first, last = events.index(slices_seen[0]), len(events) - events[::-1].index(slices_seen[-1])
    assert events[first:last].count("token") >= len(slices_seen) // 3  # the stream went on between the slices


def test_prompts_beside_young_streams_are_read_whole(engine, monkeypatch):
    """Requests that come together: each prompt is read whole (no stream has a pace to keep yet), so every slot
    decodes sooner, unless it is long (past INTERLEAVED_PREFILL); the answers equal the solo runs'."""
    from flashdraft.engine import engine as engine_mod
    tokenizer = engine.tokenizer
    requests = [Request(tokenizer.encode(PROMPTS[i] * 3), SamplingParams(max_tokens=24, ignore_eos=True),
                        cache_prompt=False) for i in range(4)]
    alone = [answer(engine.generate(r)) for r in requests]
    reads: list[tuple[int, bool, bool]] = []  # (tokens left, read to the end, beside other steps)
    slices = engine_mod.prefill_slice
    monkeypatch.setattr(engine_mod, "prefill_slice", lambda steps, s, most, beside=False: reads.append(
        (len(s.prompt) - s.prefilled, most >= len(s.prompt) - s.prefilled, beside)) or slices(steps, s, most, beside))
    monkeypatch.setattr(engine.pacer, "size", lambda: 16)
    done: list[queue.Queue] = [queue.Queue() for _ in requests]
    with engine._wake:  # all four queued before the engine admits any (its lock is re-entrant)
        for r, q in zip(requests, done):
            engine.submit(r, lambda e, q=q: isinstance(e, (Completion, Exception)) and q.put(e))
    assert [answer(q.get(timeout=600)) for q in done] == alone
    assert [(whole, beside) for _, whole, beside in reads] == [(True, False)] * 4
    # a prompt longer than INTERLEAVED_PREFILL is paced beside any stream
    reads.clear()
    monkeypatch.setattr(engine_mod, "INTERLEAVED_PREFILL", 8)
    with engine._wake:
        for r, q in zip(requests, done):
            engine.submit(r, lambda e, q=q: isinstance(e, (Completion, Exception)) and q.put(e))
    assert [answer(q.get(timeout=600)) for q in done] == alone
    assert reads[0][1:] == (True, False) and all(beside for left, _, beside in reads[1:] if left > 8), reads
    assert sum(beside for _, _, beside in reads) >= 3


def test_ngram_drafter_batched_answers_as_alone(models, monkeypatch):
    """A drafter with no model (the n-gram lookup: no target layers) in batched speculative steps, its slots a
    graph input as DFlash's."""
    target, _ = models
    engine = Engine.load(EngineConfig(str(target), spec_type="ngram-mod", device=DEVICE, ctx_size=256, n_slots=3,
                                      dtype="float32", draft_params=dict(n_match=3, n_max=8, n_min=3)))
    repeating = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]
    prompts = [repeating, [7, 100, 33, 250, 12, 90, 8, 61], repeating[3:] + [9, 40, 41]]
    requests = [Request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    alone = [answer(engine.generate(Request(r.prompt_ids, r.params, cache_prompt=False))) for r in requests]
    seen = spy_batches(engine, monkeypatch)
    keys, run = [], engine.steps.graphs.run
    monkeypatch.setattr(engine.steps.graphs, "run", lambda key, *a, **kw: keys.append(key) or run(key, *a, **kw))
    together = all_at_once(engine, [Request(r.prompt_ids, r.params, cache_prompt=False) for r in requests])
    assert [answer(c) for c in together] == alone  # the proposals too: each slot's own n-grams
    assert any(name == "speculative_batch" and n > 1 for name, n in seen)
    assert all(k.slots is None for k in keys if isinstance(k, SpecBatchKey))


def test_adaptive_load_measures_every_batch_size(models):
    """The start-up times each verify width at every batch size 2..n_slots (what the batch width is chosen from),
    also after the warm-up's own speculative request timed the single-slot widths."""
    target, draft = models
    engine = Engine.load(EngineConfig(str(target), str(draft), device=DEVICE, ctx_size=256, n_slots=3,
                                      dtype="float32", adaptive=True))
    assert engine.width_costs is not None and sorted(engine.batch_costs) == [2, 3]
    assert all(costs[1] == 1.0 and len(costs) > 1 for costs in engine.batch_costs.values())


def test_a_stopped_engine_fails_its_requests_and_later_ones(models, monkeypatch):
    """The engine thread ending (an error outside any request's step) fails the requests waiting for it at once,
    and every later one, rather than leaving them to wait forever."""
    target, _ = models
    engine = Engine.load(EngineConfig(str(target), device=DEVICE, ctx_size=128, n_slots=2, dtype="float32"))

    def broken() -> None:
        raise SystemExit("the device went away")  # not an Exception: past the step's own handler

    monkeypatch.setattr(engine, "step", broken)
    request = Request([5, 6, 7], SamplingParams(max_tokens=4))
    for _ in range(2):
        errors: list[str] = []

        def call() -> None:
            try:
                engine.generate(request)
            except RuntimeError as e:
                errors.append(str(e))

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(60)
        assert errors == ["the engine stopped: SystemExit: the device went away"]
    assert engine.free_slot_count == 2


class Digits:
    """A tokenizer for a few-token vocabulary: each id reads as its number."""
    eos_ids: list[int] = []

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize("params", SAMPLING_CASES[2:])
def test_sampling_distribution_is_lossless_in_batched_steps(small_vocab_pair, params, monkeypatch):
    """Sampled speculative decoding stays lossless when slots step together: 1500 seeded requests queued at once
    through four slots (batched speculative steps), their first three tokens against the target's exact
    distribution (test_engine's chi-square test, there for one slot at a time)."""
    target, draft = small_vocab_pair
    engine = Engine(target, Digits(), draft, EngineConfig(device="cpu", ctx_size=16, n_slots=4, dtype="float32"))
    prompt = [0, 1, 2, 1, 1]
    expected = exact_first_tokens(target, torch.tensor(prompt), params, 3)
    seen = spy_batches(engine, monkeypatch)
    samples = 1500
    answers: queue.Queue = queue.Queue()
    for i in range(samples):
        # eight tokens each, so that requests overlap; the first three are counted
        p = SamplingParams(**{**params.__dict__, "max_tokens": 8, "seed": 10_000 + i})
        engine.submit(Request(prompt, p), lambda e: isinstance(e, (Completion, Exception)) and answers.put(e))
    counts: dict[tuple, int] = {}
    for _ in range(samples):
        c = answers.get(timeout=600)
        assert isinstance(c, Completion), c
        first = tuple(c.token_ids[:3])
        counts[first] = counts.get(first, 0) + 1
    assert any(name == "speculative_batch" and n > 1 for name, n in seen)
    assert chi_square_pvalue(counts, expected, samples) > 1e-3


def test_the_pacer_is_fed_the_decode_steps_and_the_slices(models):
    """A long prompt arriving while streams decode: the pacer gets the decode steps' times and, for each slice it
    sized, the tokens read in that step; the slices cover the prompt."""
    target, _ = models
    engine = Engine.load(EngineConfig(str(target), device=DEVICE, ctx_size=512, n_slots=3, dtype="float32"))
    tokenizer = engine.tokenizer
    sizes: list[int] = []
    size = engine.pacer.size
    engine.pacer.size = lambda: sizes.append(size()) or sizes[-1]
    streams = [engine.stream(Request(tokenizer.encode(PROMPTS[i]), SamplingParams(max_tokens=120, ignore_eos=True),
                                     cache_prompt=False)) for i in range(2)]
    for stream in streams:
        until_steady(stream)
    engine.pacer.slices.clear()  # the second stream's prompt was read beside the first's steps
    sizes.clear()
    long = tokenizer.encode(" ".join(PROMPTS) * 6)[:300]
    done = []
    thread = threading.Thread(target=lambda: done.append(engine.generate(
        Request(long, SamplingParams(max_tokens=4, ignore_eos=True), cache_prompt=False))))
    thread.start()
    for stream in streams:
        for _ in stream:
            pass
    thread.join()
    assert done[0].token_ids and engine.pacer.step_s is not None
    read = [n for n, _ in engine.pacer.slices]
    assert sum(read) == len(long) and len(read) == len(sizes) >= 2
    assert read[:-1] == sizes[:-1] and read[-1] <= sizes[-1]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_prompt_slices_beside_a_stream_answer_as_alone(arch, monkeypatch):
    """A prompt read in slices beside a running stream (16 tokens a slice: slice steps, the last padded past the
    prompt's end; a recurrent target's slices eagerly), speculative, greedy: both answers and the drafter's
    proposals equal the solo runs'."""
    from test_engine import random_draft, random_hybrid_target, random_target
    from flashdraft.engine import generate
    make = random_target if arch == "llama" else random_hybrid_target
    target = make(vocab=96, layers=4 if arch == "llama" else 3, hidden=32, seed=5, max_len=256)
    draft = random_draft(target, block_size=16 if arch == "llama" else 4, seed=6)  # a slice's rows: one observation
    draft.setup_cache(target.state.max_len)
    engine = Engine(target, Digits(), draft, EngineConfig(device="cpu", ctx_size=128, n_slots=2, dtype="float32"))
    running = Request(list(range(3, 20)), SamplingParams(max_tokens=60, ignore_eos=True), cache_prompt=False)
    arriving = Request(list(range(20, 60)), SamplingParams(max_tokens=6, ignore_eos=True), cache_prompt=False)
    alone = [engine.generate(r) for r in (running, arriving)]
    eager_rest = []
    prefill = generate.prefill
    monkeypatch.setattr(generate, "prefill", lambda *a, **kw: len(a[2]) == 40 and eager_rest.append(a[4]) or
                        prefill(*a, **kw))
    monkeypatch.setattr(engine.pacer, "size", lambda: 16)
    stream = engine.stream(running)
    until_steady(stream)
    done: list[Completion] = []
    thread = threading.Thread(target=lambda: done.append(engine.generate(arriving)))
    thread.start()
    for event in stream:
        pass
    thread.join()
    assert answer(event)[:2] == answer(alone[0])[:2] and answer(done[0]) == answer(alone[1])
    assert eager_rest == ([] if arch == "llama" else [0, 16, 32])

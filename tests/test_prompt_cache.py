"""The prompt cache (llama-server's cache_prompt): a slot keeps its last conversation's K/V and the draft's context,
a request sharing a prefix with it runs only the rest (timings.cache_n reports the reused tokens), the slot with the
longest shared prefix is taken, and reuse never changes a greedy answer (with and without a draft)."""
import openai
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)

from flashdraft.engine.engine import Request, SlotPool
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def turns(first: list[int], n: int):
    """A conversation: each prompt is the last prompt, its answer and a new 'user' message."""
    prompt = first
    for i in range(n):
        answer = yield prompt
        prompt = prompt + answer + [7 + i, 11, 13 + i]


def run_conversation(engine, first: list[int], n_turns: int, speculative: bool, cache: bool) -> list:
    out = []
    conversation = turns(first, n_turns)
    prompt = next(conversation)
    for _ in range(n_turns):
        c = engine.generate(Request(prompt, PARAMS, speculative=speculative, cache_prompt=cache))
        out.append((prompt, c))
        try:
            prompt = conversation.send(c.token_ids)
        except StopIteration:
            break
    return out


@pytest.mark.parametrize("draft", [False, True])
def test_six_turns_reuse_the_previous_turns_and_answer_the_same(models, draft):
    engine = load(models, draft=draft, n_slots=1, slot_ctx=512)
    first = [5, 6, 7, 8, 9, 10, 11, 12]
    reused = run_conversation(engine, first, 6, draft, cache=True)
    fresh = run_conversation(engine, first, 6, draft, cache=False)
    for turn, ((prompt, hit), (_, miss)) in enumerate(zip(reused, fresh)):
        assert hit.token_ids == miss.token_ids, turn
        assert miss.timings.cache_n == 0 and miss.timings.prompt_n == len(prompt)
        if turn == 0:
            continue
        previous_prompt, previous = reused[turn - 1]
        # everything the slot ran last turn: its prompt and its answer but the last token
        assert hit.timings.cache_n == len(previous_prompt) + len(previous.token_ids) - 1, turn
        assert hit.timings.prompt_n == len(prompt) - hit.timings.cache_n
    if draft:  # the draft's context was kept too: it proposed what it proposes after a full prefill
        assert [c.spec.draft_steps for _, c in reused] == [c.spec.draft_steps for _, c in fresh]


def test_two_slots_keep_two_interleaved_conversations(models):
    engine = load(models, draft=True, n_slots=2, slot_ctx=512)
    a, b = turns([5, 6, 7, 8, 9, 10], 4), turns([40, 41, 42, 43, 44, 45, 46], 4)
    prompts = {"a": next(a), "b": next(b)}
    seen = {"a": [], "b": []}
    for _ in range(3):
        for name, conv in (("a", a), ("b", b)):
            c = engine.generate(Request(prompts[name], PARAMS))
            solo = load(models, draft=True, n_slots=1, slot_ctx=512).generate(
                Request(prompts[name], PARAMS, cache_prompt=False))
            assert c.token_ids == solo.token_ids
            seen[name].append(c.timings.cache_n)
            prompts[name] = conv.send(c.token_ids)
    for name in "ab":  # from the second turn on, each conversation found its own slot's prefix
        assert seen[name][0] == 0 and all(n > 8 for n in seen[name][1:]), seen


def test_slot_choice_and_the_last_token_always_runs():
    pool = SlotPool(3, similarity=0.5)
    for slot, tokens in ((0, [1, 2, 3, 4]), (1, [1, 2, 9]), (2, [7, 7])):
        assert pool.acquire([], reuse=False) == (slot, 0)
        pool.release(slot, tokens)
    assert pool.acquire([1, 2, 3, 4, 5], reuse=True) == (0, 4)  # the longest shared prefix
    pool.release(0, [1, 2, 3, 4, 5])
    assert pool.acquire([1, 2, 3, 4, 5], reuse=True) == (0, 4)  # the same prompt again: its last token runs
    # slot 2 shares 1 of 8 tokens, under the similarity: the least recently used free slot instead
    assert pool.acquire([7, 1, 1, 1, 1, 1, 1, 1], reuse=True) == (1, 0)
    assert pool.acquire([7, 7, 8], reuse=True) == (2, 2)
    assert pool.count() == 0


def test_openai_sdk_conversation_reports_cached_tokens(models):
    engine = load(models, draft=True, n_slots=2, slot_ctx=1024)
    with serving(create_app(engine, settings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        messages = [{"role": "user", "content": "The quick brown fox"}]
        cached = []
        for turn in range(4):
            kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0)
            r = client.chat.completions.create(**kw)
            again = client.chat.completions.create(**kw, extra_body={"cache_prompt": False})
            assert r.choices[0].message.content == again.choices[0].message.content
            assert again.usage.prompt_tokens_details.cached_tokens == 0
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"and then {turn}"}]
        assert all(n > 0 for n in cached[1:]), cached


def test_a_plain_request_between_leaves_the_draft_no_stale_context(models):
    """The draft's ring is filled by speculative requests only: after a plain request in the slot, a speculative
    one reuses only what the ring holds (here nothing), and proposes what it proposes with no cache at all."""
    engine = load(models, draft=True, n_slots=1, slot_ctx=512)
    a, b = [5, 6, 7, 8, 9, 10, 11, 12], [30, 31, 32, 33, 34, 35, 36, 37, 38]
    engine.generate(Request(a, PARAMS))  # the ring: a's context
    engine.generate(Request(b, PARAMS, speculative=False))  # the target cache: b; the ring still a's
    hit = engine.generate(Request(b, PARAMS))
    fresh = engine.generate(Request(b, PARAMS, cache_prompt=False))
    assert hit.timings.cache_n == 0
    assert hit.token_ids == fresh.token_ids and hit.spec.draft_steps == fresh.spec.draft_steps
    again = engine.generate(Request(b, PARAMS))  # now the ring holds b's turn too
    assert again.timings.cache_n == len(b) - 1 and again.spec.draft_steps == fresh.spec.draft_steps


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny target whose heads (32 values) take llama.cpp's 32-value block types."""
    from tiny import make_target
    return make_target(tmp_path_factory.mktemp("wide-heads") / "target", heads=2, kv_heads=1)


@pytest.mark.parametrize("types", [("q8_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "iq4_nl"), ("turbo3", "turbo4")])
def test_a_cached_prefix_gives_the_fresh_answer_with_a_quantized_cache(wide_heads, types):
    """A prompt's first chunk attends to its own K/V as the cache will give them back, as every later step and a
    prefill after a cache hit do (llama.cpp attends through the cache too): the same request answers the same
    whatever the slot ran before it."""
    engine = load((wide_heads, None), n_slots=1, slot_ctx=512, cache_type_k=types[0], cache_type_v=types[1])
    first = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    reused = run_conversation(engine, first, 4, False, cache=True)
    fresh = run_conversation(engine, first, 4, False, cache=False)
    assert [c.timings.cache_n > 0 for _, c in reused[1:]] == [True] * 3
    assert [c.token_ids for _, c in reused] == [c.token_ids for _, c in fresh]
    # the logits themselves: a whole prompt in one fresh chunk, and its second half after the first from the cache,
    # differ by float rounding only (before, by the cache type's rounding: 1e-3 to 1e-1 here)
    import torch

    from flashdraft.engine.generate import prefill
    ids = torch.tensor([5 + (i * 7) % 300 for i in range(60)])
    with torch.inference_mode():
        whole = prefill(engine.target, engine.state, ids, 0)
        prefill(engine.target, engine.state, ids[:37], 0)
        continued = prefill(engine.target, engine.state, ids, 0, cached=37)
    assert (whole - continued).abs().max() < 1e-4, (types, (whole - continued).abs().max())


def test_responses_and_slots_name_the_slot_that_holds_the_prompt(models):
    """The slot a response names (id_slot) and /slots shows is the engine's cache slot holding its prompt: a
    request that continues the conversation held in slot 1 runs there (and reuses it) while slot 0 is free."""
    import threading

    import httpx
    engine = load(models, n_slots=2, slot_ctx=512)
    with serving(create_app(engine, settings())) as url:
        def complete(prompt: list[int], n: int = 8) -> dict:
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0, "return_tokens": True}
            return httpx.post(url + "/completion", json=body, timeout=60).json()

        first = [5, 17, 42, 99, 7, 63, 12, 88]
        other = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
        a = complete(first)
        b = complete(other)  # the least recently used free slot: the other one
        assert (a["id_slot"], b["id_slot"]) == (0, 1)
        c = complete(other + b["tokens"] + [7, 11])  # continues slot 1's conversation; slot 0 is free too
        assert c["id_slot"] == 1 and c["timings"]["cache_n"] == len(other) + len(b["tokens"]) - 1
        assert all(not s["is_processing"] for s in httpx.get(url + "/slots", timeout=30).json())
        # while a request runs, /slots shows it in its engine slot (here slot 0, which holds its conversation)
        runner = threading.Thread(target=complete, args=(first + a["tokens"] + [9] * 40,), kwargs={"n": 400})
        runner.start()
        seen = set()
        while runner.is_alive():
            seen |= {s["id"] for s in httpx.get(url + "/slots", timeout=30).json() if s["is_processing"]}
        runner.join()
        assert seen == {0}

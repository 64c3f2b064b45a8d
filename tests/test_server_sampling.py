"""The sampling fields clients rely on, over real HTTP: logprobs (OpenAI chat and completions, llama.cpp's n_probs)
against transformers' own log-softmax, logit_bias / penalties giving the same greedy answers with and
without speculative decoding, and seeded sampled answers the same with and without it."""
import httpx
import openai
import pytest
import torch
from test_server import load, models, serving, settings  # noqa: F401  (models: the fixture every test shares)

from flashdraft.server.app import create_app

PROMPT = [5, 17, 42, 99, 7, 63, 12]


@pytest.fixture(scope="module")
def urls(models):  # noqa: F811
    """(plain, speculative) servers on the same target."""
    with serving(create_app(load(models, n_slots=1, slot_ctx=512), settings())) as plain, \
            serving(create_app(load(models, draft=True, n_slots=1, slot_ctx=512), settings())) as spec:
        yield plain, spec


def native(url: str, **body) -> dict:
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "ignore_eos": True, "return_tokens": True, **body}
    r = httpx.post(url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference_logprobs(models, ids: list[int]) -> torch.Tensor:  # noqa: F811
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def test_n_probs_are_transformers_log_softmax_with_and_without_speculation(models, urls):  # noqa: F811
    plain, spec = urls
    out = [native(url, n_probs=3) for url in (plain, spec)]
    assert out[0]["tokens"] == out[1]["tokens"]
    tokens = out[0]["tokens"]
    ref = reference_logprobs(models, PROMPT + tokens)[len(PROMPT) - 1:-1]
    for o in out:
        probs = o["completion_probabilities"]
        assert [p["id"] for p in probs] == tokens
        for row, p in zip(ref, probs):
            assert p["logprob"] == pytest.approx(float(row[p["id"]]), abs=1e-4)
            assert [t["id"] for t in p["top_logprobs"]] == row.topk(3).indices.tolist()
            assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
            assert bytes(p["bytes"]).decode("utf-8", "replace") == p["token"]
    assert "completion_probabilities" not in native(plain)


def test_openai_logprobs_chat_and_completions_streamed_and_not(urls):
    _, spec = urls
    client = openai.OpenAI(base_url=spec + "/v1", api_key="none")
    kw = dict(model="x", messages=[{"role": "user", "content": "The quick brown fox"}], temperature=0,
              max_tokens=20, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 20
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "ignore")  # random model: broken UTF-8
    assert text == r.choices[0].message.content.replace("\ufffd", "") and len(text) > 10
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the second request reuses the first one's cached K/V (rows written by decode steps, not a prefill): the same
    # tokens, log-probabilities within float rounding
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None

    c = client.completions.create(model="x", prompt=PROMPT, temperature=0, max_tokens=12, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(
        c.choices[0].text)
    # (the legacy format keys alternatives by text: two byte pieces shown as U+FFFD are one key)
    assert all(1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                            lp.token_logprobs))
    native_lp = native(spec, n_predict=12, n_probs=1)["completion_probabilities"]
    assert lp.token_logprobs == pytest.approx([p["logprob"] for p in native_lp], abs=1e-6)
    assert lp.tokens == [p["token"] for p in native_lp]
    parts = list(client.completions.create(model="x", prompt=PROMPT, temperature=0, max_tokens=12, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens] == lp.tokens
    assert [o for p in parts if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset] == lp.text_offset
    # a stop string that never matches but whose first character comes: the text after it is held a step, the
    # held tokens' offsets still count from where their own text starts
    held = next(ch for ch in c.choices[0].text[1:] if ch.isascii() and ch.isprintable())
    kw = dict(model="x", prompt=PROMPT, temperature=0, max_tokens=12, logprobs=3, stop=[held + "\x01"],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    parts = list(client.completions.create(**kw, stream=True))
    assert [o for p in parts if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset] == \
        whole.text_offset == lp.text_offset


ADJUSTED = [{"logit_bias": {"0": False}},  # placeholder, replaced by the greedy tokens below
            {"repeat_penalty": 1.5, "repeat_last_n": 16},
            {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repeat_last_n": -1},
            {"logit_bias": [[11, 3.0], [12, False]], "repeat_penalty": 1.2}]


@pytest.mark.parametrize("case", range(len(ADJUSTED)))
def test_logit_bias_and_penalties_same_answer_with_speculation(urls, case):
    plain, spec = urls
    free = native(plain, n_predict=40)["tokens"]
    body = ADJUSTED[case]
    if case == 0:  # ban the tokens the unconstrained answer uses most
        body = {"logit_bias": {str(t): False for t in sorted(set(free), key=free.count)[-3:]}}
    answers = [native(url, n_predict=40, **body)["tokens"] for url in (plain, spec)]
    assert answers[0] == answers[1] and answers[0] != free
    if case == 0:
        assert not set(answers[0]) & {int(t) for t in body["logit_bias"]}


SEEDED = [{"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05},  # issue 44's settings
          {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
          {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.3,
           "frequency_penalty": 0.4, "presence_penalty": 0.3, "repeat_last_n": 8, "logit_bias": {"11": 2.0}}]


@pytest.mark.parametrize("case", range(len(SEEDED)))
def test_seeded_sampling_same_answer_with_speculation(urls, case):
    """A seeded sampled answer is the same token for token with and without speculative decoding (each position's
    noise is keyed by the seed and the position), and again after other requests; another seed answers otherwise."""
    plain, spec = urls
    body = {**SEEDED[case], "seed": 4242}
    answers = [native(url, n_predict=40, **body)["tokens"] for url in (plain, spec, plain, spec)]
    assert answers[0] == answers[1] == answers[2] == answers[3]
    assert native(spec, n_predict=40, **{**body, "seed": 4243})["tokens"] != answers[0]
    assert native(plain, n_predict=40)["tokens"] != answers[0]  # sampled, not greedy


def test_logit_bias_boost_takes_over(urls):
    _, spec = urls
    assert native(spec, n_predict=10, logit_bias={"77": 100})["tokens"] == [77] * 10


@pytest.mark.parametrize("body,words", [
    ({"logit_bias": {"abc": 1}}, ("'logit_bias'", "token ids")),
    ({"logit_bias": {"100000": 1}}, ("'logit_bias'", "outside the vocabulary")),
    ({"logit_bias": {"5": "x"}}, ("'logit_bias'", "numbers or false")),
    ({"logit_bias": 3}, ("'logit_bias'", "object")),
    ({"n_probs": -1}, ("'n_probs'", ">= 0")),
    ({"n_probs": 101}, ("top log-probabilities", "100")),
    ({"repeat_penalty": 0}, ("repeat_penalty", "> 0")),
    ({"repeat_last_n": -2}, ("repeat_last_n", ">= -1")),
    ({"post_sampling_probs": True}, ("'post_sampling_probs'", "not supported")),
])
def test_bad_sampling_fields_are_a_400(urls, body, words):
    plain, _ = urls
    r = httpx.post(plain + "/completion", json={"prompt": "hi", "n_predict": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_top_logprobs_needs_logprobs(urls):
    plain, _ = urls
    r = httpx.post(plain + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "top_logprobs": 2}, timeout=60)
    assert r.status_code == 400 and "'top_logprobs' needs 'logprobs': true" in r.json()["error"]["message"]

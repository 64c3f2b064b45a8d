"""Numeric extremes in every sampling field, over real HTTP: each answer is a 400 naming the field or a 200 with
tokens, never a 5xx or an empty 200; penalty windows cost what the tokens that exist cost, whatever width is asked;
a row of logits with no finite choice (NaN from the model, every token banned) is an error, never token 0."""
import threading
import time

import httpx
import pytest
import torch
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)

from flashdraft.engine import sampling as S
from flashdraft.engine.sampling import SamplingParams, adjust_logits, sample
from flashdraft.server.app import create_app

PROMPT = [5, 17, 42, 99, 7, 63, 12]
# Every finite double class: subnormal, tiny, float32's overflow, the largest, negative zero, integers past 2^53,
# non-integers, and their negatives
EXTREMES = [5e-324, -5e-324, 1e-39, -1e-39, 1e-45, 1e38, -1e38, 1e308, -1e308, -0.0, 0.5, 2.5, -2.5, 2 ** 53 + 1,
            2 ** 63, 2 ** 64, -(2 ** 63), 10 ** 30, 1e19]
# A penalty and a bias active in the base request, so every field's value reaches the arithmetic it feeds
BASE = {"prompt": PROMPT, "n_predict": 2, "ignore_eos": True, "return_tokens": True, "repeat_penalty": 1.1,
        "frequency_penalty": 0.1, "logit_bias": {"9": 0.5}}
SAMPLED = {"temperature": 1.0, "seed": 7, "top_k": 0, "top_p": 0.95, "min_p": 0.01}
PLAIN = {"temperature": 1.0, "seed": 7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # the whole vocabulary, unsorted
GREEDY = {"temperature": 0.0}
EOS_TEXT = "<|endoftext|>"  # token 0 of the tiny models
MODES = {"sampled": SAMPLED, "plain": PLAIN, "greedy": GREEDY}


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=512), settings())) as url:
        yield url


def check_answer(r: httpx.Response, field: str, want: int | None = 2) -> None:
    """A 400 whose message names `field`, or a 200 with `want` tokens (None: at least one) that are not the NaN
    row's token 0 (a tiny model's text may be empty: two halves of a UTF-8 character, so tokens are counted)."""
    assert r.status_code < 500, (field, r.status_code, r.text[:1000])
    if r.status_code == 400:
        message = r.json()["error"]["message"]
        assert field in message, (field, message)
        return
    assert r.status_code == 200, (field, r.status_code, r.text[:1000])
    body = r.json()
    if "tokens" in body:
        n, ids = len(body["tokens"]), body["tokens"]
    else:  # OpenAI's shapes: the tokens' texts from logprobs where the request asked for them
        choice = body["choices"][0]
        n = body["usage"]["completion_tokens"]
        content = (choice.get("logprobs") or {}).get("content") or []
        ids = [0 if c["token"] == EOS_TEXT else 1 for c in content]
    assert n == want if want is not None else n > 0, (field, want, body)
    assert not ids or ids != [0] * len(ids), (field, "token 0 only: a NaN row sampled", body)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


NATIVE_FIELDS = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                 "frequency_penalty", "seed", "n_probs"]


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
@pytest.mark.parametrize("field", NATIVE_FIELDS)
def test_numeric_extremes_of_each_field(url, field, mode):
    for value in EXTREMES:
        check_answer(post(url, "/completion", BASE | mode | {field: value}), field)


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
def test_numeric_extremes_of_logit_bias_values(url, mode):
    for value in EXTREMES:
        for form in ({"5": value, "9": 0.5}, [[5, value], [9, 0.5]]):
            check_answer(post(url, "/completion", BASE | mode | {"logit_bias": form}), "logit_bias")


def test_numeric_extremes_of_token_limits(url):
    """Huge limits run to the end of the slot's context; -0.0 is 0 and asks for nothing."""
    for value in EXTREMES:
        want = 0 if value == 0 else None
        check_answer(post(url, "/completion", BASE | SAMPLED | {"n_predict": value}), "n_predict", want)
        check_answer(post(url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": value,
                                                   "temperature": 0, "ignore_eos": True}), "max_tokens", want)


def test_numeric_extremes_of_top_logprobs(url):
    chat = {"messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "logprobs": True}
    for value in EXTREMES:
        r = post(url, "/v1/chat/completions", chat | {"top_logprobs": value})
        check_answer(r, "top_logprobs")
        r = post(url, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0,
                                          "ignore_eos": True, "logprobs": value})
        check_answer(r, "logprobs")


@pytest.mark.parametrize("body", [{"temperature": 1e-39}, {"logit_bias": {"5": 1e308}},
                                  {"frequency_penalty": 1e39}, {"presence_penalty": -1e39},
                                  {"repeat_penalty": 1e-45}], ids=lambda b: next(iter(b)))
def test_values_float32_cannot_hold_are_not_an_empty_200(url, body):
    """The issue's cases: each became inf or 0 in float32, NaN logits, and a 200 with nothing in it."""
    for path, extra in (("/completion", BASE | SAMPLED), ("/completion", BASE | PLAIN), ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True, "seed": 3,
            "logprobs": True})):
        check_answer(post(url, path, extra | body), next(iter(body)))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("width", [10 ** 8, 2 ** 62, 10 ** 30])
def test_huge_repeat_last_n_is_clamped_to_the_tokens_that_exist(url, width):
    """The window never has more positions than the prompt and the output so far: no memory, no time, no 500."""
    body = BASE | SAMPLED | {"repeat_last_n": width, "repeat_penalty": 1.3, "n_predict": 8}
    post(url, "/completion", body | {"repeat_last_n": 64})  # warm
    peak, done = [rss_bytes()], threading.Event()
    start = peak[0]

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    try:
        r = post(url, "/completion", body)
    finally:
        done.set()
        watcher.join()
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text  # a 200 (clamped), as llama.cpp's -1 means "the whole context"
    assert len(r.json()["tokens"]) == 8
    assert peak[0] - start < 200 * 2 ** 20, f"RSS grew by {(peak[0] - start) / 2 ** 20:.0f} MiB"
    assert elapsed < 30, elapsed
    # the same answer as a window covering everything there is (-1)
    assert r.json()["tokens"] == post(url, "/completion", body | {"repeat_last_n": -1}).json()["tokens"]


@pytest.mark.parametrize("key", ["\u00b2", "1e3", "-1", " 5", "5 ", "+5", "\u0665", "0x5", "9" * 5000,
                                 "123456789012345678901234567890", ""])
def test_logit_bias_keys_that_are_not_token_ids_are_a_400(url, key):
    r = post(url, "/completion", BASE | {"logit_bias": {key: 5}})
    assert r.status_code == 400, (key[:30], r.status_code, r.text[:500])
    assert "logit_bias" in r.json()["error"]["message"]


@pytest.mark.parametrize("key", [2 ** 64, -1, 10 ** 30, "9" * 5000])
def test_logit_bias_array_ids_outside_the_vocabulary_are_a_400(url, key):
    r = post(url, "/completion", BASE | {"logit_bias": [[key, 5]]})
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "logit_bias" in r.json()["error"]["message"]


def test_logit_bias_array_text_keys_are_tokenized(url):
    """llama.cpp's array form: a string that is not an ASCII integer is text (its tokens get the bias)."""
    r = post(url, "/completion", BASE | {"logit_bias": [["\u00b2", 5], ["fox", -2]]})
    assert r.status_code == 200, r.text
    assert len(r.json()["tokens"]) == 2


def test_huge_integer_sampling_values_are_a_400_not_a_500(url):
    """An integer too large for a double (JSON allows it) fails float(): a 400 naming the field."""
    for field in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        raw = '{"prompt": "hi", "n_predict": 2, "%s": %s}' % (field, "9" * 400)
        r = httpx.post(url + "/completion", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        assert field in r.json()["error"]["message"]
    raw = '{"prompt": "hi", "n_predict": 2, "logit_bias": {"5": %s}}' % ("9" * 400)
    r = httpx.post(url + "/completion", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text[:300]


def test_logit_bias_banning_every_token_is_a_400(url):
    vocab = httpx.get(url + "/props", timeout=30).json().get("n_vocab") or vocab_size(url)
    for form in ({str(t): False for t in range(vocab)}, [[t, False] for t in range(vocab)]):
        r = post(url, "/completion", BASE | SAMPLED | {"logit_bias": form})
        assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text[:300]
    r = post(url, "/completion", BASE | SAMPLED | {"logit_bias": {str(t): False for t in range(1, vocab)}})
    assert r.status_code == 200 and r.json()["tokens"] == [0, 0], r.text[:300]  # one left: that one


def vocab_size(url: str) -> int:
    """The smallest id the server rejects as outside the vocabulary."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        r = post(url, "/completion", BASE | {"logit_bias": {str(mid): 1}})
        lo, hi = (mid + 1, hi) if r.status_code == 200 else (lo, mid)
    return lo


def test_the_server_serves_on(url):
    check_answer(post(url, "/completion", BASE | SAMPLED), "none")


# A model whose logits turn NaN: the request fails as such, the server serves on

POISON = {"calls": 0, "from": None}


@pytest.fixture(scope="module")
def nan_url(models):  # noqa: F811
    engine = load(models, n_slots=1, slot_ctx=512)
    real = engine.target.logits

    def logits(hidden):
        out = real(hidden)
        POISON["calls"] += 1
        if POISON["from"] is not None and POISON["calls"] >= POISON["from"]:
            out = out.clone().fill_(float("nan"))
        return out
    engine.target.logits = logits
    with serving(create_app(engine, settings())) as url:
        yield url


def poison(from_call: int | None) -> None:
    POISON["calls"], POISON["from"] = 0, from_call


def check_nan_error(message: str) -> None:
    assert "NaN" in message and "no token" in message, message
    assert "site-packages" not in message and "Exception raised from" not in message, message


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
@pytest.mark.parametrize("from_call", [1, 3], ids=["prefill", "mid-answer"])
def test_nan_logits_are_an_error_not_token_0(nan_url, mode, from_call):
    try:
        poison(from_call)
        r = post(nan_url, "/completion", BASE | mode | {"n_predict": 6, "cache_prompt": False})
        assert r.status_code == 500, r.text[:500]
        check_nan_error(r.json()["error"]["message"])
        poison(from_call)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True,
                "stream": True, "cache_prompt": False} | mode
        with httpx.stream("POST", nan_url + "/v1/chat/completions", json=chat, timeout=120) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200
        errors = [line for line in lines if '"error"' in line]
        assert len(errors) == 1, lines
        check_nan_error(errors[0])
        assert not any('"finish_reason":"length"' in line for line in lines), lines
    finally:
        poison(None)
    check_answer(post(nan_url, "/completion", BASE | mode), "none")  # and the slot serves on


# The engine: a row with no finite choice is an error, never a token


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1)],
                         ids=["greedy", "sampled", "top_k", "top_p_min_p"])
@pytest.mark.parametrize("bad", ["nan", "all_nan", "all_-inf", "+inf"])
def test_a_row_with_no_finite_choice_is_an_error(params, bad):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    if bad == "nan":
        logits[1, 7] = float("nan")
    elif bad == "all_nan":
        logits[1] = float("nan")
    elif bad == "all_-inf":
        logits[1] = float("-inf")
    else:
        logits[1, 3] = float("inf")
    tokens = sample(logits, params, g).tolist()
    assert tokens[0] >= 0 and tokens[2] >= 0
    assert tokens[1] < 0
    with pytest.raises(S.NoTokenToSample, match="NaN"):
        S.check_sampled(tokens)
    S.check_sampled([tokens[0], tokens[2]])


def test_a_single_plus_inf_logit_still_errors_rather_than_nan():
    """softmax of a row holding +inf is NaN: an overflowing model is reported, not sampled as token 0."""
    logits = torch.zeros(1, 10)
    logits[0, 4] = float("inf")
    assert sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)).tolist() == [-1]


def test_extreme_but_valid_params_keep_the_logits_finite():
    """The bounds SamplingParams.validate allows, all at once, leave every logit finite in float32."""
    p = SamplingParams(temperature=S.MIN_TEMPERATURE, repeat_penalty=S.MAX_REPEAT_PENALTY,
                       presence_penalty=-S.MAX_PENALTY, frequency_penalty=-S.MAX_PENALTY, repeat_last_n=-1,
                       logit_bias={t: S.MAX_LOGIT_BIAS for t in range(10)})
    p.validate()
    logits = torch.full((1, 50), 1e4)
    bias = torch.zeros(50)
    bias[:10] = S.MAX_LOGIT_BIAS
    history = [1, 2, 3] * 10000
    out = adjust_logits(logits, p, bias, history)
    assert torch.isfinite(out).all()
    assert torch.isfinite(out / p.temperature).all()
    q = SamplingParams(temperature=S.MIN_TEMPERATURE * 1.01, top_p=0.5)
    assert sample(out, q, torch.Generator().manual_seed(0)).tolist()[0] >= 0


@pytest.mark.parametrize("field,value", [("temperature", 1e-39), ("temperature", 1e38), ("repeat_penalty", 1e-45),
                                         ("repeat_penalty", 1e39), ("presence_penalty", -1e39),
                                         ("frequency_penalty", 1e39), ("top_p", 5e-324), ("min_p", 5e-324)])
def test_validate_bounds_or_handles_extremes(field, value):
    p = SamplingParams(**{field: value})
    try:
        p.validate()
    except ValueError as e:
        assert field in str(e)
        return
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    tokens = sample(adjust_logits(logits, p, None, [1, 2, 3]), p, torch.Generator().manual_seed(0)).tolist()
    assert all(t >= 0 for t in tokens), (field, value, tokens)


def test_penalty_window_never_wider_than_the_history():
    from flashdraft.engine.sampling import penalty_counts
    p = SamplingParams(repeat_penalty=1.2, repeat_last_n=2 ** 62)
    counts = penalty_counts([1, 2, 2, 3], torch.tensor([4, 4]), 3, p, 10)
    assert counts.shape == (3, 10)
    assert counts[0].tolist() == [0, 1, 2, 1, 0, 0, 0, 0, 0, 0]
    assert counts[2].tolist() == [0, 1, 2, 1, 2, 0, 0, 0, 0, 0]
    every = penalty_counts([1, 2, 2, 3], torch.tensor([4, 4]), 3, SamplingParams(repeat_penalty=1.2,
                                                                                 repeat_last_n=-1), 10)
    assert torch.equal(counts, every)
    short = penalty_counts([1, 2, 2, 3], torch.tensor([4, 4]), 3, SamplingParams(repeat_penalty=1.2,
                                                                                 repeat_last_n=2), 10)
    assert short[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert short[2].tolist() == [0, 0, 0, 0, 2, 0, 0, 0, 0, 0]


def test_a_stream_with_return_tokens_carries_every_token(models):
    """As llama-server's: one event per token, also for a token with no text of its own (a special token here,
    forced by logit_bias), so the streamed ids are the answer's ids and a client sees every step."""
    import json as json_module
    engine = load(models, n_slots=1, slot_ctx=512, dtype="float32")
    special = 1  # <|im_start|>: skipped in the text
    with serving(create_app(engine, settings())) as url:
        body = {"prompt": PROMPT, "n_predict": 12, "ignore_eos": True, "temperature": 0, "return_tokens": True,
                "logit_bias": {str(special): 100}}
        final = httpx.post(url + "/completion", json=body, timeout=60).json()
        events = []
        with httpx.stream("POST", url + "/completion", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json_module.loads(line[6:]))
    assert final["tokens"] == [special] * 12 and final["content"] == ""
    streamed = [t for e in events if not e.get("stop") for t in e["tokens"]]
    assert streamed == final["tokens"] and sum(not e.get("stop") for e in events) == 12

"""`flashdraft serve` over real HTTP on a free port: the OpenAI SDK, llama.cpp's routes, greedy answers equal to
`flashdraft generate`, concurrent clients, every error case, client disconnects, the llama-server command lines."""
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from flashdraft.engine.engine import EngineConfig, Completion, Engine
from flashdraft.engine.engine import Request as EngineRequest
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app
from flashdraft.server.reasoning import ThinkSplitter, prompt_opens_thinking, split_reasoning
from flashdraft.server.scheduler import Scheduler
from flashdraft.server.settings import Settings
from tiny import CHATML, interrupt, make_draft, make_target, wait_healthy

REPO = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("FLASHDRAFT_TEST_DEVICE", "cpu")  # cuda: the same tests over CUDA graphs and threads
PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding", "0123456789",
           "return a + b", "jumps over the lazy dog.", "drafts tokens and verifies", "The lazy fox"]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server-models")
    target = make_target(root / "target")
    return target, make_draft(root / "draft", target)


def load(models, draft: bool = False, n_slots: int = 1, slot_ctx: int = 512, **kw) -> Engine:
    target, draft_dir = models
    return Engine.load(EngineConfig(str(target), str(draft_dir) if draft else None, device=DEVICE, ctx_size=slot_ctx,
                       n_slots=n_slots, **kw))


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def settings(**kw) -> Settings:
    return Settings(**{"model": "tiny", "alias": "tiny", "temperature": 0.0, **kw})


@pytest.fixture(scope="module")
def spec(models) -> Iterator[tuple[str, Engine]]:
    """Target + DFlash draft, 4 slots."""
    engine = load(models, draft=True, n_slots=4, slot_ctx=512)
    with serving(create_app(engine, settings(metrics=True))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def plain(models) -> Iterator[tuple[str, Engine]]:
    """Target only, one slot with room for a long generation."""
    engine = load(models, n_slots=1, slot_ctx=4096)
    with serving(create_app(engine, settings(metrics=True))) as url:
        yield url, engine


def chat_body(prompt: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 24, **kw}


def sse_events(lines: Iterator[str]) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_stream(url: str, body: dict) -> list:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def check_stats(obj: dict, n_tokens: int, n_prompt: int, speculative: bool) -> None:
    """`timings` and `speculative` agree with each other and with the tokens returned."""
    t = obj["timings"]
    assert set(t) >= {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert t["predicted_n"] == n_tokens and t["prompt_n"] + t["cache_n"] == n_prompt and t["prompt_n"] >= 1
    if not speculative:
        assert "speculative" not in obj and "draft_n" not in t
        return
    s = obj["speculative"]
    hist = s["acceptance_histogram"]
    assert len(hist) == s["block_size"] + 1 and sum(hist) == s["verify_steps"] > 0
    assert t["draft_n"] == s["draft_n"] <= s["verify_steps"] * (s["block_size"] - 1)
    assert t["draft_n_accepted"] == s["draft_n_accepted"] == sum((k - 1) * n for k, n in enumerate(hist) if k)
    assert s["mean_acceptance_length"] == pytest.approx(sum(k * n for k, n in enumerate(hist)) / sum(hist))
    assert s["acceptance_rate"] == pytest.approx(s["draft_n_accepted"] / s["draft_n"])
    # the first token comes from the prefill, every other one from a verify step (EOS may cut the last)
    produced = 1 + sum(k * n for k, n in enumerate(hist))
    assert produced - s["block_size"] < n_tokens <= produced


# ---- the OpenAI SDK


def test_openai_sdk_chat_and_completions(spec):
    url, engine = spec
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "def add(a, b):"}],
                                       temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and len(r.id) == len("chatcmpl-") + 32 and r.id[9:].isalnum()
    assert r.object == "chat.completion" and r.model == "tiny" and r.system_fingerprint
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 40 and r.usage.prompt_tokens_details.cached_tokens == 0
    extra = r.model_extra
    check_stats(extra, 40, r.usage.prompt_tokens, speculative=True)
    assert extra["speculative"]["verify_steps"] < 40  # each verify step commits at least one token

    stream = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "def add(a, b):"}],
                                            temperature=0, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 40 and len({c.id for c in chunks}) == 1
    check_stats(chunks[-1].model_extra, 40, r.usage.prompt_tokens, speculative=True)
    assert all("timings" not in (c.model_extra or {}) for c in chunks[:-1])

    c = client.completions.create(model="x", prompt="The quick brown fox", temperature=0, max_tokens=16)
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.choices[0].finish_reason in ("stop", "length")
    check_stats(c.model_extra, c.usage.completion_tokens, c.usage.prompt_tokens,
                speculative=c.usage.completion_tokens > 1)
    parts = list(client.completions.create(model="x", prompt="The quick brown fox", temperature=0, max_tokens=16,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == c.choices[0].text
    assert parts[-1].choices[0].finish_reason == c.choices[0].finish_reason and "timings" in parts[-1].model_extra

    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "llamacpp"


def test_stop_strings_and_seeded_sampling(spec):
    url, _ = spec
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    full = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "fox"}], temperature=0,
                                          max_tokens=30, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[10:13]
    cut = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "fox"}], temperature=0,
                                         max_tokens=30, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]
    sampled = [client.chat.completions.create(model="x", messages=[{"role": "user", "content": "fox"}], temperature=1.0,
                                              seed=7, max_tokens=20).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


# ---- same answers as `flashdraft generate`, alone or with seven other clients


def generate_cli(models, prompt: str, draft: bool, chat: bool, capsys) -> dict:
    """`flashdraft generate --json`, run in this process (the same code path, without a second torch import)."""
    from flashdraft.cli import main
    target, draft_dir = models
    argv = ["generate", "-m", str(target), "--prompt", prompt, "--json", "-n", "24", "--temp", "0",
            "--ctx-size", "512", "--device", DEVICE]
    argv += ["--draft", str(draft_dir)] if draft else []
    argv += ["--chat"] if chat else []
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "plain"])
def test_greedy_matches_generate(models, spec, plain, draft, capsys):
    url = (spec if draft else plain)[0]
    raw = generate_cli(models, PROMPTS[0], draft, False, capsys)
    chat = generate_cli(models, PROMPTS[1], draft, True, capsys)
    native = httpx.post(url + "/completion", json={"prompt": PROMPTS[0], "n_predict": 24, "temperature": 0,
                                                   "return_tokens": True}, timeout=60).json()
    assert native["tokens"] == raw["token_ids"] and native["content"] == raw["text"]
    events = post_stream(url + "/completion", {"prompt": PROMPTS[0], "n_predict": 24, "temperature": 0, "stream": True})
    assert "".join(e["content"] for e in events) == raw["text"] and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1]) and "[DONE]" not in events
    assert events[-1]["stop_type"] == {"stop": "eos", "length": "limit"}[raw["finish_reason"]]
    reply = httpx.post(url + "/v1/chat/completions", json=chat_body(PROMPTS[1]), timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == chat["text"]
    assert reply["choices"][0]["finish_reason"] == chat["finish_reason"]
    assert ("speculative" in reply) == (draft and len(chat["token_ids"]) > 1)


def stream_chat(url: str, prompt: str) -> str:
    events = post_stream(url + "/v1/chat/completions", chat_body(prompt, stream=True))
    assert events[-1] == "[DONE]" and "timings" in events[-2]
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


def test_eight_concurrent_streams_get_their_own_answers(spec):
    url, engine = spec
    alone = [httpx.post(url + "/v1/chat/completions", json=chat_body(p), timeout=60).json()
             ["choices"][0]["message"]["content"] for p in PROMPTS]
    assert len(set(alone)) > 1
    results: dict[int, str] = {}
    seen_busy = []

    def client(i: int) -> None:
        results[i] = stream_chat(url, PROMPTS[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen_busy.append(sum(s["is_processing"] for s in httpx.get(url + "/slots").json()))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == alone
    assert max(seen_busy) <= engine.n_slots
    assert wait_until(lambda: engine.free_slot_count == engine.n_slots)


def test_concurrent_requests_answer_as_alone(models):
    """Requests running together (their plain steps batched into one target call) answer as each alone."""
    engine = load(models, n_slots=3)
    requests = [EngineRequest(engine.tokenizer.encode(p), SamplingParams(max_tokens=12, ignore_eos=True))
                for p in PROMPTS[:4]]
    alone = [engine.generate(r).token_ids for r in requests]
    batched, run_batch = [], engine.steps.plain_batch
    engine.steps.plain_batch = lambda states, *a: batched.append(len(states)) or run_batch(states, *a)

    async def all_at_once() -> list[list[int]]:
        scheduler = Scheduler(engine)

        async def one(r: EngineRequest) -> list[int]:
            async with contextlib.aclosing(scheduler.run(r)) as events:
                return [e async for _, e in events if isinstance(e, Completion)][0].token_ids
        fresh = [EngineRequest(r.prompt_ids, r.params) for r in requests]
        return await asyncio.gather(*(one(r) for r in fresh))

    assert asyncio.run(all_at_once()) == alone
    assert engine.free_slot_count == 3 and max(batched) == 3


# ---- llama.cpp routes


def test_props_slots_models_tokenize(spec):
    url, engine = spec
    props = httpx.get(url + "/props").json()
    gen = props["default_generation_settings"]
    assert gen["n_ctx"] == 512 and gen["params"] == {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                                     "n_predict": -1, "seed": -1}
    assert props["total_slots"] == 4 and props["model_alias"] == "tiny" and props["reasoning"] == "auto"
    assert props["speculative"] == {"type": "dflash", "block_size": 8, "draft_window": None}
    assert props["chat_template"] == CHATML and props["draft_model_path"] and props["build_info"]
    slots = httpx.get(url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and not any(s["is_processing"] for s in slots)
    assert slots[0]["n_ctx"] == 512 and slots[0]["speculative"] is True
    ids = httpx.post(url + "/tokenize", json={"content": "The quick brown fox"}).json()["tokens"]
    assert ids == engine.tokenizer.encode("The quick brown fox", add_special=False)
    pieces = httpx.post(url + "/tokenize", json={"content": "The quick", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "The quick"
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"content": "The quick brown fox"}
    for path in ("/health", "/v1/health"):
        assert httpx.get(url + path).json() == {"status": "ok"}
    assert httpx.get(url + "/models").json()["data"][0]["id"] == "tiny"
    prompt = httpx.post(url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert prompt == {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}


def test_metrics(spec, plain):
    url, _ = spec
    httpx.post(url + "/v1/chat/completions", json=chat_body("fox", max_tokens=30, ignore_eos=True), timeout=60)
    text = httpx.get(url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "requests_processing", "requests_deferred", "n_decode_total", "n_tokens_max",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"llamacpp:{name}" in values, name
    assert values["llamacpp:tokens_predicted_total"] >= 30 and values["llamacpp:spec_decode_num_drafts_total"] > 0
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] <= 7 * values["llamacpp:spec_decode_num_drafts_total"]
    per_pos = {k: v for k, v in values.items()
               if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total")}
    assert len(per_pos) == 7 and 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in per_pos
    assert sum(per_pos.values()) == values["llamacpp:spec_decode_num_accepted_tokens_total"]
    by = 'flashdraft:spec_decode_num_{}_tokens_by_drafter_total{{drafter="dflash"}}'  # every token its drafter's
    assert values[by.format("draft")] == values["llamacpp:spec_decode_num_draft_tokens_total"]
    assert values[by.format("accepted")] == values["llamacpp:spec_decode_num_accepted_tokens_total"]
    assert values["llamacpp:requests_processing"] == 0 and values["llamacpp:requests_deferred"] == 0


def test_metrics_off_and_webui(models):
    engine = load(models)
    with serving(create_app(engine, settings())) as url:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "<html" in page.text.lower()
    with serving(create_app(engine, settings(webui=False))) as url:
        assert httpx.get(url + "/").status_code == 404


def test_reasoning_flag_reaches_the_template(models):
    engine = load(models)
    engine.tokenizer.chat_template = (CHATML + "{% if enable_thinking is defined and not enable_thinking %}"
                                      "<think>\n\n</think>\n\n{% endif %}")
    with serving(create_app(engine, settings(reasoning="off"))) as url:
        def prompt(**kw) -> str:
            body = {"messages": [{"role": "user", "content": "hi"}], **kw}
            return httpx.post(url + "/apply-template", json=body).json()["prompt"]
        assert prompt().endswith("<think>\n\n</think>\n\n")
        assert not prompt(chat_template_kwargs={"enable_thinking": True}).endswith("</think>\n\n")
        r = httpx.post(url + "/v1/chat/completions", json=chat_body("hi", max_tokens=2)).json()
        assert r["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt(), add_special=False))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("opening,closing", [("<think>", "</think>"), ("<|channel>thought", "<channel|>")])
def test_think_splitter(chunk, opening, closing):
    text = f"{opening}\nLet me see: 2 + 2.{closing}\n\nIt is 4."  # <think>, or Gemma 4's thought channel
    splitter, reasoning, content = ThinkSplitter(), "", ""
    for i in range(0, len(text), chunk):
        r, c = splitter.push(text[i:i + chunk])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r, content + c) == ("Let me see: 2 + 2.", "It is 4.")
    assert split_reasoning("No <think> here</think>") == ("", "No <think> here</think>")
    assert split_reasoning("<thi") == ("", "<thi")
    assert split_reasoning("still thinking", thinking_open=True) == ("still thinking", "")
    assert split_reasoning("<|chan") == ("", "<|chan")
    assert split_reasoning("more<channel|>answer", prompt_opens_thinking("<|turn>model\n<|channel>thought\n")) == \
        ("more", "answer")
    assert prompt_opens_thinking("<|turn>model\n<|channel>thought\n<channel|>") is None  # --reasoning off


def test_reasoning_content_and_timings_per_token(models):
    engine = load(models)
    engine.tokenizer.chat_template = CHATML + "<think>\n"  # a template that opens the thinking block itself
    with serving(create_app(engine, settings())) as url:
        body = chat_body("fox", max_tokens=12, ignore_eos=True)
        plain = httpx.post(url + "/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()
        text = plain["choices"][0]["message"]["content"]
        split = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert split == {"role": "assistant", "content": "", "reasoning_content": text.lstrip()}
        events = post_stream(url + "/v1/chat/completions", {**body, "stream": True, "timings_per_token": True})
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == text.lstrip()
        assert not any(d.get("content") for d in deltas)
        running = [e["timings"]["predicted_n"] for e in events[1:-2]]
        assert running and running == sorted(running) and events[-2]["timings"]["predicted_n"] == 12
        assert_error(httpx.post(url + "/v1/chat/completions", json={**body, "reasoning_format": "yes"}), 400,
                     "invalid_request_error")


# ---- errors: each one answered in OpenAI's envelope, then the server serves a good request


def assert_error(r: httpx.Response, status: int, type_: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_ and err["message"]


def test_every_error_then_a_good_request(plain, monkeypatch):
    url, engine = plain
    good = chat_body("fox", max_tokens=4)
    chat = url + "/v1/chat/completions"
    cases = [
        ("POST", chat, {"content": b"{not json"}, 400, "invalid_request_error"),
        ("POST", chat, {"content": b'["a list"]'}, 400, "invalid_request_error"),
        ("POST", chat, {"json": {}}, 400, "invalid_request_error"),
        ("POST", chat, {"json": {"messages": "hi"}}, 400, "invalid_request_error"),
        ("POST", chat, {"json": {"messages": [{"content": "no role"}]}}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", temperature="hot")}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", max_tokens=1.5)}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", stream="yes")}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", top_p=1.5)}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", temperature=-1)}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", min_p=2)}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", stop=[1])}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox", n=2)}, 400, "invalid_request_error"),
        ("POST", chat, {"json": chat_body("fox " * 5000)}, 400, "exceed_context_size_error"),
        ("POST", url + "/v1/completions", {"json": {"prompt": ["two", "prompts"]}}, 400, "invalid_request_error"),
        ("POST", url + "/v1/completions", {"json": {"prompt": [1, 2, 10 ** 6]}}, 400, "invalid_request_error"),
        ("POST", url + "/completion", {"json": {"prompt": 5}}, 400, "invalid_request_error"),
        ("POST", url + "/tokenize", {"json": {"content": 5}}, 400, "invalid_request_error"),
        ("POST", url + "/v1/unknown", {"json": {}}, 404, "not_found_error"),
        ("GET", url + "/nothing/here", {}, 404, "not_found_error"),
        ("POST", chat, {"content": b"x" * (16 * 1024 * 1024 + 1)}, 413, "invalid_request_error"),
    ]
    for method, where, kw, status, type_ in cases:
        assert_error(httpx.request(method, where, timeout=60, **kw), status, type_)
        r = httpx.post(chat, json=good, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    too_long = httpx.post(chat, json=chat_body("fox " * 5000)).json()["error"]
    assert too_long["n_ctx"] == 4096 and too_long["n_prompt_tokens"] >= 4096

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure at 0x7f00dead: CUDA caching allocator internals")
    with monkeypatch.context() as m:
        m.setattr(engine.target, "forward", boom)
        r = httpx.post(chat, json=good, timeout=60)
        assert_error(r, 500, "server_error")
        assert "RuntimeError" in r.text and "0x7f00dead" not in r.text  # its kind, never its internals
        with httpx.stream("POST", chat, json={**good, "stream": True}, timeout=60) as r:
            events = sse_events(r.iter_lines())
        assert events[-1]["error"]["type"] == "server_error"
    assert httpx.post(chat, json=good, timeout=60).status_code == 200
    assert wait_until(lambda: engine.free_slot_count == 1)


def test_api_key(models, monkeypatch):
    engine = load(models)
    with serving(create_app(engine, settings(api_key="sekrit"))) as url:
        chat = url + "/v1/chat/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert_error(httpx.post(chat, json=chat_body("fox", max_tokens=2), headers=headers), 401,
                         "authentication_error")
            assert httpx.get(url + "/health").status_code == 200
            r = httpx.post(chat, json=chat_body("fox", max_tokens=2), headers={"Authorization": "Bearer sekrit"})
            assert r.status_code == 200
        assert httpx.post(chat, json=chat_body("fox", max_tokens=2), headers={"X-Api-Key": "sekrit"}).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekrit")
        assert client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope").chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_health_is_503_while_loading(models):
    release = threading.Event()

    def loader() -> Engine:
        release.wait(60)
        return load(models)

    with serving(create_app(loader, settings())) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert_error(httpx.post(url + "/v1/chat/completions", json=chat_body("fox")), 503, "unavailable_error")
        release.set()
        deadline = time.time() + 60
        while httpx.get(url + "/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        assert httpx.post(url + "/v1/chat/completions", json=chat_body("fox", max_tokens=2)).status_code == 200


# ---- disconnects free the slot


def predicted_total(url: str) -> float:
    return next(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("llamacpp:tokens_predicted_total"))


def test_disconnect_frees_the_slot(plain):
    url, engine = plain
    long = chat_body("fox", max_tokens=4000, ignore_eos=True)
    short = chat_body("fox", max_tokens=4, ignore_eos=True)
    counts = [predicted_total(url)]
    with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    t0 = time.time()
    r = httpx.post(url + "/v1/chat/completions", json=short, timeout=60)
    assert r.status_code == 200 and time.time() - t0 < 15
    counts.append(predicted_total(url))

    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(url + "/v1/chat/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
    t0 = time.time()
    r = httpx.post(url + "/v1/chat/completions", json=short, timeout=60)
    assert r.status_code == 200 and time.time() - t0 < 15
    counts.append(predicted_total(url))
    assert wait_until(lambda: httpx.get(url + "/slots").json()[0]["is_processing"] is False)
    assert wait_until(lambda: engine.free_slot_count == 1)
    # neither long generation ran to its end (cancelled generations are counted too)
    assert all(0 < b - a - 4 < 4000 for a, b in zip(counts, counts[1:])), counts


def test_queued_request_waits_and_is_counted(plain):
    url, _ = plain
    long = chat_body("fox", max_tokens=3000, ignore_eos=True, stream=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
        next(lines)
        waiting = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions",
                                                             json=chat_body("fox", max_tokens=2), timeout=120))
        waiting.start()
        deadline = time.time() + 10
        deferred = 0.0
        while time.time() < deadline and not deferred:
            text = httpx.get(url + "/metrics").text
            deferred = next(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("llamacpp:requests_deferred"))
        assert deferred == 1
    waiting.join(60)
    assert not waiting.is_alive()


# ---- the llama-server command lines

LINE_1 = ("-m {target} --host 0.0.0.0 --port {port} -np 1 -ngl all -b 2048 -ub 512 --ctx-size 32768 "
          "--cache-type-k q5_0 --cache-type-v q4_1 --flash-attn on --jinja --metrics --log-timestamps "
          "--log-prefix --reasoning off --temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0")
LINE_2 = ("-m {target} --spec-draft-model {draft} --spec-type dflash --spec-dflash-cross-ctx 1024 "
          "--host 0.0.0.0 --port {port} -np 1 --kv-unified -ngl all --spec-draft-ngl all -b 2048 -ub 512 "
          "--ctx-size 32768 --flash-attn on --cache-ram 0 --jinja --no-mmap --mlock --no-host --metrics "
          "--log-timestamps --log-prefix --reasoning off --temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(line: str, models) -> list[str]:
    target, draft = models
    return [sys.executable, "-m", "flashdraft.cli", "serve",
            *line.format(target=target, draft=draft, port=free_port()).split()]


def test_command_line_1_with_head_size_16_names_what_q5_0_needs(models):
    """The guide's first line asks for q5_0 / q4_1 blocks of 32 values; the tiny test model's heads are 16 wide:
    the load fails with one error line naming that, and the process exits 1 (tests/test_gemma_gguf.py serves
    the same line with a model whose heads fit)."""
    out = subprocess.run(serve_cmd(LINE_1, models), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if " E " in line]
    assert len(errors) == 1 and "KV cache type q5_0 needs a head size divisible by 32, got 16" in errors[0]


def test_unknown_flag_is_an_error(models):
    out = subprocess.run(serve_cmd("-m {target} --no-such-flag", models), capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 2 and "--no-such-flag" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_command_line_2_serves(models):
    cmd = serve_cmd(LINE_2, models)
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, url)
        props = httpx.get(url + "/props").json()
        assert props["speculative"] == {"type": "dflash", "block_size": 8, "draft_window": 1024}
        assert props["default_generation_settings"]["n_ctx"] == 32768 and props["reasoning"] == "off"
        assert props["default_generation_settings"]["params"]["temperature"] == 0.7
        r = httpx.post(url + "/v1/chat/completions", json=chat_body("fox", max_tokens=16, ignore_eos=True), timeout=60)
        assert r.status_code == 200 and "speculative" in r.json()
        assert "llamacpp:spec_decode_num_drafts_total" in httpx.get(url + "/metrics").text
    finally:
        log = interrupt(proc, 30)
    for flag in ("-ngl all", "--spec-draft-ngl all", "-b 2048", "-ub 512", "--flash-attn on", "--cache-ram 0",
                 "--kv-unified", "--no-mmap", "--mlock", "--no-host"):
        assert f"W ignoring {flag}: " in log, flag
    assert "/v1/chat/completions slot 0" in log and "acceptance length" in log


# ---- the real SmolLM2-135M GGUF


@pytest.mark.slow  # ~20 s on an idle 2-core CPU, a minute on a busy one
def test_smollm2_openai_sdk_matches_the_engine(smollm2_gguf):
    """The real GGUF, loaded once: the SDK's answers equal the engine's own greedy answer for the same chat."""
    from flashdraft.formats.chat import render_prompt
    question = "What is the capital of France?"
    engine = Engine.load(EngineConfig(str(smollm2_gguf), device=DEVICE, ctx_size=1024, n_slots=2))
    prompt_ids = render_prompt(engine.tokenizer, question, chat=True)
    expected = engine.generate(EngineRequest(prompt_ids, SamplingParams(max_tokens=24)))
    assert "Paris" in expected.text
    with serving(create_app(engine, Settings(model=str(smollm2_gguf), n_slots=2))) as url:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == Path(smollm2_gguf).name
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=24)
        assert r.choices[0].message.content == expected.text
        assert r.choices[0].finish_reason == expected.finish_reason
        assert r.usage.prompt_tokens == len(prompt_ids)
        check_stats(r.model_extra, r.usage.completion_tokens, r.usage.prompt_tokens, speculative=False)
        chunks = list(client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                     max_tokens=24, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        assert chunks[-1].model_extra["timings"]["predicted_n"] == len(expected.token_ids)

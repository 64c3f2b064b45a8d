"""Greedy answers over real HTTP with each quantized KV cache type (`-ctk/-ctv`): four concurrent streams on a
4-slot server answer what each request answers alone, and a request whose prefix the prompt cache holds answers
what it answers fresh. Before the fresh prefill attended through the cache (KVSlots.as_read), a quantized
cache gave different answers with and without a cached prefix, and concurrent answers differed from the solo ones.

A tiny target with 32-value heads (the block types' size), speculation on (a DFlash draft whose own cache stays
float); SmolLM2's real weights in the slow variant."""
import json
import threading

import httpx
import pytest
from test_server import load, serving, settings

from flashdraft.quant.kv_types import BLOCK_KV_TYPES, ROTATED_KV_TYPES
from flashdraft.server.app import create_app

TYPES = [*BLOCK_KV_TYPES, *ROTATED_KV_TYPES]  # every quantized type -ctk/-ctv accept
PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding", "0123456789",
           "return a + b", "jumps over the lazy dog.", "drafts tokens and verifies", "The lazy fox"]
CONCURRENT = 4


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    from tiny import make_draft, make_target
    root = tmp_path_factory.mktemp("kv-types")
    target = make_target(root / "target", heads=2, kv_heads=1)
    return target, make_draft(root / "draft", target)


def chat(url: str, messages: list[dict], stream: bool = False, cache: bool = False, max_tokens: int = 20) -> str:
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "cache_prompt": cache, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text[:300]
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                if obj.get("choices"):
                    text.append(obj["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def check_answers(url: str, prompts: list[str], max_tokens: int) -> None:
    user = [[{"role": "user", "content": p}] for p in prompts]
    alone = [chat(url, m, max_tokens=max_tokens) for m in user]  # fresh, one at a time
    assert len(set(alone)) > 1
    got: dict[int, str] = {}

    def client(i: int) -> None:
        got[i] = chat(url, user[i], stream=True, cache=True, max_tokens=max_tokens)

    for first in range(0, len(prompts), CONCURRENT):
        threads = [threading.Thread(target=client, args=(i,))
                   for i in range(first, min(first + CONCURRENT, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [got[i] for i in range(len(prompts))] == alone, "concurrent answers differ from the solo ones"
    # a second turn: its prefix (the first turn) is in the prompt cache now, or it is not used
    for i in range(0, len(prompts), 3):
        turn = user[i] + [{"role": "assistant", "content": alone[i]}, {"role": "user", "content": "and then?"}]
        chat(url, user[i], cache=True, max_tokens=max_tokens)  # the slot holds the first turn
        cached = chat(url, turn, cache=True, max_tokens=max_tokens)
        fresh = chat(url, turn, cache=False, max_tokens=max_tokens)
        assert cached == fresh, (i, cached, fresh)


@pytest.mark.parametrize("kv_type", TYPES)
def test_greedy_answers_with_a_quantized_cache_do_not_depend_on_the_other_requests(wide_models, kv_type):
    engine = load(wide_models, draft=True, n_slots=CONCURRENT, slot_ctx=512, cache_type_k=kv_type,
                  cache_type_v=kv_type)
    with serving(create_app(engine, settings())) as url:
        check_answers(url, PROMPTS, 20)


@pytest.mark.slow  # SmolLM2-135M on the CPU: about a minute a type
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_greedy_answers_with_a_quantized_cache_on_real_weights(smollm2_gguf, kv_type):
    from flashdraft.engine.engine import Engine, EngineConfig
    engine = Engine.load(EngineConfig(str(smollm2_gguf), device="cpu", ctx_size=1024, n_slots=CONCURRENT,
                                      cache_type_k=kv_type, cache_type_v=kv_type))
    with serving(create_app(engine, settings())) as url:
        check_answers(url, PROMPTS[:4], 16)

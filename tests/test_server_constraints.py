"""Text that spells a special token inside a grammar literal or a schema stays text (before, `"a<|im_end|>b"`
let the model write the real end-of-turn token and the answer stopped at "a")."""
import httpx
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: the session fixture)

from flashdraft.server.app import create_app


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=1024), settings())) as url:
        yield url


SPECIAL_TEXT = [  # (field, value, the answer it forces)
    ("grammar", 'root ::= "a<|im_end|>b"', "a<|im_end|>b"),
    ("grammar", 'root ::= "<|im_start|>x"', "<|im_start|>x"),
    ("json_schema", {"const": "x<|im_end|>y"}, '"x<|im_end|>y"'),
]


@pytest.mark.parametrize("field,value,text", SPECIAL_TEXT)
def test_special_token_text_in_a_constraint_stays_text(url, field, value, text):
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 40, "temperature": 0, field: value,
                                              "return_tokens": True}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["content"] == text
    written = r.json()["tokens"][:-1]  # the last: the end of generation once the grammar is complete
    assert 2 not in written and 1 not in written  # <|im_end|>, <|im_start|>: never written as text


@pytest.fixture(scope="module")
def smollm2_url(smollm2_gguf):
    from flashdraft.engine.engine import Engine, EngineConfig
    engine = Engine.load(EngineConfig(str(smollm2_gguf), device="cpu", ctx_size=512))
    with serving(create_app(engine, settings())) as url:
        yield url, engine.tokenizer


@pytest.mark.parametrize("field,value,text", SPECIAL_TEXT)
def test_special_token_text_stays_text_with_a_real_vocabulary(smollm2_url, field, value, text):
    """SmolLM2's 49k vocabulary, whose <|im_end|> is both the end of turn and an end-of-generation token."""
    url, tokenizer = smollm2_url
    specials = {tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")}
    assert None not in specials
    for path, body, key in (("/completion", {"prompt": "hi", "n_predict": 40, "return_tokens": True}, "content"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 40}, None)):
        r = httpx.post(url + path, json=body | {"temperature": 0, field: value}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        obj = r.json()
        if key:
            assert obj[key] == text and not specials & set(obj["tokens"][:-1]), obj  # the last: the end
        else:
            assert obj["choices"][0]["message"]["content"] == text, obj
            assert obj["choices"][0]["finish_reason"] == "stop"

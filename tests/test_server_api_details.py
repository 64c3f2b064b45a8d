"""Details of the HTTP API over real HTTP: the Anthropic route answers errors in Anthropic's shape (`{"type": "error",
"error": {...}}`, and `event: error` in streams) so that its SDK raises its own errors, a non-boolean `stream` is a
400 naming it on every route, HEAD answers like GET on the status routes, a JSON schema nested 40 objects deep is
accepted, and a GBNF grammar with a repetition of a repetition is accepted and obeyed."""
import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)

from flashdraft.server import routes_anthropic
from flashdraft.server.app import create_app

anthropic = pytest.importorskip("anthropic")

KEY = "secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def url(models):
    engine = load(models, n_slots=2, slot_ctx=1024)
    with serving(create_app(engine, settings(metrics=True, api_key=KEY))) as u:
        yield u


def claude(url: str, key: str = KEY):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def is_anthropic_error(body, kind: str) -> bool:
    return (isinstance(body, dict) and body.get("type") == "error" and body["error"]["type"] == kind
            and isinstance(body["error"]["message"], str) and body["error"]["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_bad_request_is_the_sdks_error(url, stream):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(url).messages.create(model="x", max_tokens=8, messages=[], stream=stream)
    assert e.value.status_code == 400
    assert is_anthropic_error(e.value.body, "invalid_request_error"), e.value.body
    assert "'messages'" in e.value.body["error"]["message"]


def test_anthropic_wrong_key_is_the_sdks_error(url):
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(url, key="wrong").messages.create(model="x", max_tokens=8, messages=HELLO)
    assert is_anthropic_error(e.value.body, "authentication_error"), e.value.body


def test_anthropic_stream_failing_midway_is_the_sdks_error(url, monkeypatch):
    real = routes_anthropic.stream_events

    async def failing(request, req):
        async for item in real(request, req):
            yield item
            raise RuntimeError("the engine failed")

    monkeypatch.setattr(routes_anthropic, "stream_events", failing)
    with pytest.raises(anthropic.APIStatusError) as e:
        with claude(url).messages.stream(model="x", max_tokens=16, messages=HELLO) as s:
            s.get_final_message()
    assert is_anthropic_error(e.value.body, "api_error"), e.value.body
    assert "RuntimeError" in e.value.body["error"]["message"]  # its kind; its message stays in the log
    with httpx.stream("POST", url + "/v1/messages", headers=HEADERS, timeout=120,
                      json={"model": "x", "max_tokens": 16, "messages": HELLO, "stream": True}) as r:
        lines = list(r.iter_lines())
    error = lines.index("event: error")
    assert is_anthropic_error(json.loads(lines[error + 1].removeprefix("data: ")), "api_error"), lines


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "x", "max_tokens": 4, "messages": HELLO}),
    ("/v1/chat/completions", {"model": "x", "max_tokens": 4, "messages": HELLO}),
    ("/v1/completions", {"model": "x", "max_tokens": 4, "prompt": "The quick"}),
    ("/completion", {"n_predict": 4, "prompt": "The quick"}),
])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_stream_must_be_a_boolean(url, path, body, value):
    r = httpx.post(url + path, json=body | {"stream": value}, headers=HEADERS, timeout=120)
    if value is None:  # null: the default, not streamed
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "'stream'" in error["message"], r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/props", "/slots", "/metrics", "/health", "/v1/health", "/v1/models", "/models"])
def test_head_answers_like_get_without_a_body(url, path):
    get = httpx.get(url + path, headers=HEADERS, timeout=60)
    head = httpx.head(url + path, headers=HEADERS, timeout=60)
    assert get.status_code == 200 and get.content
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def nested_schema(depth: int) -> dict:
    schema = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_a_schema_nested_40_objects_deep_is_accepted(url):
    schema = nested_schema(40)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(
        model="x", messages=HELLO, temperature=0, max_tokens=800,
        response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    answer = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(answer), schema)
    else:  # a random model may spend its tokens on whitespace; what it wrote is still the schema's prefix
        assert answer.lstrip().startswith('{')


@pytest.mark.parametrize("grammar, pattern", [
    ('root ::= ("a"{1,3}){2}', r"a{2,6}"),
    ('root ::= "x" ("a"{1,2} "b"?){1,3} "y"', r"x(a{1,2}b?){1,3}y"),
    ('root ::= ("0"? "1"{2}){2,3}', r"(0?1{2}){2,3}"),
])
def test_gbnf_with_a_repetition_of_a_repetition(url, grammar, pattern):
    r = httpx.post(url + "/completion", headers=HEADERS, timeout=120,
                   json={"prompt": "The quick brown fox", "n_predict": 32, "grammar": grammar})
    assert r.status_code == 200, r.text
    assert re.fullmatch(pattern, r.json()["content"]), r.json()

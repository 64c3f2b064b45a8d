"""OpenAI tool calls: each format's output parsed back into calls (Hermes/Qwen, Llama 3 JSON, Mistral, Gemma 4, bare
JSON), over real HTTP with the OpenAI SDK (streaming and not, with and without a draft) on a tiny model whose
template takes tools, `tool_choice` variants (required and named ones are grammar-constrained), the tool result sent
back through the template, a template without tools answered with a clear 400; and, slow, the real
Qwen2.5-Coder-0.5B GGUF calling a weather tool by itself."""
import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)

from flashdraft.server.app import create_app
from flashdraft.server.tools import held_back, parse_tool_calls, tool_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NAMES = ["get_weather", "get_time"]
# a ChatML template that takes tools as Qwen 2.5's does (Hermes markers)
HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
          "Call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
          "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
          "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure.",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n<tool_call>{"name": '
               '"get_time", "arguments": {"zone": "UTC"}}</tool_call>', "",
     [("get_weather", {"city": "A"}), ("get_time", {"zone": "UTC"})]),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "P"}}\n```', "", [("get_weather", {"city": "P"})]),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "", [("get_time", {"zone": "CET"})]),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": '
               '"B"}}', "", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "B"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "",
     [("get_weather", {"city": "Rome"})]),
    ("mistral", 'ok [TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "ok", [("get_time", {"zone": "UTC"})]),
    ("gemma4", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,hourly:true,'
               'spots:[<|"|>a<|"|>,<|"|>b<|"|>]}<tool_call|>', "Let me check.",
     [("get_weather", {"city": "Paris, FR", "days": 3, "hourly": True, "spots": ["a", "b"]})]),
    # not calls: plain content, never an error
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', None, []),
    ("hermes", '{"name": "rm_rf", "arguments": {}}', None, []),
    ("json", "The weather is fine.", None, []),
    ("gemma4", "call:get_weather{city:<|\"|>unterminated", None, []),
])
def test_each_format_parses_into_calls(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, fmt, NAMES)
    assert got_content == (text if content is None else content)
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls


def test_stream_holds_back_from_where_a_call_may_start():
    assert held_back("Hello there", "hermes") == len("Hello there")
    assert held_back("Hello <tool_", "hermes") == len("Hello ")
    assert held_back("Hi <tool_call>{", "hermes") == len("Hi ")
    assert held_back('  {"name"', "hermes") == 0
    assert held_back("x [TOOL_CA", "mistral") == 2
    assert tool_format("{{ messages }}") is None and tool_format(HERMES) == "hermes"


@pytest.fixture(scope="module")
def tool_models(models, tmp_path_factory) -> tuple[Path, Path]:
    target, draft = models
    folder = tmp_path_factory.mktemp("hermes") / "target"
    shutil.copytree(target, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=HERMES)))
    return folder, draft


@pytest.fixture(scope="module")
def tool_urls(tool_models, models):
    engines = [load(tool_models, draft=True, n_slots=2, slot_ctx=1024), load(tool_models, n_slots=2, slot_ctx=1024)]
    plain_template = load(models)
    with serving(create_app(engines[0], settings())) as a, serving(create_app(engines[1], settings())) as b, \
            serving(create_app(plain_template, settings())) as c:
        yield a, b, c


def ask(url: str, stream: bool, **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    kw = dict(model="x", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
              max_tokens=800, tools=[WEATHER, TIME]) | kw
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments, c.id) for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [(t.function.name, t.function.arguments, t.id) for c in chunks if c.choices
             for t in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content or None, calls, finish[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_give_valid_calls(tool_urls, stream):
    spec, plain, _ = tool_urls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    answers = []
    for url in (spec, plain):
        content, calls, finish = ask(url, stream, tool_choice="required")
        assert finish == "tool_calls" and calls and not content
        for name, args, call_id in calls:
            jsonschema.validate(json.loads(args), schemas[name])
            assert call_id.startswith("call_")
        answers.append([c[:2] for c in calls])
        content, calls, finish = ask(url, stream, tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert finish == "tool_calls" and [c[0] for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0][1]), schemas["get_time"])
        content, calls, finish = ask(url, stream, tool_choice="required", parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1
    assert answers[0] == answers[1]  # speculation is lossless under the call's grammar too


@pytest.mark.parametrize("stream", [False, True])
def test_auto_and_none_give_content_and_the_result_goes_back(tool_urls, stream):
    spec, plain, _ = tool_urls
    for url in (spec, plain):
        for choice in ("auto", "none"):  # this random model writes no call: its text comes back as content
            content, calls, finish = ask(url, stream, tool_choice=choice, max_tokens=20)
            assert calls == [] and finish == "length"  # (its text may be special tokens only: no content)
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}]
    content, calls, finish = ask(spec, stream, messages=messages, max_tokens=10)
    assert finish == "length" and not calls
    rendered = httpx.post(spec + "/apply-template", json={"messages": messages, "tools": [WEATHER]}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert "<|im_start|>tool\n{\"temperature\": 21}" in rendered


@pytest.mark.parametrize("body, status, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "not among the tools"),
    ({"tool_choice": "sometimes"}, 400, "'tool_choice' must be"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0] must be"),
    ({"tools": "get_weather"}, 400, "'tools' must be an array"),
    ({"tools": None, "tool_choice": "required"}, 400, "'tool_choice' needs 'tools'"),
])
def test_bad_tools_are_400s(tool_urls, body, status, message):
    r = httpx.post(tool_urls[0] + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 4} | body, timeout=60)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


def test_props_name_the_tool_call_format(tool_urls):
    assert httpx.get(tool_urls[0] + "/props").json()["chat_template_caps"] == {"supports_tools": True,
                                                                             "tool_call_format": "hermes"}
    assert httpx.get(tool_urls[2] + "/props").json()["chat_template_caps"]["supports_tools"] is False


def test_a_template_without_tools_is_a_clear_400(tool_urls):
    r = httpx.post(tool_urls[2] + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and "does not support tools" in r.json()["error"]["message"]


QWEN = Path.home() / ".cache" / "flashdraft" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.mark.slow  # a 0.5B model on the CPU: about a minute
@pytest.mark.skipif(not QWEN.exists(), reason="fetch it with ../shared/tools/fetch_models.sh ~/.cache/flashdraft/models qwen05")
@pytest.mark.parametrize("stream", [False, True])
def test_qwen_calls_the_weather_tool_and_answers_from_its_result(stream):
    from flashdraft.engine.engine import Engine, EngineConfig
    engine = Engine.load(EngineConfig(str(QWEN), device="cpu", ctx_size=2048))
    with serving(create_app(engine, settings())) as url:
        content, calls, finish = ask(url, stream, max_tokens=60)
        assert finish == "tool_calls" and [c[0] for c in calls] == ["get_weather"]
        assert json.loads(calls[0][1])["city"] == "Paris"
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": calls[0][2], "type": "function",
                         "function": {"name": "get_weather", "arguments": calls[0][1]}}]},
                    {"role": "tool", "tool_call_id": calls[0][2], "content": "{\"temperature_c\": 21, \"sky\": \"sunny\"}"}]
        # (with both tools declared this 0.5B model calls again and again; with the one it used, it answers)
        content, calls, finish = ask(url, stream, messages=messages, max_tokens=80, tools=[WEATHER])
        assert finish == "stop" and not calls and "21" in content
        content, calls, finish = ask(url, stream, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                     max_tokens=60)
        assert finish == "tool_calls" and calls[0][0] == "get_time"


def test_smollm2_template_has_no_tools_a_clear_400(smollm2_gguf):
    from flashdraft.engine.engine import Engine, EngineConfig
    engine = Engine.load(EngineConfig(str(smollm2_gguf), device="cpu", ctx_size=256))
    with serving(create_app(engine, settings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="does not support tools"):
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[WEATHER], max_tokens=8)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")  # and the server keeps serving


def test_malformed_tool_and_constraint_bodies_never_a_5xx(tool_urls):
    """150 random mixes of bad values in the agent fields over the three routes: always an answer or a 4xx, never a
    5xx or an error inside a stream, and the server still healthy."""
    import random
    values = [None, 1, -1, 0.5, "x", "", [], {}, [1], ["a"], [{}], [{"type": "text"}], {"type": "json_schema"},
              {"type": "json_object", "schema": 5}, {"name": "get_weather"}, [{"type": "tool_use", "input": 5}],
              [{"type": "tool_result", "content": 7}], True, {"type": "function", "function": {"name": 5}}, [WEATHER],
              [{"name": "x", "input_schema": 5}], {"type": "tool"}, "root ::= [a-", {"$ref": "#/x"}]
    fields = ["messages", "max_tokens", "tools", "tool_choice", "response_format", "json_schema", "grammar", "system",
              "stream", "parallel_tool_calls", "stop_sequences", "temperature"]
    rng = random.Random(0)
    url = tool_urls[0]
    for _ in range(150):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "prompt": "hi"}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields)] = rng.choice(values)
        path = rng.choice(["/v1/messages", "/v1/chat/completions", "/completion"])
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code == 200 and body.get("stream") is True:
            assert '"error"' not in r.text, (path, body, r.text[-300:])
    assert httpx.get(url + "/health").status_code == 200


def test_stream_sends_content_before_a_call_and_the_call_after(tool_models):
    """A scripted answer (text, then a Hermes call split across deltas): the stream sends the text as it comes,
    holds back from the partial opener on, then sends the call as one delta.tool_calls chunk."""
    from flashdraft.engine.engine import Completion, Delta, Timings
    from flashdraft.engine.generate import SpecStats
    engine = load(tool_models, n_slots=1)
    pieces = ["Sure, ", "checking. <tool_", 'call>{"name": "get_weather", "arguments": {"city": "Rome"}}',
              "</tool_call>"]

    def scripted(req, post):  # the engine's events for the request, as its loop posts them
        for piece in pieces:
            post(Delta(piece, [1]))
        post(Completion(text="".join(pieces), token_ids=[1] * len(pieces), prompt_ids=list(req.prompt_ids),
                        finish_reason="stop", stop_word=None, timings=Timings(), spec=SpecStats()))

    engine.submit = scripted
    with serving(create_app(engine, settings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Rome?"}],
                                                     tools=[WEATHER], stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        texts = [d.content for d in deltas if d.content]
        calls = [t for d in deltas for t in d.tool_calls or []]
        assert texts == ["Sure, ", "checking. "]  # the partial "<tool_" was held back
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather",
                                                                                        {"city": "Rome"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Rome?"}], tools=[WEATHER])
        assert r.choices[0].message.content == "Sure, checking." and r.choices[0].finish_reason == "tool_calls"


def pydantic_tool() -> dict:
    """A tool whose parameters Pydantic wrote: a nested model behind a local `$ref` into `$defs`."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class City(BaseModel):
        model_config = ConfigDict(extra="forbid")  # bounded output: a random model writes free text forever
        name: Literal["Paris", "Rome"]
        unit: Literal["celsius", "fahrenheit"]

    class Forecast(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: City
        days: int = Field(ge=1, le=7)

    return {"type": "function", "function": {"name": "get_forecast", "parameters": Forecast.model_json_schema()}}


@pytest.mark.parametrize("stream", [False, True])
def test_pydantic_parameters_with_refs_work_with_required_and_named_choice(tool_urls, stream):
    tool = pydantic_tool()
    params = tool["function"]["parameters"]
    assert "$defs" in params and "$ref" in json.dumps(params["properties"])  # what the wrapper used to break
    for choice in ("required", {"type": "function", "function": {"name": "get_forecast"}}):
        # (one tool: the schema's text in the prompt leaves room for the call in the 1024-token context)
        content, calls, finish = ask(tool_urls[1], stream, tools=[tool], tool_choice=choice, parallel_tool_calls=False)
        assert finish == "tool_calls" and [c[0] for c in calls] == ["get_forecast"], (content, calls)
        jsonschema.validate(json.loads(calls[0][1]), params)


def test_recursive_parameters_keep_their_root_reference():
    """A schema that refers to its own root ("#", as a recursive model's may) or to `definitions` still compiles
    and accepts a call after being moved below the call's wrapper."""
    import llguidance

    from flashdraft.server.tools import choice_grammar
    tree = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 4},
                                             "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}},
                                             "leaf": {"$ref": "#/definitions/leaf"}},
            "required": ["label"], "additionalProperties": False,
            "definitions": {"leaf": {"type": "boolean"}}}
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    grammar = choice_grammar([tool], "required", False)
    schema = json.loads(grammar.text)
    call = {"name": "tree", "arguments": {"label": "a", "kids": [{"label": "b", "kids": [], "leaf": True}]}}
    jsonschema.validate(call, schema)  # the references resolve inside the wrapper
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "tree", "arguments": {"label": "a", "kids": [{"label": 3}]}}, schema)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("json_schema", grammar.text)) == ""


@pytest.mark.parametrize("tool, message", [
    ({"type": "function", "function": {"name": "<|im_end|>"}}, "tools[0].function.name must be"),
    ({"type": "function", "function": {"name": "x" * 65}}, "tools[0].function.name must be"),
    ({"type": "function", "function": {"name": "a b"}}, "tools[0].function.name must be"),
    ({"type": "retrieval", "function": {"name": "find"}}, "tools[0].type must be"),
    ({"type": "function", "function": {"name": "f", "parameters": "{\"type\": \"object\"}"}},
     "tools[0].function.parameters must be"),
])
def test_bad_tool_definitions_are_400s_naming_the_field(tool_urls, tool, message):
    r = httpx.post(tool_urls[0] + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text

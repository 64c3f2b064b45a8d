"""Anthropic's Messages API (`POST /v1/messages`) with the `anthropic` SDK over real HTTP (the servers default to
greedy sampling: this SDK release takes no temperature): the same text as the
chat route for the same conversation, streamed events that join into it, tool_use blocks from `tool_choice: any`
with inputs valid for the tool's input_schema, tool_result blocks back through the template, and 400s."""
import jsonschema
import openai
import pytest
from test_server import models, serving, settings  # noqa: F401  (models: a fixture)
from test_tools import WEATHER, tool_models, tool_urls  # noqa: F401  (fixtures)

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


def clients(url: str):
    return anthropic.Anthropic(base_url=url, api_key="none"), openai.OpenAI(base_url=url + "/v1", api_key="none")


def test_messages_match_chat_completions_streamed_and_not(tool_urls):
    url = tool_urls[0]
    claude, gpt = clients(url)
    r = claude.messages.create(model="x", max_tokens=24, system="Be brief.",
                               messages=[{"role": "user", "content": "The quick brown fox"}])
    chat = gpt.chat.completions.create(model="x", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}])
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == chat.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(model="x", max_tokens=24, system="Be brief.",
                                messages=[{"role": "user", "content": "The quick brown fox"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == "max_tokens"
    count = claude.messages.count_tokens(model="x", system="Be brief.",
                                         messages=[{"role": "user", "content": "The quick brown fox"}])
    assert count.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_and_tool_result(tool_urls, stream):
    claude, _ = clients(tool_urls[0])
    kw = dict(model="x", max_tokens=800, tools=[TOOL], tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        with claude.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = claude.messages.create(**kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, TOOL["input_schema"])
    follow = claude.messages.create(model="x", max_tokens=8, tools=[TOOL], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C, sunny"}]}])
    assert follow.stop_reason == "max_tokens"


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({"max_tokens": 4, "messages": []}, "'messages' must be a non-empty array"),
    ({"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}, "role must be"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'image' block is not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
      "tool_choice": {"type": "sometimes"}}, "tool_choice.type must be"),
])
def test_bad_messages_are_400s(tool_urls, body, message):
    import httpx
    r = httpx.post(tool_urls[0] + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text

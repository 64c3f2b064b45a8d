"""Structured output over real HTTP with the OpenAI SDK: `response_format` json_schema / json_object and llama.cpp's
`json_schema` and GBNF `grammar` fields, constrained with llguidance at every verified position. Answers validate
against their schemas for 20 prompts, with and without speculation, and the speculative answer equals the plain one
under the same constraint (the constraint keeps speculation lossless); bad schemas and grammars are 400s."""
import json

import httpx
import jsonschema
import openai
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture)

from flashdraft.engine.engine import Request
from flashdraft.engine.grammar import Constraint, Grammar
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = [f"Describe person number {i} as JSON." for i in range(20)]


@pytest.fixture(scope="module")
def urls(models):
    spec, plain = load(models, draft=True, n_slots=2, slot_ctx=1024), load(models, n_slots=2, slot_ctx=1024)
    with serving(create_app(spec, settings())) as a, serving(create_app(plain, settings())) as b:
        yield a, b


def test_json_schema_answers_validate_and_speculation_is_lossless(urls):
    answers = {}
    for url in urls:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        answers[url] = []
        for prompt in PROMPTS:
            r = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=600,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            answers[url].append(r.choices[0].message.content)
    spec, plain = urls
    assert answers[spec] == answers[plain]
    assert len(set(answers[spec])) > 1  # the prompts reached the answers


def test_json_object_gbnf_and_llama_cpp_json_schema(urls):
    url = urls[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=80, response_format={"type": "json_object"})
    text = r.choices[0].message.content  # any object: this random model may still be inside a long string
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=600, response_format={"type": "json_object", "schema": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)  # llama.cpp's schema in json_object
    body = {"prompt": "Answer:", "n_predict": 40, "temperature": 0, "grammar": 'root ::= ("yes" | "no") "."'}
    assert httpx.post(url + "/completion", json=body, timeout=60).json()["content"] in ("yes.", "no.")
    body = {"prompt": "Numbers:", "n_predict": 300, "temperature": 0,
            "json_schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                            "minItems": 2, "maxItems": 4}}
    out = json.loads(httpx.post(url + "/completion", json=body, timeout=60).json()["content"])
    assert isinstance(out, list) and 2 <= len(out) <= 4 and all(isinstance(v, int) for v in out)
    # streamed: the chunks join into a valid answer
    chunks = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                            max_tokens=600, stream=True, response_format={
                                                "type": "json_schema", "json_schema": {"schema": SCHEMA}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema"}}, "must be an object with a 'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"json_schema": {"type": "nonsense-type"}}, "'json_schema'"),
    ({"grammar": "root ::= ("}, "'grammar'"),
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, "only one output constraint"),
])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(urls, body, message):
    url = urls[1]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body},
                   timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def test_a_forbidden_drafted_token_is_rejected_like_a_mismatch(models):
    """The masks of a verify block: row i after the committed tokens and drafted[:i]; past a token the grammar
    forbids, nothing more is walked, and the matcher is back where it was."""
    engine = load(models)
    tok = engine.tokenizer
    constraint = Constraint(tok, Grammar("gbnf", 'root ::= "ab" "cd"'), engine.target.cfg.vocab_size)
    a, b, c = (tok.encode(s, add_special=False) for s in ("a", "b", "c"))
    assert len(a) == len(b) == len(c) == 1
    masks = constraint.masks([a[0], b[0], a[0]])  # "a", "b" allowed, then "a" where only "c" is
    assert masks[0, a[0]] and not masks[0, b[0]]
    assert masks[1, b[0]] and not masks[1, a[0]]
    assert masks[2, c[0]] and not masks[2, a[0]]
    assert masks[3].all()  # past the forbidden "a": never used
    assert torch_equal_rows(constraint.masks([]), masks[:1])  # rolled back to the start
    plain = engine.generate(Request(tok.encode("x", add_special=False), SamplingParams(max_tokens=10),
                                    grammar=Grammar("gbnf", 'root ::= "ab" "cd"')))
    assert plain.text == "abcd" and plain.finish_reason == "stop"


def torch_equal_rows(x, y) -> bool:
    return bool((x == y).all())


def test_a_checked_grammar_compiles_once_and_still_pickles(models):
    """check() keeps its compiled matcher for the request's Constraint; the grammar still pickles (tensor-parallel
    ranks receive the request that way) and a rank that gets it compiles its own."""
    import pickle

    from flashdraft.engine.grammar import check
    engine = load(models)
    grammar = Grammar("gbnf", 'root ::= "ab" "cd"')
    check(engine.tokenizer, grammar)
    assert len(grammar.compiled) == 1
    copy = pickle.loads(pickle.dumps(grammar))
    assert copy == grammar and copy.compiled == []
    for g in (grammar, copy):
        constraint = Constraint(engine.tokenizer, g, engine.target.cfg.vocab_size)
        a = engine.tokenizer.encode("a", add_special=False)
        assert constraint.masks([])[0, a[0]]
    assert grammar.compiled == []  # taken by the first Constraint

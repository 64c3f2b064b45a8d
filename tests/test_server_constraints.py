"""Output constraints a client can get wrong in ways the grammar compiler accepts: a schema that no value matches
(a `$ref` cycle with nothing else in it, a required property that nothing matches) is a 400 naming the field,
never an empty 200; text that spells a special token inside a grammar literal or a schema stays text (before,
`"a<|im_end|>b"` let the model write the real end-of-turn token and the answer stopped at "a")."""
import json
import shutil

import httpx
import pytest
from test_server import load, models, serving, settings  # noqa: F401  (models: a fixture shared by the whole run)
from test_tools import HERMES

from flashdraft.server.app import create_app

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TWO_CYCLE = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REQUIRED_CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
                  "$defs": {"a": {"$ref": "#/$defs/a"}}}
ENDLESS = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                             "required": ["next"]}}, "$ref": "#/$defs/node"}  # each node needs a next: no finite value
ITEMS_CYCLE = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}, "$defs": {"a": {"$ref": "#/$defs/a"}}}
NOTHING = [CYCLE, TWO_CYCLE, REQUIRED_CYCLE, ENDLESS, ITEMS_CYCLE,
           {"type": "object", "properties": {"x": False}, "required": ["x"]}]
SOMETHING = [  # schemas with refs, cycles and required properties that values do match
    {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                          {"type": "null"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], "$defs": {"a": {"$ref": "#/$defs/a"}}},  # any type
    {"$ref": "https://example.com/schema"},  # not ours to resolve: left to the compiler
    {"type": "object", "properties": {"a~b/c": {"$ref": "#/properties/d"}, "d": {"type": "integer"}},
     "required": ["a~b/c"]},
    {"type": "object", "properties": {"a": {"$ref": "#/properties/a~1b"}, "a/b": {"type": "string"}},
     "required": ["a"]},
]


@pytest.mark.parametrize("schema", NOTHING)
def test_unmatchable_finds_schemas_no_value_matches(schema):
    from flashdraft.engine.grammar import unmatchable
    assert unmatchable(schema)


@pytest.mark.parametrize("schema", SOMETHING)
def test_unmatchable_leaves_schemas_values_match(schema):
    from flashdraft.engine.grammar import unmatchable
    assert unmatchable(schema) is None


def test_unmatchable_is_linear_in_a_long_chain_of_refs():
    """5000 definitions each referring to the next: decided in well under a second (a fixpoint iterated over the
    whole schema would take one pass per definition, minutes)."""
    import time

    from flashdraft.engine.grammar import unmatchable
    n = 5000
    schema = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}, "$ref": "#/$defs/d0"}
    schema["$defs"][f"d{n}"] = {"$ref": "#/$defs/d0"}
    t = time.perf_counter()
    assert unmatchable(schema)
    schema["$defs"][f"d{n}"] = {"type": "string"}
    assert unmatchable(schema) is None
    assert time.perf_counter() - t < 3.0  # 0.1 s on an idle core; room for a busy machine


@pytest.fixture(scope="module")
def url(models):  # noqa: F811
    with serving(create_app(load(models, n_slots=1, slot_ctx=1024), settings())) as url:
        yield url


@pytest.fixture(scope="module")
def tools_url(models, tmp_path_factory):  # noqa: F811
    target, draft = models
    folder = tmp_path_factory.mktemp("hermes-constraints") / "target"
    shutil.copytree(target, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=HERMES)))
    with serving(create_app(load((folder, draft), n_slots=1, slot_ctx=1024), settings())) as url:
        yield url


def assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("schema", NOTHING[:5])
def test_a_schema_no_value_matches_is_a_400_naming_the_field(url, schema):
    r = httpx.post(url + "/v1/chat/completions", json=CHAT | {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=60)
    assert_400(r, "response_format.json_schema.schema", "no JSON value matches")
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 4, "json_schema": schema}, timeout=60)
    assert_400(r, "'json_schema'", "no JSON value matches")


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "g"}}])
@pytest.mark.parametrize("schema", [REQUIRED_CYCLE, ENDLESS])
def test_tool_parameters_no_value_matches_are_a_400_naming_the_tool(tools_url, schema, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": schema}}]
    r = httpx.post(tools_url + "/v1/chat/completions", json=CHAT | {"tools": tools, "tool_choice": choice},
                   timeout=60)
    assert_400(r, "tools[1].function.parameters", "no JSON value matches")


def test_a_grammar_that_matches_nothing_is_a_400(url):
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 4, "grammar": "root ::= a\na ::= a"},
                   timeout=60)
    assert_400(r, "'grammar'")


def test_schemas_values_match_are_served(url):
    for schema in SOMETHING[:4]:
        r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 4, "json_schema": schema}, timeout=60)
        assert r.status_code == 200, (schema, r.text[:300])


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


# ---- grammars at the budget's size: compiled without crashing the process, in well under a second

DEEP = {  # a chain of about 3.7k levels within each budget: llguidance's compiler recurses once a level
    "schema $ref chain": ("json_schema", lambda n: {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
                                                   | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}, 3600),
    "GBNF rule chain": ("grammar", lambda n: "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(n))
                        + f'\nr{n} ::= "y"', 3000),
}


@pytest.mark.parametrize("case", list(DEEP))
def test_a_deep_grammar_within_the_budget_compiles_in_a_worker_thread(models, case):  # noqa: F811
    """In a child process (a crash there is a failure here, not the end of the test run), as the server does: the
    request's grammar checked in a worker thread of the default stack size. Before: a segmentation fault."""
    import subprocess
    import sys

    from test_server import REPO

    from flashdraft.server import budgets
    field, make, n = DEEP[case]
    value = make(n)
    size = len(value) if isinstance(value, str) else len(json.dumps(value))
    assert size <= (budgets.GRAMMAR_CHARS if field == "grammar" else budgets.SCHEMA_CHARS)
    script = f"""
import json, sys, threading, time
from flashdraft.formats.tokenizer import Tokenizer
from flashdraft.server.structured import request_grammar
tokenizer = Tokenizer.from_hf_folder({str(models[0])!r})
body = json.loads(sys.stdin.read())
def run():
    t = time.perf_counter()
    request_grammar(tokenizer, body)
    print("compiled in", round(time.perf_counter() - t, 2), "s", flush=True)
worker = threading.Thread(target=run)
worker.start()
worker.join()
"""
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps({field: value}), capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0 and "compiled in" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_gbnf_conversion_is_linear_and_as_llguidance_writes_it():
    """A chain of 3.2k rules (62 KB) converts in well under a second (before: 8 s, llguidance's resolve rescans
    every rule until nothing changes); the Lark text is the one llguidance writes for ordinary grammars."""
    import random
    import time

    from llguidance.gbnf_to_lark import gbnf_to_lark as theirs

    from flashdraft.engine.grammar import gbnf_to_lark
    text = DEEP["GBNF rule chain"][1](3200)
    t = time.perf_counter()
    gbnf_to_lark(text)
    assert time.perf_counter() - t < 3.0  # 0.14 s on an idle core; room for a busy machine
    rng = random.Random(0)
    grammars = ['root ::= x y\nx ::= "a"+\ny ::= [0-9]{1,3} z\nz ::= "q" | x',
                'root ::= fooBar\nfooBar ::= baz-qux "x"\nbaz-qux ::= "y" | root']
    for _ in range(100):
        n = rng.randint(1, 8)
        rules = [f"r{i} ::= " + " | ".join(" ".join(rng.choice([f'"t{i}"', "[a-c]", f"r{rng.randrange(n)}", '"z"?',
                                                                   f'(r{rng.randrange(n)} | "w")'])
                                                        for _ in range(rng.randint(1, 3)))
                                               for _ in range(rng.randint(1, 3))) for i in range(n)]
        grammars.append("\n".join(["root ::= r0"] + rules))
    for grammar in grammars:
        assert gbnf_to_lark(grammar) == theirs(grammar), grammar

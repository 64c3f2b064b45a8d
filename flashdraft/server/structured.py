"""Structured output fields: OpenAI's `response_format` (`json_object`, `json_schema`) and llama.cpp's `json_schema`
and `grammar` (GBNF), turned into one engine grammar (engine/grammar.py), checked before the request takes a slot."""
import json

from flashdraft.engine.grammar import Grammar, check
from flashdraft.server.budgets import GRAMMAR_CHARS, SCHEMA_CHARS
from flashdraft.server.protocol import ApiError

ANY_OBJECT = '{"type": "object"}'


def _schema_text(schema, where: str) -> str:
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ApiError(400, f"{where} must be a JSON schema object")
    return json.dumps(schema)


def request_grammar(tokenizer, body: dict, tool_grammar: Grammar | None = None) -> Grammar | None:
    found: list[tuple[str, str, Grammar]] = []  # (the field, where in it, its grammar)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            schema = fmt.get("schema")
            found.append(("response_format", "response_format.schema", Grammar(
                "json_schema", ANY_OBJECT if schema is None else _schema_text(schema, "response_format.schema"))))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ApiError(400, "response_format.json_schema must be an object with a 'schema'")
            found.append(("response_format", "response_format.json_schema.schema", Grammar(
                "json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"))))
        elif kind != "text":
            raise ApiError(400, "response_format.type must be \"text\", \"json_object\" or \"json_schema\"")
    if body.get("json_schema") is not None:
        found.append(("json_schema", "json_schema", Grammar("json_schema",
                                                            _schema_text(body["json_schema"], "'json_schema'"))))
    if body.get("grammar") is not None:
        if not isinstance(body["grammar"], str):
            raise ApiError(400, "'grammar' must be a GBNF grammar string")
        if body["grammar"].strip():
            found.append(("grammar", "grammar", Grammar("gbnf", body["grammar"])))
    if tool_grammar is not None:
        found.append(("tool_choice", "tool_choice", tool_grammar))
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint per request, got {', '.join(n for n, _, _ in found)}")
    if not found:
        return None
    name, where, grammar = found[0]
    limit = GRAMMAR_CHARS if grammar.kind != "json_schema" else SCHEMA_CHARS
    if len(grammar.text) > limit:  # its compilation would take too long (budgets.py)
        field = "tools" if name == "tool_choice" else name
        raise ApiError(400, f"'{field}' is too large: {len(grammar.text):,} characters of "
                            f"{'JSON schema' if grammar.kind == 'json_schema' else 'grammar'} (at most {limit:,})")
    try:
        check(tokenizer, grammar)  # compiles it once: the slot's Constraint takes the compiled matcher
    except ValueError as e:
        raise ApiError(400, f"'{where}': {e}") from None
    return grammar

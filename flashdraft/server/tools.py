"""OpenAI tool calls: which format a chat template speaks, the model's output parsed back into `tool_calls`, what
a stream must hold back while a call may be starting, and the grammar that `tool_choice: required` (or a named
function) puts on the output.

Formats (the template's own markers decide): Hermes / Qwen `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
Llama 3 JSON (`{"name": .., "parameters": {..}}`, after `<|python_tag|>` or alone), Mistral `[TOOL_CALLS][{..}]`
(or `[TOOL_CALLS]name[ARGS]{..}`), Gemma 4 `<|tool_call>call:name{key:value,..}<tool_call|>` with its own value
syntax (strings between `<|"|>`). A bare JSON object (or array of them) naming a declared tool is read as a call in
every format (a Markdown code fence around it too): small models often drop the markers, and the constrained
`required` output is one. Output that does
not parse into calls of declared tools stays plain content, never an error.
"""
import json
import re
from dataclasses import dataclass

from flashdraft.engine.grammar import Grammar, unmatchable
from flashdraft.server.budgets import SCHEMA_CHARS

MAX_PARALLEL_CALLS = 8
OPENERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",),
           "gemma4": ("<|tool_call>", "call:"), "json": ()}


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served (the server answers 400 with the message)."""


def tool_format(template: str | None) -> str | None:
    """The tool-call format of a chat template, None when it does not take tools."""
    if not template or "tools" not in template:
        return None
    for marker, name in (("<|tool_call>", "gemma4"), ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
                         ("<|python_tag|>", "llama3")):
        if marker in template:
            return name
    return "json"


FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule: nothing a template or a grammar reads as markup


def tool_names(tools: list) -> list[str]:
    """The tools' function names, each tool checked: a function with a valid name and, if any, object parameters."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if tool.get("type", "function") != "function":
            raise ToolError(f"tools[{i}].type must be \"function\", got {str(tool['type'])[:40]!r}")
        if not FUNCTION_NAME.fullmatch(function["name"]):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got "
                            f"{function['name'][:80]!r}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        why = unmatchable(function.get("parameters", {}))
        if why:  # a call to it could never be written: not a tool
            raise ToolError(f"tools[{i}].function.parameters: {why}")
        names.append(function["name"])
    return names


def relocated(schema: dict, key: str) -> tuple[dict, dict]:
    """A function's parameter schema made to sit below another root: (its body with every local `$ref` rewritten,
    the definitions to put in the new root's `$defs`). Its own `$defs`/`definitions` go up as `key__NAME` and the
    schema itself as `key`, so refs to them and to its root ("#", as Pydantic writes recursive models) still land."""
    defs = {f"{key}__{name}": d for table in ("$defs", "definitions") for name, d in (schema.get(table) or {}).items()}

    def pointer(ref: str) -> str:
        for table in ("$defs", "definitions"):
            if ref.startswith(f"#/{table}/"):
                name, _, rest = ref[len(table) + 3:].partition("/")
                return f"#/$defs/{key}__{name}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{key}{ref[1:]}"

    def walk(node):
        if isinstance(node, dict):
            return {k: pointer(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else walk(v)
                    for k, v in node.items() if k not in ("$defs", "definitions", "$id", "$schema")}
        return [walk(v) for v in node] if isinstance(node, list) else node

    body = walk(schema)
    return body, {key: body, **{name: walk(d) for name, d in defs.items()}}


def parse_tool_choice(value, names: list[str]) -> str:
    """"auto", "none", "required", or the one function name the call must use."""
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return name
    raise ToolError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}")


def choice_grammar(tools: list, choice: str, parallel: bool) -> Grammar | None:
    """For `required` or a named function: the output is a JSON call object (an array of them when parallel calls
    are allowed), with `arguments` valid for that function's parameters."""
    if choice == "auto":
        return None
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        if choice != "required" and function["name"] != choice:
            continue
        params, own = relocated(function.get("parameters") or {"type": "object"}, f"tool{i}")
        defs.update(own)
        calls.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # parallel calls: an array of at most MAX_PARALLEL_CALLS (a bound, so that a weak model cannot list forever)
    schema = ({"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
              if parallel and choice == "required" else call)
    text = json.dumps({**schema, "$defs": defs})
    if len(text) > SCHEMA_CHARS:  # its compilation would take too long (budgets.py)
        raise ToolError(f"'tools' is too large: the call schema of tool_choice {json.dumps(choice)} is "
                        f"{len(text):,} characters of JSON schema (at most {SCHEMA_CHARS:,})")
    return Grammar("json_schema", text, compact=True)


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as templates expect them: `arguments` an object, not the JSON text OpenAI sends."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    function = dict(call["function"])
                    if isinstance(function.get("arguments"), str):
                        try:
                            parsed = json.loads(function["arguments"])
                            if isinstance(parsed, dict):
                                function["arguments"] = parsed
                        except ValueError:
                            pass
                    call = {**call, "function": function}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------- parsing

def _call_from_object(obj, names: list[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _json_calls(text: str, names: list[str]) -> list[dict] | None:
    """Calls from text that is wholly one JSON object, an array of them, or objects separated by ';' / lines (also
    inside one Markdown code fence, as small models write it)."""
    text = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.S)
    text = fence.group(1) if fence else text
    if not text:
        return None
    candidates = [text] + ([part for part in re.split(r";\s*|\n+", text)] if ";" in text or "\n" in text else [])
    try:
        value = json.loads(candidates[0])
        items = value if isinstance(value, list) else [value]
    except ValueError:
        try:
            items = [json.loads(part) for part in candidates[1:] if part.strip()]
        except ValueError:
            return None
    calls = [_call_from_object(item, names) for item in items]
    return calls if calls and all(calls) else None


def _gemma_value(text: str, i: int) -> tuple[object, int]:
    """One value of Gemma 4's argument syntax at text[i:] -> (value, index after it)."""
    if text.startswith('<|"|>', i):
        end = text.index('<|"|>', i + 5)
        return text[i + 5:end], end + 5
    if text[i] == "{":
        obj, i = {}, i + 1
        while text[i] != "}":
            colon = text.index(":", i)
            key = text[i:colon].strip()
            if key.startswith('<|"|>'):
                key = key[5:-5]
            obj[key], i = _gemma_value(text, colon + 1)
            if text[i] == ",":
                i += 1
        return obj, i + 1
    if text[i] == "[":
        items, i = [], i + 1
        while text[i] != "]":
            item, i = _gemma_value(text, i)
            items.append(item)
            if text[i] == ",":
                i += 1
        return items, i + 1
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[i:end].strip()
    return json.loads(word) if word not in ("", "null") else None, end


def _gemma_calls(text: str, names: list[str]) -> tuple[str, list[dict]] | None:
    calls, content, pos = [], [], 0
    for match in re.finditer(r"(?:<\|tool_call>)?call:([\w.-]+)\{", text):
        if match.start() < pos:
            continue
        try:
            args, end = _gemma_value(text, match.end() - 1)
        except (ValueError, IndexError):
            return None
        if match.group(1) not in names:
            return None
        content.append(text[pos:match.start()])
        calls.append({"name": match.group(1), "arguments": json.dumps(args, ensure_ascii=False)})
        pos = end + (len("<tool_call|>") if text.startswith("<tool_call|>", end) else 0)
    if not calls:
        return None
    content.append(text[pos:])
    return "".join(content).strip(), calls


def parse_tool_calls(text: str, fmt: str, names: list[str]) -> tuple[str, list[dict]]:
    """(content, calls) from a model's output; each call {"name", "arguments" (JSON text)}."""
    if fmt == "gemma4":
        found = _gemma_calls(text, names)
        if found:
            return found
    if fmt == "hermes" and "<tool_call>" in text:
        blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S)
        calls = [_json_calls(block, names) for block in blocks]
        if calls and all(calls):
            content = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
            return content, [c for group in calls for c in group]
    if fmt == "mistral" and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        calls = _json_calls(rest, names)
        if calls is None and "[ARGS]" in rest:  # name[ARGS]{...} pairs
            pairs = re.findall(r"([\w.-]+)\[ARGS\](\{.*?\})(?=\s*(?:[\w.-]+\[ARGS\]|$))", rest.strip(), flags=re.S)
            calls = [_call_from_object({"name": n, "arguments": a}, names) for n, a in pairs] or None
            calls = calls if calls and all(calls) else None
        if calls:
            return head.strip(), calls
    stripped = text.replace("<|python_tag|>", "") if fmt == "llama3" else text
    calls = _json_calls(stripped, names)
    return ("", calls) if calls else (text, [])


def held_back(text: str, fmt: str) -> int:
    """How much of the text so far a stream may send as content: up to where a tool call may begin (a whole
    opener, or the start of one at the end; a leading '{' or '[' may begin a bare JSON call)."""
    if text.lstrip()[:1] in ("{", "["):
        return 0
    safe = len(text)
    for opener in OPENERS[fmt]:
        at = text.find(opener)
        if at >= 0:
            safe = min(safe, at)
        for k in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:k]):
                safe = min(safe, len(text) - k)
                break
    return safe


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as the server handles them."""
    fmt: str
    names: list[str]
    choice: str  # "auto", "required" or a function name
    parallel: bool
    grammar: Grammar | None

    def parse(self, text: str) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(text, self.fmt, self.names)
        return content, calls if self.parallel else calls[:1]



class CallStream:
    """A streamed answer under tools: content goes out up to where a call may begin (`push`); at the end, the
    content not sent yet and the calls (`finish`)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0

    def push(self, text: str) -> str:
        self.text += text
        safe = max(self.sent, held_back(self.text, self.plan.fmt))
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest, calls = self.plan.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        sent = self.text[:self.sent].strip()  # the content around the calls, less what already went out
        return (rest[len(sent):] if rest.startswith(sent) else ""), calls


def tool_plan(template: str | None, body: dict) -> ToolPlan | None:
    """None without tools or with tool_choice "none" (then the tools are not rendered either); raises ToolError for
    tools the model's template cannot take or a bad tool_choice."""
    tools = body.get("tools")
    if tools is None or tools == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array")
    names = tool_names(tools)
    fmt = tool_format(template)
    if fmt is None:
        raise ToolError("this model's chat template does not support tools")
    choice = parse_tool_choice(body.get("tool_choice"), names)
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean")
    return ToolPlan(fmt, names, choice, parallel, choice_grammar(tools, choice, parallel))

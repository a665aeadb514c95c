"""Forced tool calls (`tool_choice` required or named) in each family's own syntax, as
llguidance Lark rules (`CallFormat.grammar`; the contract is `base.CallGrammar`).

Formats whose arguments are JSON (Hermes, Kimi, Mistral, pythonic's keyword values) take each
tool's parameters schema as it is (`%json`). Formats that write each argument as a key and a
value in their own tags (Qwen3-Coder, MiniMax, GLM) write the values the way their parser reads
them back: a string parameter's value is its raw text, up to the closing tag; any other value
is JSON of the parameter's schema. The parameters come in the schema's order, the required ones
always, the others optionally; no others. What such a format cannot carry raises RequestError
naming it: a string parameter with a `format`, a parameter whose type is not one JSON type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from runner.errors import RequestError
from runner.tool_formats.base import ForcedTool, GrammarKit

_STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength", "pattern"}
"""What a raw string value can be held to; any other keyword is refused (`description` and
`title` say nothing about the value)."""
_IGNORED = {"description", "title", "examples", "default", "$comment"}


_REGEX_ESCAPES = {char: "\\" + char for char in "\\.+*?()|[]{}^$#&-~/"} | {
    "\n": "\\n",
    "\t": "\\t",
    "\r": "\\r",
}


def _regex_text(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join(_REGEX_ESCAPES.get(char, char) for char in text)


def _sub_schema(tool: ForcedTool, schema: dict[str, Any]) -> dict[str, Any]:
    """A property's schema, with the definitions its references may point into."""
    shared: dict[str, Any] = {
        key: tool.parameters[key] for key in ("$defs", "definitions") if key in tool.parameters
    }
    return {**shared, **schema}


def _properties(tool: ForcedTool) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) of each parameter, in the schema's order."""
    parameters = tool.parameters
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    if not isinstance(properties, dict):
        raise RequestError(
            "invalid_request", f"{tool.where}.properties: must be an object.", "tools"
        )
    return [
        (name, schema if isinstance(schema, dict) else {}, name in required)
        for name, schema in properties.items()
    ]


def is_raw_string(schema: dict[str, Any]) -> bool:
    """Whether a key/value format writes this parameter's value as raw text (its parsers
    take a string type, or an enum of strings with no type, as text)."""
    kind = schema.get("type")
    if kind == "string":
        return True
    values = schema.get("enum")
    return kind is None and isinstance(values, list) and all(isinstance(v, str) for v in values)


def _raw_string(
    kit: GrammarKit, name: str, schema: dict[str, Any], where: str, closer: str, *, stripped: bool
) -> tuple[str, list[str]]:
    """A string parameter's raw text, then `closer`: (the expression, its rules).

    Where `closer` is text, the value is a lazy rule that ends at its first `closer`; where it
    is a special token, the text (which cannot hold the token) runs up to it. `stripped`: the
    parser strips the value, so the text neither starts nor ends with whitespace.
    """
    unknown = set(schema) - _STRING_KEYS - _IGNORED
    if unknown:
        raise RequestError(
            "invalid_request",
            f"{where}: {', '.join(sorted(unknown))} cannot be enforced on a string this "
            "model's tool-call format writes as plain text.",
            "tools",
        )
    char = "(.|\\n)"
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        texts = [v for v in values if isinstance(v, str) and (not stripped or v == v.strip() != "")]
        if not texts:
            raise RequestError(
                "invalid_request", f"{where}: no value this format can write.", "tools"
            )
        body = "(" + "|".join(_regex_text(text) for text in texts) + ")"
    elif "pattern" in schema:
        pattern = str(schema["pattern"]).replace("/", "\\/")
        # JSON Schema's patterns match anywhere in the string; a regex here spans it all.
        pattern = pattern[1:] if pattern.startswith("^") else f"{char}*{pattern}"
        pattern = pattern[:-1] if pattern.endswith("$") else f"{pattern}{char}*"
        body = f"(?:{pattern})"
    else:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        body = (
            f"{char}*"
            if high is None and not low
            else f"{char}{{{low},{'' if high is None else int(high)}}}"
        )
    if stripped and values is None:
        if body != f"{char}*":
            raise RequestError(
                "invalid_request",
                f"{where}: a pattern or length cannot be enforced on a string this model's "
                "tool-call format writes as plain text and strips.",
                "tools",
            )
        # Not empty, no whitespace at either end: what the parser's strip() leaves as it is.
        body = "(\\S((.|\\n)*\\S)?)"
    ref = kit.marker(closer) if closer else ""
    if ref.startswith("<["):
        return f"{name} {ref}", [f"{name}: /{body}/"]
    return name, [f"{name}[lazy]: /{body}{_regex_text(closer)}/"]


Member = Callable[[str, str, dict[str, Any], str], tuple[str, list[str]]]
"""(key, rule name, schema, where) → a parameter's expression in a call, and its rules."""


def _members(prefix: str, tool: ForcedTool, member: Member) -> tuple[str, list[str]]:
    """A call's parameters, each in its own tags, in the schema's order: the required ones
    always, the others optionally. (The expression, its rules.)"""
    parts: list[str] = []
    rules: list[str] = []
    for j, (key, schema, required) in enumerate(_properties(tool)):
        expression, more = member(key, f"{prefix}_{j}", schema, f"{tool.where}.properties.{key}")
        rules += more
        parts.append(expression if required else f"({expression})?")
    return " ".join(parts) or '""', rules


def _tagged(
    kit: GrammarKit,
    tool: ForcedTool,
    head: Callable[[str], str],
    closer: str,
    *,
    stripped: bool,
) -> Member:
    """A parameter in a key/value format: `head(key)` (its opening tags), its value, and its
    closing tag `closer`."""

    def member(key: str, name: str, schema: dict[str, Any], where: str) -> tuple[str, list[str]]:
        if is_raw_string(schema):
            expression, rules = _raw_string(kit, name, schema, where, closer, stripped=stripped)
            return f"{head(key)} {expression}", rules
        kind = schema.get("type")
        if not isinstance(kind, str) and "$ref" not in schema:
            raise RequestError(
                "invalid_request",
                f"{where}: this model's tool-call format types each argument by one JSON "
                'type; give the parameter a single "type".',
                "tools",
            )
        value = f"{name}: {kit.json(_sub_schema(tool, schema), where)}"
        return f"{head(key)} {name} {kit.marker(closer)}", [value]

    return member


def _choice(prefix: str, count: int) -> str:
    return " | ".join(f"{prefix}_{i}" for i in range(count))


def json_tools(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<tool_call>\\n{"name": "<fn>", "arguments": <its parameters>}\\n</tool_call>`, calls
    separated by a newline."""
    start, end = kit.marker("<tool_call>"), kit.marker("</tool_call>")
    names = " | ".join(f"json_tools_fn_{i}" for i in range(len(tools)))
    rules = [
        "calls: json_tools_call" + (' ("\\n" json_tools_call)*' if many else ""),
        f'json_tools_call: {start} "\\n" ({names}) "\\n" {end}',
    ]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        rules.append(
            f'json_tools_fn_{i}: {kit.literal(head)} {kit.json(tool.parameters, tool.where)} "}}"'
        )
    return "\n".join(rules)


def qwen3_coder(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>`, calls separated by a newline."""
    start, end = kit.marker("<tool_call>"), kit.marker("</tool_call>")
    rules = [
        "calls: qc_call" + (' ("\\n" qc_call)*' if many else ""),
        f'qc_call: {start} "\\n" ({_choice("qc_fn", len(tools))}) {end}',
    ]
    for i, tool in enumerate(tools):
        member = _tagged(
            kit,
            tool,
            lambda key: kit.literal(f"<parameter={key}>\n"),
            "\n</parameter>\n",
            stripped=False,
        )

        body, more = _members(f"qc_{i}", tool, member)
        head = kit.literal(f"<function={tool.name}>\n")
        rules += [f'qc_fn_{i}: {head} {body} "</function>\\n"', *more]
    return "\n".join(rules)


def minimax_m2(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n
    </invoke>\\n</minimax:tool_call>`, several invokes in one section."""
    start, end = kit.marker("<minimax:tool_call>"), kit.marker("</minimax:tool_call>")
    rules = [
        f'calls: {start} "\\n" mm_invoke{"+" if many else ""} {end}',
        f"mm_invoke: {_choice('mm_fn', len(tools))}",
    ]
    for i, tool in enumerate(tools):
        member = _tagged(
            kit,
            tool,
            lambda key: kit.literal(f"<parameter name={json.dumps(key)}>"),
            "</parameter>\n",
            stripped=True,
        )

        body, more = _members(f"mm_{i}", tool, member)
        head = kit.literal(f"<invoke name={json.dumps(tool.name)}>\n")
        rules += [f'mm_fn_{i}: {head} {body} "</invoke>\\n"', *more]
    return "\n".join(rules)


def glm47(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`, as
    GLM-4.7 writes it (no newlines); calls one after the other."""
    start, end = kit.marker("<tool_call>"), kit.marker("</tool_call>")
    key_open, key_close = kit.marker("<arg_key>"), kit.marker("</arg_key>")
    value_open = kit.marker("<arg_value>")
    rules = [
        "calls: glm_call" + (" glm_call*" if many else ""),
        f"glm_call: {start} ({_choice('glm_fn', len(tools))}) {end}",
    ]
    for i, tool in enumerate(tools):
        member = _tagged(
            kit,
            tool,
            lambda key: f"{key_open} {kit.literal(key)} {key_close} {value_open}",
            "</arg_value>",
            stripped=True,
        )

        body, more = _members(f"glm_{i}", tool, member)
        rules += [f"glm_fn_{i}: {kit.literal(tool.name)} {body}", *more]
    return "\n".join(rules)


def kimi_k2(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N
    <|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>`."""
    begin, end = (
        kit.marker("<|tool_calls_section_begin|>"),
        kit.marker("<|tool_calls_section_end|>"),
    )
    call, arguments, done = (
        kit.marker("<|tool_call_begin|>"),
        kit.marker("<|tool_call_argument_begin|>"),
        kit.marker("<|tool_call_end|>"),
    )
    rules = [
        f"calls: {begin} kimi_call{'+' if many else ''} {end}",
        f"kimi_call: {call} ({_choice('kimi_fn', len(tools))}) {done}",
        "KIMI_INDEX: /[0-9]{1,4}/",
    ]
    for i, tool in enumerate(tools):
        head = kit.literal(f"functions.{tool.name}:")
        rules.append(
            f"kimi_fn_{i}: {head} KIMI_INDEX {arguments} {kit.json(tool.parameters, tool.where)}"
        )
    return "\n".join(rules)


def mistral(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`[TOOL_CALLS]NAME[ARGS]{JSON}`, repeated for several calls."""
    start, args = kit.marker("[TOOL_CALLS]"), kit.marker("[ARGS]")
    rules = [
        "calls: mistral_call" + ("+" if many else ""),
        f"mistral_call: {start} ({_choice('mistral_fn', len(tools))})",
    ]
    for i, tool in enumerate(tools):
        schema = kit.json(tool.parameters, tool.where)
        rules.append(f"mistral_fn_{i}: {kit.literal(tool.name)} {args} {schema}")
    return "\n".join(rules)


def pythonic(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<|tool_call_start|>[NAME(key=VALUE, ...), ...]<|tool_call_end|>`, each value JSON of its
    parameter's schema (which the parser reads as a Python literal, `true`/`false`/`null`
    included)."""
    start, end = kit.marker("<|tool_call_start|>"), kit.marker("<|tool_call_end|>")
    rules = [
        f'calls: {start} "[" py_call' + (' (", " py_call)*' if many else "") + f' "]" {end}',
        f"py_call: {_choice('py_fn', len(tools))}",
    ]
    for i, tool in enumerate(tools):
        pairs = []
        for j, (key, schema, required) in enumerate(_properties(tool)):
            where = f"{tool.where}.properties.{key}"
            rules.append(f"py_{i}_{j}: {kit.json(_sub_schema(tool, schema), where)}")
            pairs.append((f"{kit.literal(key + '=')} py_{i}_{j}", required))
        rules += _keyword_rules(f"py_{i}", pairs)
        rules.append(f'py_fn_{i}: {kit.literal(tool.name + "(")} py_{i}_s0 ")"')
    return "\n".join(rules)


def _keyword_rules(prefix: str, pairs: list[tuple[str, bool]], separator: str = ", ") -> list[str]:
    """Rules `<prefix>_s0`: the `key=value` pairs joined by `separator`, in order, optional
    ones optional. `_sK`: pairs K.. with nothing before them; `_tK`: with something before
    them (so each one they write is led by its separator)."""
    n = len(pairs)
    rules = [f'{prefix}_s{n}: ""', f'{prefix}_t{n}: ""']
    for k in range(n - 1, -1, -1):
        pair, required = pairs[k]
        after = f"{prefix}_t{k + 1}"
        if required:
            rules.append(f"{prefix}_s{k}: {pair} {after}")
            rules.append(f"{prefix}_t{k}: {json.dumps(separator)} {pair} {after}")
        else:
            rules.append(f"{prefix}_s{k}: {pair} {after} | {prefix}_s{k + 1}")
            rules.append(f"{prefix}_t{k}: {json.dumps(separator)} {pair} {after} | {after}")
    return rules


_SCALARS = ("integer", "number", "boolean", "null")


def gemma4(kit: GrammarKit, tools: Sequence[ForcedTool], many: bool) -> str:
    """`<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, one call after another, in the
    syntax of Gemma 4's chat template (`format_argument`): a string its raw text between `<|"|>`
    delimiters, a number, boolean or null as JSON writes it, an object `{key:VALUE,...}` with
    bare keys, an array `[VALUE,...]` (`_gemma_value`)."""
    start, end = kit.marker("<|tool_call>"), kit.marker("<tool_call|>")
    rules = [
        "calls: gemma_call" + (" gemma_call*" if many else ""),
        f"gemma_call: {start} ({_choice('gemma_fn', len(tools))}) {end}",
    ]
    for i, tool in enumerate(tools):
        body, more = _gemma_members(kit, f"gemma_{i}", tool, tool.parameters, tool.where)
        rules += more
        rules.append(f"gemma_fn_{i}: {kit.literal(f'call:{tool.name}')} {body}")
    return "\n".join(rules)


_GEMMA_KEY = re.compile(r"\w+")
"""A key Gemma 4 writes bare (and mlx-lm's parser reads back)."""
_GEMMA_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties"} | _IGNORED
_GEMMA_ARRAY_KEYS = {"type", "items", "minItems", "maxItems"} | _IGNORED
GEMMA_MAX_ITEMS = 32
"""The most items an array with a `maxItems` may be forced to (each is a rule)."""


def _gemma_value(
    kit: GrammarKit, name: str, tool: ForcedTool, schema: dict[str, Any], where: str
) -> tuple[str, list[str]]:
    """A value of `schema` in Gemma 4's syntax: its expression and rules (named from `name`).
    RequestError, naming `where`, for what the syntax cannot carry or the grammar not hold."""
    quote = '<|"|>'
    if is_raw_string(schema):
        expression, rules = _raw_string(kit, name, schema, where, quote, stripped=False)
        return f"{kit.marker(quote)} {expression}", rules
    kind = schema.get("type")
    if kind in _SCALARS:
        return name, [f"{name}: {kit.json(_sub_schema(tool, schema), where)}"]
    if kind == "object" and not set(schema) - _GEMMA_OBJECT_KEYS:
        return _gemma_members(kit, name, tool, schema, where)
    items = schema.get("items")
    if kind == "array" and isinstance(items, dict) and not set(schema) - _GEMMA_ARRAY_KEYS:
        item, rules = _gemma_value(kit, f"{name}_i", tool, items, f"{where}.items")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) > GEMMA_MAX_ITEMS:
            raise RequestError(
                "invalid_request",
                f"{where}: a maxItems over {GEMMA_MAX_ITEMS} cannot be forced in Gemma 4's "
                "tool-call syntax.",
                "tools",
            )
        rules.append(f"{name}_item: {item}")
        rules.append(f'{name}: "[" {_items(f"{name}_item", low, high)} "]"')
        return name, rules
    extra = sorted(set(schema) - (_GEMMA_ARRAY_KEYS if kind == "array" else _GEMMA_OBJECT_KEYS))
    if extra:
        why = f"its {', '.join(extra)}"
    elif kind == "array":
        why = 'an array without one "items" schema'
    else:
        why = 'a value of no single "type"'
    raise RequestError(
        "invalid_request",
        f"{where}: Gemma 4's tool-call syntax is enforced for strings, numbers, booleans, "
        f"null, objects of listed properties and arrays of one item schema; {why} cannot be "
        "forced.",
        "tools",
    )


def _gemma_members(
    kit: GrammarKit, name: str, tool: ForcedTool, schema: dict[str, Any], where: str
) -> tuple[str, list[str]]:
    """An object's `{key:VALUE,...}`: its properties in the schema's order, the required ones
    always."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    if not isinstance(properties, dict):
        raise RequestError("invalid_request", f"{where}.properties: must be an object.", "tools")
    rules: list[str] = []
    pairs = []
    for j, (key, sub) in enumerate(properties.items()):
        at = f"{where}.properties.{key}"
        if not _GEMMA_KEY.fullmatch(key):
            raise RequestError(
                "invalid_request",
                f"{at}: Gemma 4 writes keys bare, so only letters, digits and _ can be forced.",
                "tools",
            )
        value, more = _gemma_value(
            kit, f"{name}_{j}", tool, sub if isinstance(sub, dict) else {}, at
        )
        rules += more
        pairs.append((f"{kit.literal(key + ':')} {value}", key in required))
    rules += _keyword_rules(name, pairs, ",")
    return f'"{{" {name}_s0 "}}"', rules


def _items(item: str, low: int, high: Any) -> str:
    """`low` to `high` (None: any number of) `item`s, comma-separated."""
    if high is None:
        if low == 0:
            return f'({item} ("," {item})*)?'
        return " ".join([item] + [f'"," {item}'] * (low - 1) + [f'("," {item})*'])
    high = int(high)
    if high <= 0:
        return '""'
    # Past the first `low`, each further item optional, each within the one before it.
    tail = ""
    for _ in range(high - max(low, 1)):
        tail = f'("," {item} {tail})?' if tail else f'("," {item})?'
    head = " ".join([item] + [f'"," {item}'] * (max(low, 1) - 1))
    body = f"{head} {tail}".strip()
    return body if low > 0 else f"({body})?"


CHARACTERS_PER_TOKEN = 4
"""How the reasoning bound is counted: in characters, about four a token of English text."""
HARMONY_REASONING_TOKENS = {
    "none": 128,
    "minimal": 128,
    "low": 128,
    "medium": 512,
    "high": 2048,
    "xhigh": 2048,
    "max": 2048,
}
"""The most a Harmony model may reason before a forced call or a JSON answer, by reasoning
effort (medium when the request names none), in tokens of text (`CHARACTERS_PER_TOKEN`
characters each): the grammar closes the analysis message there, so that a constrained answer
always comes."""


def harmony(
    kit: GrammarKit,
    tools: Sequence[ForcedTool],
    body: str | None,
    *,
    effort: str | None,
) -> str:
    """A Harmony (gpt-oss) answer under a constraint, after the prompt's `<|start|>assistant`:
    an optional analysis message (reasoning, bounded by `HARMONY_REASONING_TOKENS`), then
    one call of `tools` on the commentary channel (`to=functions.NAME <|constrain|>json`,
    ending the turn with `<|call|>`: Harmony calls one tool a turn), or, where `body` (a rule
    body for the JSON answer) is given, a final message holding it; both when both are."""
    start, end, message, channel = (
        kit.marker("<|start|>"),
        kit.marker("<|end|>"),
        kit.marker("<|message|>"),
        kit.marker("<|channel|>"),
    )
    constrain, call, done = (
        kit.marker("<|constrain|>"),
        kit.marker("<|call|>"),
        kit.marker("<|return|>"),
    )
    budget = HARMONY_REASONING_TOKENS[effort or "medium"]
    answers = []
    rules = [
        f'harmony_reasoning: {channel} "analysis" {message} harmony_thought {end} {start} '
        '"assistant"',
        # The markers are special tokens, which no text matches: the thought ends at <|end|>,
        # at the latest after `budget` tokens' worth of characters (llguidance's max_tokens
        # attribute would count tokens, but cannot take back a token, which its matcher then
        # needs at times: "rollback not supported with max_tokens lexemes").
        f"harmony_thought: /(.|\\n){{0,{budget * CHARACTERS_PER_TOKEN}}}/",
    ]
    if tools:
        answers.append("harmony_call")
        rules.append(f"harmony_call: {channel} ({_choice('harmony_fn', len(tools))}) {call}")
        for i, tool in enumerate(tools):
            recipient = kit.literal(f"commentary to=functions.{tool.name} ")
            arguments = kit.json(tool.parameters, tool.where)
            rules.append(f'harmony_fn_{i}: {recipient} {constrain} "json" {message} {arguments}')
    if body is not None:
        answers.append("harmony_final")
        rules.append(f'harmony_final: {channel} "final" {message} harmony_body {done}')
        rules.append(f"harmony_body: {body}")
    rules.insert(0, f"start: harmony_reasoning? ({' | '.join(answers)})")
    return "\n".join(rules)

"""What every family's tool-call format shares: the parser contract and JSON building blocks.

A model writes its tool calls inside a *section* that it opens with its family's start marker
and closes with its end marker (`<tool_call>` ... `</tool_call>`; a format whose `end` is ""
has no end marker: its section runs to the end of the output). `runner.tool_calls.
ToolCallSplitter` finds the sections in the content and feeds the text between the markers,
in pieces of any size, to a `SectionParser` of the family, which turns it into calls:

- `feed(text)` and `end()` return `ToolCallDelta`s whose `index` counts the calls *of the
  section* from 0 and whose `id` is None (the splitter numbers the calls of the whole answer
  and gives them ids);
- the calls come one after the other, in OpenAI's delta order: a call's first delta carries
  its `name` (arguments ""), then deltas carry fragments of its arguments; every delta of call
  k comes before the first of call k + 1;
- joined, a call's fragments are its arguments as the text of a JSON object, with the
  model's numbers exactly as it wrote them (never through a float);
- `end()` (the end marker came, or the output ended) completes every call it started, so the
  arguments parse; a call cut off mid-value ends as far as it got, closed;
- the deltas do not depend on how the text was split (joined per call, they are the same for
  any split), and a parser sends a fragment as soon as it knows it is final;
- `calls` says how many calls the section held; a section with none (`end()` found no call
  in it) is not a tool call, and the splitter shows its text as content.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from protocol.frames import ToolCallDelta

Tools = Sequence[dict[str, Any]]
"""A request's tools, as chat templates take them: `{"type": "function", "function": {...}}`."""


class SectionParser(ABC):
    """One tool-call section's text, fed in pieces, turned into calls (the module docstring
    gives the contract)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallDelta]:
        """More of the section's text."""

    @abstractmethod
    def end(self) -> list[ToolCallDelta]:
        """The section ended: complete the calls it holds."""


@attrs.frozen
class ForcedTool:
    """A tool a forced call may name (`tool_choice` required or named)."""

    name: str
    parameters: dict[str, Any]
    """Its JSON Schema (an object schema)."""
    where: str
    """Where the schema is in the request, for errors (`tools[0].function.parameters`)."""


class GrammarKit(Protocol):
    """What a format's grammar is written with: pieces of an llguidance Lark grammar, made
    for the model's tokenizer (`runner.engine.constraint`)."""

    def marker(self, text: str) -> str:
        """A marker: its special token where it is one (`<[id]>`), else its text."""

    def json(self, schema: dict[str, Any], where: str) -> str:
        """A rule body for a JSON value of `schema` (`%json {...}`, written with ", " and
        ": "); RequestError naming `where` if it cannot be enforced."""

    def literal(self, text: str) -> str:
        """A Lark string literal."""


CallGrammar = Callable[[GrammarKit, Sequence[ForcedTool], bool], str]
"""A format's forced calls as Lark rules: `(kit, tools, many)` → rules defining `calls`, one
call of one of `tools` (`many`: one or more), each call's arguments following its tool's
schema, in the format's own syntax; the rules' other names start with the format's name."""


@attrs.frozen
class CallFormat:
    """A family's tool-call format."""

    parser: str
    """The name of mlx-lm's tool parser for it (`mlx_lm.tool_parsers.<parser>`)."""
    start: str
    end: str
    """"" where the section runs to the end of the output."""
    new_parser: Callable[[Tools], SectionParser]
    streamed: bool
    """Arguments are sent as they are written (False: a call is sent whole at its end)."""
    grammar: CallGrammar | None = None
    """How calls are forced; None: they cannot be."""


def function_schema(tools: Tools, name: str) -> dict[str, Any]:
    """The `parameters` JSON schema of the tool `name` ({} when unknown or absent)."""
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            return parameters if isinstance(parameters, dict) else {}
    return {}


def property_schema(tools: Tools, name: str, key: str) -> dict[str, Any] | None:
    """The schema of parameter `key` of tool `name`, None when the tool does not declare it."""
    properties = function_schema(tools, name).get("properties")
    if not isinstance(properties, dict):
        return None
    schema = properties.get(key)
    return schema if isinstance(schema, dict) else None


_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def json_number(text: str) -> str | None:
    """`text` (stripped) when it is a JSON number, as written; None otherwise."""
    stripped = text.strip()
    return stripped if _JSON_NUMBER.fullmatch(stripped) else None


JSON_SPACE = " \t\r\n"
"""The characters JSON allows between its tokens."""
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
JSON_ESCAPES = frozenset('"\\/bfnrt')
"""The characters after a backslash that make a JSON string's two-character escapes."""


def json_escape(sequence: str) -> bool | None:
    """Whether `sequence`, a backslash and what followed it so far in a JSON string, is an
    escape: True when it is complete, None while it may still become one (`\\u00`), False
    when it cannot."""
    if len(sequence) < 2:
        return None
    if sequence[1] != "u":
        return len(sequence) == 2 and sequence[1] in JSON_ESCAPES
    digits = sequence[2:]
    if len(digits) > 4 or not all(digit in HEX_DIGITS for digit in digits):
        return False
    return len(digits) == 4 or None


def json_string(text: str) -> str:
    """`text` as a JSON string literal."""
    return json.dumps(text, ensure_ascii=False)


def string_fragment(text: str) -> str:
    """`text` escaped for the inside of a JSON string literal (no quotes): fragments of a
    string escape independently, so a value can be streamed piece by piece."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: text a
    streaming parser holds back, as it may be the start of the marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ObjectWriter:
    """Writes a JSON object a member at a time, as fragments: for formats that give each
    argument as a key and a value in their own syntax (XML parameters, key/value tags).

    `key(name)` opens a member (`{"name": ` or `, "name": `); its value follows as one
    `value(json_text)`, or as `open_string()`, any number of `string(text)` and
    `close_string()`; `close()` ends the object (`{}` when it had no member). Each method
    returns the fragment to send.
    """

    def __init__(self) -> None:
        self.members = 0
        self.closed = False

    def key(self, name: str) -> str:
        lead = "{" if self.members == 0 else ", "
        self.members += 1
        return f"{lead}{json_string(name)}: "

    @staticmethod
    def value(json_text: str) -> str:
        return json_text

    @staticmethod
    def open_string() -> str:
        return '"'

    @staticmethod
    def string(text: str) -> str:
        return string_fragment(text)

    @staticmethod
    def close_string() -> str:
        return '"'

    def close(self) -> str:
        if self.closed:
            return ""
        self.closed = True
        return "{}" if self.members == 0 else "}"


def literal_json(value: Any) -> str:
    """A Python value (from `ast.literal_eval` or `json.loads`) as JSON text; integers keep
    every digit (json does not round them)."""
    return json.dumps(value, ensure_ascii=False)


class ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces (it does not validate:
    the grammar, or the model, is responsible for that)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of it until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
                if char in "{[":
                    self.depth = 1
                elif char == '"':
                    self.in_string = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if self.depth == 0:
                # A bare literal (number, true, null) ends at the first delimiter.
                if char in ",}] \t\r\n":
                    self.done = True
                    return i
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)

"""GLM-4.5 / 4.6 / 4.7's calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
</tool_call>` (GLM-4.5 and 4.6 put a newline after the name and after each tag), read as
mlx-lm's `glm47` parser reads them.

Streamed as the model writes them: the name at the first `<arg_key>`, then the arguments as a
JSON object built a member at a time: `{"city": ` once the key is closed; a parameter the
tool declares as a string is a JSON string whose characters follow as they come (stripped, as
mlx-lm strips values); any other value is converted whole at its `</arg_value>` (JSON, else a
Python literal, else the text as a string), with its numbers as written.

A section with no `<arg_key>` is read whole at its end with mlx-lm's fallbacks (a JSON payload,
`name {json}`, `name a=1 b=2`, `name raw text`).

Values are read with `values.deserialize` (mlx-lm's `_deserialize`, numbers as written).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TypeAlias

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    CallFormat,
    ObjectWriter,
    SectionParser,
    Tools,
    partial_suffix,
    property_schema,
)
from runner.tool_formats.values import Json, deserialize, load_json, python_str, to_json

_KEY_OPEN = "<arg_key>"
_KEY_CLOSE = "</arg_key>"
_VALUE_OPEN = "<arg_value>"
_VALUE_CLOSE = "</arg_value>"


def _is_string(tools: Tools, name: str, key: str) -> bool:
    """The tool declares parameter `key` as a string: its value is kept as written."""
    schema = property_schema(tools, name, key)
    return schema is not None and schema.get("type") == "string"


_State: TypeAlias = "Callable[[list[ToolCallDelta]], bool]"
"""A parser state: consumes what it can of the buffer; True when it moved to another state."""


class Glm47Parser(SectionParser):
    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._state: _State = self._name
        self._buffer = ""
        """Text not yet consumed."""
        self._searched = 0
        """Where in `_buffer` the marker the state waits for may start."""
        self._function = ""
        self._writer = ObjectWriter()
        self._string = False
        """The current value is a declared string, streamed."""
        self._started = False
        """The string value has had its first non-space character."""

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._buffer += text
        deltas: list[ToolCallDelta] = []
        while self._state(deltas):
            pass
        return deltas

    def end(self) -> list[ToolCallDelta]:
        if self._state == self._ended:
            return []
        if self._state == self._name:
            return self._whole()
        pieces: list[str] = []
        if self._state in (self._gap, self._value):
            pieces.append("null")  # a value that never came, or that is cut off
        elif self._state == self._string_value:
            rest = self._buffer.rstrip() if self._started else ""
            pieces += [self._writer.string(rest) if rest else "", self._writer.close_string()]
        pieces.append(self._writer.close())
        self._state = self._ended
        return self._send(deltas=[], text="".join(pieces))

    def _name(self, deltas: list[ToolCallDelta]) -> bool:
        index = self._find(_KEY_OPEN)
        if index < 0:
            return False
        self._function = self._buffer[:index].strip()
        self.calls = 1
        deltas.append(ToolCallDelta(0, "", name=self._function))
        return self._move(index + len(_KEY_OPEN), self._key)

    def _key(self, deltas: list[ToolCallDelta]) -> bool:
        index = self._find(_KEY_CLOSE)
        if index < 0:
            return False
        key = self._buffer[:index].strip()
        self._string = _is_string(self.tools, self._function, key)
        self._send(deltas, self._writer.key(key))
        return self._move(index + len(_KEY_CLOSE), self._gap)

    def _gap(self, deltas: list[ToolCallDelta]) -> bool:
        index = self._find(_VALUE_OPEN)
        if index < 0:
            return False
        if self._string:
            self._send(deltas, self._writer.open_string())
            self._started = False
            return self._move(index + len(_VALUE_OPEN), self._string_value)
        return self._move(index + len(_VALUE_OPEN), self._value)

    def _string_value(self, deltas: list[ToolCallDelta]) -> bool:
        if not self._started:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._started = True
        index = self._buffer.find(_VALUE_CLOSE)
        if index >= 0:
            text = self._buffer[:index].rstrip()
            closing = self._writer.close_string()
            self._send(deltas, (self._writer.string(text) if text else "") + closing)
            return self._move(index + len(_VALUE_CLOSE), self._between)
        # Held back: what may start `</arg_value>`, and spaces that may end the value.
        held = partial_suffix(self._buffer, _VALUE_CLOSE)
        text = self._buffer[: len(self._buffer) - held].rstrip()
        if text:
            self._send(deltas, self._writer.string(text))
            self._buffer = self._buffer[len(text) :]
        return False

    def _value(self, deltas: list[ToolCallDelta]) -> bool:
        index = self._find(_VALUE_CLOSE)
        if index < 0:
            return False
        self._send(deltas, to_json(deserialize(self._buffer[:index].strip())))
        return self._move(index + len(_VALUE_CLOSE), self._between)

    def _between(self, deltas: list[ToolCallDelta]) -> bool:
        index = self._find(_KEY_OPEN)
        if index < 0:
            # Text between the pairs (newlines) is not part of any.
            self._buffer = self._buffer[self._searched :]
            self._searched = 0
            return False
        return self._move(index + len(_KEY_OPEN), self._key)

    def _ended(self, deltas: list[ToolCallDelta]) -> bool:
        self._buffer = ""
        return False

    def _find(self, marker: str) -> int:
        """Where `marker` starts in `_buffer` (-1: not yet; the search resumes from where the
        marker may still start, so a long value is not searched again and again)."""
        index = self._buffer.find(marker, self._searched)
        if index < 0:
            self._searched = max(self._searched, len(self._buffer) - len(marker) + 1)
        return index

    def _move(self, consumed: int, state: _State) -> bool:
        self._buffer = self._buffer[consumed:]
        self._searched = 0
        self._state = state
        return True

    def _send(self, deltas: list[ToolCallDelta], text: str) -> list[ToolCallDelta]:
        if text:
            deltas.append(ToolCallDelta(0, text))
        return deltas

    def _whole(self) -> list[ToolCallDelta]:
        """A section without `<arg_key>`: mlx-lm's fallbacks, on the whole text."""
        text, self._buffer = self._buffer, ""
        self._state = self._ended
        call = _json_call(text, self.tools) or _plain_call(text, self.tools)
        if call is None:
            return []
        name, arguments = call
        self.calls = 1
        return [ToolCallDelta(0, "", name=name), ToolCallDelta(0, arguments)]


def _normalize(name: str, arguments: dict[str, Json], tools: Tools) -> dict[str, Json]:
    """mlx-lm's `_normalize_arguments`: a string parameter's value becomes text, another
    parameter's text value is deserialized."""
    normalized: dict[str, Json] = {}
    for key, value in arguments.items():
        if _is_string(tools, name, key):
            normalized[key] = python_str(value)
        elif isinstance(value, str):
            normalized[key] = deserialize(value)
        else:
            normalized[key] = value
    return normalized


def _json_call(text: str, tools: Tools) -> tuple[str, str] | None:
    """mlx-lm's `_parse_json_tool_call`: `{"name": ..., "arguments": ...}` and its variants."""
    try:
        parsed = load_json(text.strip())
    except (ValueError, RecursionError):
        return None
    if isinstance(parsed, list) and parsed and isinstance(parsed[0], dict):
        parsed = parsed[0]
    if not isinstance(parsed, dict):
        return None
    name: Json = None
    arguments: Json = None
    if "name" in parsed and "arguments" in parsed:
        name, arguments = parsed["name"], parsed["arguments"]
    elif "function" in parsed and "arguments" in parsed:
        name, arguments = parsed["function"], parsed["arguments"]
    elif isinstance(tool := parsed.get("tool"), dict):
        name, arguments = tool.get("name"), tool.get("arguments")
    if isinstance(name, dict):
        arguments = arguments or name.get("arguments")
        name = name.get("name")
    if isinstance(arguments, str):
        arguments = deserialize(arguments)
    if not isinstance(name, str):
        return None
    if arguments is None:
        return name, "{}"
    if isinstance(arguments, dict):
        return name, to_json(_normalize(name, arguments, tools))
    return None


def _plain_call(text: str, tools: Tools) -> tuple[str, str] | None:
    """mlx-lm's `_parse_plain_text_tool_call`: `name\\n{json}`, `name {json}`,
    `name a=1 b=2`, or `name anything` (as {"raw": "anything"})."""
    stripped = text.strip()
    if not stripped:
        # mlx-lm names this call "unknown"; a section with nothing in it is no call.
        return None
    if "\n" in stripped:
        first_line, rest = stripped.split("\n", 1)
        name, rest = first_line.strip(), rest.strip()
        if name and rest:
            arguments = deserialize(rest)
            if isinstance(arguments, dict):
                return name, to_json(_normalize(name, arguments, tools))
    name, _, rest = stripped.partition(" ")
    rest = rest.strip()
    if not rest:
        return name, "{}"
    arguments = deserialize(rest)
    if isinstance(arguments, dict):
        return name, to_json(_normalize(name, arguments, tools))
    pairs = _key_values(rest, name, tools)
    if pairs is not None:
        return name, to_json(pairs)
    return name, to_json({"raw": rest})


def _key_values(text: str, name: str, tools: Tools) -> dict[str, Json] | None:
    """mlx-lm's `_parse_key_value_pairs`: shell-like `a=1 b="two words"`."""
    if "=" not in text:
        return None
    try:
        tokens = shlex.split(text)
    except ValueError:
        return None
    if not tokens:
        return None
    arguments: dict[str, Json] = {}
    for token in tokens:
        if "=" not in token:
            return None
        key, value = token.split("=", 1)
        key = key.strip()
        if not key:
            return None
        arguments[key] = value if _is_string(tools, name, key) else deserialize(value)
    return arguments


FORMAT = CallFormat(
    parser="glm47",
    start="<tool_call>",
    end="</tool_call>",
    new_parser=Glm47Parser,
    streamed=True,
)

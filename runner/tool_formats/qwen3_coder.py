"""Qwen3-Coder's tool calls, as mlx-lm's `qwen3_coder` parser reads them, streamed.

A section (between `<tool_call>` and `</tool_call>`) holds a function in XML of its own:

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

The name is sent when it ends (at whitespace, `<` or `>`, as mlx-lm's `\\s*([^\\s<>]+)>?`
reads it), each parameter's key when its name ends. A value runs to the first `</parameter>`
(a `</function>` inside it is part of it, as in mlx-lm), less one newline at each end. A
value the request's tools type as a string (or does not declare) is streamed; any other is
converted whole at its end, by mlx-lm's rules but keeping numbers as written. Text outside
the elements is ignored. Where mlx-lm would merge a second `<function=...>` of the section
into the first, it is a call of its own here.
"""

from __future__ import annotations

from typing import Any

from runner.tool_formats.base import CallFormat, json_string
from runner.tool_formats.values import json_text, number_text, python_literal_text
from runner.tool_formats.xml_params import State, Trim, ValueReader, XmlSectionParser

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_TYPES = ("num", "float")
_BOOL_TYPES = {"boolean", "bool", "binary"}
_OBJECT_TYPES = {"object", "array", "arr"}

# mlx-lm's `regex` `\s` is Unicode's White_Space: str.isspace() less these separators.
_NOT_SPACE = frozenset("\x1c\x1d\x1e\x1f")


def _is_space(char: str) -> bool:
    return char.isspace() and char not in _NOT_SPACE


def _read_name(text: str) -> tuple[str, int] | None:
    """A name at the start of `text` as mlx-lm's `\\s*([^\\s<>]+)>?` reads it: the name ("" when
    there is none) and the length read; None until the character after it has come."""
    start = 0
    while start < len(text) and _is_space(text[start]):
        start += 1
    end = start
    while end < len(text) and not _is_space(text[end]) and text[end] not in "<>":
        end += 1
    if end == len(text):
        return None
    return text[start:end], end + 1 if text[end] == ">" else end


def is_string_type(schema: dict[str, Any] | None) -> bool:
    """mlx-lm takes the value as written (a string): the parameter is undeclared, has an empty
    schema, or a string type."""
    if not schema:
        return True
    return "type" in schema and str(schema["type"]).strip().lower() in _STRING_TYPES


def convert(value: str, schema: dict[str, Any]) -> str:
    """A whole value (its newlines stripped) as JSON text, by mlx-lm's
    `_convert_param_value`, except that numbers keep their digits and a value mlx-lm cannot
    convert (it fails the whole call) stays a string."""
    if value.lower() == "null":
        return "null"
    if "type" not in schema:
        # An object or an array when it is one in JSON, else the text.
        parsed = json_text(value)
        return parsed if parsed is not None and parsed[0] in "{[" else json_string(value)
    kind = str(schema["type"]).strip().lower()
    if kind in _STRING_TYPES:
        return json_string(value)
    if kind.startswith(_INTEGER_TYPES) or kind.startswith(_NUMBER_TYPES):
        return number_text(value) or json_string(value)
    if kind in _BOOL_TYPES:
        return "true" if value.lower() == "true" else "false"
    if kind in _OBJECT_TYPES or kind.startswith(("dict", "list")):
        parsed_text = json_text(value, strict=False)
        if parsed_text is not None:
            return parsed_text
    return python_literal_text(value) or json_string(value)


class Qwen3CoderParser(XmlSectionParser):
    """One `<tool_call>` section of Qwen3-Coder's (see the module docstring)."""

    def _reader(self, schema: dict[str, Any] | None) -> ValueReader:
        if is_string_type(schema):
            return ValueReader((PARAMETER_END,), trim=Trim.NEWLINE)
        assert schema is not None
        return ValueReader(
            (PARAMETER_END,), trim=Trim.NEWLINE, convert=lambda value: convert(value, schema)
        )

    def _step(self) -> bool:
        state = self._state
        if state is State.SEEK:
            if self._skip_to((FUNCTION,)) is None:
                return False
            self._state = State.NAME
        elif state is State.NAME or state is State.KEY:
            read = _read_name(self._buffer)
            if read is None:
                return False
            name, length = read
            self._buffer = self._buffer[length:]
            if state is State.NAME:
                # A function without a name fails mlx-lm's parse: it is no call.
                if name:
                    self._open_call(name)
                self._state = State.BODY if name else State.SEEK
            elif name:
                self._open_value(name)
                self._state = State.VALUE
            else:
                self._state = State.SKIP
        elif state is State.BODY:
            marker = self._skip_to((PARAMETER, FUNCTION_END))
            if marker is None:
                return False
            if marker == FUNCTION_END:
                self._close_call()
                self._state = State.SEEK
            else:
                self._state = State.KEY
        elif state is State.VALUE:
            if self._read_value() is None:
                return False
            self._state = State.BODY
        else:
            assert state is State.SKIP
            if self._skip_to((PARAMETER_END,)) is None:
                return False
            self._state = State.BODY
        return True


FORMAT = CallFormat(
    parser="qwen3_coder",
    start="<tool_call>",
    end="</tool_call>",
    new_parser=Qwen3CoderParser,
    streamed=True,
)

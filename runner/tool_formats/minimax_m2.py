"""MiniMax-M2's tool calls, as mlx-lm's `minimax_m2` parser reads them, streamed.

A section (between `<minimax:tool_call>` and `</minimax:tool_call>`) holds one or more
invocations, each a call:

    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>

A name (of the function or of a parameter) runs to the first `>`, stripped and unquoted as
mlx-lm's `_extract_name` does; it is sent then. A value runs to the first `</parameter>` or
`</invoke>` (mlx-lm ends the invocation at the first `</invoke>`, wherever it is), stripped of
whitespace. A value whose schema types are only string ones (or that is undeclared) is
streamed; any other is converted whole at its end, by mlx-lm's
`_convert_param_value_with_types`, keeping numbers as written. Text between the elements is
ignored.
"""

from __future__ import annotations

from typing import Any

from runner.tool_formats.base import CallFormat, json_string
from runner.tool_formats.values import integer_text, json_text, number_text, python_literal_text
from runner.tool_formats.xml_params import State, Trim, ValueReader, XmlSectionParser

INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAMETER = "<parameter name="
PARAMETER_END = "</parameter>"
VALUE_ENDS = (PARAMETER_END, INVOKE_END)

_TYPE_PRIORITY = (
    "integer",
    "int",
    "number",
    "float",
    "boolean",
    "bool",
    "object",
    "array",
    "string",
    "str",
    "text",
)
_STRING_TYPES = {"string", "str", "text"}
_VALUE_TYPES = set(_TYPE_PRIORITY) - _STRING_TYPES
_NULL_WORDS = ("null", "none", "nil")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def extract_name(text: str) -> str:
    """mlx-lm's `_extract_name`: stripped, one pair of matching quotes removed."""
    text = text.strip()
    if (text.startswith('"') and text.endswith('"')) or (
        text.startswith("'") and text.endswith("'")
    ):
        return text[1:-1]
    return text


def _enum_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def schema_types(schema: Any) -> set[str]:
    """mlx-lm's `_extract_types_from_schema`, lower-cased: `type`, the types of `enum`'s
    values, and those of `anyOf` / `oneOf` / `allOf`; {"string"} when none is found."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(item for item in kind if isinstance(item, str))
    values = schema.get("enum")
    if isinstance(values, list):
        types.update(
            _enum_type(value)
            for value in values
            if value is None or isinstance(value, bool | int | float | str | list | dict)
        )
    for choice_field in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(choice_field)
        if isinstance(choices, list):
            for choice in choices:
                types.update(schema_types(choice))
    return {kind.lower() for kind in types} or {"string"}


def null_words(types: set[str]) -> tuple[str, ...]:
    """The values (any case) that mlx-lm reads as null for a parameter of `types`."""
    return _NULL_WORDS if "null" in types else _NULL_WORDS[:1]


def convert(value: str, types: set[str]) -> str:
    """A whole value (stripped) as JSON text, by mlx-lm's `_convert_param_value_with_types`
    (each type in its order of preference, then JSON, then the string), except that numbers
    keep their digits and NaN or an infinity is no number."""
    if value.lower() in null_words(types):
        return "null"
    for kind in _TYPE_PRIORITY:
        if kind not in types:
            continue
        if kind in _STRING_TYPES:
            return json_string(value)
        found: str | None = None
        if kind in ("integer", "int"):
            found = integer_text(value)
        elif kind in ("number", "float"):
            found = number_text(value)
        elif kind in ("boolean", "bool"):
            folded = value.lower().strip()
            found = "true" if folded in _TRUE else "false" if folded in _FALSE else None
        else:
            found = json_text(value, strict=False) or python_literal_text(value)
        if found is not None:
            return found
    return json_text(value) or json_string(value)


class MiniMaxM2Parser(XmlSectionParser):
    """One `<minimax:tool_call>` section of MiniMax-M2's (see the module docstring)."""

    def _reader(self, schema: dict[str, Any] | None) -> ValueReader:
        types = schema_types(schema) if schema is not None else {"string"}
        words = null_words(types)
        if not types & _VALUE_TYPES and types & _STRING_TYPES:
            return ValueReader(VALUE_ENDS, trim=Trim.WHITESPACE, null_words=words)
        return ValueReader(
            VALUE_ENDS,
            trim=Trim.WHITESPACE,
            null_words=words,
            convert=lambda value: convert(value, types),
        )

    def _read_to_tag_end(self) -> str | None:
        """The text up to the first `>` (consumed), None until it comes."""
        index = self._buffer.find(">")
        if index < 0:
            return None
        text = self._buffer[:index]
        self._buffer = self._buffer[index + 1 :]
        return text

    def _step(self) -> bool:
        state = self._state
        if state is State.SEEK:
            if self._skip_to((INVOKE,)) is None:
                return False
            self._state = State.NAME
        elif state is State.NAME:
            text = self._read_to_tag_end()
            if text is None:
                return False
            ended = text.endswith(INVOKE_END[:-1])
            if ended:
                # `<invoke name=x</invoke>`: a call without parameters.
                text = text[: -len(INVOKE_END) + 1]
            if text:
                self._open_call(extract_name(text))
            if ended or not text:
                self._close_call()
                self._state = State.SEEK if ended else State.SKIP_CALL
            else:
                self._state = State.BODY
        elif state is State.SKIP_CALL:
            if self._skip_to((INVOKE_END,)) is None:
                return False
            self._state = State.SEEK
        elif state is State.BODY or state is State.SKIP:
            markers = (PARAMETER, INVOKE_END) if state is State.BODY else VALUE_ENDS
            marker = self._skip_to(markers)
            if marker is None:
                return False
            self._end_of(marker, then=State.KEY if state is State.BODY else State.BODY)
        elif state is State.KEY:
            text = self._read_to_tag_end()
            if text is None:
                return False
            if text.endswith(INVOKE_END[:-1]):
                # The invocation ended in the parameter's name: mlx-lm drops the parameter.
                self._end_of(INVOKE_END, then=State.BODY)
            elif text.endswith(PARAMETER_END[:-1]):
                self._state = State.BODY
            elif text:
                self._open_value(extract_name(text))
                self._state = State.VALUE
            else:
                self._state = State.SKIP
        else:
            assert state is State.VALUE
            marker = self._read_value()
            if marker is None:
                return False
            self._end_of(marker, then=State.BODY)
        return True

    def _end_of(self, marker: str, *, then: State) -> None:
        """After `marker`: the invocation's end closes the call, anything else goes on."""
        if marker == INVOKE_END:
            self._close_call()
            self._state = State.SEEK
        else:
            self._state = then


FORMAT = CallFormat(
    parser="minimax_m2",
    start="<minimax:tool_call>",
    end="</minimax:tool_call>",
    new_parser=MiniMaxM2Parser,
    streamed=True,
)

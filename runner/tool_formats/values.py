"""A value the model wrote as text, read as JSON with its numbers kept as written.

The families write argument values in their own ways (JSON, Python literals, bare words); these
readers turn such text into JSON text without sending a number through a float:

- `load_json` / `to_json`: JSON parsed with its numbers as `Number`s, and written back;
- `deserialize`: mlx-lm's `_deserialize` (JSON, else a Python literal, else the text), every
  number as written (glm47, kimi_k2);
- `json_text`, `python_literal_text`, `number_text`, `integer_text`: one value's text as JSON
  text, or None, as the XML-parameter families convert a typed value (qwen3_coder, minimax_m2);
- `bare_literal`, `is_bare_literal`: a bare word or number as JSON (mistral, gemma4).
"""

from __future__ import annotations

import ast
import json
import math
from decimal import Decimal, InvalidOperation
from typing import TypeAlias

import attrs

from runner.tool_formats.base import json_number, json_string, literal_json


@attrs.frozen
class Number:
    """A number as the model wrote it (JSON's spelling), never through a float."""

    text: str

    def __bool__(self) -> bool:
        # mlx-lm tests a parsed value's truth (`arguments or ...`): a float's truth.
        return float(self.text) != 0


Json: TypeAlias = "dict[str, Json] | list[Json] | str | bool | int | Number | None"
"""A parsed value whose numbers are `Number`s (integers too, unless read as Python ints)."""


def _no_constant(name: str) -> Json:
    # NaN and Infinity are no JSON: such text is not a JSON value here.
    raise ValueError(name)


def load_json(text: str, *, strict: bool = True, integers: bool = True) -> Json:
    """`json.loads(text)` with its numbers as `Number`s (`integers` False: integers stay
    Python ints, as `json.loads` reads them); raises ValueError when it is not JSON (NaN and
    Infinity included)."""
    parsed: Json = json.loads(
        text,
        strict=strict,
        parse_int=Number if integers else None,
        parse_float=Number,
        parse_constant=_no_constant,
    )
    return parsed


def to_json(value: Json) -> str:
    """`value` as JSON text, its numbers as written (json.dumps' spacing)."""
    if isinstance(value, Number):
        return value.text
    if isinstance(value, dict):
        members = (f"{json_string(key)}: {to_json(item)}" for key, item in value.items())
        return "{" + ", ".join(members) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(item) for item in value) + "]"
    return literal_json(value)


def deserialize(text: str) -> Json:
    """mlx-lm's `_deserialize`: JSON, else a Python literal, else the text itself; numbers
    as written. NaN, Infinity and values JSON cannot hold (sets, bytes, complex numbers)
    stay text."""
    try:
        return load_json(text)
    except (ValueError, RecursionError):
        pass
    try:
        source = text.lstrip(" \t")  # as ast.literal_eval does
        return _literal(ast.parse(source, mode="eval").body, source)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotLiteral):
        return text


class _NotLiteral(Exception):
    """Not a Python literal that JSON can hold."""


def _literal(node: ast.expr, source: str) -> Json:
    """`ast.literal_eval`'s reading of `node`, numbers as written."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int | float):
            return _number(node, source)
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = node.operand
        if not isinstance(operand, ast.Constant) or type(operand.value) not in (int, float):
            raise _NotLiteral
        number = _number(operand, source)
        return Number("-" + number.text) if isinstance(node.op, ast.USub) else number
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        result: dict[str, Json] = {}
        for key_node, value_node in zip(node.keys, node.values, strict=True):
            if key_node is None:  # `**mapping`
                raise _NotLiteral
            result[_key(_literal(key_node, source))] = _literal(value_node, source)
        return result
    raise _NotLiteral


def _key(key: Json) -> str:
    """A Python dict key as `json.dumps` writes it (mlx-lm's server sends the arguments
    through it): a number's text, `true`, `null`."""
    if isinstance(key, str):
        return key
    if isinstance(key, Number):
        return key.text
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    raise _NotLiteral


def _number(node: ast.Constant, source: str) -> Number:
    """A Python number literal as JSON: as written where that is JSON (`1.50`), else its
    value (`0x10`, `1_000`, `.5`)."""
    written = json_number(ast.get_source_segment(source, node) or "")
    if written is not None:
        return Number(written)
    value = node.value
    if isinstance(value, float) and not math.isfinite(value):
        raise _NotLiteral
    return Number(repr(value))


def python_str(value: Json) -> str:
    """`str(value)` of the Python value, numbers as written (mlx-lm turns a non-string value
    of a string parameter into its `str`)."""
    if isinstance(value, str):
        return value
    return _python_repr(value)


def _python_repr(value: Json) -> str:
    if isinstance(value, Number):
        return value.text
    if isinstance(value, dict):
        members = (f"{key!r}: {_python_repr(item)}" for key, item in value.items())
        return "{" + ", ".join(members) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_repr(item) for item in value) + "]"
    return repr(value)


def json_text(text: str, *, strict: bool = True) -> str | None:
    """`text` as JSON text when it is JSON (numbers as written; integers as `json.loads`
    reads them), else None."""
    try:
        return to_json(load_json(text, strict=strict, integers=False))
    except (ValueError, RecursionError):
        return None


def python_literal_text(text: str) -> str | None:
    """`ast.literal_eval(text)` as JSON text, None when it is no literal or none JSON can
    hold (a set, bytes, a complex, an infinite float). Unlike `deserialize`, only a bare
    number keeps its text: the numbers in a container are `json.dumps`' (mlx-lm's reading)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        written = json_number(text)
        if written is not None:
            return written
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def number_text(text: str) -> str | None:
    """`text` as a JSON number when `float()` reads it as a finite one: as written when it is
    JSON's syntax, else exactly (`+5`, `.5`, `1_000`) through Decimal, never through a float."""
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    written = json_number(text)
    if written is not None:
        return written
    try:
        exact = str(Decimal(text))
    except InvalidOperation:
        return literal_json(value)
    return exact if json_number(exact) is not None else literal_json(value)


def integer_text(text: str) -> str | None:
    """`text` as a JSON integer when `int()` reads it, as written where it can be."""
    try:
        value = int(text)
    except ValueError:
        return None
    written = json_number(text)
    if written is not None and not any(char in written for char in ".eE"):
        return written
    return str(value)


_BARE_WORDS = {"true": "true", "false": "false", "null": "null"}
_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}


def bare_literal(text: str) -> str:
    """A bare value as JSON: a JSON number as written, `true`/`false`/`null` (Python's
    spellings too), else the text as a string."""
    if json_number(text) == text:
        return text
    return _BARE_WORDS.get(text) or _PYTHON_WORDS.get(text) or json_string(text)


def is_bare_literal(text: str, *, python: bool) -> bool:
    """`text` is a JSON number or `true`/`false`/`null` (with `python`, Python's spellings
    too): a bare value that is complete as it stands."""
    return json_number(text) == text or text in _BARE_WORDS or (python and text in _PYTHON_WORDS)

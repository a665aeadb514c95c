"""What the tests of the tool-call formats share.

- Running a parser: `split` a section into pieces, feed them (`batches`, `stream`) and read
  the calls back (`calls`, checking OpenAI's delta order on the way; `read`, also the parser's
  count); the contract's properties for any text: `assert_split_anywhere`, `read_cut_off`.
- Values as a model writes them: `Num` (a number as written), `dump` (JSON as `tojson` or
  `json.dumps` writes it, numbers as written), `exact` / `written` (arguments and expected
  values compared number for number), `decimals` (mlx-lm's parse, floats as Decimals).
- Generated values: `tricky_texts`, `numbers`, `LONG`; for the XML-parameter formats
  (Qwen3-Coder, MiniMax-M2) `big_integers`, `json_values`, `decimal_texts`, `Param` and
  `ParamCall`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import SectionParser, Tools, json_number

NewParser = Callable[[Tools], SectionParser]
"""A format's parser class (or `CallFormat.new_parser`)."""

# --- running a parser and reading its calls ------------------------------------------------


def split(text: str, cuts: Iterable[int]) -> list[str]:
    """`text` cut at `cuts` (any order, repeats and the ends allowed: pieces may be empty)."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def batches(parser: SectionParser, pieces: Iterable[str]) -> list[list[ToolCallDelta]]:
    """`pieces` fed to `parser`, then its end: the deltas of each feed, then of `end()`."""
    fed = [parser.feed(piece) for piece in pieces]
    return [*fed, parser.end()]


def stream(parser: SectionParser, pieces: Iterable[str]) -> list[ToolCallDelta]:
    """Every delta of `batches`, in order."""
    return [delta for batch in batches(parser, pieces) for delta in batch]


def calls(deltas: Iterable[ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, joined arguments) per call, checking OpenAI's delta order on the way: no ids,
    calls numbered from 0 one after the other, a call's first delta its name with no
    arguments, its later ones arguments only (never empty)."""
    result: list[tuple[str, str]] = []
    for delta in deltas:
        assert delta.id is None
        if delta.name is not None:
            assert (delta.index, delta.arguments) == (len(result), "")
            result.append((delta.name, ""))
        else:
            assert result
            assert delta.index == len(result) - 1
            assert delta.arguments
            name, arguments = result[-1]
            result[-1] = (name, arguments + delta.arguments)
    return result


def read(parser: SectionParser, pieces: Iterable[str]) -> list[tuple[str, str]]:
    """The `calls` of `parser` fed `pieces` and ended, checking that its `calls` counts them."""
    found = calls(stream(parser, pieces))
    assert parser.calls == len(found)
    return found


def assert_split_anywhere(
    new_parser: NewParser, text: str, expected: list[tuple[str, str]], tools: Tools = ()
) -> None:
    """`text` fed whole, a character at a time and in two pieces cut anywhere: the
    `expected` calls each time, counted by the parser."""
    assert read(new_parser(tools), [text]) == expected
    assert read(new_parser(tools), list(text)) == expected
    for at in range(len(text) + 1):
        assert read(new_parser(tools), [text[:at], text[at:]]) == expected, at


def read_cut_off(
    new_parser: NewParser, pieces: list[str], tools: Tools = ()
) -> list[tuple[str, str]]:
    """The calls of a section that may be cut off anywhere, fed as `pieces`, checked: each
    one's arguments are a JSON object, the parser counts them, and fed whole the text gives
    the same calls."""
    found = read(new_parser(tools), pieces)
    for _, arguments in found:
        assert isinstance(json.loads(arguments), dict), arguments
    assert read(new_parser(tools), ["".join(pieces)]) == found
    return found


def tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    """A request's tool `name` whose parameters are an object of `properties`."""
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


# --- values as a model writes them ---------------------------------------------------------


@dataclass(frozen=True)
class Num:
    """A number as the model writes it (rendered verbatim)."""

    text: str


def dump(
    value: Any, separators: tuple[str, str] = (", ", ": "), *, ensure_ascii: bool = False
) -> str:
    """JSON as `tojson` or `json.dumps(value, separators=..., ensure_ascii=...)` writes it,
    with `Num`s as written."""
    comma, colon = separators

    def write(value: Any) -> str:
        if isinstance(value, Num):
            return value.text
        if isinstance(value, dict):
            members = (
                json.dumps(key, ensure_ascii=ensure_ascii) + colon + write(item)
                for key, item in value.items()
            )
            return "{" + comma.join(members) + "}"
        if isinstance(value, list):
            return "[" + comma.join(write(item) for item in value) + "]"
        return json.dumps(value, ensure_ascii=ensure_ascii)

    return write(value)


def exact(text: str) -> Any:
    """JSON text parsed with every number kept as the text it was written as."""
    return json.loads(text, parse_int=lambda s: ("n", s), parse_float=lambda s: ("n", s))


def written(value: Any) -> Any:
    """What `exact` reads back from a value written with its `Num`s as written."""
    if isinstance(value, Num):
        return ("n", value.text)
    if isinstance(value, dict):
        return {key: written(item) for key, item in value.items()}
    if isinstance(value, list):
        return [written(item) for item in value]
    return value


def decimals(value: Any) -> Any:
    """A parsed value with its floats as Decimals, to compare numbers digit for digit."""
    return json.loads(json.dumps(value), parse_float=Decimal)


# --- generated values ----------------------------------------------------------------------


def tricky_texts(tricky: Sequence[str], *, size: int, count: int) -> st.SearchStrategy[str]:
    """Texts of up to `count` pieces, each some text (up to `size` characters) or one of
    `tricky` (markers, quotes, escapes a format must get right)."""
    piece = st.one_of(st.text(max_size=size), st.sampled_from(tricky))
    return st.lists(piece, max_size=count).map("".join)


numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.decimals(allow_nan=False, allow_infinity=False)
    .map(str)
    .filter(lambda s: json_number(s) == s),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
).map(Num)
"""Numbers as a model writes them: integers past a float's, decimals, floats' reprs."""
LONG = st.text("abcdefghijklmnopqrstuvwxyz", min_size=40, max_size=60)
"""A string long enough to be split inside."""

big_integers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**64 + 1, -(2**64) - 1, 2**53 + 1, 18446744073709551617]),
)


def json_values(texts: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """JSON values (parsed), their strings `texts`."""
    return st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            big_integers,
            st.floats(allow_nan=False, allow_infinity=False),
            texts,
        ),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    )


@st.composite
def decimal_texts(draw: st.DrawFn) -> str:
    """A decimal as a model writes one, with more digits than a float holds."""
    whole = draw(st.integers(0, 10**25))
    digits = draw(st.text("0123456789", min_size=1, max_size=25))
    sign = draw(st.sampled_from(["", "-"]))
    exponent = draw(st.sampled_from(["", "", "e3", "E-2"]))
    return f"{sign}{whole}.{digits}{exponent}"


@dataclass
class Param:
    """A generated parameter of an XML-parameter format's call."""

    key: str
    schema: dict[str, Any] | None
    """None: the tool does not declare it."""
    written: str
    """The value as the template writes it."""
    number: int | Decimal | None = None
    """The exact number it must be, where mlx-lm goes through a float."""


@dataclass
class ParamCall:
    """A generated call of an XML-parameter format (its `text` is the format's)."""

    name: str
    params: list[Param]

    def tool(self) -> dict[str, Any]:
        return tool(self.name, {p.key: p.schema for p in self.params if p.schema is not None})

    def expected(self, parsed: dict[str, Any]) -> dict[str, Any]:
        """mlx-lm's arguments (`parsed`: its call), with the exact numbers where mlx-lm
        rounds them."""
        assert parsed["name"] == self.name
        arguments: dict[str, Any] = decimals(parsed["arguments"])
        for param in self.params:
            if param.number is not None:
                arguments[param.key] = param.number
        return arguments

"""Pythonic tool calls (LFM2 and mlx-lm's `pythonic` parser), streamed as they are written.

Between `<|tool_call_start|>` and `<|tool_call_end|>` the model writes a Python list of calls,
`[get_weather(city="Paris"), other(x=1, opts={"deep": true})]`, each argument a keyword whose
value is a Python literal (containers may hold JSON's `true`/`false`/`null`: chat templates
render them with `tojson`).

A call's name is sent at its `(`. A string argument streams a character at a time once its
quote is known (escapes decoded as Python does, implicit concatenation `"a" "b"` followed);
any other value (numbers, names, lists, dicts, tuples) is parsed whole when it ends, at the
`,` or `)` after it, since only then is it known what it is (`(1)` is a number, `(1,)` a
list). Numbers that are JSON numbers keep their text; others (`0x1F`, `1_000`, `.5`) are
converted exactly; a value that is not a literal JSON can hold becomes its text as a string.

LFM2's chat template writes a string argument between double quotes without escaping it, so
a model may write `command="echo "hi""`: a quote followed by text that cannot follow a string
(not `,`, `)` or another string) is read as part of the string, which valid Python never has.

A call cut off anywhere closes into JSON that parses: an open string is closed, a container is
closed after its last complete element, a partial literal is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
import unicodedata
import warnings

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    HEX_DIGITS,
    CallFormat,
    ObjectWriter,
    SectionParser,
    Tools,
    json_number,
    json_string,
    literal_json,
    string_fragment,
)

_NAME = re.compile(r"[\w.-]+")
_KEYWORD = re.compile(r"([^\W\d]\w*)\s*(=?)")
_QUOTES = "'\""
_PREFIXES = "rRuU"
_SIMPLE_ESCAPES = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\n": "",
}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_OCTAL = frozenset("01234567")
_JSON_NAMES = {"true": True, "false": False, "null": None}

# What the parser expects next.
_OPEN = "open"
_CALL = "call"
_ARGUMENT = "argument"
_VALUE = "value"
_QUOTE = "quote"
_STRING = "string"
_AFTER_STRING = "after string"
_WHOLE = "whole"
_AFTER_VALUE = "after value"
_AFTER_CALL = "after call"
_DONE = "done"


def _fragment(text: str) -> str:
    """`string_fragment`, with lone surrogates (`"\\ud83d"` in Python) as escapes."""
    fragment = string_fragment(text)
    if not any("\ud800" <= char <= "\udfff" for char in fragment):
        return fragment
    return "".join(
        f"\\u{ord(char):04x}" if "\ud800" <= char <= "\udfff" else char for char in fragment
    )


def _escape(text: str, at: int) -> tuple[str, int] | None:
    """The escape sequence whose backslash is at `text[at]`: what it stands for and its
    length; None while it may not be complete. An escape Python does not know stands for
    itself (Python keeps it, with a warning)."""
    if at + 1 >= len(text):
        return None
    char = text[at + 1]
    if char in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[char], 2
    if char == "\r":  # a line continuation, \r\n or \r
        if at + 2 >= len(text):
            return None
        return "", 3 if text[at + 2] == "\n" else 2
    if char in _OCTAL:
        end = at + 2
        while end < min(len(text), at + 4) and text[end] in _OCTAL:
            end += 1
        if end < at + 4 and end == len(text):
            return None
        return chr(int(text[at + 1 : end], 8)), end - at
    if char in _HEX_ESCAPES:
        size = _HEX_ESCAPES[char]
        digits = text[at + 2 : at + 2 + size]
        if not all(digit in HEX_DIGITS for digit in digits):
            return "\\" + char, 2
        if len(digits) < size:
            return None
        code = int(digits, 16)
        return (chr(code), 2 + size) if code <= 0x10FFFF else ("\\" + char, 2)
    if char == "N":
        if at + 2 >= len(text):
            return None
        end = text.find("}", at + 2)
        if text[at + 2] != "{" or (end < 0 and len(text) - at > 100):
            return "\\N", 2
        if end < 0:
            return None
        try:
            return unicodedata.lookup(text[at + 3 : end]), end + 1 - at
        except KeyError:
            return "\\N", 2
    return "\\" + char, 2


class _Scanner:
    """Finds where a value written as a Python literal ends: at a `,` or `)` outside
    brackets and strings. Keeps the value's text, and where it could be closed if it were
    cut off."""

    def __init__(self) -> None:
        self.text = ""
        self._closers: list[str] = []
        self._key: list[bool] = []
        """Per open bracket: a dict's key comes next."""
        self._quote = ""
        self._opening = 0
        """Quote characters read where a string opens (one, two: `''`, or three)."""
        self._run = 0
        """Quote characters in a row inside a triple-quoted string."""
        self._escaped = False
        self._cut: tuple[int, str] | None = None
        """The latest place the text can be cut and closed, with what closes it."""
        self._cut_outside_strings: tuple[int, str] | None = None
        """The same, outside strings (a cut inside one may split an escape: `"\\x4`)."""

    def feed(self, text: str) -> int | None:
        """Read more of the value; return where in `text` it ended, or None."""
        start = len(self.text)
        for i, char in enumerate(text):
            if self._char(char, start + i):
                self.text += text[:i]
                return i
        self.text += text
        return None

    def repaired(self) -> str | None:
        """The value cut off here, closed, as JSON (None if nothing of it can be)."""
        cuts = [cut for cut in (self._cut, self._cut_outside_strings) if cut is not None]
        for candidate in [self.text] + [self.text[:at] + closers for at, closers in cuts]:
            converted = _convert(candidate)
            if converted is not None:
                return converted
        return None

    def _char(self, char: str, position: int) -> bool:
        """The character at `position`; True if it ends the value (it is not part of it)."""
        if self._opening:
            if char == self._quote and self._opening < 3:
                self._opening += 1
                if self._opening == 3:
                    self._quote *= 3
                    self._opening = 0
                    self._cut_inside(position + 1)
                return False
            opened, self._opening = self._opening, 0
            if opened == 2:
                self._quote = ""  # an empty string: this character is outside it
            else:
                self._cut_inside(position)
        if self._quote:
            self._string_char(char, position)
            return False
        return self._outside(char, position)

    def _string_char(self, char: str, position: int) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
            self._run = 0
            return
        elif char == self._quote[0]:
            if len(self._quote) == 1:
                self._quote = ""
                self._cut_outside(position + 1)
                return
            self._run += 1
            if self._run == 3:
                self._quote, self._run = "", 0
                self._cut_outside(position + 1)
            return
        self._run = 0
        self._cut_inside(position + 1)

    def _outside(self, char: str, position: int) -> bool:
        if char in _QUOTES:
            self._quote, self._opening = char, 1
        elif char in "([{":
            self._closers.append({"(": ")", "[": "]", "{": "}"}[char])
            self._key.append(char == "{")
            self._cut_outside(position + 1, fresh=True)
        elif char in ")]}":
            if not self._closers:
                return True
            if char == self._closers[-1]:
                self._closers.pop()
                self._key.pop()
                self._cut_outside(position + 1)
        elif char == ",":
            if not self._closers:
                return True
            self._cut_outside(position)
            self._key[-1] = self._closers[-1] == "}"
        elif char == ":" and self._closers:
            self._key[-1] = False
        return False

    def _closing(self, *, fresh: bool = False) -> str:
        """What closes the open brackets (a tuple with an element keeps its comma)."""
        return "".join(
            ",)" if closer == ")" and not (fresh and depth == 0) else closer
            for depth, closer in enumerate(reversed(self._closers))
        )

    def _cut_outside(self, position: int, *, fresh: bool = False) -> None:
        if self._closers:
            self._cut = self._cut_outside_strings = (position, self._closing(fresh=fresh))

    def _cut_inside(self, position: int) -> None:
        """A cut inside a string: only where the string is an item or a dict's value."""
        if self._closers and not self._key[-1] and not self._escaped:
            self._cut = (position, self._quote + self._closing())


def _convert(source: str) -> str | None:
    """A Python literal's text as JSON (None if it is not one JSON can hold)."""
    source = source.strip()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown escape in a string is a warning
            node = ast.parse(source, mode="eval").body
        return _json(node, source)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


def _json(node: ast.expr, source: str) -> str:
    if isinstance(node, (ast.List, ast.Tuple)):
        return "[" + ", ".join(_json(item, source) for item in node.elts) + "]"
    if isinstance(node, ast.Dict):
        members = []
        for key, item in zip(node.keys, node.values, strict=True):
            if key is None:
                raise ValueError("** in a dict")
            members.append(_key(_value(key)) + ": " + _json(item, source))
        return "{" + ", ".join(members) + "}"
    value = _value(node)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        written = ast.get_source_segment(source, node)
        if written is not None and json_number(written) == written:
            return written
    if isinstance(value, str):
        return '"' + _fragment(value) + '"'
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("infinity or NaN, which JSON cannot hold")
    if value is None or isinstance(value, (bool, int, float)):
        return literal_json(value)
    raise ValueError("not a literal JSON can hold")


def _value(node: ast.expr) -> object:
    """A scalar literal's value (mlx-lm's parser reads JSON's true/false/null too)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.UAdd, ast.USub))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        number = node.operand.value
        assert isinstance(number, (int, float))
        return -number if isinstance(node.op, ast.USub) else number
    raise ValueError("not a literal")


def _key(value: object) -> str:
    """A dict key as JSON writes it (`1` is "1", `True` "true")."""
    key: str = value if isinstance(value, str) else next(iter(json.loads(json.dumps({value: 0}))))
    return json_string(key)


class PythonicParser(SectionParser):
    """The pythonic calls in a section (see the module docstring)."""

    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._state = _OPEN
        self._writer: ObjectWriter | None = None
        """The arguments of the open call."""
        self._key: str | None = ""
        """The argument being read (None for a positional one, skipped)."""
        self._quote = ""
        """The closing quote of the string piece being read: ', ", ''' or \"\"\"."""
        self._raw = False
        self._scanner: _Scanner | None = None
        self._text: list[str] = []
        """Arguments text of the open call not yet sent."""

    def feed(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        self._buffer += text
        while self._buffer and self._step(deltas):
            pass
        self._flush(deltas)
        return deltas

    def end(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        writer = self._writer
        if writer is not None:
            if self._state in (_QUOTE, _STRING, _AFTER_STRING):
                self._text.append(writer.close_string())
            elif self._state == _WHOLE and self._scanner is not None and self._key is not None:
                self._scanner.feed(self._buffer)
                value = self._scanner.repaired()
                if value is not None:
                    self._text.append(writer.key(self._key) + value)
            self._text.append(writer.close())
        self._flush(deltas)
        self._writer = self._scanner = None
        self._buffer, self._state = "", _DONE
        return deltas

    def _flush(self, deltas: list[ToolCallDelta]) -> None:
        text = "".join(self._text)
        self._text.clear()
        if text:
            deltas.append(ToolCallDelta(self.calls - 1, text))

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Read what the buffer allows in the current state; False when it needs more."""
        state = self._state
        if state == _OPEN:
            start = self._buffer.find("[")  # as mlx-lm: what comes before the list is not read
            self._buffer = self._buffer[start + 1 :] if start >= 0 else ""
            self._state = _CALL if start >= 0 else _OPEN
            return start >= 0
        if state == _STRING:
            return self._string()
        if state == _WHOLE:
            return self._whole()
        if state == _AFTER_STRING:
            return self._after_string()
        if state == _QUOTE:
            return self._open_quote()
        if state == _DONE:
            self._buffer = ""
            return False
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return False
        if state == _CALL:
            return self._call(deltas)
        if state == _ARGUMENT:
            return self._argument()
        if state == _VALUE:
            return self._value()
        char, self._buffer = self._buffer[0], self._buffer[1:]
        if state == _AFTER_VALUE and char == ",":
            self._state = _ARGUMENT
        elif char == ")" and state == _AFTER_VALUE:
            self._end_call()
        elif char == "," and state == _AFTER_CALL:
            self._state = _CALL
        else:
            self._abandon()  # the end of the list, or text that is not a call
        return True

    def _call(self, deltas: list[ToolCallDelta]) -> bool:
        buffer = self._buffer
        name = _NAME.match(buffer)
        if name is None:
            self._abandon()  # `]`: the end of the list (or text that is not a call)
            return True
        rest = buffer[name.end() :].lstrip()
        if not rest:
            return False
        if rest[0] != "(":
            self._abandon()
            return True
        self._flush(deltas)
        deltas.append(ToolCallDelta(self.calls, "", name=name.group()))
        self.calls += 1
        self._writer = ObjectWriter()
        self._buffer = rest[1:]
        self._state = _ARGUMENT
        return True

    def _argument(self) -> bool:
        buffer = self._buffer
        if buffer[0] == ")":
            self._buffer = buffer[1:]
            self._end_call()
            return True
        keyword = _KEYWORD.match(buffer)
        if keyword is not None and keyword.end() == len(buffer):
            return False
        if keyword is None or not keyword.group(2):
            # A positional argument, `*args`, `**kwargs`: skipped, as mlx-lm's fallback does.
            self._key = None
            self._scanner = _Scanner()
            self._state = _WHOLE
            return True
        self._key = keyword.group(1)
        self._buffer = buffer[keyword.end() :]
        self._state = _VALUE
        return True

    def _value(self) -> bool:
        buffer = self._buffer
        writer, key = self._writer, self._key
        assert writer is not None
        assert key is not None
        if buffer[0] in _PREFIXES and len(buffer) < 2:
            return False
        if buffer[0] in _QUOTES or (buffer[0] in _PREFIXES and buffer[1] in _QUOTES):
            self._raw = buffer[0] in "rR"
            self._buffer = buffer if buffer[0] in _QUOTES else buffer[1:]
            self._text.append(writer.key(key) + writer.open_string())
            self._state = _QUOTE
        else:
            self._scanner = _Scanner()
            self._state = _WHOLE
        return True

    def _open_quote(self) -> bool:
        """A string piece's opening quote: one, or three, or an empty string `""`."""
        buffer = self._buffer
        quote = buffer[0]
        if len(buffer) < 3 and buffer == quote * len(buffer):
            return False
        if buffer.startswith(quote * 3):
            self._quote, self._buffer = quote * 3, buffer[3:]
            self._state = _STRING
        elif buffer.startswith(quote * 2):
            self._quote, self._buffer = quote, buffer[2:]
            self._state = _AFTER_STRING
        else:
            self._quote, self._buffer = quote, buffer[1:]
            self._state = _STRING
        return True

    def _string(self) -> bool:
        buffer, quote = self._buffer, self._quote
        out: list[str] = []
        i = 0
        while i < len(buffer):
            char = buffer[i]
            if char == "\\":
                if self._raw:
                    if i + 1 >= len(buffer):
                        break
                    out.append(buffer[i : i + 2])
                    i += 2
                    continue
                escape = _escape(buffer, i)
                if escape is None:
                    break
                out.append(escape[0])
                i += escape[1]
                continue
            if char == quote[0]:
                if buffer.startswith(quote, i):
                    self._text.append(_fragment("".join(out)))
                    self._buffer = buffer[i + len(quote) :]
                    self._state = _AFTER_STRING
                    return True
                if quote.startswith(buffer[i:]):
                    break  # perhaps the start of the closing quotes
            out.append(char)
            i += 1
        self._text.append(_fragment("".join(out)))
        self._buffer = buffer[i:]
        return False

    def _after_string(self) -> bool:
        """After a string piece: the value's end, another piece (`"a" "b"`), or, for text
        Python would refuse, the quote was part of the string (chat templates write strings
        between quotes without escaping them)."""
        buffer = self._buffer
        stripped = buffer.lstrip()
        if not stripped or (stripped[0] in _PREFIXES and len(stripped) < 2):
            return False
        writer = self._writer
        assert writer is not None
        char = stripped[0]
        if char in ",)":
            self._text.append(writer.close_string())
            self._buffer = stripped
            self._state = _AFTER_VALUE
        elif char in _QUOTES or (char in _PREFIXES and stripped[1] in _QUOTES):
            self._raw = char in "rR"
            self._buffer = stripped if char in _QUOTES else stripped[1:]
            self._state = _QUOTE
        else:
            spaces = buffer[: len(buffer) - len(stripped)]
            self._text.append(_fragment(self._quote + spaces))
            self._buffer = stripped
            self._state = _STRING
        return True

    def _whole(self) -> bool:
        scanner = self._scanner
        writer = self._writer
        assert scanner is not None
        assert writer is not None
        end = scanner.feed(self._buffer)
        if end is None:
            self._buffer = ""
            return False
        self._buffer = self._buffer[end:]
        if self._key is not None:
            # Not a literal (a name, an expression): its text, as mlx-lm's fallback reads it.
            value = _convert(scanner.text) or json_string(scanner.text.strip())
            self._text.append(writer.key(self._key) + value)
        self._scanner = None
        self._state = _AFTER_VALUE
        return True

    def _end_call(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            self._text.append(writer.close())
        self._state = _AFTER_CALL

    def _abandon(self) -> None:
        """The list ends here (at its `]`, or where it stops being calls)."""
        self._end_call()
        self._state = _DONE


FORMAT = CallFormat(
    parser="pythonic",
    start="<|tool_call_start|>",
    end="<|tool_call_end|>",
    new_parser=PythonicParser,
    streamed=True,
)

"""Mistral's tool calls (Mistral, Devstral, Magistral), streamed as they are written.

Newer models (v11+ tokenizers: Devstral, Mistral Small 3.2, Magistral) write a call as
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, one `[TOOL_CALLS]` per call (some templates
put `[CALL_ID]id` between the name and `[ARGS]`); older ones write one list,
`[TOOL_CALLS][{"name": "get_weather", "arguments": {...}}, ...]`.

Mistral has no end marker: the section is everything after the first `[TOOL_CALLS]` to the end
of the output, so the markers of the next calls arrive inside it, as separators. Between and
after calls, text that is not a call is skipped, as mlx-lm's parser skips it.

A call's name is sent at `[ARGS]` (at the `"name"` value in the list form), then its arguments
as the model writes them: JSON passes through unchanged (numbers, escapes and spacing as
written), except that what may still be taken back is held: a key until its value starts, a
comma until the next member, a literal until it ends. So a call cut off anywhere closes into
JSON that parses. Malformed JSON is repaired rather than refused (a raw control character is
escaped, an unknown literal becomes a string), or ends the arguments where it goes wrong.
"""

from __future__ import annotations

import json
import re

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    JSON_SPACE,
    CallFormat,
    SectionParser,
    Tools,
    json_escape,
    partial_suffix,
    string_fragment,
)
from runner.tool_formats.values import bare_literal, is_bare_literal

_MARKER = "[TOOL_CALLS]"


def _proper_prefixes(marker: str) -> str:
    """A regex for any non-empty proper prefix of `marker`."""
    return "|".join(re.escape(marker[:size]) for size in range(len(marker) - 1, 0, -1))


_HEADER = re.compile(r"([\w-]+)\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?\[ARGS\]")
# Where a header that is still being written may begin, to keep from the skipped text.
_HEADER_TAIL = re.compile(
    r"[\w-]+\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?"
    rf"(?:{_proper_prefixes('[ARGS]')}|{_proper_prefixes('[CALL_ID]')})?\Z"
)

_LITERAL_END = JSON_SPACE + ',:[]{}"'

# What `_Json` expects next.
_VALUE = "value"
_KEY = "key"
_COLON = "colon"
_AFTER = "after"
_STRING = "string"
_LITERAL = "literal"


class _Json:
    """One JSON value, fed in pieces, passed through as written as far as it is final.

    `feed` returns how much of the text the value took (all of it until it ends) and the
    text to send; `finish` the rest that makes it a complete value (closers), for a value cut
    off or broken.
    """

    def __init__(self) -> None:
        self.done = False
        self._state = _VALUE
        self._closers: list[str] = []
        self._pending = ""
        """Text that may be taken back: a comma, a key and its colon before their value."""
        self._literal = ""
        self._escape = ""
        """A string's escape sequence still being written."""
        self._in_key = False
        self._out: list[str] = []

    def feed(self, text: str) -> tuple[int, str]:
        i = 0
        while i < len(text) and not self.done:
            char = text[i]
            state = self._state
            if state == _STRING:
                self._string(char)
            elif state == _LITERAL:
                if char not in _LITERAL_END:
                    self._literal += char
                else:
                    self._end_literal()
                    continue  # the delimiter is read in the new state
            elif char in JSON_SPACE:
                self._space(char)
            elif not self._structure(char):
                self.done = True  # malformed: the value ends here, closed by `finish`
                break
            i += 1
        out, self._out = "".join(self._out), []
        return i, out

    def finish(self) -> str:
        """Close the value as far as it got (what may be taken back is dropped)."""
        out: list[str] = []
        if self._state == _STRING and not self._in_key:
            out.append('"')
        elif self._state == _LITERAL and is_bare_literal(self._literal, python=False):
            out.append(self._pending + self._literal)
        out.extend(reversed(self._closers))
        self._closers.clear()
        self._pending = ""
        self._state = _AFTER
        self.done = True
        return "".join(out)

    def _send(self, text: str) -> None:
        self._out.append(self._pending + text)
        self._pending = ""

    def _space(self, char: str) -> None:
        if self._pending:
            self._pending += char
        else:
            self._out.append(char)

    def _structure(self, char: str) -> bool:
        """A character outside strings and literals; False if it cannot come here."""
        state = self._state
        if state == _VALUE:
            if char in "{[":
                self._send(char)
                self._closers.append("}" if char == "{" else "]")
                self._state = _KEY if char == "{" else _VALUE
            elif char == '"':
                self._send('"')
                self._state, self._in_key = _STRING, False
            elif char == "]" and self._closers[-1:] == ["]"]:
                self._close()  # an empty array, or a trailing comma (dropped)
            elif char in ",:}]":
                return False
            else:
                self._state, self._literal = _LITERAL, char
        elif state == _KEY:
            if char == '"':
                self._pending += '"'
                self._state, self._in_key = _STRING, True
            elif char == "}":
                self._close()  # an empty object, or a trailing comma (dropped)
            else:
                return False
        elif state == _COLON:
            if char != ":":
                return False
            self._pending += ":"
            self._state = _VALUE
        elif char == ",":
            self._pending = ","
            self._state = _KEY if self._closers[-1] == "}" else _VALUE
        elif self._closers and char == self._closers[-1]:
            self._close()
        else:
            return False
        return True

    def _close(self) -> None:
        self._pending = ""
        self._out.append(self._closers.pop())
        self._value_done()

    def _value_done(self) -> None:
        self._state = _AFTER
        if not self._closers:
            self.done = True

    def _end_literal(self) -> None:
        self._send(bare_literal(self._literal))  # as written, else repaired
        self._literal = ""
        self._value_done()

    def _string(self, char: str) -> None:
        if self._escape:
            self._escape += char
            self._string_escape()
        elif char == "\\":
            self._escape = "\\"
        elif char == '"':
            self._string_text('"')
            if self._in_key:
                self._state = _COLON
            else:
                self._value_done()
        elif char < " ":
            self._string_text(string_fragment(char))
        else:
            self._string_text(char)

    def _string_escape(self) -> None:
        escape = self._escape
        complete = json_escape(escape)
        if complete is None:
            return
        if complete:
            self._escape = ""
            self._string_text(escape)
            return
        # Not an escape JSON has: the backslash stands for itself.
        self._escape = ""
        self._string_text("\\\\")
        for char in escape[1:]:
            self._string(char)

    def _string_text(self, text: str) -> None:
        if self._in_key:
            self._pending += text
        else:
            self._out.append(text)


class MistralParser(SectionParser):
    """Mistral's calls in a section (see the module docstring)."""

    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._fresh = True
        """At the start of the section or just after a marker: the list form may start."""
        self._json: _Json | None = None
        """The arguments of a `name[ARGS]` call being streamed."""
        self._header_call: int | None = None
        """The `name[ARGS]` call being read (its arguments in `_json` once their `{` came)."""
        self._list: _ListForm | None = None

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._buffer += text
        deltas: list[ToolCallDelta] = []
        while self._buffer and self._step(deltas):
            pass
        return deltas

    def end(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self._json is not None and self._header_call is not None:
            self._send(deltas, self._header_call, self._json.finish())
        elif self._header_call is not None:
            self._send(deltas, self._header_call, "{}")
        elif self._list is not None:
            self._list.finish(deltas)
        self._json = self._list = self._header_call = None
        self._buffer = ""
        return deltas

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Read what the buffer allows in the current state; False when it needs more."""
        if self._list is not None:
            taken = self._list.feed(self._buffer, deltas)
            self._buffer = self._buffer[taken:]
            if self._list.done:
                self._list = None
                self._fresh = False  # another list needs its own marker
                return True
            return False
        if self._header_call is not None:
            return self._arguments(deltas, self._header_call)
        return self._between(deltas)

    def _arguments(self, deltas: list[ToolCallDelta], index: int) -> bool:
        if self._json is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            self._buffer = stripped
            if stripped[0] != "{":
                # Arguments that are not an object: none, and the text is not a call.
                self._send(deltas, index, "{}")
                self._header_call = None
                return True
            self._json = _Json()
        taken, out = self._json.feed(self._buffer)
        self._buffer = self._buffer[taken:]
        self._send(deltas, index, out)
        if not self._json.done:
            return False
        self._send(deltas, index, self._json.finish())
        self._json = self._header_call = None
        return True

    def _between(self, deltas: list[ToolCallDelta]) -> bool:
        """Text before a call: markers, the list form's start, a `name[ARGS]` header."""
        if self._fresh:
            stripped = self._buffer.lstrip()
            if stripped.startswith(_MARKER):
                self._buffer = stripped[len(_MARKER) :]
                return True
            self._buffer = stripped
            if not stripped or _MARKER.startswith(stripped):
                return False
            if stripped[0] == "[":
                rest = stripped[1:].lstrip()
                if not rest:
                    return False
                if rest[0] in "{]":
                    self._buffer = rest
                    self._list = _ListForm(self)
                    return True
            self._fresh = False
        header = _HEADER.search(self._buffer)
        marker = self._buffer.find(_MARKER)
        if marker >= 0 and (header is None or marker < header.start()):
            self._buffer = self._buffer[marker + len(_MARKER) :]
            self._fresh = True
            return True
        if header is not None:
            self._buffer = self._buffer[header.end() :]
            self._header_call = self.start_call(deltas, header.group(1))
            return True
        # Nothing yet: keep only what may begin a marker or a header.
        tail = _HEADER_TAIL.search(self._buffer)
        keep = len(self._buffer) - tail.start() if tail else 0
        keep = max(keep, partial_suffix(self._buffer, _MARKER))
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def start_call(self, deltas: list[ToolCallDelta], name: str) -> int:
        """Send a new call's name; return its index."""
        index = self.calls
        self.calls += 1
        deltas.append(ToolCallDelta(index, "", name=name))
        return index

    @staticmethod
    def _send(deltas: list[ToolCallDelta], index: int, text: str) -> None:
        if text:
            deltas.append(ToolCallDelta(index, text))


# What `_ListForm` expects next.
_ITEM = "item"
_MEMBER = "member"
_MEMBER_COLON = "member colon"
_MEMBER_VALUE = "member value"
_MEMBER_AFTER = "member after"


class _Call:
    """A call of the list form: its name and arguments may come in either order."""

    def __init__(self) -> None:
        self.index: int | None = None
        """Its index once its name is known and sent."""
        self.held: list[str] = []
        """Arguments read before the name."""
        self.has_arguments = False
        self.sent = False
        """Some of its arguments were sent."""


class _ListForm:
    """`[{"name": ..., "arguments": {...}}, ...]`: each object a call, its arguments streamed
    (held until its name is known, when "arguments" comes first), its other members skipped.
    Arguments given as a JSON string (some templates render them so) are sent at its end."""

    def __init__(self, parser: MistralParser) -> None:
        self._parser = parser
        self.done = False
        self._state = _ITEM
        self._call: _Call | None = None
        self._key = ""
        self._value: _Json | None = None
        self._value_text: list[str] = []
        self._purpose = ""
        """What the value being read is: "key", "name", "arguments", "encoded" or "skip"."""

    def feed(self, text: str, deltas: list[ToolCallDelta]) -> int:
        """Read the text; return how much of it the list took."""
        i = 0
        while i < len(text) and not self.done:
            if self._value is not None:
                taken, out = self._value.feed(text[i:])
                i += taken
                self._value_out(out, deltas)
                if not self._value.done:
                    break
                self._value_out(self._value.finish(), deltas)
                self._value_end(deltas)
                continue
            char = text[i]
            if char in JSON_SPACE:
                i += 1
                continue
            taken = self._structure(char, deltas)
            if taken < 0:
                self._end_call(deltas)
                self.done = True  # not the list form any more: the rest is not a call
            i += max(taken, 0)
        return i

    def finish(self, deltas: list[ToolCallDelta]) -> None:
        if self._value is not None and self._purpose == "arguments":
            self._value_out(self._value.finish(), deltas)
        self._value = None
        self._end_call(deltas)
        self.done = True

    def _structure(self, char: str, deltas: list[ToolCallDelta]) -> int:
        """A character between values: 1 if it is taken, 0 if it starts a value, -1 if it
        cannot come here."""
        state = self._state
        if state == _ITEM:
            if char == "{":
                self._call = _Call()
                self._state = _MEMBER
            elif char == "]":
                self.done = True
            return 1 if char in "{]," else -1
        if state == _MEMBER:
            if char == '"':
                self._read("key")
                return 0
            if char == "}":
                self._end_call(deltas)
                self._state = _ITEM
            return 1 if char in "}," else -1
        if state == _MEMBER_COLON:
            self._state = _MEMBER_VALUE
            return 1 if char == ":" else -1
        if state == _MEMBER_VALUE:
            call = self._call
            assert call is not None
            if self._key == "name" and call.index is None and char == '"':
                self._read("name")
            elif self._key == "arguments" and not call.has_arguments and char in '{"':
                call.has_arguments = True
                self._read("arguments" if char == "{" else "encoded")
            else:
                self._read("skip")
            return 0
        if char == ",":
            self._state = _MEMBER
        elif char == "}":
            self._end_call(deltas)
            self._state = _ITEM
        return 1 if char in ",}" else -1

    def _read(self, purpose: str) -> None:
        self._purpose = purpose
        self._value = _Json()
        self._value_text = []

    def _value_out(self, out: str, deltas: list[ToolCallDelta]) -> None:
        call = self._call
        if not out:
            return
        if self._purpose != "arguments" or call is None:
            self._value_text.append(out)
        else:
            self._arguments(call, out, deltas)

    def _arguments(self, call: _Call, text: str, deltas: list[ToolCallDelta]) -> None:
        if call.index is None:
            call.held.append(text)
        else:
            deltas.append(ToolCallDelta(call.index, text))
            call.sent = True

    def _value_end(self, deltas: list[ToolCallDelta]) -> None:
        text = "".join(self._value_text)
        purpose, self._value, self._value_text = self._purpose, None, []
        if purpose == "key":
            key = json.loads(text)
            self._key = key if isinstance(key, str) else ""
            self._state = _MEMBER_COLON
            return
        self._state = _MEMBER_AFTER
        call = self._call
        if call is None:
            return
        if purpose == "name":
            name = json.loads(text)
            if isinstance(name, str):
                call.index = self._parser.start_call(deltas, name)
                held, call.held = "".join(call.held), []
                if held:
                    self._arguments(call, held, deltas)
        elif purpose == "encoded":
            self._arguments(call, _encoded_arguments(json.loads(text)), deltas)

    def _end_call(self, deltas: list[ToolCallDelta]) -> None:
        call, self._call = self._call, None
        if call is None or call.index is None:
            return  # an object without a name is not a call
        if not call.sent:
            deltas.append(ToolCallDelta(call.index, "{}"))


def _encoded_arguments(text: object) -> str:
    """Arguments rendered as a JSON string: their JSON, as written, when it is an object."""
    stripped = text.lstrip() if isinstance(text, str) else ""
    if not stripped.startswith("{"):
        return "{}"
    value = _Json()
    _, out = value.feed(stripped)
    return out + value.finish()


FORMAT = CallFormat(
    parser="mistral", start=_MARKER, end="", new_parser=MistralParser, streamed=True
)

"""Gemma 4's tool calls, streamed as they are written.

Between `<|tool_call>` and `<tool_call|>` Gemma 4 writes `call:NAME{key:value,...}`: keys
unquoted, strings between `<|"|>` delimiters (their text raw: the format has no escapes),
numbers, `true`/`false`/`null`, nested `{...}` and `[...]` (the chat template's
`format_argument`). A section normally holds one call; like mlx-lm's parser, this one reads
every `call:NAME{...}` in it and skips the text between them.

The name is sent at `{`; then the arguments, converted to JSON as they come: strings a
character at a time (held back only where a `<|"|>` may be starting), numbers as written, other
values at their end. A key and a comma are held until the value after them starts, so a call
cut off anywhere closes into JSON that parses.
"""

from __future__ import annotations

import re

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    CallFormat,
    SectionParser,
    Tools,
    json_string,
    partial_suffix,
    string_fragment,
)
from runner.tool_formats.values import bare_literal, is_bare_literal

_QUOTE = '<|"|>'
_CALL = re.compile(r"call:([\w-]+)\{")
# Where a `call:NAME{` that is still being written may begin, to keep from the skipped text.
_CALL_TAIL = re.compile(r"c(?:a(?:l(?:l(?::[\w-]*)?)?)?)?\Z")
_VALUE_END = re.compile(r"[,}\]]")

# What `_Arguments` expects next.
_KEY = "key"
_QUOTED_KEY = "quoted key"
_COLON = "colon"
_VALUE = "value"
_STRING = "string"
_AFTER = "after"


class _Arguments:
    """A call's `{...}`, fed from just after its `{`, turned into a JSON object as it comes.

    `feed` returns the JSON text that is final and leaves in `rest` the text after the
    call's closing `}` once it has come (`done`); `finish` closes what is open.
    """

    def __init__(self) -> None:
        self.done = False
        self.rest = ""
        self._buffer = ""
        self._closers = ["}"]
        self._members = [0]
        """Members written so far, per open object (and a 0 per open array)."""
        self._state = _KEY
        self._pending = ""
        """A comma, a key and its colon, held until their value starts."""
        self._out: list[str] = ["{"]

    def feed(self, text: str) -> str:
        self._buffer += text
        while self._buffer and not self.done and self._step():
            pass
        if self.done:
            self.rest, self._buffer = self._buffer, ""
        out, self._out = "".join(self._out), []
        return out

    def finish(self) -> str:
        """Close the arguments as far as they got."""
        if not self.done:
            if self._state == _STRING:
                self._out.append(string_fragment(self._buffer) + '"')
            elif self._state == _VALUE:
                literal = self._buffer.strip()
                if is_bare_literal(literal, python=True):
                    self._send(bare_literal(literal))
            self._out.extend(reversed(self._closers))
            self._closers.clear()
            self.done = True
        self._buffer = ""
        out, self._out = "".join(self._out), []
        return out

    def _send(self, text: str) -> None:
        self._out.append(self._pending + text)
        self._pending = ""

    def _step(self) -> bool:
        """Read what the buffer allows in the current state; False when it needs more."""
        state = self._state
        if state == _STRING:
            return self._string()
        buffer = self._buffer.lstrip()
        self._buffer = buffer
        if not buffer:
            return False
        if state == _KEY:
            return self._key()
        if state == _QUOTED_KEY:
            end = buffer.find(_QUOTE)
            if end < 0:
                return False
            self._add_key(buffer[:end])
            self._buffer = buffer[end + len(_QUOTE) :]
            self._state = _COLON
            return True
        if state == _COLON:
            if buffer[0] != ":":
                return self._broken()
            self._buffer = buffer[1:]
            self._state = _VALUE
            return True
        if state == _VALUE:
            return self._value()
        return self._after()

    def _key(self) -> bool:
        buffer = self._buffer
        if buffer[0] == "}":
            return self._close()  # no member, or a trailing comma (dropped)
        if buffer.startswith(_QUOTE):
            self._buffer = buffer[len(_QUOTE) :]
            self._state = _QUOTED_KEY
            return True
        if _QUOTE.startswith(buffer):
            return False
        end = re.search(r"[:,{}\[\]]", buffer)
        if end is None:
            return False
        if buffer[end.start()] != ":":
            return self._broken()
        self._add_key(buffer[: end.start()].strip())
        self._buffer = buffer[end.start() + 1 :]
        self._state = _VALUE
        return True

    def _add_key(self, key: str) -> None:
        self._pending = (", " if self._members[-1] else "") + json_string(key) + ": "
        self._members[-1] += 1

    def _value(self) -> bool:
        buffer = self._buffer
        char = buffer[0]
        if buffer.startswith(_QUOTE):
            self._send('"')
            self._buffer = buffer[len(_QUOTE) :]
            self._state = _STRING
            return True
        if _QUOTE.startswith(buffer):
            return False
        if char in "{[":
            self._send(char)
            self._closers.append("}" if char == "{" else "]")
            self._members.append(0)
            self._buffer = buffer[1:]
            self._state = _KEY if char == "{" else _VALUE
            return True
        if char in "}]":
            # An empty array, a trailing comma, or a key with no value: what is held is dropped.
            return self._close() if char == self._closers[-1] else self._broken()
        end = _VALUE_END.search(buffer)
        if end is None:
            return False
        # Older templates render None through Jinja as `None`: Python's spellings are read.
        self._send(bare_literal(buffer[: end.start()].strip()))
        self._buffer = buffer[end.start() :]
        self._value_done()
        return True

    def _string(self) -> bool:
        buffer = self._buffer
        end = buffer.find(_QUOTE)
        if end < 0:
            # All of it but what may be the start of the closing delimiter.
            keep = partial_suffix(buffer, _QUOTE)
            self._out.append(string_fragment(buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep :]
            return False
        self._out.append(string_fragment(buffer[:end]) + '"')
        self._buffer = buffer[end + len(_QUOTE) :]
        self._value_done()
        return True

    def _after(self) -> bool:
        buffer = self._buffer
        char = buffer[0]
        if char == ",":
            self._buffer = buffer[1:]
            if self._closers[-1] == "}":
                self._state = _KEY
            else:
                self._pending = ", "
                self._state = _VALUE
            return True
        if char == self._closers[-1]:
            return self._close()
        return self._broken()

    def _close(self) -> bool:
        self._pending = ""
        self._out.append(self._closers.pop())
        self._members.pop()
        self._buffer = self._buffer[1:]
        self._value_done()
        return True

    def _value_done(self) -> None:
        self._state = _AFTER
        if not self._closers:
            self.done = True

    def _broken(self) -> bool:
        """Text the format does not allow here: the arguments end, closed as far as they got."""
        self._pending = ""
        self._out.extend(reversed(self._closers))
        self._closers.clear()
        self.done = True
        return False


class Gemma4Parser(SectionParser):
    """Gemma 4's calls in a section (see the module docstring)."""

    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._arguments: _Arguments | None = None

    def feed(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        self._buffer += text
        while self._buffer:
            arguments = self._arguments
            if arguments is None:
                match = _CALL.search(self._buffer)
                if match is None:
                    tail = _CALL_TAIL.search(self._buffer)
                    self._buffer = self._buffer[tail.start() :] if tail else ""
                    break
                deltas.append(ToolCallDelta(self.calls, "", name=match.group(1)))
                self.calls += 1
                self._arguments = arguments = _Arguments()
                text, self._buffer = self._buffer[match.end() :], ""
            else:
                text, self._buffer = self._buffer, ""
            self._send(deltas, arguments.feed(text))
            if not arguments.done:
                break
            self._buffer, self._arguments = arguments.rest, None
        return deltas

    def end(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self._arguments is not None:
            self._send(deltas, self._arguments.finish())
            self._arguments = None
        self._buffer = ""
        return deltas

    def _send(self, deltas: list[ToolCallDelta], text: str) -> None:
        if text:
            deltas.append(ToolCallDelta(self.calls - 1, text))


FORMAT = CallFormat(
    parser="gemma4",
    start="<|tool_call>",
    end="<tool_call|>",
    new_parser=Gemma4Parser,
    streamed=True,
)

"""Kimi-K2's calls: a section `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>`
holding one or more `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}
<|tool_call_end|>`, read as mlx-lm's `kimi_k2` parser reads them.

Streamed as the model writes them: a call's name at `<|tool_call_argument_begin|>`, then its
arguments' JSON text itself, as written (so its numbers are the model's). `JsonStreamer` sends
the text as soon as closing what is open would complete it (a key, a comma or a number is held
until what follows it has begun), so a call cut off ends as far as it got, closed. Arguments
that are not a JSON object from the start (a Python literal) are read whole at the call's end.
"""

from __future__ import annotations

import re

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    JSON_SPACE,
    CallFormat,
    SectionParser,
    Tools,
    json_escape,
    partial_suffix,
)
from runner.tool_formats.values import deserialize, to_json

_CALL_BEGIN = "<|tool_call_begin|>"
_ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
_CALL_END = "<|tool_call_end|>"

_NAME = re.compile(r"\s*(?:functions\.)?(.+?):\d+\s*", re.DOTALL)
"""mlx-lm's reading of a call's head, `functions.NAME:IDX`."""
_LOOSE_NAME = re.compile(r"\s*(?:functions\.)?(.+?)\s*", re.DOTALL)

# JsonStreamer's states: where in the grammar the next character falls.
_START = "start"  # before the object
_FIRST_KEY = "first key"  # after `{`: a key or `}`
_KEY = "key"  # after a comma in an object
_COLON = "colon"
_VALUE = "value"  # after a colon, or a comma in an array
_FIRST_VALUE = "first value"  # after `[`: a value or `]`
_AFTER = "after"  # after a value: a comma or a closer
_STRING = "string"
_NUMBER = "number"
_LITERAL = "literal"
_DONE = "done"  # the object ended: the rest is not read
_BROKEN = "broken"  # not JSON: the rest is not read
_NOT_OBJECT = "not object"  # the arguments are read whole
_UNREAD = frozenset({_DONE, _BROKEN, _NOT_OBJECT})

# A number's states (JSON's grammar); those in _NUMBER_ENDS may end it.
_MINUS, _ZERO, _INTEGER, _POINT, _FRACTION, _EXPONENT, _EXPONENT_SIGN, _EXPONENT_DIGITS = range(8)
_NUMBER_ENDS = frozenset({_ZERO, _INTEGER, _FRACTION, _EXPONENT_DIGITS})


class JsonStreamer:
    """One JSON object's text, fed in pieces: `feed` returns the text that is final, `finish`
    the text that closes what was sent (or the whole arguments, read as mlx-lm reads them,
    when nothing could be streamed)."""

    def __init__(self) -> None:
        self._written: list[str] = []
        """Everything fed, for the arguments read whole."""
        self._pending = ""
        """Text after the last point where closing would complete what was sent."""
        self._sent = False
        self._closers: list[str] = []
        self._state = _START
        self._in_key = False
        self._escape = ""
        """In a string: the escape sequence being read (from its backslash), else ""."""
        self._number = _MINUS
        self._literal = ""
        """The rest of the `true`, `false` or `null` being read."""
        self._commit_in_string = False

    def feed(self, text: str) -> str:
        self._written.append(text)
        if self._state in _UNREAD:
            return ""
        if self._state == _START:
            text = text.lstrip(JSON_SPACE)
        buffer = self._pending + text
        commit = 0
        for index in range(len(self._pending), len(buffer)):
            ended_number = self._read(buffer[index])
            if self._state in (_BROKEN, _NOT_OBJECT):
                break
            if ended_number:  # the number before this character is complete
                commit = index
                self._commit_in_string = False
            if self._completable():
                commit = index + 1
                self._commit_in_string = self._state == _STRING
            if self._state == _DONE:
                break
        sent, self._pending = buffer[:commit], buffer[commit:]
        if self._state in _UNREAD:
            self._pending = ""
        self._sent = self._sent or bool(sent)
        return sent

    def finish(self) -> str:
        """The text that ends the arguments: closers for what is open, dropping what was
        held (a half-written key, number or `tru`, a trailing comma)."""
        if self._state == _DONE:
            return ""
        if not self._sent:
            value = deserialize("".join(self._written).strip())
            return to_json(value) if isinstance(value, dict) else "{}"
        quote = '"' if self._commit_in_string else ""
        return quote + "".join(reversed(self._closers))

    def _completable(self) -> bool:
        """Closing what is open now gives valid JSON (the top object's `{` alone is not sent,
        so arguments that break at once can still be read whole)."""
        state = self._state
        if state == _STRING:
            return not self._in_key and not self._escape
        if state == _FIRST_KEY:
            return len(self._closers) > 1
        return state in (_AFTER, _FIRST_VALUE, _DONE)

    def _read(self, char: str) -> bool:
        """Moves the state on by one character; True when it ended a number (and was then
        read in the state after it)."""
        state = self._state
        if state == _STRING:
            self._read_string(char)
        elif state == _NUMBER:
            if self._read_number(char):
                return False
            if self._number not in _NUMBER_ENDS:
                self._state = _BROKEN
                return False
            self._after_value()
            self._read(char)
            return True
        elif state == _LITERAL:
            if char != self._literal[0]:
                self._state = _BROKEN
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._after_value()
        elif char in JSON_SPACE:
            pass
        elif state == _START:
            if char == "{":
                self._open("}", _FIRST_KEY)
            else:
                self._state = _NOT_OBJECT
        elif state in (_FIRST_KEY, _KEY):
            if char == '"':
                self._begin_string(key=True)
            elif char == "}" and state == _FIRST_KEY:
                self._close(char)
            else:
                self._state = _BROKEN
        elif state == _COLON:
            self._state = _VALUE if char == ":" else _BROKEN
        elif state in (_VALUE, _FIRST_VALUE):
            if char == "]" and state == _FIRST_VALUE:
                self._close(char)
            else:
                self._begin_value(char)
        elif state == _AFTER:
            if char == ",":
                self._state = _KEY if self._closers[-1] == "}" else _VALUE
            elif char == self._closers[-1]:
                self._close(char)
            else:
                self._state = _BROKEN
        return False

    def _begin_value(self, char: str) -> None:
        if char == "{":
            self._open("}", _FIRST_KEY)
        elif char == "[":
            self._open("]", _FIRST_VALUE)
        elif char == '"':
            self._begin_string(key=False)
        elif char == "-" or "0" <= char <= "9":
            self._state = _NUMBER
            self._number = {"-": _MINUS, "0": _ZERO}.get(char, _INTEGER)
        elif char in "tfn":
            self._state = _LITERAL
            self._literal = {"t": "rue", "f": "alse", "n": "ull"}[char]
        else:
            self._state = _BROKEN

    def _begin_string(self, *, key: bool) -> None:
        self._state = _STRING
        self._in_key = key
        self._escape = ""

    def _read_string(self, char: str) -> None:
        if self._escape:
            self._escape += char
            complete = json_escape(self._escape)
            if complete is False:
                self._state = _BROKEN
            elif complete:
                self._escape = ""
        elif char == "\\":
            self._escape = "\\"
        elif char == '"':
            if self._in_key:
                self._state = _COLON
            else:
                self._after_value()
        elif char < " ":
            self._state = _BROKEN  # JSON strings hold no raw control characters

    def _read_number(self, char: str) -> bool:
        """True when `char` continues the number."""
        state = self._number
        if "0" <= char <= "9":
            if state == _MINUS:
                self._number = _ZERO if char == "0" else _INTEGER
            elif state == _POINT:
                self._number = _FRACTION
            elif state in (_EXPONENT, _EXPONENT_SIGN):
                self._number = _EXPONENT_DIGITS
            elif state == _ZERO:
                return False
        elif char == "." and state in (_ZERO, _INTEGER):
            self._number = _POINT
        elif char in "eE" and state in (_ZERO, _INTEGER, _FRACTION):
            self._number = _EXPONENT
        elif char in "+-" and state == _EXPONENT:
            self._number = _EXPONENT_SIGN
        else:
            return False
        return True

    def _open(self, closer: str, state: str) -> None:
        self._closers.append(closer)
        self._state = state

    def _close(self, closer: str) -> None:
        self._closers.pop()
        self._after_value()

    def _after_value(self) -> None:
        self._state = _AFTER if self._closers else _DONE


# KimiK2Parser's states, after _START (the section's start: a call, or a bare call's head).
_BETWEEN = "between"  # after a call: waiting for the next `<|tool_call_begin|>`
_HEAD = "head"  # `functions.NAME:IDX`
_ARGUMENTS = "arguments"
_SKIP = "skip"  # a call whose head cannot be read, up to its `<|tool_call_end|>`
_ENDED = "ended"


class KimiK2Parser(SectionParser):
    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._state = _START
        self._searched = 0
        """Where in `_buffer` a call's head may still hold a marker."""
        self._arguments = JsonStreamer()

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._buffer += text
        deltas: list[ToolCallDelta] = []
        while self._step(deltas):
            pass
        return deltas

    def end(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if self._state == _ARGUMENTS:
            # What was held as the start of `<|tool_call_end|>` is the model's text.
            self._send(deltas, self._arguments.feed(self._buffer))
            self._send(deltas, self._arguments.finish())
        self._buffer = ""
        self._state = _ENDED
        return deltas

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Consumes what it can of `_buffer`; True when the state changed."""
        buffer = self._buffer
        if self._state == _START:
            stripped = buffer.lstrip()
            if not stripped or _CALL_BEGIN.startswith(stripped):
                return False
            # A section that does not open with `<|tool_call_begin|>` is one call's head and
            # arguments, as mlx-lm reads it.
            bare = not stripped.startswith(_CALL_BEGIN)
            self._buffer = stripped if bare else stripped[len(_CALL_BEGIN) :]
            self._state = _HEAD
            return True
        if self._state == _BETWEEN:
            index = buffer.find(_CALL_BEGIN)
            if index < 0:
                self._buffer = buffer[len(buffer) - partial_suffix(buffer, _CALL_BEGIN) :]
                return False
            return self._move(index + len(_CALL_BEGIN), _HEAD)
        if self._state == _HEAD:
            return self._head(deltas)
        if self._state == _ARGUMENTS:
            index = buffer.find(_CALL_END)
            if index < 0:
                held = partial_suffix(buffer, _CALL_END)
                self._send(deltas, self._arguments.feed(buffer[: len(buffer) - held]))
                self._buffer = buffer[len(buffer) - held :]
                return False
            self._send(deltas, self._arguments.feed(buffer[:index]))
            self._send(deltas, self._arguments.finish())
            return self._move(index + len(_CALL_END), _BETWEEN)
        if self._state == _SKIP:
            index = buffer.find(_CALL_END)
            if index < 0:
                self._buffer = buffer[len(buffer) - partial_suffix(buffer, _CALL_END) :]
                return False
            return self._move(index + len(_CALL_END), _BETWEEN)
        self._buffer = ""
        return False

    def _head(self, deltas: list[ToolCallDelta]) -> bool:
        """`functions.NAME:IDX` up to `<|tool_call_argument_begin|>`: the call's name."""
        index = self._buffer.find(_ARGUMENTS_BEGIN, self._searched)
        end = self._buffer.find(_CALL_END, self._searched)
        if end >= 0 and (index < 0 or end < index):
            # A call without arguments: mlx-lm cannot read it either.
            return self._move(end + len(_CALL_END), _BETWEEN)
        if index < 0:
            # Neither marker is in what was searched: search only the rest next time.
            self._searched = max(0, len(self._buffer) - len(_ARGUMENTS_BEGIN) + 1)
            return False
        head = self._buffer[:index]
        match = _NAME.fullmatch(head) or _LOOSE_NAME.fullmatch(head)
        if match is None:
            return self._move(index, _SKIP)
        deltas.append(ToolCallDelta(self.calls, "", name=match.group(1)))
        self.calls += 1
        self._arguments = JsonStreamer()
        return self._move(index + len(_ARGUMENTS_BEGIN), _ARGUMENTS)

    def _move(self, consumed: int, state: str) -> bool:
        self._buffer = self._buffer[consumed:]
        self._searched = 0
        self._state = state
        return True

    def _send(self, deltas: list[ToolCallDelta], text: str) -> None:
        if text:
            deltas.append(ToolCallDelta(self.calls - 1, text))


FORMAT = CallFormat(
    parser="kimi_k2",
    start="<|tool_calls_section_begin|>",
    end="<|tool_calls_section_end|>",
    new_parser=KimiK2Parser,
    streamed=True,
)

"""What the XML-like formats share (Qwen3-Coder's `<parameter=KEY>`, MiniMax-M2's
`<parameter name="KEY">`): a call per element, its arguments one tagged value per parameter.

`XmlSectionParser` holds the plumbing of such a parser (its `State`, the call being written,
its `ObjectWriter`, the deltas to send); `ValueReader` reads one parameter's value up to its
closing tag, streaming a string value as it comes and converting any other whole at its end
(with the conversions of `values`, which keep the model's numbers as written).
"""

from __future__ import annotations

import enum
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import (
    ObjectWriter,
    SectionParser,
    Tools,
    json_string,
    partial_suffix,
    property_schema,
    string_fragment,
)


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The first of `markers` in `text` (from `start`): where, and which."""
    found: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker, start)
        if index >= 0 and (found is None or index < found[0]):
            found = (index, marker)
    return found


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the end of `text` that may be the start of one of `markers`."""
    return max(partial_suffix(text, marker) for marker in markers)


class Trim(enum.Enum):
    """What a family's parser strips off a value's ends."""

    NEWLINE = enum.auto()
    """One newline at each end (Qwen3-Coder writes the value on lines of its own)."""
    WHITESPACE = enum.auto()
    """All whitespace (MiniMax-M2: `str.strip()`)."""


class ValueReader:
    """One parameter's value, read up to the first of its `closers`.

    With `convert` None the value is a string, streamed: its opening quote goes out as soon as
    the value can no longer be one of `null_words` (which mean null, any case), then its
    characters as they come, less what may still be stripped or be a closing tag. Otherwise
    the value is read whole and `convert` turns it into JSON text at its end.
    """

    def __init__(
        self,
        closers: Sequence[str],
        *,
        trim: Trim,
        null_words: Sequence[str] = ("null",),
        convert: Callable[[str], str] | None = None,
    ) -> None:
        self._closers = closers
        self._trim = trim
        self._null_words = null_words
        self._convert = convert
        self._text = ""
        """Read and not sent yet (a whole value: all of it)."""
        self._searched = 0
        """No closer starts before this index of `_text`."""
        self._started = False
        """The value's start is known (what is stripped off it is gone)."""
        self._opened = False
        """The string's opening quote is sent."""

    def feed(self, text: str) -> tuple[str, str | None, str]:
        """More text: the fragment to send, the closer that ended the value (None while it
        goes on) and the text after that closer."""
        self._text += text
        if not self._start():
            return "", None, ""
        found = find_first(self._text, self._closers, self._searched)
        if found is not None:
            index, closer = found
            rest = self._text[index + len(closer) :]
            return self._finish(self._text[:index]), closer, rest
        keep = held_back(self._text, self._closers)
        self._searched = len(self._text) - keep
        if self._convert is not None:
            return "", None, ""
        return self._stream(len(self._text) - keep), None, ""

    def end(self) -> str:
        """The value was cut off: the fragment that ends it as far as it got (a closing tag
        it had begun is dropped)."""
        self._start()
        keep = held_back(self._text, self._closers)
        return self._finish(self._text[: len(self._text) - keep])

    def _start(self) -> bool:
        if self._started:
            return True
        if self._trim is Trim.NEWLINE:
            if not self._text:
                return False
            if self._text[0] == "\n":
                self._text = self._text[1:]
        else:
            self._text = self._text.lstrip()
            if not self._text:
                return False
        self._started = True
        return True

    def _trim_end(self, text: str) -> str:
        if self._trim is Trim.NEWLINE:
            return text[:-1] if text.endswith("\n") else text
        return text.rstrip()

    def _stream(self, upto: int) -> str:
        """Send what of `_text[:upto]` is surely part of the string."""
        ready = self._trim_end(self._text[:upto])
        prefix = ""
        if not self._opened:
            folded = ready.lower()
            if any(word.startswith(folded) for word in self._null_words):
                return ""
            self._opened = True
            prefix = '"'
        self._text = self._text[len(ready) :]
        self._searched = max(0, self._searched - len(ready))
        return prefix + string_fragment(ready)

    def _finish(self, rest: str) -> str:
        """The fragment that ends the value, `rest` being what of it is not sent yet."""
        rest = self._trim_end(rest)
        if self._convert is not None:
            return self._convert(rest)
        if self._opened:
            return string_fragment(rest) + '"'
        if rest.lower() in self._null_words:
            return "null"
        return json_string(rest)


class State(enum.Enum):
    """Where an XML-like family's parser is in its section."""

    SEEK = enum.auto()
    """Before a call's opening tag."""
    NAME = enum.auto()
    """In the call's function name."""
    SKIP_CALL = enum.auto()
    """In a call without a name, which mlx-lm drops (MiniMax-M2)."""
    BODY = enum.auto()
    """Between parameters."""
    KEY = enum.auto()
    """In a parameter's name."""
    VALUE = enum.auto()
    SKIP = enum.auto()
    """In a parameter without a name, which mlx-lm drops."""
    DONE = enum.auto()
    """The section ended: nothing more is read."""


class XmlSectionParser(SectionParser):
    """The plumbing of an XML-like family's parser: `_step()` (the family's) consumes what
    `_buffer` holds of the current `_state`, opening calls and values with the methods here."""

    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._state = State.SEEK
        self._buffer = ""
        """Text read and not consumed yet."""
        self._deltas: list[ToolCallDelta] = []
        self._writer: ObjectWriter | None = None
        """The open call's arguments."""
        self._name = ""
        """The open call's function name."""
        self._value: ValueReader | None = None
        """The open parameter's value."""

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._buffer += text
        while self._state is not State.DONE and self._step():
            pass
        if self._state is State.DONE:
            self._buffer = ""
        return self._take()

    def end(self) -> list[ToolCallDelta]:
        if self._value is not None:
            self._send(self._value.end())
            self._value = None
        self._close_call()
        self._buffer = ""
        self._state = State.DONE
        return self._take()

    @abstractmethod
    def _step(self) -> bool:
        """Consume what the buffer holds of the current state; False when it needs more."""

    @abstractmethod
    def _reader(self, schema: dict[str, Any] | None) -> ValueReader:
        """The reader of a parameter of the open call, `schema` its schema (None when the
        tool does not declare it)."""

    def _skip_to(self, markers: Sequence[str]) -> str | None:
        """Drop the buffer up to the end of the first of `markers`: which it was, None while
        none has come (the end that may begin one is kept)."""
        found = find_first(self._buffer, markers)
        if found is None:
            keep = held_back(self._buffer, markers)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return None
        index, marker = found
        self._buffer = self._buffer[index + len(marker) :]
        return marker

    def _open_call(self, name: str) -> None:
        self._deltas.append(ToolCallDelta(self.calls, "", name=name))
        self.calls += 1
        self._name = name
        self._writer = ObjectWriter()

    def _open_value(self, key: str) -> None:
        assert self._writer is not None
        self._send(self._writer.key(key))
        self._value = self._reader(property_schema(self.tools, self._name, key))

    def _read_value(self) -> str | None:
        """Feed the buffer to the open value: the closer that ended it, None while it goes
        on."""
        assert self._value is not None
        fragment, closer, rest = self._value.feed(self._buffer)
        self._buffer = rest
        self._send(fragment)
        if closer is not None:
            self._value = None
        return closer

    def _close_call(self) -> None:
        if self._writer is not None:
            self._send(self._writer.close())
            self._writer = None

    def _send(self, text: str) -> None:
        """A fragment of the open call's arguments (one delta per feed where it can)."""
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        index = self.calls - 1
        if last is not None and last.index == index and last.name is None:
            self._deltas[-1] = ToolCallDelta(index, last.arguments + text)
        else:
            self._deltas.append(ToolCallDelta(index, text))

    def _take(self) -> list[ToolCallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

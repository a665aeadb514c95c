"""Tool calls in a model's output, recognised as they are generated. Pure logic, no mlx.

A model calls a tool by writing its family's markup: a section opened by a start marker and
closed by an end marker (`<tool_call>` ... `</tool_call>` for Hermes/Qwen models, other markers
for other families; `runner.tool_formats` holds each family's `CallFormat`). `ToolCallSplitter`
takes a request's content text, piece by piece, finds the sections and hands their text to the
family's `SectionParser`, and returns the content a client sees and `ToolCallDelta`s.

Calls are streamed as OpenAI streams them: a first delta with the call's index (counting the
answer's calls from 0), a fresh id and its name (arguments empty) once the name is known; then
fragments of the arguments' JSON text as the model writes them (formats that cannot be streamed
send each call whole at its section's end; docs/models.md says which).

Markup never reaches the content: not the markers of a call, not an end marker with no call
open (models write a stray one), not a marker split across pieces. A section no parser can
read is shown as content without its markers. Whitespace between and after calls is not
content; other text around calls is.
"""

from __future__ import annotations

import uuid

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import CallFormat, SectionParser, Tools, partial_suffix


def new_call_id() -> str:
    """A tool call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


class _Section:
    """The section being written."""

    def __init__(self, parser: SectionParser, first: int) -> None:
        self.parser = parser
        self.first = first
        """The answer's index of the section's first call."""
        self.text = ""
        """Everything fed to the parser, shown as content if it holds no call."""


class ToolCallSplitter:
    """Splits a request's content into text and tool-call deltas (see the module docstring).

    `calls` counts the calls started so far; a request that made any finishes with
    "tool_calls" instead of "stop".
    """

    def __init__(self, format: CallFormat, tools: Tools = ()) -> None:
        self._format = format
        self._tools = tools
        self._held = ""
        """Text that may be the beginning of a marker, or whitespace after a call."""
        self._section: _Section | None = None
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add content text; return the content to show now and the deltas it completes."""
        buffer = self._held + text
        self._held = ""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        start, end = self._format.start, self._format.end
        while buffer:
            section = self._section
            if section is None:
                at, marker = _first(buffer, start, end)
                if at < 0:
                    keep = max(partial_suffix(buffer, start), partial_suffix(buffer, end))
                    self._show(buffer[: len(buffer) - keep], content)
                    self._held += buffer[len(buffer) - keep :]
                    break
                self._show(buffer[:at], content, before_call=marker == start)
                buffer = buffer[at + len(marker) :]
                if marker == start:
                    self._section = _Section(self._format.new_parser(self._tools), self.calls)
                # else: an end marker with no call open closes nothing and is not shown.
                continue
            at = buffer.find(end) if end else -1
            if at < 0:
                keep = partial_suffix(buffer, end) if end else 0
                self._pass(section, buffer[: len(buffer) - keep], deltas)
                self._held = buffer[len(buffer) - keep :]
                break
            self._pass(section, buffer[:at], deltas)
            self._show(self._close(section, deltas), content)
            buffer = buffer[at + len(end) :]
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """Generation ended: the held-back text, and the end of a section left open (a call
        cut off by max_tokens is sent as far as it got, closed)."""
        deltas: list[ToolCallDelta] = []
        held, self._held = self._held, ""
        section = self._section
        start, end = self._format.start, self._format.end
        if section is not None:
            # What is held in a section is the start of its end marker, cut off: markup.
            held = self._close(section, deltas)
        elif held and end.startswith(held.lstrip()) and not start.startswith(held.lstrip()):
            held = ""  # the start of a stray end marker, cut off
        if self.calls and held.isspace():
            held = ""
        return held, deltas

    def _pass(self, section: _Section, text: str, deltas: list[ToolCallDelta]) -> None:
        """Feed section text to its parser."""
        if not text:
            return
        section.text += text
        self._number(section, section.parser.feed(text), deltas)

    def _close(self, section: _Section, deltas: list[ToolCallDelta]) -> str:
        """The section ended; returns the content it becomes (its text, when no call was in it)."""
        self._section = None
        self._number(section, section.parser.end(), deltas)
        return "" if section.parser.calls else section.text

    def _number(
        self, section: _Section, local: list[ToolCallDelta], deltas: list[ToolCallDelta]
    ) -> None:
        """The section's deltas with the answer's indexes, and an id on each call's first."""
        for delta in local:
            index = section.first + delta.index
            if delta.name is not None:
                self.calls = max(self.calls, index + 1)
                deltas.append(ToolCallDelta(index, "", id=new_call_id(), name=delta.name))
                if delta.arguments:
                    deltas.append(ToolCallDelta(index, delta.arguments))
            elif delta.arguments:
                deltas.append(ToolCallDelta(index, delta.arguments))

    def _show(self, text: str, content: list[str], *, before_call: bool = False) -> None:
        """Content outside calls; whitespace after a call is held until text follows it."""
        if not text:
            return
        if self.calls and text.isspace():
            if not before_call:
                self._held += text
            return
        content.append(text)


def _first(buffer: str, start: str, end: str) -> tuple[int, str]:
    """Where the first marker in `buffer` is, and which (-1 when there is none)."""
    at_start = buffer.find(start)
    at_end = buffer.find(end) if end else -1
    if at_end >= 0 and (at_start < 0 or at_end < at_start):
        return at_end, end
    return at_start, start

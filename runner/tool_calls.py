"""Tool calls in a model's output, recognised as they are generated. Pure logic, no mlx.

A model calls a tool by writing its own markup around the call: `<tool_call>` ... `</tool_call>`
for Hermes/Qwen models, other markers for other families (mlx-lm's tokenizer knows them as
`tool_call_start` / `tool_call_end`, and has the family's `tool_parser`). `ToolCallSplitter`
takes a request's content text, piece by piece, and splits it into the content a client sees
and `ToolCallDelta`s; the markup itself is never shown as content.

Calls are streamed as they are generated, as OpenAI streams them: when the call's function
name is known, a first delta with its index, a fresh id and the name (arguments empty); then
fragments of the arguments' JSON text as the model writes them. That works for the JSON form
`{"name": ..., "arguments": {...}}` the Hermes/Qwen family uses. A call in any other form (or
JSON whose keys come in another order) is parsed whole with the model's tool parser when its
end marker arrives, and sent as one name delta and one arguments delta.

Whitespace between and after calls is not content; other text around calls is.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from protocol.frames import ToolCallDelta

ToolParser = Callable[[str, Any], Any]
"""mlx-lm's `tool_parser(text, tools)`: a call's text to {"name", "arguments"} (or a list)."""

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    """A tool call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


class _ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces (it does not validate:
    the grammar, or the model, is responsible for that)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of it until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
                if char in "{[":
                    self.depth = 1
                elif char == '"':
                    self.in_string = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if self.depth == 0:
                # A bare literal (number, true, null) ends at the first delimiter.
                if char in ",}] \t\r\n":
                    self.done = True
                    return i
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _Call:
    """The call being written."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        """Everything between the markers so far."""
        self.named = False
        """The first delta (id and name) has been sent: arguments are streamed."""
        self.consumed = 0
        """Characters of `text` already looked at by the streaming path."""
        self.scanner = _ValueScanner()


class ToolCallSplitter:
    """Splits a request's content into text and tool-call deltas (see the module docstring).

    `calls` counts the calls started so far; a request that made any finishes with
    "tool_calls" instead of "stop".
    """

    def __init__(
        self, start: str, end: str, parser: ToolParser | None = None, tools: Any = None
    ) -> None:
        self._start = start
        self._end = end
        self._parser = parser
        self._tools = tools
        self._held = ""
        """Text that may be the beginning of a marker, or whitespace after a call."""
        self._call: _Call | None = None
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add content text; return the content to show now and the deltas it completes."""
        buffer = self._held + text
        self._held = ""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while buffer:
            call = self._call
            if call is None:
                index = buffer.find(self._start)
                if index < 0:
                    keep = _partial_suffix(buffer, self._start)
                    self._show(buffer[: len(buffer) - keep], content)
                    self._held += buffer[len(buffer) - keep :]
                    break
                self._show(buffer[:index], content, before_call=True)
                self._call = _Call(self.calls)
                self.calls += 1
                buffer = buffer[index + len(self._start) :]
                continue
            index = call.text.__len__()
            call.text += buffer
            end = call.text.find(self._end, max(0, index - len(self._end) + 1))
            if end < 0:
                keep = _partial_suffix(call.text, self._end)
                self._stream(call, len(call.text) - keep, deltas)
                break
            rest = call.text[end + len(self._end) :]
            call.text = call.text[:end]
            self._stream(call, end, deltas)
            self._show(self._close(call, deltas), content)
            self._call = None
            buffer = rest
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """Generation ended: the held-back text, and the end of a call left open (a call cut
        off by max_tokens is sent as far as it got)."""
        deltas: list[ToolCallDelta] = []
        unparsed = ""
        call = self._call
        if call is not None:
            self._stream(call, len(call.text), deltas)
            unparsed = self._close(call, deltas)
            self._call = None
        held, self._held = self._held, ""
        if self.calls and held.isspace():
            held = ""
        return held + unparsed, deltas

    def _show(self, text: str, content: list[str], *, before_call: bool = False) -> None:
        """Content outside calls; whitespace after a call is held until text follows it."""
        if not text:
            return
        if self.calls and text.isspace():
            if not before_call:
                self._held += text
            return
        content.append(text)

    def _stream(self, call: _Call, upto: int, deltas: list[ToolCallDelta]) -> None:
        """Send what is known of the call's name and arguments in `call.text[:upto]`."""
        if not call.named:
            match = _JSON_HEAD.match(call.text, 0, upto)
            if match is None:
                return
            call.named = True
            call.consumed = match.end()
            deltas.append(
                ToolCallDelta(
                    call.index, "", id=new_call_id(), name=json.loads(f'"{match.group(1)}"')
                )
            )
        if upto <= call.consumed or call.scanner.done:
            return
        piece = call.text[call.consumed : upto]
        if not call.scanner.started:
            # Whitespace before the arguments' value is not part of it.
            stripped = piece.lstrip()
            call.consumed += len(piece) - len(stripped)
            piece = stripped
        taken = call.scanner.feed(piece)
        call.consumed += len(piece)
        if piece[:taken]:
            deltas.append(ToolCallDelta(call.index, piece[:taken]))

    def _close(self, call: _Call, deltas: list[ToolCallDelta]) -> str:
        """The call's end: a call that was not streamed is parsed whole now. Returns the
        content a call nothing can parse becomes (its text, markers included)."""
        if call.named:
            return ""
        calls = self._parse(call.text)
        if not calls:
            self.calls -= 1
            return self._start + call.text + self._end
        for i, (name, arguments) in enumerate(calls):
            index = call.index
            if i:
                index = self.calls
                self.calls += 1
            deltas.append(ToolCallDelta(index, "", id=new_call_id(), name=name))
            deltas.append(ToolCallDelta(index, arguments))
        return ""

    def _parse(self, text: str) -> list[tuple[str, str]]:
        """A whole call's (name, arguments JSON) pairs by the model's parser; none if it
        cannot read them."""
        if self._parser is None:
            return []
        try:
            parsed = self._parser(text, self._tools)
        except Exception:
            return []
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in calls):
            return []
        result = []
        for item in calls:
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            result.append((item["name"], arguments))
        return result


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0

"""Hermes / Qwen2.5 / Qwen3's JSON calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, one call per section (mlx-lm's `json_tools` parser).

Streamed as the model writes it: the name once `{"name": "...", "arguments": ` is complete,
then the arguments' JSON text itself, as written (so its numbers are the model's), until the
value ends. A call whose keys come in another order is read whole at the section's end.
"""

from __future__ import annotations

import json
import re
from typing import Any

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import JSON_SPACE, CallFormat, SectionParser, Tools, ValueScanner

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class JsonCallParser(SectionParser):
    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self._text = ""
        self._named = False
        self._consumed = 0
        """Characters of `_text` the streaming path has looked at."""
        self._scanner = ValueScanner()

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._text += text
        return self._stream()

    def end(self) -> list[ToolCallDelta]:
        if self._named:
            return self._stream()
        return self._whole()

    def _stream(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if not self._named:
            match = _HEAD.match(self._text)
            if match is None:
                return deltas
            try:
                name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                return deltas  # a malformed escape in the name: read whole at the end, or not
            self._named = True
            self.calls = 1
            self._consumed = match.end()
            deltas.append(ToolCallDelta(0, "", name=name))
        if self._scanner.done or len(self._text) <= self._consumed:
            return deltas
        piece = self._text[self._consumed :]
        if not self._scanner.started:
            # Whitespace before the value is not part of it.
            stripped = piece.lstrip()
            self._consumed += len(piece) - len(stripped)
            piece = stripped
        taken = self._scanner.feed(piece)
        self._consumed += len(piece)
        if piece[:taken]:
            deltas.append(ToolCallDelta(0, piece[:taken]))
        return deltas

    def _whole(self) -> list[ToolCallDelta]:
        """A call in another key order: `{"arguments": ..., "name": ...}`."""
        try:
            parsed: Any = json.loads(self._text)
        except (json.JSONDecodeError, RecursionError):
            return []
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return []
        arguments = raw_member(self._text, "arguments")
        if arguments is None or not isinstance(parsed["arguments"], dict):
            arguments = "{}" if "arguments" not in parsed else None
        if arguments is None:
            return []
        self.calls = 1
        return [ToolCallDelta(0, "", name=parsed["name"]), ToolCallDelta(0, arguments)]


def raw_member(text: str, key: str) -> str | None:
    """The text, as written, of member `key` of the JSON object `text` (valid JSON), or None."""
    decoder = json.JSONDecoder()
    index = text.index("{") + 1
    while True:
        index = _skip_space(text, index)
        if text[index] == "}":
            return None
        name, index = decoder.raw_decode(text, index)
        index = _skip_space(text, index) + 1  # the colon
        index = _skip_space(text, index)
        scanner = ValueScanner()
        size = scanner.feed(text[index:])
        if name == key:
            return text[index : index + size]
        index = _skip_space(text, index + size)
        if text[index] == "}":
            return None
        index += 1  # the comma


def _skip_space(text: str, index: int) -> int:
    while text[index] in JSON_SPACE:
        index += 1
    return index


FORMAT = CallFormat(
    parser="json_tools",
    start="<tool_call>",
    end="</tool_call>",
    new_parser=JsonCallParser,
    streamed=True,
)
